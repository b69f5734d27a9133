"""The activation a layer's input is quantized to, as a rule sees it: which op's qconfig makes
its observer (prepare_fx), what the trial measured of it, and how many bits it has.

QL203, QL204 and QL205 count bits lost with the same ``activation_bits`` and ``physical_bits``,
so every rule states the bits of one backend alike (7 under x86's reduce_range, not 8)."""

from __future__ import annotations

import math

from qlint.core.graph import OpNode
from qlint.linter.context import LintContext
from qlint.measure.pt2e_trial import PT2E_ACTIVATION_LEVELS
from qlint.measure.trial import ActivationError

# Ops whose int8 output reuses their input's qparams (prepare_fx shares the observer), and
# BatchNorm, which fuses into the conv before it: the observer that sets a layer's input
# range sits on the output of the first op upstream that is none of these.
_SHARES_INPUT_QPARAMS = frozenset(
    {
        "relu",
        "relu6",
        "hardtanh",
        "max_pool",
        "adaptive_avg_pool",
        "avg_pool",
        "flatten",
        "view",
        "reshape",
        "permute",
        "transpose",
        "dropout",
        "identity",
        "contiguous",
        "squeeze",
        "unsqueeze",
        "getitem",
        "batch_norm",
        "clamp",
    }
)


def observer_owner(ctx: LintContext, node: OpNode) -> OpNode:
    """The op whose qconfig makes the observer that quantizes ``node``'s input under prepare_fx.

    The observer sits on the output of the first op upstream that does not share its input's
    qparams (the producer). prepare_fx makes it from the first op, going from that producer
    down to ``node``, that it quantizes statically: the producer itself when it has an int8
    output (a conv, an add); else the first qparam-sharing op on the way (a ReLU after an
    LSTMCell, which stays float, quantizes its own input); else ``node``, whose qconfig
    observes its input (a conv after a ``sqrt``). Checked against prepare_fx with a marked
    observer on each candidate (tests/test_ql203_owner.py)."""
    chain: list[OpNode] = []  # from node's input upstream to the producer
    producers = ctx.graph.producers(node.name)
    current = producers[0] if producers else None
    while current is not None:
        chain.append(current)
        if current.kind not in _SHARES_INPUT_QPARAMS:
            break
        upstream = ctx.graph.producers(current.name)
        current = upstream[0] if upstream else None
    for op in reversed(chain):
        if op.op != "input" and op.is_quantized and ctx.backend.quantizes_output(op.kind):
            return op
    return node


def computes_its_module(op: OpNode) -> bool:
    """A functional op computing its own module's output (``F.conv2d`` on ``self.weight`` in a
    Conv2d subclass's forward, as EfficientNet's same-padding convs): prepare_fx gives it that
    module's qconfig by name, as it gives every op of that module's forward."""
    return op.op == "function" and op.module is not None and op.module == op.scope


def functional_ops_of_scopes(ctx: LintContext, scopes: set[str], leaving_out: list[OpNode]) -> list[str]:
    """The functional ops traced in the forward of modules ``scopes`` (a qconfig set on such a
    module by name reaches them too), but those in ``leaving_out``."""
    return [
        op.display
        for op in ctx.graph.ops()
        if op.scope in scopes and op.op != "module" and op.module is None and op not in leaving_out
    ]


def measured_input(ctx: LintContext, node: OpNode) -> ActivationError | None:
    """The trial's measurement of the tensor quantized as ``node``'s input: the nearest one up
    the qparam-sharing ops (prepare_fx observes the producer's output, pt2e the input edge)."""
    if ctx.trial is None:
        return None
    producers = ctx.graph.producers(node.name)
    current = producers[0] if producers else None
    while current is not None:
        found = ctx.trial.activation(current.name)
        if found is not None or current.kind not in _SHARES_INPUT_QPARAMS:
            return found
        upstream = ctx.graph.producers(current.name)
        current = upstream[0] if upstream else None
    return None


# torch's dynamic Linear and conv kernels quantize their input per call with reduce_range on
# these engines (qnnpack ignores it): 128 levels, whatever the qconfig's quant range says.
_DYNAMIC_REDUCE_RANGE = frozenset({"x86", "fbgemm", "onednn"})


def activation_bits(node: OpNode, measured: ActivationError | None, exported: bool, backend: str) -> int:
    """Bits the layer's input is quantized to: log2 of its observer's level count (7 with
    reduce_range): for a dynamic layer, what its kernel uses on ``backend``'s engine; else as
    measured in the trial, else as the pt2e quantizer (an exported graph) or the intended
    qconfig says."""
    qconfig = node.qconfig
    spec = qconfig.activation if qconfig is not None else None
    levels = None
    if qconfig is not None and qconfig.is_dynamic and not exported:
        levels = 128 if backend in _DYNAMIC_REDUCE_RANGE else 256
    elif measured is not None:
        levels = measured.levels
    elif exported:
        levels = PT2E_ACTIVATION_LEVELS
    elif spec is not None and spec.quant_min is not None and spec.quant_max is not None:
        levels = spec.quant_max - spec.quant_min + 1
    return max(1, math.ceil(math.log2(levels))) if levels is not None else 8


def physical_bits(value: float, bits: int) -> float:
    """A bit count clamped to what the dtype has: [0, bits]."""
    if not math.isfinite(value):
        return float(bits) if value == math.inf else math.nan
    return min(max(value, 0.0), float(bits))
