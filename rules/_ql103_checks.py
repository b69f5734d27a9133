"""Rule-independent machinery for checking resolved qconfigs against a backend (used by QL103)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from torch.ao.quantization import QConfigMapping

from qlint.core.graph import ModelGraph, OpNode
from qlint.core.intent import ObserverSpec, default_mapping, function_candidates, import_type, node_qconfig
from qlint.linter.context import INTENT_EAGER, INTENT_PREPARED, LintContext
from qlint.linter.findings import QConfigRow, Severity
from qlint.linter.qconfig_table import qconfig_rows
from qlint.rules._ql103_islands import is_static_quantized, through_shape_ops

# node.op values of calls: producers that are real ops (not inputs, outputs or attributes).
CALL_OPS = ("module", "function", "method")
LISTED_NODES = 5  # node names spelled out in a message; data lists them all


class QConfigCheckState:
    """What one check() run shares between its sub-checks: the graph, the intent and lazy caches."""

    def __init__(self, ctx: LintContext) -> None:
        self.ctx = ctx
        self.graph: ModelGraph = ctx.graph
        self.eager = ctx.eager_flow or ctx.intent == INTENT_EAGER
        self.prepared = ctx.intent == INTENT_PREPARED
        self._rows: dict[str, QConfigRow] | None = None
        self._default: QConfigMapping | None = None

    def checked_nodes(self) -> Iterator[OpNode]:
        """Statically quantized ops whose qconfig the backend will look at."""
        for node in self.graph.ops():
            if not is_static_quantized(node):
                continue
            if self.eager and (node.op != "module" or node.kind in ("quant_stub", "dequant_stub")):
                continue  # eager mode quantizes modules only; functional ops keep no qconfig
            yield node

    def spec_of_input(self, producer: OpNode, consumer: OpNode) -> tuple[ObserverSpec | None, OpNode]:
        """The observer that quantizes ``producer``'s output where ``consumer`` reads it."""
        source = through_shape_ops(self.graph, producer)
        if source.op in CALL_OPS and is_static_quantized(source):
            return source.qconfig.activation, source
        # A float tensor is observed by the consumer's own qconfig when prepare_fx quantizes it.
        own = consumer.qconfig.activation if consumer.qconfig else None
        return own, source

    def input_spec(self, node: OpNode) -> tuple[ObserverSpec | None, OpNode]:
        """The observer of ``node``'s first input (its own in eager mode, where stubs quantize)."""
        if node.qconfig is None:
            raise ValueError(f"{node.name} has no qconfig: only checked (quantized) ops have an input spec")
        if self.eager:
            return node.qconfig.activation, node
        producers = [p for p in self.graph.producers(node.name) if p.op in CALL_OPS or p.op == "input"]
        if not producers:
            return node.qconfig.activation, node
        return self.spec_of_input(producers[0], node)

    def expected_fixed(self, node: OpNode) -> ObserverSpec | None:
        """The FixedQParams observer the backend's default mapping gives this call, if any."""
        if self._default is None:
            self._default = default_mapping(self.ctx.backend.name)
        table = self._default.object_type_qconfigs
        qconfig = None
        cls = import_type(node.module_type) if node.module_type else None
        if cls is not None:
            qconfig = table.get(cls)
        elif node.module is None:
            for candidate in function_candidates(node.kind, node.target if node.op == "method" else None):
                if candidate in table:
                    qconfig = table[candidate]
                    break
        resolved = node_qconfig(qconfig, "default") if qconfig is not None else None
        spec = resolved.activation if resolved else None
        return spec if spec is not None and spec.is_fixed_qparams else None

    def table(self, nodes: Sequence[OpNode]) -> list[dict[str, Any]]:
        """The qconfig table rows of ``nodes`` (as check_qat_model prints them), for finding data."""
        if self._rows is None:
            self._rows = {row.node: row for row in qconfig_rows(self.graph)}
        out = []
        for node in nodes:
            row = self._rows.get(node.name)
            if row is None:
                continue
            out.append(
                {
                    "node": row.node,
                    "target": row.target,
                    "kind": row.kind,
                    "input_dtype": row.input_dtype,
                    "output_dtype": row.output_dtype,
                    "observer": row.activation_observer,
                    "ch_axis": row.ch_axis,
                }
            )
        return out


