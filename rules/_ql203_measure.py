"""QL203's measurements: torch's outlier statistic per channel, the observer that quantizes a
layer's input, the trial's measurement of that activation, and the bits that activation has.

QL204 and QL205 count their bits lost with the same ``activation_bits`` and ``physical_bits``,
so every rule states the bits of one backend alike (7 under x86's reduce_range, not 8)."""

from __future__ import annotations

import dataclasses
import math

import torch

from qlint.core.graph import OpNode
from qlint.linter.context import LintContext
from qlint.measure.pt2e_trial import PT2E_ACTIVATION_LEVELS
from qlint.measure.trial import ActivationError
from qlint.stats import TensorStats


def outlier_metric(average_ratio: torch.Tensor) -> torch.Tensor:
    """torch's per-channel p_r after its sign/flip fix-up, as torch *intends* it.

    p = average over batches of max / q-quantile. torch makes a negative p positive
    ("we care more about magnitude") and flips p < 1 to 1/p. (torch's code flips the
    original negative value, so its p stays negative and is never an outlier; qlint
    uses |p| as the comment intends.) Channels with no counted batch get NaN.
    """
    p = average_ratio.to(torch.float64).abs()
    flipped = torch.where(p < 1, 1 / p, p)
    return torch.where(average_ratio == 0, math.nan, flipped)


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


def bulk_ratio(stats: TensorStats) -> torch.Tensor:
    """Per channel, max / reference quantile where it measures a positive bulk under a positive
    maximum (CPU float64): the average ratio where it is >= 1 (inf: a batch with quantile 0),
    NaN elsewhere.

    torch's average also mixes signs (a batch whose quantile is negative under a positive
    maximum) and falls below 1 (maximum and quantile both negative); torch flips it (1/p) to
    flag the channel, but no bulk fraction or quantile can be read from it: inverting it is
    unbounded (on MiniLM's GELU outputs it put the bulk of a tensor whose maximum is 24.6 at
    177, and another's at 1/3.1e6 of the int8 range).
    """
    ratios = stats.average_percentile_ratio().cpu().to(torch.float64)
    positive = (ratios >= 1) & (stats.channel_max.cpu().to(torch.float64) > 0)
    return torch.where(positive, ratios, math.nan)


def clip_value(stats: TensorStats, channels: list[int]) -> float:
    """Where the bulk of the flagged channels ends: the largest of their reference quantiles,
    max / ``bulk_ratio``, always within [0, their largest maximum]; NaN where no channel gives
    one. A channel whose maximum is <= 0 has its bulk at or below 0, where the range of every
    int8 observer starts (observers widen their range to hold 0); a quantile of 0 is 0."""
    maxima = stats.channel_max.cpu().to(torch.float64)
    ratios = bulk_ratio(stats)
    values: list[float] = []
    for channel in channels:
        top, ratio = float(maxima[channel]), float(ratios[channel])
        if not math.isfinite(top):
            continue  # no finite value seen in this channel
        if top <= 0:
            values.append(0.0)
        elif not math.isnan(ratio):
            values.append(top / ratio)  # 0 for an infinite ratio
    return max(values) if values else math.nan


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


@dataclasses.dataclass(frozen=True)
class OutlierMeasurement:
    """torch's OutlierDetector quantities for the input of one layer (per-channel tensors on CPU)."""

    metric: torch.Tensor  # average percentile ratio per channel (NaN: no batch counted)
    outlier: torch.Tensor  # bool: sufficient batches and metric > ratio_threshold
    sufficient: torch.Tensor  # bool: enough batches counted
    constant: torch.Tensor  # bool: min == max over all data
    nan_count: int
    inf_count: int
    stats: TensorStats


def measure(
    statistics, node: OpNode, ratio_threshold: float, fraction_batches_used_threshold: float
) -> OutlierMeasurement | None:
    """Percentile-ratio outliers, constant channels and NaN/Inf at the input of ``node``."""
    stats = statistics.get(node.name, "input", 0)
    if stats is None or int(stats.batches) == 0:
        return None
    metric = outlier_metric(stats.average_percentile_ratio()).cpu()
    used = stats.percentile_batches_tracked().cpu().to(torch.float64)
    # Of the batches whose reference was selected (one in PERCENTILE_EVERY: qlint.stats.selection).
    sufficient = used / max(int(stats.reference_batches), 1) >= fraction_batches_used_threshold
    outlier = sufficient & (metric > ratio_threshold)  # NaN compares False
    has_values = stats.count.cpu() > 0
    constant = has_values & (stats.channel_min.cpu() == stats.channel_max.cpu())
    return OutlierMeasurement(
        metric, outlier, sufficient, constant, int(stats.nan_count.sum()), int(stats.inf_count.sum()), stats
    )
