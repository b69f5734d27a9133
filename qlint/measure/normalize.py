"""Per-sample input normalization: a float-exact rewrite for inputs whose loudness varies.

A model input such as raw audio can differ in scale by 1000x from one sample to the next.
Static int8 quantization gives each tensor one scale, set by the loudest samples, so the
quiet ones use a few of the 256 levels. When the input reaches its first biased layer
through ops that scale with it (a bias-free conv or linear, pads, slices, ``relu``,
``sqrt(a**2 + b**2)``: positively homogeneous of degree 1), that whole front end can run on
the input divided by its own per-sample maximum ``s``, and the first biased layer's output
is put back exactly::

    conv(front(x)) = s * (conv(front(x / s)) - b) + b

The quantized ops before that point then see every sample at full scale. The two helper
modules (``qlint_normalize_<input>``, ``qlint_denormalize_<layer>``) hold the float
arithmetic; the plan's mapping keeps them float (:func:`helper_modules`).

:func:`find_normalizable_inputs` walks forward from each model input, tracking the degree
``d`` with which each value scales (``f(c·x) = c^d · f(x)`` for ``c > 0``), and keeps only
ops that leave the batch dimension first. An input qualifies when every path out of that
region ends at a biased conv/linear module whose input has degree 1.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from qlint.errors import QlintError

KIND = "normalize_input"
_TINY = 1e-30  # an all-zero sample keeps the scale positive; its values stay zero

_LAYERS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)
# Modules f with f(c·x) = c·f(x) for c > 0 that keep the batch dimension first.
_HOMOGENEOUS_MODULES = (
    nn.ReLU,
    nn.Identity,
    nn.Dropout,
    nn.MaxPool1d,
    nn.MaxPool2d,
    nn.MaxPool3d,
    nn.AvgPool1d,
    nn.AvgPool2d,
    nn.AvgPool3d,
    nn.AdaptiveAvgPool1d,
    nn.AdaptiveAvgPool2d,
    nn.AdaptiveMaxPool1d,
    nn.AdaptiveMaxPool2d,
    nn.ZeroPad2d,
    nn.ReflectionPad1d,
    nn.ReflectionPad2d,
    nn.ReplicationPad1d,
    nn.ReplicationPad2d,
)
_SAME_DEGREE_FUNCTIONS = {F.relu, torch.relu, torch.abs, operator.abs, operator.neg, torch.neg}
_SAME_DEGREE_METHODS = {"relu", "abs", "neg", "contiguous", "clone"}
_ADDITIVE = {operator.add, operator.sub, torch.add, torch.sub}
_PAD_MODES = ("constant", "reflect", "replicate", "circular")


def normalizer_name(placeholder: str) -> str:
    return f"qlint_normalize_{placeholder}"


def denormalizer_name(fqn: str) -> str:
    return f"qlint_denormalize_{fqn.replace('.', '_')}"


def helper_modules(placeholder: str, layers: list[str]) -> list[str]:
    """The helper modules a ``normalize_input`` rewrite adds: their ops must stay float."""
    return [normalizer_name(placeholder), *(denormalizer_name(fqn) for fqn in layers)]


class SampleNormalize(nn.Module):
    """``x`` → (``x`` divided by each sample's largest magnitude, those magnitudes ``s``)."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scale = x.abs().flatten(1).amax(dim=1).clamp_min(_TINY)
        # the batch dimension moved last broadcasts against the (B,) scale at any rank
        return (x.transpose(0, -1) / scale).transpose(0, -1), scale


class SampleDenormalize(nn.Module):
    """A biased layer's output on normalized input → its output on the original input."""

    def __init__(self, bias: torch.Tensor, channel_dims_after: int) -> None:
        super().__init__()
        self.bias: torch.Tensor
        self.register_buffer("bias", bias.detach().clone().reshape(-1, *([1] * channel_dims_after)))

    def forward(self, y: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return ((y - self.bias).transpose(0, -1) * scale).transpose(0, -1) + self.bias


class Candidate:
    """One input to normalize and the biased layers where its front end ends."""

    def __init__(self, placeholder: str, layers: list[fx.Node]) -> None:
        self.placeholder, self.layer_nodes = placeholder, layers

    @property
    def layers(self) -> list[str]:
        return [str(node.target) for node in self.layer_nodes]


def _keeps_batch_first(node: fx.Node) -> bool:
    """Shape ops that leave dimension 0 where it is (others are refused)."""
    args = node.args[1:]
    if node.target in ("unsqueeze", torch.unsqueeze, "squeeze", torch.squeeze):
        dims: list[object] = [a for a in args if isinstance(a, int)] or [node.kwargs.get("dim")]
        return all(isinstance(d, int) and (d >= 1 or d == -1) for d in dims)
    if node.target in ("flatten", torch.flatten):
        start = args[0] if args else node.kwargs.get("start_dim", 0)
        return isinstance(start, int) and start >= 1
    if node.target is operator.getitem:
        index = args[0] if args else None
        first = index[0] if isinstance(index, tuple) and index else index
        return isinstance(first, slice) and first == slice(None, None, None)
    return False


def _shape_op(node: fx.Node) -> bool:
    names = ("unsqueeze", "squeeze", "flatten")
    if node.op == "call_method":
        return node.target in names
    return node.op == "call_function" and node.target in (
        torch.unsqueeze,
        torch.squeeze,
        torch.flatten,
        operator.getitem,
    )


def _degree(node: fx.Node, degree: dict[fx.Node, float], modules: dict[str, nn.Module]) -> float | None:
    """How ``node``'s value scales with the input (``c^d``); None when it does not."""
    inputs = [a for a in node.all_input_nodes if a in degree]
    others = [a for a in node.all_input_nodes if a not in degree]
    first = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
    if first is None:
        return None
    if node.op == "call_module":
        module = modules[str(node.target)]
        if isinstance(module, _LAYERS) and module.bias is None and len(inputs) == 1 and first in degree:
            return degree[first]
        if isinstance(module, _HOMOGENEOUS_MODULES) and len(node.args) == 1 and first in degree:
            return degree[first]
        return None
    if _shape_op(node):
        return degree[first] if first in degree and not others and _keeps_batch_first(node) else None
    if node.op == "call_method" and node.target in _SAME_DEGREE_METHODS and len(inputs) == 1 and first in degree:
        return degree[first]
    if node.op != "call_function" or first not in degree:
        return None
    if node.target in _SAME_DEGREE_FUNCTIONS and not others and len(node.args) == 1:
        return degree[first]
    if node.target is F.pad:
        mode = node.kwargs.get("mode", node.args[2] if len(node.args) > 2 else "constant")
        value = node.kwargs.get("value", node.args[3] if len(node.args) > 3 else None)
        return degree[first] if mode in _PAD_MODES and value in (None, 0, 0.0) and not others else None
    if node.target in (operator.pow, torch.pow):
        exponent = node.args[1] if len(node.args) > 1 else None
        return degree[first] * exponent if isinstance(exponent, (int, float)) and exponent > 0 else None
    if node.target is torch.sqrt and len(node.args) == 1:
        return degree[first] / 2
    if node.target in _ADDITIVE:
        degrees = {degree[a] for a in inputs}
        constants = [a for a in node.args if not isinstance(a, fx.Node)]
        return degrees.pop() if len(degrees) == 1 and not others and not constants and len(inputs) == 2 else None
    if node.target in (operator.mul, torch.mul) and all(a.op == "get_attr" for a in others):
        # a number or a parameter keeps the degree; a second input of the region adds its own
        return sum(degree[a] for a in inputs) if len(node.args) == 2 else None
    if node.target is operator.truediv and len(inputs) == 1 and isinstance(node.args[1], (int, float)):
        return degree[first]
    return None


def _biased_layer(node: fx.Node, degree: dict[fx.Node, float], modules: dict[str, nn.Module]) -> bool:
    if node.op != "call_module" or len(node.args) != 1 or node.kwargs:
        return False
    module = modules[str(node.target)]
    first = node.args[0]
    return isinstance(module, _LAYERS) and module.bias is not None and degree.get(first) == 1  # type: ignore[arg-type]


def _region_ends(gm: fx.GraphModule, placeholder: fx.Node) -> list[fx.Node] | None:
    """The biased layers ending ``placeholder``'s homogeneous front end, or None if a path
    leaves it anywhere else (an op that does not scale with the input, or the output)."""
    modules = dict(gm.named_modules())
    degree: dict[fx.Node, float] = {placeholder: 1.0}
    ends: list[fx.Node] = []
    for node in gm.graph.nodes:
        if node is placeholder or not any(a in degree for a in node.all_input_nodes):
            continue
        found = _degree(node, degree, modules)
        if found is not None:
            degree[node] = found
        elif _biased_layer(node, degree, modules):
            ends.append(node)
        else:
            return None
    return ends or None


def find_normalizable_inputs(gm: fx.GraphModule) -> Iterator[Candidate]:
    """Each model input whose front end scales with it up to biased conv/linear layers."""
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        ends = _region_ends(gm, node)
        if ends:
            yield Candidate(str(node.target), ends)


def normalize_input(gm: fx.GraphModule, placeholder: str, layers: list[str]) -> None:
    """Apply the rewrite to ``gm`` in place (recompile after); ``layers`` must be the
    candidate's biased layers, which the plan recorded."""
    graph = gm.graph
    source: fx.Node | None = next((n for n in graph.nodes if n.op == "placeholder" and n.target == placeholder), None)
    ends = _region_ends(gm, source) if source is not None else None
    if source is None or ends is None or sorted(str(n.target) for n in ends) != sorted(layers):
        raise QlintError(f"{KIND}: input {placeholder!r} no longer reaches {', '.join(layers)} through scaling ops")
    gm.add_submodule(normalizer_name(placeholder), SampleNormalize())
    users = list(source.users)
    with graph.inserting_after(source):
        pair = graph.call_module(normalizer_name(placeholder), (source,))
    with graph.inserting_after(pair):
        normalized = graph.call_function(operator.getitem, (pair, 0))
    with graph.inserting_after(normalized):
        scale = graph.call_function(operator.getitem, (pair, 1))
    for user in users:
        user.replace_input_with(source, normalized)
    for layer in ends:
        module = gm.get_submodule(str(layer.target))
        weight, bias = module.weight, module.bias
        if not (isinstance(weight, torch.Tensor) and isinstance(bias, torch.Tensor)):
            raise QlintError(f"{KIND}: {layer.target} has no weight and bias tensors")
        channel_dims_after = 0 if isinstance(module, nn.Linear) else weight.dim() - 2
        name = denormalizer_name(str(layer.target))
        gm.add_submodule(name, SampleDenormalize(bias, channel_dims_after))
        consumers = list(layer.users)
        with graph.inserting_after(layer):
            restored = graph.call_module(name, (layer, scale))
        for consumer in consumers:
            consumer.replace_input_with(layer, restored)