class FindingGroups:
    """Findings that share a cause (usually one global qconfig) are reported once."""

    def __init__(self) -> None:
        self._nodes: dict[tuple, list[OpNode]] = {}
        self._info: dict[tuple, dict[str, Any]] = {}

    def add(self, key: tuple, node: OpNode, **info: Any) -> None:
        self._nodes.setdefault(key, []).append(node)
        self._info.setdefault(key, info)

    def items(self) -> Iterator[tuple[tuple, list[OpNode], dict[str, Any]]]:
        for key, nodes in self._nodes.items():
            yield key, nodes, dict(self._info[key])


def requires_fixed_qparams(ctx: LintContext, kind: str, dtype: str) -> bool:
    """True when every static kernel for this dtype requires fixed qparams (qnnpack's qint8 path does not)."""
    options = [
        o for o in ctx.backend.dtype_options(kind) if not o.is_dynamic and dtype in (o.output_dtype, o.input_dtype)
    ]
    return bool(options) and all(o.input_quant_min is not None or o.input_quant_max is not None for o in options)


def float_reason(node: OpNode) -> str:
    """Why an op runs in float, in the words a float-island message uses."""
    qc = node.qconfig
    if qc is None:
        return "qconfig None"
    if qc.is_dynamic:
        return "dynamic qconfig: float output"
    return "float qconfig"


def fixed_qparams_range(spec: ObserverSpec) -> tuple[float, float]:
    """The float range a FixedQParams observer can represent, to show what it clips."""
    qmin = spec.quant_min if spec.quant_min is not None else 0
    qmax = spec.quant_max if spec.quant_max is not None else 255
    zero = spec.fixed_zero_point or 0
    scale = spec.fixed_scale or 0.0
    return round((qmin - zero) * scale, 6), round((qmax - zero) * scale, 6)


def scale_text(scale: float) -> str:
    """A scale as messages print it, with its 1/n form when it has one (1/256 reads better)."""
    inverse = 1.0 / scale if scale else 0.0
    if inverse and abs(inverse - round(inverse)) < 1e-6:
        return f"{scale:g} (1/{round(inverse)})"
    return f"{scale:g}"


def within_quant_range(qmin: int | None, qmax: int | None, low: int | None, high: int | None) -> bool:
    """True when [qmin, qmax] lies inside the bounds a backend accepts (None: no bound)."""
    if low is not None and (qmin is None or qmin < low):
        return False
    if high is not None and (qmax is None or qmax > high):
        return False
    return True


def is_reduced_range(spec: ObserverSpec) -> bool:
    """7-bit activations: reduce_range=True, or an explicit quant range of at most 128 codes."""
    if spec.quant_min is not None and spec.quant_max is not None:
        return spec.quant_max - spec.quant_min <= 127
    return spec.reduce_range


def qparams_text(spec: ObserverSpec) -> str:
    """An observer's qparams in one phrase, to compare the inputs of a cat in a message."""
    if spec.is_fixed_qparams:
        return f"{spec.observer} scale={spec.fixed_scale:g} zero_point={spec.fixed_zero_point}"
    return f"{spec.observer} {spec.dtype} [{spec.quant_min}, {spec.quant_max}]"


def describe_nodes(nodes: Sequence[OpNode]) -> str:
    """Like "3 ops (a, b, c)": the ops a grouped finding covers, the first LISTED_NODES spelled out."""
    names = ", ".join(n.display for n in nodes[:LISTED_NODES])
    if len(nodes) > LISTED_NODES:
        names += f" and {len(nodes) - LISTED_NODES} more"
    return f"{len(nodes)} op{'s' if len(nodes) != 1 else ''} ({names})"


