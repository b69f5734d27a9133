"""QL203's measurements: torch's outlier statistic per channel (p_r), the bulk of an outlier
channel, and where that bulk ends."""

from __future__ import annotations

import dataclasses
import math

import torch

from qlint.core.graph import OpNode
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


def bulk_text(ratio: float, bits_lost: float, bits: int) -> str:
    """What calibrating to the spike leaves the bulk of an outlier channel: a fraction of the
    range, or, past one step of the grid, nothing at all."""
    if ratio >= 2**bits - 1:
        return f": the bulk of an outlier channel falls within one int8 step (1/{ratio:.3g} of the range: all {bits} bits lost)"
    return f": the bulk of an outlier channel keeps 1/{ratio:.3g} of the int8 range (about {bits_lost:.1f} of {bits} bits lost)"
