"""QL103 qconfig: qconfigs that the backend rejects, ignores or pays extra for."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from pydantic import Field
from qlint.rules._ql103_checks import (
    CALL_OPS,
    LISTED_NODES,
    FindingGroups,
    QConfigCheckState,
    activation_dtype_text,
    activation_range_text,
    describe_nodes,
    fixed_qparams_range,
    float_reason,
    full_range_activation_text,
    is_reduced_range,
    qparams_text,
    requires_fixed_qparams,
    scale_text,
    wasted_reduce_range_text,
    weight_dtype_text,
    weight_qscheme_text,
    weight_range_text,
    within_quant_range,
)
from qlint.rules._ql103_islands import (
    Island,
    eager_float_islands,
    feeds_cat,
    fx_float_islands,
    is_static_quantized,
    unique_nodes,
)
from torch.ao.quantization import (
    DeQuantStub,
    QConfig,
    QConfigMapping,
    QuantStub,
    get_default_qconfig,
    get_default_qconfig_mapping,
)
from torch.ao.quantization.observer import (
    HistogramObserver,
    MinMaxObserver,
    PerChannelMinMaxObserver,
    default_per_channel_weight_observer,
)

from qlint.core.graph import OpNode
from qlint.core.ops import CONV_OR_LINEAR_KINDS, FIXED_QPARAMS_KINDS, SHAPE_KINDS, WEIGHTED_KINDS
from qlint.linter.context import LintContext
from qlint.linter.findings import Finding, Severity
from qlint.linter.rule import Example, Need, Rule, RuleOptions

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
KIND_FLOAT_ISLAND = "float-island"
KIND_CAT = "cat-input-qparams"

_EIGHT_BIT = ("torch.quint8", "torch.qint8")
_CONV_TRANSPOSE_KINDS = frozenset({"conv_transpose1d", "conv_transpose2d", "conv_transpose3d"})
# The output range the math guarantees for each fixed-qparams op.
_MATH_RANGE = {"sigmoid": (0.0, 1.0), "hardsigmoid": (0.0, 1.0), "softmax": (0.0, 1.0), "tanh": (-1.0, 1.0)}


class QConfigCheck(Rule):
    """Flags qconfigs that the backend rejects, silently ignores, or pays extra for.

    ## What it does
    Reads the qconfig every op resolves to (from your QConfigMapping, the backend default,
    eager `.qconfig` attributes, or the observers of a prepared model) and checks it
    against the backend:

    - **fixed-qparams ops** (sigmoid, tanh, hardsigmoid, `nn.Softmax`) given a calibrated
      observer instead of the `FixedQParamsObserver` the backend requires, or one with
      the wrong scale/zero point;
    - **backend support**: activation or weight dtypes the backend has no kernel for
      (qint8 activations on x86/fbgemm, quint8 weights), quant ranges it rejects (qnnpack's
      qint8 path needs weights in [-127, 127]), weight qschemes its kernels do not take
      (affine or float-qparams weights where the kernel wants symmetric ones), and
      `reduce_range` settings that risk overflow (off on x86/fbgemm) or waste a bit (on
      elsewhere);
    - **float islands**: ops left in float (qconfig `None`) between quantized ops;
    - **cat inputs** observed with different qparams.

    Each finding carries the qconfig table (node, target, kind, input/output dtype,
    observer, ch_axis) of the nodes involved, as Horizon's `check_qat_model` prints it.

    ## Why is this bad?
    A qconfig the backend cannot run is not an error at `prepare_fx` time: the op is left
    in float, or its qconfig is ignored with a warning that is easy to miss, so the model
    you convert is not the model you configured. Fixed-qparams ops have a known output
    range ([0, 1] or [-1, 1]) and their kernels use scale 1/256 with zero point 0 (or
    2/256 with zero point 128); a calibrated observer wastes codes or clips and is
    rejected. In post-training quantization `prepare_fx` ignores such a qconfig and the
    converted op keeps its fixed qparams, so the int8 model is the same and the measured
    impact 0 dB (info); in QAT the fake-quant trains with a range the int8 kernel will not
    use. Every float island costs a dequantize before it and a quantize after it.
    `prepare_fx` makes all inputs of `cat` share the first input's observer, so inputs
    whose qconfigs disagree are quantized with someone else's scale: a sigmoid first
    forces [0, 1) on every other input and clips them.

    ## Example
    ```python
    mapping = QConfigMapping().set_global(get_default_qconfig("x86"))  # sigmoid gets a HistogramObserver
    mapping.set_module_name("head.act", None)                          # GELU between two quantized convs
    ```

    ## Use instead
    ```python
    mapping = get_default_qconfig_mapping("x86")  # FixedQParams qconfigs for sigmoid/tanh/softmax
    # quantize the op, or move the float op to the start or end of the model
    ```

    ## Options
    - `fixed_qparams`: check fixed-qparams ops (sigmoid, tanh, hardsigmoid, softmax).
    - `backend_support`: check dtypes, quant ranges and weight qschemes against the backend.
    - `reduce_range`: check `reduce_range` of the activations entering conv and linear layers.
    - `report_wasted_reduce_range`: also report (as info) `reduce_range=True` on backends that do not need it.
    - `float_islands`: report float ops between quantized ops.
    - `min_island_ops`: the number of computing (non-shape) ops an island needs to be reported.
    - `cat_inputs`: report `cat` inputs observed with different qparams.

    ## References
    - https://pytorch.org/docs/stable/quantization.html#backend-hardware-support
    - torch.ao.quantization.get_default_qconfig_mapping, torch.ao.quantization.backend_config
    - torch/ao/quantization/fx/prepare.py (`_maybe_make_input_output_share_observers`)
    - torch/ao/quantization/fx/utils.py ("QConfig must specify a FixedQParamsObserver ...")
    """

    code = "QL103"
    name = "qconfig"
    summary = "A qconfig does not fit the backend, leaves a float island, or splits cat's qparams."
    severity = Severity.WARNING
    requires = frozenset({Need.GRAPH, Need.QCONFIG})

    class Options(RuleOptions):
        fixed_qparams: bool = Field(True, description="Check fixed-qparams ops.")
        backend_support: bool = Field(True, description="Check dtypes, ranges and qschemes.")
        reduce_range: bool = Field(True, description="Check reduce_range of conv/linear inputs.")
        report_wasted_reduce_range: bool = Field(True, description="Report unneeded reduce_range.")
        float_islands: bool = Field(True, description="Report float ops between quantized ops.")
        min_island_ops: int = Field(1, ge=1, description="Computing ops an island needs.")
        cat_inputs: bool = Field(True, description="Report cat inputs with different qparams.")

    options: Options  # this rule's own Options, so the type checker knows its fields

    def check(self, ctx: LintContext) -> Iterable[Finding]:
        state = QConfigCheckState(ctx)
        if self.options.fixed_qparams and not state.eager:
            yield from self._fixed_qparams(state)
        if self.options.backend_support:
            yield from self._backend_support(state)
        if self.options.reduce_range:
            yield from self._reduce_range(state)
        if self.options.float_islands:
            yield from self._float_islands(state)
        if self.options.cat_inputs and not state.eager:
            yield from self._cat_inputs(state)

    # --- fixed-qparams ops -------------------------------------------------------------
    def _fixed_qparams(self, state: QConfigCheckState) -> Iterator[Finding]:
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
                yield self.finding(
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
            yield self.finding(
                node.display, message, data={"kind": KIND_FIXED_OBSERVER, **common}, suggestion=suggestion
            )

    # --- backend support: dtypes, quant ranges, qschemes --------------------------------
    def _backend_support(self, state: QConfigCheckState) -> Iterator[Finding]:
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
                    within_quant_range(spec.quant_min, spec.quant_max, o.input_quant_min, o.input_quant_max)
                    for o in ranged
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
            yield self._support_finding(state, key[0], nodes, info)

    def _support_finding(
        self, state: QConfigCheckState, kind: str, nodes: list[OpNode], info: dict[str, Any]
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
        return self.finding(nodes[0].display, message, data=data, suggestion=suggestion, severity=severity)

    # --- reduce_range --------------------------------------------------------------------
    def _reduce_range(self, state: QConfigCheckState) -> Iterator[Finding]:
        ctx = state.ctx
        wants = ctx.backend.wants_reduce_range
        if not wants and not self.options.report_wasted_reduce_range:
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
            yield self.finding(nodes[0].display, message, data=data, suggestion=suggestion, severity=severity)

    # --- float islands -------------------------------------------------------------------
    def _float_islands(self, state: QConfigCheckState) -> Iterator[Finding]:
        islands = eager_float_islands(state.graph) if state.eager else fx_float_islands(state.graph)
        for island in islands:
            compute = [n for n in island.nodes if n.kind not in SHAPE_KINDS]
            if len(compute) < self.options.min_island_ops:
                continue
            yield self._island_finding(state, island, compute)

    def _island_finding(self, state: QConfigCheckState, island: Island, compute: list[OpNode]) -> Finding:
        backend = state.ctx.backend
        head = compute[0]
        ops = ", ".join(f"{n.display} ({n.kind})" for n in compute[:LISTED_NODES])
        if len(compute) > LISTED_NODES:
            ops += f" and {len(compute) - LISTED_NODES} more"
        producers = ", ".join(dict.fromkeys(p.display for p in island.producers))
        consumers = ", ".join(dict.fromkeys(c.display for c in island.consumers))
        unsupported = sorted({n.kind for n in compute if not backend.supports(n.kind)})
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
        like = neighbour.qconfig.activation if neighbour.qconfig and neighbour.qconfig.activation else None
        suggestion = {
            "action": "set_qconfig",
            "target": head.display,
            "targets": [n.display for n in compute],
            "like": neighbour.name,
            "activation": like.observer if like else None,
            "alternative": "move_to_model_edge",
        }
        return self.finding(head.display, message, data=data, suggestion=suggestion)

    # --- cat inputs ----------------------------------------------------------------------
    def _cat_inputs(self, state: QConfigCheckState) -> Iterator[Finding]:
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
            yield self._cat_finding(state, cat, inputs, odd)

    def _cat_finding(self, state: QConfigCheckState, cat: OpNode, inputs, odd) -> Finding:
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
        return self.finding(cat.display, message, data=data, suggestion=suggestion)


# --- examples --------------------------------------------------------------------------


def _seeded(build):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return build().eval()


class _Head(nn.Module):
    """Conv stem, a two-branch cat, a sigmoid gate, a linear head and a softmax."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.left = nn.Conv2d(8, 8, 1)
        self.right = nn.Conv2d(8, 8, 3, padding=1)
        self.gate = nn.Sigmoid()
        self.fc = nn.Linear(16, 4)
        self.softmax = nn.Softmax(dim=-1)

    def forward(self, x):
        y = F.relu(self.stem(x))
        y = torch.cat([F.relu(self.left(y)), self.right(y)], 1)
        y = y * self.gate(y)
        return self.softmax(self.fc(torch.flatten(F.adaptive_avg_pool2d(y, 1), 1)))


