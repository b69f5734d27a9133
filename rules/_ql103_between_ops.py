"""QL103's checks between ops: float islands between quantized ops, and cat inputs observed
with different qparams."""

from __future__ import annotations

from collections.abc import Iterator

from qlint.core.graph import OpNode
from qlint.core.ops import SHAPE_KINDS
from qlint.linter.findings import Finding
from qlint.linter.rule import Rule
from qlint.rules._ql103_checks import (
    CALL_OPS,
    LISTED_NODES,
    QConfigCheckState,
    fixed_qparams_range,
    float_reason,
    qparams_text,
)
from qlint.rules._ql103_islands import Island, eager_float_islands, fx_float_islands, is_static_quantized, unique_nodes

# Sub-check kinds (data["kind"]; part of each finding's fingerprint).
KIND_FLOAT_ISLAND = "float-island"
KIND_CAT = "cat-input-qparams"


# --- float islands -------------------------------------------------------------------
def float_island_findings(rule: Rule, state: QConfigCheckState, min_island_ops: int) -> Iterator[Finding]:
    graph, backend = state.graph, state.ctx.backend
    islands = eager_float_islands(graph) if state.eager else fx_float_islands(graph, backend)
    for island in islands:
        compute = [n for n in island.nodes if n.kind not in SHAPE_KINDS]
        if len(compute) < min_island_ops:
            continue
        yield _island_finding(rule, state, island, compute)


def _island_finding(rule: Rule, state: QConfigCheckState, island: Island, compute: list[OpNode]) -> Finding:
    backend = state.ctx.backend
    head = compute[0]
    ops = ", ".join(f"{n.display} ({n.kind})" for n in compute[:LISTED_NODES])
    if len(compute) > LISTED_NODES:
        ops += f" and {len(compute) - LISTED_NODES} more"
    producers = ", ".join(dict.fromkeys(p.display for p in island.producers))
    consumers = ", ".join(dict.fromkeys(c.display for c in island.consumers))
    unsupported = sorted({n.kind for n in compute if not backend.supports(n.kind)})
    # ops no module computes: a qconfig by module name (what a plan and the trial apply) names
    # nothing for them, so torch would ignore it
    functional = [] if state.eager else [n for n in compute if n.module is None]
    if state.eager:
        how = "between a DeQuantStub and a QuantStub, with quantized modules on both sides"
        fix = (
            "move these ops before the first QuantStub or after the last DeQuantStub, or "
            "quantize them and remove the stub pair"
        )
    else:
        states = sorted({float_reason(n) for n in compute})
        how = f"({' / '.join(states)}) between quantized ops"
        fix = (
            "give them a quantized qconfig (e.g. the one their neighbours use), or move them "
            "to the start or end of the model"
        )
        if functional:
            fix += (
                f"; {', '.join(n.display for n in functional)} "
                f"{'is a function call' if len(functional) == 1 else 'are function calls'}, which no "
                "module-name entry reaches: set its qconfig by op type (mapping.set_object_type(function, "
                "qconfig), every call) or by call (mapping.set_module_name_object_type_order(scope, "
                "function, index, qconfig))"
            )
    if unsupported:
        fix += (
            f"; {backend.name} has no quantized kernel for {', '.join(unsupported)}, so moving "
            "it to the model edge or replacing it with a supported op is the way out"
        )
    message = (
        f"{ops} run{'s' if len(compute) == 1 else ''} in float {how}: {producers} → island → "
        f"{consumers}. Every edge into the island costs a dequantize and every edge out a "
        f"quantize ({island.dequantize_edges} + {island.quantize_edges} here), each an extra "
        f"pass over the tensor and an extra rounding step. Fix: {fix}."
    )
    involved = list(island.producers) + list(island.nodes) + list(island.consumers)
    neighbour = island.producers[0]
    data = {
        "kind": KIND_FLOAT_ISLAND,
        "node": head.name,
        "island": [n.name for n in island.nodes],
        "island_targets": [n.display for n in island.nodes],
        "producers": [p.name for p in island.producers],
        "consumers": [c.name for c in island.consumers],
        "dequantize_edges": island.dequantize_edges,
        "quantize_edges": island.quantize_edges,
        "unsupported_kinds": unsupported,
        "eager": state.eager,
        "qconfig_table": state.table(unique_nodes(involved)),
    }
    if functional:
        # a qconfig by op type or by call: no module-name entry (what a plan and the trial
        # apply) expresses it, and torch would ignore one named after the node
        return rule.finding(head.display, message, data=data)
    like = neighbour.qconfig.activation if neighbour.qconfig and neighbour.qconfig.activation else None
    suggestion = {
        "action": "set_qconfig",
        "target": head.display,
        "targets": [n.display for n in compute],
        "like": neighbour.name,
        "activation": like.observer if like else None,
        "alternative": "move_to_model_edge",
    }
    return rule.finding(head.display, message, data=data, suggestion=suggestion)


