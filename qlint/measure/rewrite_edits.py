"""How each float-preserving rewrite edits an fx graph in place: the BN fold (and the folded
functional conv made a module call), the fan-out copy, view → reshape, an op of its own for a
conv's input, a copy of a shared module per call site, and the plan-only normalize_input and
split_leading_token."""

from __future__ import annotations

import copy
import operator
from typing import Any, cast

import torch
import torch.fx as fx
import torch.nn as nn

from qlint.errors import QlintError
from qlint.measure.normalize import KIND as NORMALIZE_KIND
from qlint.measure.normalize import normalize_input
from qlint.measure.rewrite_candidates import BN_TYPES, FUNCTIONAL_CONVS, Candidate, conv_bias_node
from qlint.measure.token_split import KIND as SPLIT_KIND
from qlint.measure.token_split import split_leading_token

FANOUT_SUFFIX = "_qlint_fanout"


def _attr_owner(gm: fx.GraphModule, target: str) -> tuple[nn.Module, str]:
    owner_path, _, name = target.rpartition(".")
    return (gm.get_submodule(owner_path) if owner_path else gm), name


def _split_token(gm: fx.GraphModule, candidate: Candidate) -> None:
    split_leading_token(gm, candidate.modules[0])


def _normalize_input(gm: fx.GraphModule, candidate: Candidate) -> None:
    normalize_input(gm, candidate.nodes[0], candidate.modules)


def _observe_input(gm: fx.GraphModule, candidate: Candidate) -> None:
    fqn = candidate.modules[0]
    calls = [
        n
        for n in gm.graph.nodes
        if (n.op == "call_module" and n.target == fqn)
        or (
            n.op == "call_function"
            and n.target in FUNCTIONAL_CONVS
            and getattr(_conv_arguments(n).get("weight"), "target", None) == f"{fqn}.weight"
        )
    ]
    if not calls:
        raise QlintError(f"observe_input: no call of {fqn} in the graph")
    for node in calls:
        with gm.graph.inserting_before(node):
            observed = gm.graph.call_function(operator.add, (node.args[0], 0.0))
        node.args = (observed, *node.args[1:])


def _uses_of_attr(gm: fx.GraphModule, target: str) -> list[fx.Node]:
    return [u for n in gm.graph.nodes if n.op == "get_attr" and n.target == target for u in n.users]


def _fold(gm: fx.GraphModule, candidate: Candidate) -> None:
    conv = next(n for n in gm.graph.nodes if n.name == candidate.nodes[0])
    bn_node = next(n for n in gm.graph.nodes if n.name == candidate.nodes[1])
    bn = gm.get_submodule(str(bn_node.target))
    if not isinstance(bn, BN_TYPES) or bn.running_mean is None or bn.running_var is None:
        raise QlintError(f"{bn_node.target} is not a batch norm with running statistics")
    weight_node = conv.args[1] if len(conv.args) > 1 else conv.kwargs["weight"]
    bias_node = conv_bias_node(conv)
    for attr in [weight_node] + ([bias_node] if bias_node is not None else []):
        if any(u is not conv for u in _uses_of_attr(gm, str(attr.target))):
            raise QlintError(f"{attr.target} is also used outside {conv.name}")
    owner, name = _attr_owner(gm, str(weight_node.target))
    weight = getattr(owner, name).detach()
    bias = getattr(*_attr_owner(gm, str(bias_node.target))).detach() if bias_node is not None else None
    with torch.no_grad():
        std = torch.sqrt(bn.running_var + bn.eps)
        gamma = bn.weight.detach() if bn.weight is not None else torch.ones_like(std)
        beta = bn.bias.detach() if bn.bias is not None else torch.zeros_like(std)
        factor = gamma / std
        new_weight = weight * factor.reshape(-1, *([1] * (weight.dim() - 1)))
        old_bias = bias if bias is not None else torch.zeros_like(bn.running_mean)
        new_bias = (old_bias - bn.running_mean) * factor + beta
    setattr(owner, name, nn.Parameter(new_weight.to(weight.dtype), requires_grad=False))
    if bias_node is not None:
        b_owner, b_name = _attr_owner(gm, str(bias_node.target))
        setattr(b_owner, b_name, nn.Parameter(new_bias.to(weight.dtype), requires_grad=False))
    else:
        owner_path = str(weight_node.target).rpartition(".")[0]
        b_name = "qlint_folded_bias"
        owner.register_parameter(b_name, nn.Parameter(new_bias.to(weight.dtype), requires_grad=False))
        with gm.graph.inserting_before(conv):
            new_bias_node = gm.graph.get_attr(f"{owner_path}.{b_name}" if owner_path else b_name)
        if len(conv.args) > 2:
            conv.args = conv.args[:2] + (new_bias_node,) + conv.args[3:]
        else:
            conv.kwargs = {**conv.kwargs, "bias": new_bias_node}
    bn_node.replace_all_uses_with(conv)
    gm.graph.erase_node(bn_node)
    _as_module_call(gm, conv)


_CONV_MODULES: dict[int, type[nn.Module]] = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
_CONV_ARGS = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")


def _conv_arguments(node: fx.Node) -> dict[str, Any]:
    given = dict(zip(_CONV_ARGS, node.args, strict=False)) | dict(node.kwargs)
    return {"stride": 1, "padding": 0, "dilation": 1, "groups": 1} | given


