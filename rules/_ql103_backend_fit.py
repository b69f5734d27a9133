"""QL103's checks of each op's qconfig against what the backend runs: fixed-qparams ops,
kernel dtypes, quant ranges and weight qschemes, and reduce_range."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from qlint.core.graph import OpNode
from qlint.core.ops import CONV_OR_LINEAR_KINDS, FIXED_QPARAMS_KINDS, WEIGHTED_KINDS
from qlint.linter.findings import Finding
from qlint.linter.rule import Rule
from qlint.rules._ql103_checks import (
    FindingGroups,
    QConfigCheckState,
    activation_dtype_text,
    activation_range_text,
    describe_nodes,
    fixed_qparams_range,
    full_range_activation_text,
    is_reduced_range,
    requires_fixed_qparams,
    scale_text,
    wasted_reduce_range_text,
    weight_dtype_text,
    weight_qscheme_text,
    weight_range_text,
    within_quant_range,
)
from qlint.rules._ql103_islands import feeds_cat, is_static_quantized

# Sub-check kinds (data["kind"]; part of each finding's fingerprint).
KIND_FIXED_OBSERVER = "fixed-qparams-observer"
KIND_FIXED_MISMATCH = "fixed-qparams-mismatch"
KIND_ACT_DTYPE = "activation-dtype"
KIND_ACT_RANGE = "activation-quant-range"
KIND_WEIGHT_DTYPE = "weight-dtype"
KIND_WEIGHT_RANGE = "weight-quant-range"
KIND_WEIGHT_QSCHEME = "weight-qscheme"
KIND_REDUCE_RANGE = "activation-reduce-range"
KIND_REDUCE_RANGE_WASTE = "activation-reduce-range-waste"

_EIGHT_BIT = ("torch.quint8", "torch.qint8")
_CONV_TRANSPOSE_KINDS = frozenset({"conv_transpose1d", "conv_transpose2d", "conv_transpose3d"})
# The output range the math guarantees for each fixed-qparams op.
_MATH_RANGE = {"sigmoid": (0.0, 1.0), "hardsigmoid": (0.0, 1.0), "softmax": (0.0, 1.0), "tanh": (-1.0, 1.0)}


# --- fixed-qparams ops -------------------------------------------------------------
def fixed_qparams_findings(rule: Rule, state: QConfigCheckState) -> Iterator[Finding]:
    ctx, graph = state.ctx, state.graph
    for node in graph.ops():
        if node.kind not in FIXED_QPARAMS_KINDS or not is_static_quantized(node):
            continue
        spec = node.qconfig.activation
        expected = state.expected_fixed(node)
        if expected is None or not requires_fixed_qparams(ctx, node.kind, spec.dtype):
            continue  # torch does not treat this call as a fixed-qparams op here
        if state.prepared and feeds_cat(graph, node):
            continue  # prepare_fx replaced its observer with cat's shared one (see cat check)
        low, high = _MATH_RANGE[node.kind]
        wanted = (
            f"FixedQParamsObserver(scale={expected.fixed_scale:g}, "
            f"zero_point={expected.fixed_zero_point}, dtype={expected.dtype})"
        )
        common = {
            "node": node.name,
            "op_kind": node.kind,
            "observer": spec.observer,
            "dtype": spec.dtype,
            "source": node.qconfig.source,
            "expected_observer": "FixedQParamsObserver",
            "expected_scale": expected.fixed_scale,
            "expected_zero_point": expected.fixed_zero_point,
            "output_range": [low, high],
            "qconfig_table": state.table([node]),
        }
        # A module gets its qconfig by name; a functional op (an aten node of a .pt2 too)
        # has no module to name, so the fix is by op type (mapping.set_object_type).
        suggestion = {
            "action": "set_qconfig",
            "target": node.module if node.op == "module" else None,
            "node": node.name,
            "object_type": node.module_type or node.target,
            "activation": "FixedQParamsObserver",
            "scale": expected.fixed_scale,
            "zero_point": expected.fixed_zero_point,
            "dtype": expected.dtype,
            "quant_min": expected.quant_min,
            "quant_max": expected.quant_max,
            "from": f"get_default_qconfig_mapping('{ctx.backend.name}')",
        }
        fix = (
            f"Fix: give this op the qconfig that get_default_qconfig_mapping('{ctx.backend.name}') "
            f"sets for it ({wanted}), e.g. start from get_default_qconfig_mapping and "
            "override other entries, instead of QConfigMapping().set_global(...)."
        )
        if spec.is_fixed_qparams:
            if (
                abs(spec.fixed_scale - expected.fixed_scale) <= 1e-9
                and spec.fixed_zero_point == expected.fixed_zero_point
            ):
                continue
            got_low, got_high = fixed_qparams_range(spec)
            message = (
                f"{node.display} ({node.kind}) has a FixedQParams observer with scale "
                f"{spec.fixed_scale:g} and zero point {spec.fixed_zero_point} (covers "
                f"[{got_low:g}, {got_high:g}]), but its output lies in [{low:g}, {high:g}] and the "
                f"{ctx.backend.name} kernel uses scale {scale_text(expected.fixed_scale)}, zero point "
                f"{expected.fixed_zero_point}. prepare_fx rejects qparams that differ from the "
                "backend's and ignores this qconfig, so the op is not quantized as configured "
                f"and the wrong range would clip or waste codes. {fix}"
            )
            yield rule.finding(
                node.display,
                message,
                suggestion=suggestion,
                data={
                    "kind": KIND_FIXED_MISMATCH,
                    **common,
                    "scale": spec.fixed_scale,
                    "zero_point": spec.fixed_zero_point,
                },
            )
            continue
        message = (
            f"{node.display} ({node.kind}) is observed by {spec.observer} (from the "
            f"{node.qconfig.source} qconfig), but its output range is fixed by the math: "
            f"[{low:g}, {high:g}], which {ctx.backend.name} quantizes with scale "
            f"{scale_text(expected.fixed_scale)} and zero point {expected.fixed_zero_point}. A calibrated "
            "observer wastes codes on the part of the range the data did not reach or clips "
            "its tails, and it breaks the backend's fixed-qparams lookup: prepare_fx warns "
            "'QConfig must specify a FixedQParamsObserver' and ignores this qconfig, so the "
            f"op is not quantized the way the mapping says (in QAT the fake-quant learns a "
            f"range the int8 kernel will not use). {fix}"
        )
        yield rule.finding(node.display, message, data={"kind": KIND_FIXED_OBSERVER, **common}, suggestion=suggestion)


# --- backend support: dtypes, quant ranges, qschemes --------------------------------
def backend_support_findings(rule: Rule, state: QConfigCheckState) -> Iterator[Finding]:
    ctx = state.ctx
    groups = FindingGroups()
    for node in state.checked_nodes():
        qc = node.qconfig
        spec = qc.activation
        options = [
            o
            for o in ctx.backend.dtype_options(node.kind)
            if not o.is_dynamic and o.input_dtype not in (None, "torch.float32")
        ]
        if not options:
            continue  # no static kernel (float, weight-only or dynamic op): not a qconfig matter
        matching = [o for o in options if spec.dtype in (o.output_dtype, o.input_dtype)]
        if not matching:
            supported = sorted({o.output_dtype for o in options if o.output_dtype})
            groups.add(
                (KIND_ACT_DTYPE, spec.dtype, tuple(supported)),
                node,
                dtype=spec.dtype,
                observer=spec.observer,
                supported=supported,
            )
            continue
        ranged = [o for o in matching if o.input_quant_min is not None or o.input_quant_max is not None]
        if ranged and len(ranged) == len(matching) and not spec.is_fixed_qparams:
            if not any(
                within_quant_range(spec.quant_min, spec.quant_max, o.input_quant_min, o.input_quant_max) for o in ranged
            ):
                bounds = [ranged[0].input_quant_min, ranged[0].input_quant_max]
                groups.add(
                    (KIND_ACT_RANGE, spec.dtype, spec.quant_min, spec.quant_max),
                    node,
                    dtype=spec.dtype,
                    observer=spec.observer,
                    quant_range=[spec.quant_min, spec.quant_max],
                    supported_range=bounds,
                )
        weight = qc.weight
        if (
            node.weight is None
            or node.kind not in WEIGHTED_KINDS
            or weight is None
            or weight.is_float
            or not any(o.weight_dtype for o in matching)
        ):
            continue
        weighted = [o for o in matching if o.weight_dtype == weight.dtype]
        if not weighted:
            supported = sorted({o.weight_dtype for o in matching if o.weight_dtype})
            groups.add(
                (KIND_WEIGHT_DTYPE, weight.dtype, spec.dtype),
                node,
                dtype=weight.dtype,
                activation_dtype=spec.dtype,
                observer=weight.observer,
                supported=supported,
            )
            continue
        if not any(
            within_quant_range(weight.quant_min, weight.quant_max, o.weight_quant_min, o.weight_quant_max)
            for o in weighted
        ):
            bound = next(o for o in weighted if o.weight_quant_min is not None or o.weight_quant_max is not None)
            groups.add(
                (KIND_WEIGHT_RANGE, weight.dtype, weight.quant_min, weight.quant_max, spec.dtype),
                node,
                dtype=weight.dtype,
                activation_dtype=spec.dtype,
                observer=weight.observer,
                quant_range=[weight.quant_min, weight.quant_max],
                supported_range=[bound.weight_quant_min, bound.weight_quant_max],
            )
        if node.kind in _CONV_TRANSPOSE_KINDS and node.op == "module" and weight.is_per_channel:
            groups.add(
                (KIND_WEIGHT_QSCHEME, weight.qscheme, "transpose"),
                node,
                qscheme=weight.qscheme,
                observer=weight.observer,
                dtype=weight.dtype,
                transpose=True,
            )
        elif node.kind in CONV_OR_LINEAR_KINDS and weight.qscheme and "symmetric" not in weight.qscheme:
            groups.add(
                (KIND_WEIGHT_QSCHEME, weight.qscheme),
                node,
                qscheme=weight.qscheme,
                observer=weight.observer,
                dtype=weight.dtype,
            )
    for key, nodes, info in groups.items():
        yield _support_finding(rule, state, key[0], nodes, info)


def _support_finding(
    rule: Rule, state: QConfigCheckState, kind: str, nodes: list[OpNode], info: dict[str, Any]
) -> Finding:
    backend = state.ctx.backend.name
    where = describe_nodes(nodes)
    sources = sorted({n.qconfig.source for n in nodes if n.qconfig is not None})
    data: dict[str, Any] = {
        "kind": kind,
        "node": nodes[0].name,
        "nodes": [n.name for n in nodes],
        "targets": [n.display for n in nodes],
        "sources": sources,
        "backend": backend,
        **info,
        "qconfig_table": state.table(nodes),
    }
    targets = [n.display for n in nodes]
    text = {
        KIND_ACT_DTYPE: activation_dtype_text,
        KIND_ACT_RANGE: activation_range_text,
        KIND_WEIGHT_DTYPE: weight_dtype_text,
        KIND_WEIGHT_RANGE: weight_range_text,
        KIND_WEIGHT_QSCHEME: weight_qscheme_text,
    }[kind]
    message, suggestion, severity = text(where, backend, info, targets, sources)
    return rule.finding(nodes[0].display, message, data=data, suggestion=suggestion, severity=severity)


# --- reduce_range --------------------------------------------------------------------
def reduce_range_findings(rule: Rule, state: QConfigCheckState, report_wasted_reduce_range: bool) -> Iterator[Finding]:
    ctx = state.ctx
    wants = ctx.backend.wants_reduce_range
    if not wants and not report_wasted_reduce_range:
        return
    groups = FindingGroups()
    for node in state.checked_nodes():
        if node.kind not in CONV_OR_LINEAR_KINDS:
            continue
        spec, source = state.input_spec(node)
        if spec is None or spec.is_fixed_qparams or spec.dtype not in _EIGHT_BIT:
            continue
        reduced = is_reduced_range(spec)
        if wants and not reduced:
            groups.add(
                (KIND_REDUCE_RANGE, spec.qparams_key()),
                node,
                observer=spec.observer,
                quant_range=[spec.quant_min, spec.quant_max],
                reduce_range=spec.reduce_range,
                input_node=source.name,
            )
        elif not wants and reduced:
            groups.add(
                (KIND_REDUCE_RANGE_WASTE, spec.qparams_key()),
                node,
                observer=spec.observer,
                quant_range=[spec.quant_min, spec.quant_max],
                reduce_range=spec.reduce_range,
                input_node=source.name,
            )
    backend = ctx.backend.name
    for key, nodes, info in groups.items():
        kind = key[0]
        where = describe_nodes(nodes)
        data = {
            "kind": kind,
            "node": nodes[0].name,
            "nodes": [n.name for n in nodes],
            "targets": [n.display for n in nodes],
            "backend": backend,
            "sources": sorted({n.qconfig.source for n in nodes}),
            **info,
            "qconfig_table": state.table(nodes),
        }
        text = full_range_activation_text if kind == KIND_REDUCE_RANGE else wasted_reduce_range_text
        message, suggestion, severity = text(where, backend, info, data["targets"])
        yield rule.finding(nodes[0].display, message, data=data, suggestion=suggestion, severity=severity)
