"""Match the layers of a float model with those of its quantized counterpart.

The counterpart can be a prepared model (observers or fake-quant, from
``prepare_fx`` / ``prepare_qat_fx`` / eager ``prepare``), an FX-converted int8
model, a dynamically quantized model, or an eager-mode converted model.  All of
them keep the float model's module names for the layers they replace, so the
primary key is the module fqn.  Fusion is the complication: a quantized
``ConvReLU2d`` at ``conv`` stands for the float ``conv -> bn -> relu`` chain, so
the float side's comparison point moves to the end of that chain ("absorbed"
ops).  Functional ops of an FX graph (``x + y`` becoming ``quantized.add``) have
no fqn; they are paired by op kind, by the nearest module layers that feed them
and by their occurrence order (:mod:`qlint.measure.functional_matching`).  Whatever
is left is paired in graph order.  A pt2e-converted graph's ops are read after their own
output quantize/dequantize pair (:mod:`qlint.measure.pt2e_outputs`).  A module called several
times is one layer per call when matched ``per_call`` (:mod:`qlint.measure.call_sites`).  The
result's records are :mod:`qlint.measure.match_result`'s.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import torch
import torch.fx
from torch import nn
from torch.ao.quantization import FakeQuantizeBase, ObserverBase

from qlint.core.ops import (
    SHAPE_KINDS,
    function_kind,
    fuses_relu,
    is_aten_graph,
    layer_kind,
    method_kind,
    quantized_form,
)
from qlint.core.trace import symbolic_graph
from qlint.errors import TraceError
from qlint.measure.call_sites import chain_nodes, module_calls, split_calls
from qlint.measure.consumer_clamp import attach_consumer_clamps
from qlint.measure.functional_matching import is_relu_node, match_functional, upstream_of
from qlint.measure.match_result import MODULE_SITE, NODE_SITE, CounterpartKind, LayerMatch, MatchResult, Site
from qlint.measure.pt2e_outputs import quantized_outputs

# --- what counts as a layer ---------------------------------------------------


def _is_quantizer(module: nn.Module | None) -> bool:
    return isinstance(module, (ObserverBase, FakeQuantizeBase))


def detect_counterpart(model: nn.Module) -> CounterpartKind:
    has_quantizer = has_dynamic = has_static = False
    for module in model.modules():
        if _is_quantizer(module):
            has_quantizer = True
        elif layer_kind(module) is None:
            continue  # packed-params holders and containers say nothing about the kind
        elif quantized_form(module) == "dynamic":
            has_dynamic = True
        elif quantized_form(module) == "static":
            has_static = True
    if isinstance(model, torch.fx.GraphModule):
        quantize_ops = any(
            node.op == "call_function" and "quantize_per" in str(getattr(node.target, "__name__", node.target))
            for node in model.graph.nodes
        )
        if quantize_ops and is_aten_graph(model):
            return CounterpartKind.CONVERTED_PT2E
        if has_static or quantize_ops:
            return CounterpartKind.CONVERTED_FX
    if has_quantizer:
        return CounterpartKind.PREPARED
    if has_static:
        return CounterpartKind.EAGER_CONVERTED
    if has_dynamic:
        return CounterpartKind.DYNAMIC
    return CounterpartKind.FLOAT


def quantized_layer_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Top-most layer-like modules; the insides of fused/packed modules are not layers."""
    layers: dict[str, nn.Module] = {}
    for fqn, module in model.named_modules():
        if not fqn or _inside(fqn, layers):
            continue
        if layer_kind(module) is not None:
            layers[fqn] = module
    return layers


def _inside(fqn: str, owners: Mapping[str, object]) -> bool:
    """Whether an ancestor of ``fqn`` is one of ``owners``: one lookup per dotted prefix."""
    parts = fqn.split(".")
    return any(".".join(parts[:depth]) in owners for depth in range(1, len(parts)))