def activation_dtype_text(
    where: str, backend: str, info: dict[str, Any], targets: list[str], sources: list[str]
) -> tuple[str, dict[str, Any], Severity]:
    """Activations in a dtype the backend has no kernel for: why the ops stay float, and the fix."""
    supported = " or ".join(info["supported"])
    message = (
        f"{where} use {info['dtype']} activations ({info['observer']}), but {backend} has "
        f"quantized kernels for these ops only with {supported} activations. prepare_fx "
        "finds no matching dtype config and leaves them in float, so nothing you configured "
        f"is quantized there. Fix: use {info['supported'][0]} activation observers, e.g. "
        f"get_default_qconfig('{backend}') or get_default_qconfig_mapping('{backend}')."
    )
    suggestion = {
        "action": "set_qconfig",
        "targets": targets,
        "scope": sources,
        "activation_dtype": info["supported"][0],
        "observer": info["observer"],
    }
    return message, suggestion, Severity.ERROR


def activation_range_text(
    where: str, backend: str, info: dict[str, Any], targets: list[str], sources: list[str]
) -> tuple[str, dict[str, Any], Severity]:
    """An activation quant range the backend rejects: why the ops stay float, and the fix."""
    message = (
        f"{where} observe activations with quant range {info['quant_range']}, outside the "
        f"{info['supported_range']} that {backend} accepts for them. prepare_fx rejects the "
        "qconfig and leaves these ops in float. Fix: use an observer with quant_min/quant_max "
        f"inside {info['supported_range']} (the defaults of get_default_qconfig('{backend}'))."
    )
    suggestion = {
        "action": "set_qconfig",
        "targets": targets,
        "scope": sources,
        "quant_min": info["supported_range"][0],
        "quant_max": info["supported_range"][1],
    }
    return message, suggestion, Severity.ERROR


def weight_dtype_text(
    where: str, backend: str, info: dict[str, Any], targets: list[str], sources: list[str]
) -> tuple[str, dict[str, Any], Severity]:
    """Weights in a dtype the backend has no kernel for: why the layers stay float, and the fix."""
    supported = " or ".join(info["supported"])
    message = (
        f"{where} quantize weights to {info['dtype']} ({info['observer']}), but {backend} "
        f"kernels with {info['activation_dtype']} activations take only {supported} weights. "
        "prepare_fx finds no matching dtype config and leaves these layers in float. Fix: "
        f"use a {info['supported'][0]} weight observer (torch.ao.quantization."
        "default_per_channel_weight_observer or default_weight_observer)."
    )
    suggestion = {
        "action": "set_weight_observer",
        "targets": targets,
        "scope": sources,
        "dtype": info["supported"][0],
        "observer": "PerChannelMinMaxObserver",
        "qscheme": "torch.per_channel_symmetric",
        "ch_axis": 0,
    }
    return message, suggestion, Severity.ERROR


def weight_range_text(
    where: str, backend: str, info: dict[str, Any], targets: list[str], sources: list[str]
) -> tuple[str, dict[str, Any], Severity]:
    """A weight quant range outside the backend's (int8 overflow guard): why it fails, and the fix."""
    low, high = info["supported_range"]
    message = (
        f"{where} quantize {info['dtype']} weights to {info['quant_range']}, but {backend}'s "
        f"kernels for {info['activation_dtype']} activations require weights in [{low}, {high}] "
        "(the symmetric range keeps the int8 products from overflowing). prepare_fx rejects "
        "the qconfig and leaves these layers in float. Fix: set quant_min="
        f"{low}, quant_max={high} on the weight observer, e.g. "
        f"MinMaxObserver.with_args(dtype=torch.qint8, qscheme=torch.per_tensor_symmetric, "
        f"quant_min={low}, quant_max={high})."
    )
    suggestion = {
        "action": "set_weight_observer",
        "targets": targets,
        "scope": sources,
        "observer": info["observer"],
        "dtype": info["dtype"],
        "quant_min": low,
        "quant_max": high,
    }
    return message, suggestion, Severity.ERROR


