"""Pairing the functional ops of a float FX graph with those of its quantized graph.

Functional ops (``x + y`` becoming ``quantized.add``) have no module fqn to match by: each
worth a row of its own is keyed by its op kind, the nearest module layers that feed it and
its occurrence among ops of that key, on both sides; equal keys pair. A quantized kernel
that fuses a ReLU (``add_relu``) takes the float ReLU after the op into its match.
"""

from __future__ import annotations

import torch
import torch.fx
from torch import nn

from qlint.core.ops import FunctionOp, function_op, method_kind
from qlint.measure.match_result import NODE_SITE, LayerMatch, Site

# Functional ops worth a row of their own, by op kind.
_COMPARED_FUNCTIONAL_KINDS = frozenset(
    {
        "add",
        "mul",
        "cat",
        "matmul",
        "linear",
        "conv1d",
        "conv2d",
        "conv3d",
        "relu",
        "relu6",
        "hardswish",
        "sigmoid",
        "tanh",
        "gelu",
        "silu",
        "leaky_relu",
        "elu",
        "hardtanh",
        "layer_norm",
        "softmax",
    }
)


def functional_kind(node: torch.fx.Node) -> tuple[str | None, bool]:
    """(kind, fuses_relu) for a call_function / call_method node worth comparing, else (None, False)."""
    if node.op == "call_method":
        op = FunctionOp(method_kind(str(node.target)))
    elif node.op == "call_function" and not isinstance(node.target, str):
        op = function_op(node.target)
    else:
        return None, False
    if op.kind not in _COMPARED_FUNCTIONAL_KINDS:
        return None, False
    return op.kind, op.fused_relu


def is_relu_node(node: torch.fx.Node, modules: dict[str, nn.Module]) -> bool:
    if node.op == "call_module":
        return isinstance(modules.get(str(node.target)), nn.ReLU)
    kind, _ = functional_kind(node)
    return kind == "relu"


def nearest_layer_ancestors(
    node: torch.fx.Node, layer_of: dict[torch.fx.Node, str], through: str | None = None
) -> frozenset[str]:
    """The layers nearest upstream of ``node``; the nodes of layer ``through`` are walked past."""
    return upstream_of(node, layer_of, through)[0]


def upstream_of(
    node: torch.fx.Node, layer_of: dict[torch.fx.Node, str], through: str | None = None
) -> tuple[frozenset[str], list[torch.fx.Node]]:
    """The layers nearest upstream of ``node``, and the nodes of no layer walked past to reach
    them (the nodes of layer ``through`` are walked past and not listed)."""
    found: set[str] = set()
    passed: list[torch.fx.Node] = []
    stack, seen = list(node.all_input_nodes), set()
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        owner = layer_of.get(current)
        if owner is not None and owner != through:
            found.add(owner)
            continue
        stack.extend(current.all_input_nodes)
        if owner is None:
            passed.append(current)
    return frozenset(found), passed


def match_functional(float_graph, quant_graph, layers, float_modules, quant_modules) -> set[str]:
    """Pair functional ops by (kind, nearest module layers feeding them, occurrence).

    Returns the float module fqns absorbed into a fused functional op.
    """
    absorbed_modules: set[str] = set()
    absorbed_nodes = {name for layer in layers.values() for name in layer.absorbed}
    float_layer_of = {}
    for node in float_graph.graph.nodes:
        if node.op == "call_module" and str(node.target) in layers:
            float_layer_of[node] = str(node.target)
    by_float_exit = {layer.float_exit.name: layer.name for layer in layers.values()}
    for node in float_graph.graph.nodes:
        if node.op == "call_module" and str(node.target) in by_float_exit:
            float_layer_of[node] = by_float_exit[str(node.target)]
        if node.name in absorbed_nodes:
            owner = next(layer.name for layer in layers.values() if node.name in layer.absorbed)
            float_layer_of[node] = owner
    quant_to_float = {layer.quant_site.name: layer.name for layer in layers.values()}
    quant_layer_of = {
        node: quant_to_float[str(node.target)]
        for node in quant_graph.graph.nodes
        if node.op == "call_module" and str(node.target) in quant_to_float
    }

    def keyed(graph, layer_of, skip):
        seen: dict[tuple, int] = {}
        result = {}
        for node in graph.graph.nodes:
            kind, fused = functional_kind(node)
            if kind is None or node in layer_of or node.name in skip:
                continue
            signature = (kind, nearest_layer_ancestors(node, layer_of))
            index = seen.get(signature, 0)
            seen[signature] = index + 1
            result[signature + (index,)] = (node, fused)
        return result

    float_keys = keyed(float_graph, float_layer_of, absorbed_nodes)
    quant_keys = keyed(quant_graph, quant_layer_of, set())
    for key, (float_node, _) in float_keys.items():
        if key not in quant_keys:
            continue
        quant_node, fused = quant_keys[key]
        layer = LayerMatch(
            name=float_node.name,
            kind=key[0],
            float_entry=Site(NODE_SITE, float_node.name),
            float_exit=Site(NODE_SITE, float_node.name),
            quant_site=Site(NODE_SITE, quant_node.name),
            quant_class=str(getattr(quant_node.target, "__name__", quant_node.target)),
            matched_by="signature",
        )
        if fused and len(float_node.users) == 1:
            follower = next(iter(float_node.users))
            if is_relu_node(follower, float_modules):
                # quantized add_relu / linear_relu: the float ReLU after the op is part of it.
                is_module = follower.op == "call_module"
                layer.absorbed.append(str(follower.target) if is_module else follower.name)
                layer.float_exit = Site(NODE_SITE, follower.name)
                if is_module:
                    absorbed_modules.add(str(follower.target))
                    layers.pop(str(follower.target), None)
        layers[layer.name] = layer
    return absorbed_modules