def _as_module_call(gm: fx.GraphModule, conv: fx.Node) -> None:
    """Turn a folded functional conv into a call of a plain ``nn.ConvNd`` at its owner's path.

    The owner is the module holding the weight (an ``nn.Conv2d`` subclass with a custom
    forward, traced through, as EfficientNet-Lite's padded convs are). prepare_fx then fuses
    what follows the conv (a ReLU), and a plan's decisions by module name reach it: a qconfig
    set by name never reaches a functional call in a traced GraphModule."""
    arguments = _conv_arguments(conv)
    weight, bias, source = arguments["weight"], arguments.get("bias"), arguments["input"]
    if not (isinstance(bias, fx.Node) and bias.op == "get_attr" and isinstance(source, fx.Node)):
        return
    owner_path = str(weight.target).rpartition(".")[0]
    if not owner_path or str(bias.target).rpartition(".")[0] != owner_path:
        return
    if any(n.op == "call_module" and n.target == owner_path for n in gm.graph.nodes):
        return  # the owner's own forward runs elsewhere
    owner = gm.get_submodule(owner_path)
    held = {name for name, _ in owner.named_parameters(recurse=False)} | {
        name for name, _ in owner.named_buffers(recurse=False)
    }
    if held - {str(weight.target).rpartition(".")[2], str(bias.target).rpartition(".")[2]}:
        return  # the owner holds more than this conv's weight and bias
    weight_value = getattr(owner, str(weight.target).rpartition(".")[2])
    groups = int(arguments["groups"])
    plain = _CONV_MODULES[FUNCTIONAL_CONVS[cast(Any, conv.target)]](
        weight_value.shape[1] * groups,
        weight_value.shape[0],
        tuple(weight_value.shape[2:]),
        arguments["stride"],
        arguments["padding"],
        arguments["dilation"],
        groups,
        bias=True,
    )
    plain.weight = weight_value
    plain.bias = getattr(owner, str(bias.target).rpartition(".")[2])
    plain.train(owner.training)
    parent, _, leaf = owner_path.rpartition(".")
    parent_module = gm.get_submodule(parent) if parent else gm
    # The owner's children (e.g. the static padding the graph calls) move beside the conv:
    # prepare_fx swaps the conv for a fused module that would not carry them.
    children = dict(owner.named_children())
    if any(hasattr(parent_module, f"{leaf}_{name}") for name in children):
        return
    moved = {}
    for name, child in children.items():
        parent_module.add_module(f"{leaf}_{name}", child)
        moved[f"{owner_path}.{name}"] = f"{parent}.{leaf}_{name}" if parent else f"{leaf}_{name}"
    for node in gm.graph.nodes:
        if node.op == "call_module" and str(node.target) in moved:
            node.target = moved[str(node.target)]
    setattr(parent_module, leaf, plain)
    with gm.graph.inserting_before(conv):
        call = gm.graph.call_module(owner_path, (source,))
    conv.replace_all_uses_with(call)
    gm.graph.erase_node(conv)
    for attr in (weight, bias):
        if not attr.users:
            gm.graph.erase_node(attr)


def _duplicate_fanout(gm: fx.GraphModule, candidate: Candidate) -> None:
    node = next(n for n in gm.graph.nodes if n.name == candidate.nodes[0])
    bn_node = next(n for n in gm.graph.nodes if n.name == candidate.nodes[1])
    base = str(node.target).replace(".", "_") + FANOUT_SUFFIX
    name, i = base, 1
    while hasattr(gm, name):
        i += 1
        name = f"{base}{i}"
    duplicate = copy.deepcopy(gm.get_submodule(str(node.target)))
    # verify gives the copy the original's qconfig (torch's stubs allow only Tensor | Module attributes)
    duplicate.qlint_fanout_of = str(node.target)  # type: ignore[assignment]
    gm.add_submodule(name, duplicate)
    with gm.graph.inserting_after(node):
        copy_node = gm.graph.call_module(name, node.args, dict(node.kwargs))
    node.replace_all_uses_with(copy_node, delete_user_cb=lambda user: user is not bn_node and user is not copy_node)


def _split_module(gm: fx.GraphModule, candidate: Candidate) -> None:
    """Every call of a shared module after the first gets a copy of its own, registered beside
    it (``<name>_qlint_call2``, ...) so that qconfigs set on a parent still reach it. In FX
    each call is observed on its own anyway; what the copies change is the converted model,
    where one quantized module would serve every call with one set of output qparams."""
    fqn = candidate.modules[0]
    calls = [n for n in gm.graph.nodes if n.op == "call_module" and n.target == fqn]
    if len(calls) < 2:
        raise QlintError(f"split_module: {fqn} is called {len(calls)} time(s) in the graph, not shared")
    parent_name, _, name = fqn.rpartition(".")
    parent = gm.get_submodule(parent_name)
    original = gm.get_submodule(fqn)
    for index, node in enumerate(calls[1:], start=2):
        copy_name, suffix = f"{name}_qlint_call{index}", index
        while hasattr(parent, copy_name):  # a name the model already uses
            suffix += len(calls)
            copy_name = f"{name}_qlint_call{suffix}"
        duplicate = copy.deepcopy(original)
        # the copy follows the original's module-name qconfig (fanout_follows_original reads this)
        duplicate.qlint_fanout_of = fqn  # type: ignore[assignment]
        parent.add_module(copy_name, duplicate)
        node.target = f"{parent_name}.{copy_name}" if parent_name else copy_name


def _view_to_reshape(gm: fx.GraphModule, candidate: Candidate) -> None:
    node = next(n for n in gm.graph.nodes if n.name == candidate.nodes[0])
    node.target = "reshape"


APPLY = {
    "fold_bn_into_functional_conv": _fold,
    "view_to_reshape": _view_to_reshape,
    "fuse": _duplicate_fanout,
    "observe_input": _observe_input,
    "split_module": _split_module,
    NORMALIZE_KIND: _normalize_input,
    SPLIT_KIND: _split_token,
}