def weight_qscheme_text(
    where: str, backend: str, info: dict[str, Any], targets: list[str], sources: list[str]
) -> tuple[str, dict[str, Any], Severity]:
    """A weight qscheme the kernels do not take: an error where convert fails, else a warning."""
    severity = Severity.ERROR
    qscheme = info["qscheme"]
    per_channel = "per_channel" in qscheme and not info.get("transpose")
    if info.get("transpose"):
        why = (
            "prepare_fx does not support per-channel weight observers for ConvTranspose "
            "modules and raises 'Per channel weight observer is not supported yet for "
            "ConvTranspose{n}d'"
        )
    elif "float_qparams" in qscheme:
        why = (
            "float-qparams weights are only supported by the embedding kernels; conv and "
            "linear prepack rejects them at convert time"
        )
    elif backend == "onednn":
        why = (
            "oneDNN only supports symmetric weight quantization (zero point 0); "
            "quantized::qconv_prepack/linear_prepack fail at convert with 'ONEDNN only "
            "supports symmetric quantization of weight'"
        )
    else:
        severity = Severity.WARNING
        why = (
            f"{backend}'s kernels are built for symmetric weights (zero point 0): an "
            "asymmetric zero point needs extra zero-point compensation per output, "
            + (
                "and x86 cannot use its oneDNN kernels and falls back to FBGEMM"
                if backend == "x86"
                else "and buys almost no accuracy for weights, which are centred on zero"
            )
        )
    want = "torch.per_channel_symmetric" if per_channel or "float_qparams" in qscheme else "torch.per_tensor_symmetric"
    observer = "PerChannelMinMaxObserver" if want.startswith("torch.per_channel") else "MinMaxObserver"
    message = (
        f"{where} quantize weights with {qscheme} ({info['observer']}): {why}. Fix: use "
        f"{observer}.with_args(dtype=torch.qint8, qscheme={want})."
    )
    suggestion: dict[str, Any] = {
        "action": "set_weight_observer",
        "targets": targets,
        "scope": sources,
        "observer": observer,
        "qscheme": want,
        "dtype": "torch.qint8",
    }
    if want.startswith("torch.per_channel"):
        suggestion["ch_axis"] = 0
    return message, suggestion, severity


def full_range_activation_text(
    where: str, backend: str, info: dict[str, Any], targets: list[str]
) -> tuple[str, dict[str, Any], Severity]:
    """8-bit activations into x86/fbgemm conv/linear: the VNNI-less overflow risk, and the fix."""
    message = (
        f"The activations entering {where} are quantized to the full 8-bit range "
        f"{info['quant_range']} ({info['observer']}, reduce_range=False). {backend}'s kernels "
        "multiply uint8 activations by int8 weights and add pairs of products in 16 bits "
        "(vpmaddubsw) on CPUs without VNNI, which can saturate and silently corrupt "
        "outputs. Fix: use reduce_range=True on the activation observer (7-bit "
        f"activations, as get_default_qconfig('{backend}') does), or deploy only on "
        "VNNI-capable CPUs."
    )
    suggestion = {
        "action": "set_activation_observer",
        "targets": targets,
        "observer": info["observer"],
        "reduce_range": True,
    }
    return message, suggestion, Severity.WARNING


def wasted_reduce_range_text(
    where: str, backend: str, info: dict[str, Any], targets: list[str]
) -> tuple[str, dict[str, Any], Severity]:
    """reduce_range where the backend does not overflow: the wasted bit, and the fix."""
    message = (
        f"The activations entering {where} use reduce_range (range {info['quant_range']}, "
        f"{info['observer']}), which only x86/fbgemm need to avoid 16-bit overflow. "
        f"{backend}'s kernels do not overflow, so this throws away one bit of activation "
        "resolution (twice the rounding error) for nothing. Fix: use reduce_range=False, "
        f"as get_default_qconfig('{backend}') does."
    )
    suggestion = {
        "action": "set_activation_observer",
        "targets": targets,
        "observer": info["observer"],
        "reduce_range": False,
    }
    return message, suggestion, Severity.INFO