def float_layer_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Leaf torch layers of the float model, in registration order."""
    return {
        fqn: module
        for fqn, module in model.named_modules()
        if fqn
        and layer_kind(module) is not None
        and not any(layer_kind(child) is not None for child in module.children())
    }


def trace_or_none(model: nn.Module, notes: list[str], label: str) -> torch.fx.GraphModule | None:
    """The model's FX graph (see :func:`qlint.core.trace.symbolic_graph`); None when it has none.

    A traced float model shares its submodules with the original (tracing
    copies nothing), which is what lets hooks and the graph see the same calls.
    """
    try:
        return symbolic_graph(model)
    except TraceError as error:
        notes.append(f"{label} model is not FX-traceable ({str(error).partition(':')[0]}); using module order")
        return None


def _missing_or_identity(model_modules: dict[str, nn.Module], fqn: str) -> bool:
    module = model_modules.get(fqn)
    return module is None or isinstance(module, nn.Identity)


def match_layers(float_model: nn.Module, quantized_model: nn.Module, *, per_call: bool = False) -> MatchResult:
    """Pair the float model's layers with the quantized counterpart's (see the module docstring).

    Nothing is run; the float model is FX-traced when possible (tracing shares
    its submodules, it does not copy or change them).  ``per_call``: a module the float
    graph calls several times is one layer per call, named by the call's FX node (what
    compare shows); otherwise one layer, named by its fqn, pools its calls (what lint's
    trial reports, by the module a fix names).
    """
    notes: list[str] = []
    counterpart = detect_counterpart(quantized_model)
    float_graph = trace_or_none(float_model, notes, "float")
    quant_graph = quantized_model if isinstance(quantized_model, torch.fx.GraphModule) else None
    float_modules = dict(float_model.named_modules(remove_duplicate=False))
    quant_modules = dict(quantized_model.named_modules(remove_duplicate=False))
    quant_layers = quantized_layer_modules(quantized_model)

    # Float module layers in forward order: graph order when traced, else registration order.
    if float_graph is not None:
        float_nodes = [
            node
            for node in float_graph.graph.nodes
            if node.op == "call_module" and layer_kind(float_modules.get(str(node.target), nn.Identity())) is not None
        ]
        float_order: list[str] = []
        for node in float_nodes:
            if str(node.target) not in float_order:
                float_order.append(str(node.target))
    else:
        float_nodes = []
        float_order = list(float_layer_modules(float_model))
    node_of_fqn = {str(node.target): node for node in float_nodes}

    layers: dict[str, LayerMatch] = {}
    absorbed: set[str] = set()

    def add_match(fqn: str, quant_fqn: str, matched_by: str) -> None:
        quant_module = quant_layers[quant_fqn]
        kind = layer_kind(float_modules[fqn])
        if kind is None:
            raise ValueError(f"{fqn} is not a layer: only layer modules are matched")
        layer = LayerMatch(
            name=fqn,
            kind=kind,
            float_entry=Site(MODULE_SITE, fqn),
            float_exit=Site(MODULE_SITE, fqn),
            quant_site=Site(MODULE_SITE, quant_fqn),
            quant_class=type(quant_module).__name__,
            matched_by=matched_by,
        )
        _absorb_fused_followers(
            layer, quant_module, float_modules, quant_modules, node_of_fqn.get(fqn), float_order, absorbed
        )
        layers[fqn] = layer

    unmatched_float: list[str] = []
    for fqn in float_order:
        if fqn in absorbed:
            continue
        quant_module = quant_layers.get(fqn)
        if quant_module is None or layer_kind(float_modules[fqn]) != layer_kind(quant_module):
            unmatched_float.append(fqn)
        else:
            add_match(fqn, fqn, "fqn")

    # Leftover module layers: pair by kind in forward order (renamed modules).
    leftover_quant = [fqn for fqn in quant_layers if fqn not in layers]
    for fqn in list(unmatched_float):
        if fqn in absorbed:
            continue
        kind = layer_kind(float_modules[fqn])
        candidate = next(
            (
                q
                for q in leftover_quant
                if layer_kind(quant_layers[q]) == kind and _missing_or_identity(float_modules, q)
            ),
            None,
        )
        if candidate is None:
            continue
        leftover_quant.remove(candidate)
        add_match(fqn, candidate, "graph-order")
        notes.append(f"{fqn} matched to {candidate} by graph order (no module of that name in the quantized model)")
    unmatched_float = [fqn for fqn in unmatched_float if fqn not in absorbed and fqn not in layers]

    if float_graph is not None and quant_graph is not None:
        absorbed_by_functional = match_functional(float_graph, quant_graph, layers, float_modules, quant_modules)
        unmatched_float = [fqn for fqn in unmatched_float if fqn not in absorbed_by_functional]
    if float_graph is not None:
        taken = set(float_modules) | set(layers)
        split = split_calls(layers.values(), float_graph, quant_graph, taken, notes, per_call=per_call)
        layers = {layer.name: layer for layer in split}
        attach_consumer_clamps(layers.values(), float_graph)
    if quant_graph is not None:
        _attach_quantizers(quant_graph, layers, quant_modules)
    if quant_graph is not None and counterpart is CounterpartKind.CONVERTED_PT2E:
        _attach_pt2e_outputs(quant_graph, layers)

    ordered = _forward_order(layers, float_graph, float_order)
    _attach_predecessors(ordered, float_graph)
    return MatchResult(
        layers=ordered,
        counterpart=counterpart,
        unmatched_float=unmatched_float,
        unmatched_quantized=leftover_quant,
        float_graph=float_graph,
        quant_graph=quant_graph,
        notes=notes,
    )


def _absorb_fused_followers(layer, quant_module, float_modules, quant_modules, node, float_order, absorbed) -> None:
    """Move the float comparison point past BN/ReLU that the quantized layer fused in."""
    wants_relu = fuses_relu(quant_module)
    if layer.kind.startswith(("conv", "linear")) or layer.kind == "batch_norm":
        followers = (
            _graph_followers(node, float_modules)
            if node is not None
            else _order_followers(layer.name, float_order, float_modules)
        )
        for follower_kind, follower in followers:
            is_module = isinstance(follower, str)
            if (
                follower_kind == "batch_norm"
                and layer.kind != "batch_norm"
                and is_module
                and _missing_or_identity(quant_modules, follower)
                and layer.folded_batch_norm is None
            ):
                layer.folded_batch_norm = follower
            elif (
                follower_kind == "relu"
                and wants_relu
                and (not is_module or _missing_or_identity(quant_modules, follower))
            ):
                wants_relu = False
            else:
                break
            layer.absorbed.append(follower if is_module else follower.name)
            if is_module:
                absorbed.add(follower)
                layer.float_chain.append(follower)
                layer.float_exit = Site(MODULE_SITE, follower)
            else:
                # A functional ReLU has no module to hook: apply it to the last hooked output.
                layer.float_exit_relu = True
            if follower_kind == "relu":
                break
    if wants_relu:
        # Fused ReLU with no visible float ReLU (untraceable functional call): the quantized
        # op's output is relu(...) whatever the float graph looks like.
        layer.float_exit_relu = True


def _graph_followers(node: torch.fx.Node, float_modules) -> list:
    chain: list[tuple[str, str | torch.fx.Node]] = []
    while len(node.users) == 1:
        user = next(iter(node.users))
        if user.op == "call_module":
            kind = layer_kind(float_modules.get(str(user.target), nn.Identity()))
            if kind not in ("batch_norm", "relu"):
                break
            chain.append((kind, str(user.target)))
        elif is_relu_node(user, float_modules):
            chain.append(("relu", user))
        else:
            break
        node = user
    return chain


def _order_followers(fqn: str, float_order: list[str], float_modules) -> list:
    index = float_order.index(fqn)
    return [(layer_kind(float_modules[name]), name) for name in float_order[index + 1 : index + 3]]


def _prepared_as_float(node: torch.fx.Node, role: str) -> bool:
    """Whether ``prepare_fx`` planned this node's ``role`` ("input" or "output") activation as
    float: convert_fx then runs it float (LSTMCell without a static kernel, a layer whose qconfig
    is None). An observer beside such a node is its neighbour's: the producer's output, or the
    consumer's input. Graphs that do not record the plan (``target_dtype_info``) count as
    quantized, as their observers suggest."""
    plan = node.meta.get("target_dtype_info")
    if not isinstance(plan, Mapping) or f"{role}_act_obs_or_fq_ctr" not in plan:
        return False
    constructor = plan[f"{role}_act_obs_or_fq_ctr"]
    if constructor is None:
        return True
    with warnings.catch_warnings():  # torch's observers warn about their own arguments (reduce_range) when built
        warnings.simplefilter("ignore")
        dtype = getattr(constructor(), "dtype", None)
    return isinstance(dtype, torch.dtype) and dtype.is_floating_point


def _attach_quantizers(quant_graph, layers, quant_modules) -> None:
    """For prepared graphs: the observer/fake-quant feeding each layer and the one after it,
    where the layer's own input and output are quantized (an observer beside a layer convert_fx
    keeps float belongs to its neighbour)."""
    module_nodes = module_calls(quant_graph)
    named_nodes = {node.name: node for node in quant_graph.graph.nodes}
    for layer in layers.values():
        if layer.quant_site.kind == MODULE_SITE:
            # A layer pooling a module's calls takes the last call's quantizers.
            calls = module_nodes.get(layer.quant_site.name, [])
            call = layer.quant_site.call
            node = (calls[call] if call is not None else calls[-1]) if calls else None
        else:
            node = named_nodes.get(layer.quant_site.name)
        if node is None:
            continue
        if (
            layer.quant_site.kind == MODULE_SITE
            and node.args
            and isinstance(node.args[0], torch.fx.Node)
            and node.args[0].op == "call_module"
            and _is_quantizer(quant_modules.get(str(node.args[0].target)))
            and not _prepared_as_float(node, "input")
        ):
            layer.quant_input_quantizer = str(node.args[0].target)
        if _prepared_as_float(node, "output"):
            continue
        for user in node.users:
            if user.op == "call_module" and _is_quantizer(quant_modules.get(str(user.target))):
                layer.quant_output_quantizer = str(user.target)
                break


def _attach_pt2e_outputs(quant_graph, layers) -> None:
    """pt2e: read each op's quantized value after its own output quantize/dequantize pair, the
    value the int8 model passes on (an FX-converted layer is read at its quantized output)."""
    outputs = quantized_outputs(quant_graph)
    for layer in layers.values():
        output = outputs.get(layer.quant_site.name) if layer.quant_site.kind == NODE_SITE else None
        if output is not None:
            layer.quant_exit, layer.quant_output_scale = output.node, output.scale


def _forward_order(layers, float_graph, float_order) -> list[LayerMatch]:
    if float_graph is None:
        position = {fqn: index for index, fqn in enumerate(float_order)}
        return sorted(layers.values(), key=lambda layer: position.get(layer.name, len(position)))
    position = {}
    for index, node in enumerate(float_graph.graph.nodes):
        key = str(node.target) if node.op == "call_module" else node.name
        position.setdefault(key, index)
        position.setdefault(node.name, index)
    return sorted(layers.values(), key=lambda layer: position.get(layer.name, len(position)))


def _attach_predecessors(ordered: list[LayerMatch], float_graph) -> None:
    """Nearest upstream layers in the float DAG; a chain when the graph is unknown."""
    if float_graph is None:
        for previous, layer in zip(ordered, ordered[1:]):
            layer.predecessors = [previous.name]
        return
    owner_of_name: dict[str, str] = {}
    owner_of_node: dict[torch.fx.Node, str] = {}  # layers read at one call of their modules
    calls = module_calls(float_graph)
    for layer in ordered:
        nodes = chain_nodes(layer, calls)
        if nodes:
            owner_of_node.update((node, layer.name) for node in nodes)
            continue
        for name in (layer.float_entry.name, layer.float_exit.name, *layer.absorbed):
            owner_of_name.setdefault(name, layer.name)
    layer_of: dict[torch.fx.Node, str] = {}
    entry_nodes: dict[str, torch.fx.Node] = {}
    for node in float_graph.graph.nodes:
        key = str(node.target) if node.op == "call_module" else node.name
        owner = owner_of_node.get(node) or owner_of_name.get(key)
        if owner is not None:
            layer_of[node] = owner
            entry_nodes.setdefault(owner, node)
    order = {other.name: index for index, other in enumerate(ordered)}
    modules = dict(float_graph.named_modules())
    position = {node: index for index, node in enumerate(float_graph.graph.nodes)}
    for layer in ordered:
        node = entry_nodes.get(layer.name)
        if node is None:
            continue
        ancestors, passed = upstream_of(node, layer_of, through=layer.name)
        layer.predecessors = sorted(ancestors, key=lambda name: order.get(name, 0))
        # the value-computing ops of no layer on the way (shape ops left out), in graph order
        between = [other for other in passed if _computes_values(other, modules)]
        layer.between = [other.name for other in sorted(between, key=position.__getitem__)]


def _computes_values(node: torch.fx.Node, modules: dict[str, nn.Module]) -> bool:
    if node.op == "call_function" and callable(node.target):
        kind = function_kind(node.target)
    elif node.op == "call_method":
        kind = method_kind(str(node.target))
    elif node.op == "call_module":
        kind = layer_kind(modules[str(node.target)]) or "module"
    else:
        return False
    return kind not in SHAPE_KINDS


__all__ = [
    "match_layers",
    "detect_counterpart",
    "quantized_layer_modules",
    "float_layer_modules",
]
