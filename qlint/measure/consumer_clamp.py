"""The clamp a layer's only consumer applies, and whether the layer's int8 grid does its work.

A conv followed by a ReLU6 that the backend does not fuse gets a fixed output range [0, 6]
from QL101: the int8 conv saturates where the ReLU6 clamps, so the clamp costs nothing. Read
raw, that conv looks broken: the float conv's values outside [0, 6] are "clipped" on the
quantized side, yet the ReLU6 discards them in the float model too. The error that reaches
the model is the one after the clamp. So where a layer's only consumer clamps to [low, high]
and the layer's output grid lies inside that range, the float side is read after the clamp
(the quantized side is already inside it). A grid wider than the clamp is read raw, as torch's
numeric suite does: the layer's own rounding is then all there is to see.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.fx
from torch import nn

from qlint.core.ops import function_kind, method_kind
from qlint.measure.call_sites import module_calls
from qlint.measure.match_result import MODULE_SITE, ConsumerClamp, LayerMatch
from qlint.measure.quantizers import QuantGrid


def _number(value: object, default: float) -> float | None:
    """A constant clamp bound; None when it is not a number (a tensor bound is not constant)."""
    if value is None:
        return default
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def _bounds(node: torch.fx.Node, modules: dict[str, nn.Module]) -> tuple[float, float] | None:
    """[low, high] that ``node`` clamps its first argument to; None when it is no constant clamp."""
    if node.op == "call_module":
        module = modules.get(str(node.target))
        if isinstance(module, nn.Hardtanh):  # nn.ReLU6 is a Hardtanh(0, 6)
            return float(module.min_val), float(module.max_val)
        return (0.0, math.inf) if isinstance(module, nn.ReLU) else None
    if node.op == "call_function" and callable(node.target):
        kind = function_kind(node.target)
    elif node.op == "call_method":
        kind = method_kind(str(node.target))
    else:
        return None
    if kind == "relu":
        return 0.0, math.inf
    if kind == "relu6":
        return 0.0, 6.0
    names = {"hardtanh": ("min_val", "max_val"), "clamp": ("min", "max")}.get(kind)
    if names is None:
        return None
    defaults = (-1.0, 1.0) if kind == "hardtanh" else (-math.inf, math.inf)
    given = [node.args[i] if len(node.args) > i else node.kwargs.get(names[i - 1]) for i in (1, 2)]
    low, high = _number(given[0], defaults[0]), _number(given[1], defaults[1])
    return None if low is None or high is None else (low, high)


def _consumer_clamp(node: torch.fx.Node, modules: dict[str, nn.Module]) -> ConsumerClamp | None:
    if len(node.users) != 1:
        return None
    user = next(iter(node.users))
    if not user.args or user.args[0] is not node:
        return None
    bounds = _bounds(user, modules)
    return None if bounds is None else ConsumerClamp(user.name, *bounds)


def attach_consumer_clamps(layers: Iterable[LayerMatch], float_graph: torch.fx.GraphModule) -> None:
    """Set each layer's ``consumer_clamp``: the clamp that is the only consumer of its float
    output, at every call the layer reads. A layer whose value gets a fused ReLU applied by hand
    (``float_exit_relu``) is left alone."""
    modules = dict(float_graph.named_modules())
    nodes = {node.name: node for node in float_graph.graph.nodes}
    calls = module_calls(float_graph)
    for layer in layers:
        if layer.float_exit_relu:
            continue
        site = layer.float_exit
        if site.kind == MODULE_SITE:
            every = calls.get(site.name, [])
            exits = every if site.call is None else every[site.call : site.call + 1]
        else:
            exits = [nodes[site.name]] if site.name in nodes else []
        clamps = {_consumer_clamp(node, modules) for node in exits}
        if len(clamps) == 1:
            layer.consumer_clamp = clamps.pop()


def within(grid: QuantGrid | None, clamp: ConsumerClamp | None) -> bool:
    """Whether every value of ``grid`` lies inside ``clamp``'s range (half a step of slack for
    float rounding): the int8 layer then saturates where its consumer clamps."""
    if grid is None or clamp is None:
        return False
    slack = grid.scale / 2
    return grid.low >= clamp.low - slack and grid.high <= clamp.high + slack