class _GeluSandwich(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.act = nn.GELU()
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x):
        return self.conv2(self.act(self.conv1(x)))


class _GatedCat(nn.Module):
    """cat([sigmoid(a), relu(b)]): the sigmoid branch comes first."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 4, 1)
        self.b = nn.Conv2d(3, 4, 1)
        self.sig = nn.Sigmoid()
        self.out = nn.Conv2d(8, 4, 1)

    def forward(self, x):
        return self.out(torch.cat([self.sig(self.a(x)), torch.relu(self.b(x))], 1))


class _EagerIsland(nn.Module):
    def __init__(self, island: bool) -> None:
        super().__init__()
        self.island = island
        self.quant = QuantStub()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.dequant1 = DeQuantStub()
        self.norm = nn.LayerNorm([8, 8, 8])
        self.quant2 = QuantStub()
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.dequant = DeQuantStub()

    def forward(self, x):
        y = self.conv1(self.quant(x))
        if self.island:
            y = self.quant2(self.norm(self.dequant1(y)))
        y = self.dequant(self.conv2(y))
        return self.norm(y) if not self.island else y


def _head() -> nn.Module:
    return _seeded(_Head)


def _gelu_sandwich() -> nn.Module:
    return _seeded(_GeluSandwich)


def _gated_cat() -> nn.Module:
    return _seeded(_GatedCat)


def _eager(island: bool) -> nn.Module:
    model = _seeded(lambda: _EagerIsland(island))
    model.qconfig = get_default_qconfig("x86")
    return model


def _eager_clean() -> nn.Module:
    return _eager(False)


def _eager_island() -> nn.Module:
    return _eager(True)


def _image() -> tuple[torch.Tensor, ...]:
    return (torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0)),)


def _x86_default() -> QConfigMapping:
    return get_default_qconfig_mapping("x86")


def _qnnpack_default() -> QConfigMapping:
    return get_default_qconfig_mapping("qnnpack")


def _global_only() -> QConfigMapping:
    return QConfigMapping().set_global(get_default_qconfig("x86"))


def _qint8_activations() -> QConfigMapping:
    qconfig = QConfig(
        activation=HistogramObserver.with_args(dtype=torch.qint8, reduce_range=True),
        weight=default_per_channel_weight_observer,
    )
    return get_default_qconfig_mapping("x86").set_global(qconfig)


def _qnnpack_symmetric_full_range() -> QConfigMapping:
    qconfig = QConfig(
        activation=HistogramObserver.with_args(dtype=torch.qint8, qscheme=torch.per_tensor_symmetric),
        weight=MinMaxObserver.with_args(dtype=torch.qint8, qscheme=torch.per_tensor_symmetric),
    )
    return get_default_qconfig_mapping("qnnpack").set_global(qconfig)


def _x86_full_range() -> QConfigMapping:
    qconfig = QConfig(
        activation=HistogramObserver.with_args(reduce_range=False), weight=default_per_channel_weight_observer
    )
    return get_default_qconfig_mapping("x86").set_global(qconfig)


def _onednn_affine_weights() -> QConfigMapping:
    qconfig = QConfig(
        activation=HistogramObserver.with_args(reduce_range=False),
        weight=PerChannelMinMaxObserver.with_args(dtype=torch.qint8, qscheme=torch.per_channel_affine),
    )
    return get_default_qconfig_mapping("onednn").set_global(qconfig)


def _gelu_in_float() -> QConfigMapping:
    return get_default_qconfig_mapping("x86").set_module_name("act", None)


def _gelu_at_edge() -> QConfigMapping:
    return get_default_qconfig_mapping("x86").set_module_name("conv2", None).set_module_name("act", None)


VALID = (
    Example(
        "conv/cat/sigmoid/linear/softmax model under x86's default mapping", _head, _image, qconfig_mapping=_x86_default
    ),
    Example(
        "the same model under qnnpack's default mapping",
        _head,
        _image,
        qconfig_mapping=_qnnpack_default,
        backend="qnnpack",
    ),
    Example(
        "float ops at the end of the model are not an island", _gelu_sandwich, _image, qconfig_mapping=_gelu_at_edge
    ),
    Example("eager model whose float LayerNorm runs after the last DeQuantStub", _eager_clean, _image),
)
INVALID = (
    Example(
        "set_global(get_default_qconfig('x86')) gives the sigmoid a HistogramObserver",
        _head,
        _image,
        qconfig_mapping=_global_only,
        flagged=("gate", "softmax"),
    ),
    Example("qint8 activations on x86", _gelu_sandwich, _image, qconfig_mapping=_qint8_activations, flagged=("conv1",)),
    Example(
        "qnnpack qint8 activations with weights in [-128, 127]",
        _gelu_sandwich,
        _image,
        qconfig_mapping=_qnnpack_symmetric_full_range,
        backend="qnnpack",
        flagged=("conv1",),
    ),
    Example(
        "reduce_range=False activations on x86",
        _gelu_sandwich,
        _image,
        qconfig_mapping=_x86_full_range,
        flagged=("conv1",),
    ),
    Example(
        "per-channel affine weights on onednn",
        _gelu_sandwich,
        _image,
        qconfig_mapping=_onednn_affine_weights,
        backend="onednn",
        flagged=("conv1",),
    ),
    Example(
        "GELU with qconfig None between two quantized convs",
        _gelu_sandwich,
        _image,
        qconfig_mapping=_gelu_in_float,
        flagged=("act",),
    ),
    Example(
        "cat of a sigmoid branch and a relu branch", _gated_cat, _image, qconfig_mapping=_x86_default, flagged=("cat",)
    ),
    Example("eager LayerNorm between DeQuantStub and QuantStub", _eager_island, _image, flagged=("norm",)),
)
