"""QL203's measurements: torch's outlier statistic per channel, the observer that quantizes a
layer's input, and the trial's measurement of that activation."""

from __future__ import annotations

import dataclasses
import math

import torch

from qlint.core.graph import OpNode
from qlint.linter.context import LintContext
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
# range belongs to the first op upstream that is none of these.
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


def input_producer(ctx: LintContext, node: OpNode) -> OpNode | None:
    """The op whose output observer quantizes ``node``'s input (through qparam-sharing ops)."""
    producers = ctx.graph.producers(node.name)
    current = producers[0] if producers else None
    while current is not None and current.kind in _SHARES_INPUT_QPARAMS:
        upstream = ctx.graph.producers(current.name)
        if not upstream:
            break
        current = upstream[0]
    return current


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


def clip_value(stats: TensorStats, channels: list[int]) -> float:
    """The largest reference quantile over the flagged channels: above it only the spikes lie."""
    maxima = stats.channel_max.cpu().to(torch.float64)
    ratios = stats.average_percentile_ratio().cpu().to(torch.float64).abs()
    values = [float(maxima[c] / ratios[c]) for c in channels if float(ratios[c]) > 0]
    return max(values) if values else math.nan


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