# --- cat inputs ----------------------------------------------------------------------
def cat_input_findings(rule: Rule, state: QConfigCheckState) -> Iterator[Finding]:
    graph = state.graph
    for cat in graph.by_kind("cat"):
        if not is_static_quantized(cat):
            continue
        inputs = []
        for producer in graph.producers(cat.name):
            if producer.op not in CALL_OPS and producer.op != "input":
                continue
            spec, source = state.spec_of_input(producer, cat)
            if spec is not None:
                inputs.append((producer, source, spec))
        if len(inputs) < 2:
            continue
        first = inputs[0][2]
        odd = [(p, s, spec) for p, s, spec in inputs[1:] if spec.qparams_key() != first.qparams_key()]
        if not odd:
            continue
        yield _cat_finding(rule, state, cat, inputs, odd)


def _cat_finding(rule: Rule, state: QConfigCheckState, cat: OpNode, inputs, odd) -> Finding:
    first_producer, first_source, first = inputs[0]
    described = "; ".join(f"{s.display}: {qparams_text(spec)}" for _, s, spec in inputs)
    if first.is_fixed_qparams and any(not spec.is_fixed_qparams for _, _, spec in odd):
        low, high = fixed_qparams_range(first)
        effect = (
            f"here the first input, {first_source.display}, has fixed qparams, so every other "
            f"input is quantized to [{low:g}, {high:g}] and clipped outside it"
        )
        fix = (
            f"put a calibrated input first in the cat (or apply {first_source.kind} after "
            "the cat), and give all inputs one qconfig"
        )
    else:
        effect = (
            f"the other inputs' observers ({', '.join(s.display for _, s, _ in odd)}) are "
            f"replaced by {first_source.display}'s {first.observer}, so their configured "
            "dtype/range is silently ignored; where observers cannot be shared (eager "
            "mode, other front ends) each input is requantized to cat's scale instead"
        )
        fix = "give every input of the cat (and the cat) the same qconfig"
    message = (
        f"The inputs of {cat.display} are observed with different qparams ({described}). "
        "prepare_fx can only use one scale and zero point for cat: it makes all inputs and the "
        f"output share the first input's observer; {effect}. Fix: {fix}."
    )
    involved = unique_nodes([s for _, s, _ in inputs] + [cat])
    data = {
        "kind": KIND_CAT,
        "node": cat.name,
        "inputs": [
            {
                "node": s.name,
                "target": s.display,
                "observer": spec.observer,
                "dtype": spec.dtype,
                "qscheme": spec.qscheme,
                "quant_range": [spec.quant_min, spec.quant_max],
                "fixed_scale": spec.fixed_scale,
                "fixed_zero_point": spec.fixed_zero_point,
                "matches_first": spec.qparams_key() == first.qparams_key(),
            }
            for _, s, spec in inputs
        ],
        "first_input": first_source.name,
        "mismatched": [s.name for _, s, _ in odd],
        "qconfig_table": state.table(involved),
    }
    # The observer to share: a calibrated one (it sees every input), and it should come first.
    calibrated = next(((s, spec) for _, s, spec in inputs if not spec.is_fixed_qparams), None)
    shared_source, shared = calibrated if calibrated is not None else (first_source, first)
    suggestion = {
        "action": "unify_qconfig",
        "target": cat.display,
        "cat": cat.name,
        "nodes": [s.display for _, s, _ in inputs],
        "activation": shared.observer,
        "first_input": shared_source.name,
    }
    return rule.finding(cat.display, message, data=data, suggestion=suggestion)
