"""From batches to :class:`~qlint.stats.accumulator.TensorStats`.

Two steps, so that a stream of batches pays the bookkeeping once per chunk
instead of once per batch:

1. :func:`summarize_values` reduces one batch to a :class:`BatchSummary`: a
   few per-channel vectors (min, max, sum, sum of squares, the reference
   quantile, counts) and the histogram. This is the only step that reads the
   activation.
2. :func:`stats_of_summaries` turns any number of summaries into the
   ``TensorStats`` of those batches with a handful of vectorised ops (ratios,
   flags and batch ranges for all batches at once).

``summarize_batch`` is both steps for one batch and ``update_stats`` merges
its result, so "one batch at a time" and "summaries folded in chunks" are the
same arithmetic (float64 sums up to re-association).

Layouts: the channel axis splits a batch into ``(outer, channels, inner)``.
Channel-major data (``outer == 1``) is read in place as rows; channel-last data
(``inner == 1``: the ``[..., features]`` input of a Linear) is read in place as
columns; anything else (``[N, C, H, W]`` conv inputs) is copied channel-major
into a reusable buffer. Finite CPU batches take a fast path that sums in
float32 per batch (float64 across batches); other batches, and every batch
off-CPU, take a path with no device-to-host reads.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional, Union

import torch

from qlint.stats import kernel, selection
from qlint.stats.accumulator import HISTOGRAM_SHAPE, ScratchBuffers, TensorStats

_FLOAT32_MAX = torch.finfo(torch.float32).max
# Channel runs shorter than this are copied channel-major before the compiled kernel reads them.
_SHORT_RUN = 256
# Channel max-abs range where float32 sums of squares neither under- nor overflow.
_MODERATE_MAGNITUDE = (1e-15, 1e15)

PerChannel = Union[torch.Tensor, int]  # an int stands for the same count in every channel


@dataclasses.dataclass(frozen=True)
class BatchSummary:
    """Per-channel reductions of one batch: all :func:`stats_of_summaries` needs.

    Tensors are 1-D of length ``channels`` on the batch's device and never alias
    a scratch buffer, so summaries can be kept until they are folded."""

    channels: int
    channel_min: torch.Tensor
    channel_max: torch.Tensor
    sum: torch.Tensor
    sum_of_squares: torch.Tensor
    count: PerChannel
    nan_count: PerChannel
    inf_count: PerChannel
    reference: Optional[torch.Tensor]  # None: the percentile was not requested
    histogram: Optional[torch.Tensor]  # None: not requested
    # The float rows (min, max, sum, sum of squares, reference, and the kernel's
    # selection hint) already stacked as float64 [6, channels], when the producer had them so:
    # a chunk then stores the batch with one copy.
    packed: Optional[torch.Tensor] = None

    @property
    def device(self) -> torch.device:
        return self.channel_max.device


# ------------------------------------------------------------------ public API
def summarize_values(batch: torch.Tensor, channel_axis: Optional[int], reference_percentile: float, *,
                     scratch: Optional[ScratchBuffers] = None, sync_free: Optional[bool] = None,
                     percentile: bool = True, histogram: bool = True,
                     use_kernel: bool = True) -> Optional[BatchSummary]:
    """Reduce one floating batch to its :class:`BatchSummary` (None for an empty batch).

    ``use_kernel=False`` skips the compiled fast path (for a batch it already refused)."""
    if not batch.is_floating_point():
        raise TypeError(f"summarize_batch needs a floating tensor, got {batch.dtype}")
    if not 0.0 < reference_percentile < 1.0:
        raise ValueError(f"reference_percentile must be in (0, 1), got {reference_percentile}")
    if batch.numel() == 0:
        return None
    scratch = scratch if scratch is not None else ScratchBuffers()
    if sync_free is None:
        sync_free = batch.device.type != "cpu"
    if batch.requires_grad:
        batch = batch.detach()
    with torch.no_grad():
        if use_kernel and not sync_free and batch.dtype == torch.float32 and kernel.available():
            summary = _summarize_finite_with_kernel(batch, channel_axis, reference_percentile, percentile,
                                                    histogram, scratch)
            if summary is not None:
                return summary
        values, by_column = _channel_layout(batch.detach(), channel_axis, scratch)
        hist = _exponent_histogram(values, scratch) if histogram else None
        summary = None
        if not sync_free:
            summarize_finite = _summarize_finite_columns if by_column else _summarize_finite_rows
            summary = summarize_finite(values, reference_percentile, scratch, percentile, hist)
        if summary is None:
            summary = _summarize_any_rows(values.t() if by_column else values, reference_percentile, percentile,
                                          hist)
        return summary


class SummaryChunk:
    """Room for up to ``capacity`` :class:`BatchSummary` of one width on one device.

    Summaries are copied into tensors allocated once, so a stream keeps no
    per-batch allocation alive between folds (small long-lived allocations
    among large per-batch temporaries fragment the heap). :meth:`stats` folds
    the stored batches with a handful of vectorised ops."""

    # The last row only mirrors BatchSummary.packed's layout (one copy per batch); it is never folded.
    _FLOAT_ROWS = ("channel_min", "channel_max", "sum", "sum_of_squares", "reference", "unused_hint")
    _COUNT_ROWS = ("count", "nan_count", "inf_count")

    def __init__(self, capacity: int, channels: int, device: torch.device) -> None:
        self.capacity, self.channels, self.device = capacity, channels, device
        self._floats = torch.zeros(capacity, len(self._FLOAT_ROWS), channels, dtype=torch.float64, device=device)
        self._float_rows = self._floats.unbind(0)  # per-batch views, made once
        self._counts = torch.zeros(capacity, len(self._COUNT_ROWS), channels, dtype=torch.int64, device=device)
        # Finite batches have one count for every channel and no NaN/Inf: kept as plain
        # ints (None: that row's counts are in _counts) and written at fold time.
        self._uniform_counts: list[Optional[int]] = [None] * capacity
        self._histograms: Optional[torch.Tensor] = None  # allocated with the first histogram
        self._size = 0
        self._with_reference: Optional[bool] = None

    def __len__(self) -> int:
        return self._size

    def accepts(self, summary: BatchSummary) -> bool:
        return summary.channels == self.channels and summary.device == self.device and self._size < self.capacity

    def add(self, summary: BatchSummary) -> None:
        if not self.accepts(summary):
            raise ValueError(f"summary of {summary.channels} channels on {summary.device} does not fit a chunk of "
                             f"{self.channels} channels on {self.device} with {self.capacity - self._size} free")
        with_reference = summary.reference is not None
        if self._with_reference is None:
            self._with_reference = with_reference
        elif with_reference != self._with_reference:
            raise ValueError("summaries with and without the percentile cannot share a chunk")
        row = self._size
        if summary.packed is not None:  # the reference row is unused without the percentile
            self._float_rows[row].copy_(summary.packed)
        else:
            floats = [summary.channel_min, summary.channel_max, summary.sum, summary.sum_of_squares,
                      summary.reference if with_reference else summary.channel_max]
            torch.stack(floats, out=self._floats[row, :5])
        counts = (summary.count, summary.nan_count, summary.inf_count)
        if all(isinstance(value, int) for value in counts) and counts[1] == counts[2] == 0:
            self._uniform_counts[row] = counts[0]
        else:
            self._uniform_counts[row] = None
            torch.stack([_per_channel(value, self.channels, dtype=torch.int64, device=self.device)
                         for value in counts], out=self._counts[row])
        if summary.histogram is not None:
            if self._histograms is None:
                self._histograms = torch.zeros((self.capacity,) + HISTOGRAM_SHAPE, dtype=torch.int64,
                                               device=self.device)
            self._histograms[row].copy_(summary.histogram)
        elif self._histograms is not None:
            self._histograms[row].zero_()
        self._size += 1

    def clear(self) -> None:
        self._size = 0
        self._with_reference = None

    def stats(self, channel_axis: Optional[int], q: float) -> TensorStats:
        """The ``TensorStats`` of the stored batches."""
        if not self._size:
            return TensorStats.empty(channel_axis, q, self.channels, self.device)
        for row, count in enumerate(self._uniform_counts[: self._size]):
            if count is not None:  # plain slices: an index_put here cost ~1 ms per fold
                self._counts[row, 1:].zero_()
                self._counts[row, 0].fill_(count)
        floats, counts = self._floats[: self._size], self._counts[: self._size]  # (batches, field, C)
        channel_min, channel_max, reference = floats[:, 0], floats[:, 1], floats[:, 4]
        has_values = counts[:, 0] > 0
        if self._with_reference:
            counted = has_values & (reference != 0)
            zero_denominator = has_values & (reference == 0) & (channel_max != 0)
            ratio = torch.where(counted, channel_max / torch.where(counted, reference, 1.0), 0.0)
        else:  # percentile not requested: no batch counts towards it
            counted = zero_denominator = torch.zeros_like(has_values)
            ratio = torch.zeros_like(channel_max)
        any_values = has_values.any(1)
        batch_range = torch.where(any_values, channel_max.amax(1) - channel_min.amin(1), 0.0)
        constant = has_values & (channel_max == channel_min)
        flags = torch.stack([counted, zero_denominator, constant]).sum(1)
        return TensorStats._packed(
            channel_axis,
            q,
            extrema=torch.stack([channel_min.amin(0), channel_max.amax(0)]),
            channel_sums=torch.cat([floats[:, 2:4].sum(0), ratio.sum(0, keepdim=True)]),
            channel_counts=torch.cat([counts.sum(0), flags]),
            histogram=(self._histograms[: self._size].sum(0) if self._histograms is not None
                       else torch.zeros(HISTOGRAM_SHAPE, dtype=torch.int64, device=self.device)),
            batch_counts=torch.stack([torch.tensor(self._size, device=self.device), any_values.sum()]),
            batch_range_sum=batch_range.sum(),
        )


def stats_of_summaries(channel_axis: Optional[int], q: float, summaries: list[BatchSummary]) -> TensorStats:
    """The ``TensorStats`` of the batches behind ``summaries`` (same width and device)."""
    if not summaries:
        return TensorStats.empty(channel_axis, q)
    first = summaries[0]
    if any(s.channels != first.channels for s in summaries):
        raise ValueError(f"channel count changed within a stream: {sorted({s.channels for s in summaries})}")
    chunk = SummaryChunk(len(summaries), first.channels, first.device)
    for summary in summaries:
        chunk.add(summary)
    return chunk.stats(channel_axis, q)


def summarize_batch(batch: torch.Tensor, channel_axis: Optional[int] = 1, reference_percentile: float = 0.975, *,
                    scratch: Optional[ScratchBuffers] = None, sync_free: Optional[bool] = None,
                    percentile: bool = True, histogram: bool = True) -> TensorStats:
    """Stats of one batch, on the batch's device.

    ``channel_axis`` may be negative; a tensor with too few dimensions for it
    is read as unbatched (leading singleton dims are assumed), so a 1-D input
    to a Linear with ``channel_axis=1`` has one channel per feature.
    ``sync_free`` picks the path: False uses host reads to take a cheaper
    route when all values are finite (free on CPU), True never reads device
    values back (default: True off-CPU). Results are identical, except that
    the host-read path sums a finite batch in float32 (~1e-7 relative).
    ``percentile=False`` skips the percentile ratio and ``histogram=False`` the
    histogram (they stay zero): they are the two costly statistics, and a point
    whose rules read neither should not pay for them.
    """
    summary = summarize_values(batch, channel_axis, reference_percentile, scratch=scratch, sync_free=sync_free,
                               percentile=percentile, histogram=histogram)
    if summary is None:
        return TensorStats.empty(channel_axis, reference_percentile, device=batch.device)
    return stats_of_summaries(channel_axis, reference_percentile, [summary])


def update_stats(stats: TensorStats, batch: torch.Tensor, scratch: Optional[ScratchBuffers] = None, *,
                 percentile: bool = True, histogram: bool = True) -> TensorStats:
    """Pure update: ``stats`` followed by one batch (``stats`` is not mutated)."""
    batch_stats = summarize_batch(batch, stats.channel_axis, stats.reference_percentile, scratch=scratch,
                                  percentile=percentile, histogram=histogram)
    return stats.merge(batch_stats)


# -------------------------------------------------------------------- layout
def _per_channel(value: PerChannel, channels: int, **kind) -> torch.Tensor:
    if isinstance(value, int):
        return torch.full((channels,), value, **kind)
    return value


def channel_count(shape: tuple[int, ...], channel_axis: Optional[int]) -> int:
    """Channels of a tensor of this shape (see ``summarize_batch`` for short shapes)."""
    return _outer_channels_inner(tuple(shape), channel_axis)[1]


def _outer_channels_inner(shape: tuple[int, ...], channel_axis: Optional[int]) -> tuple[int, int, int]:
    """Split a shape around its channel axis: (product before, channels, product after).

    A shape with too few dims for ``channel_axis`` is read as unbatched (leading singleton dims)."""
    if channel_axis is None:
        return 1, 1, math.prod(shape)
    missing_leading_dims = channel_axis + 1 - len(shape) if channel_axis >= 0 else -channel_axis - len(shape)
    if missing_leading_dims > 0:
        shape = (1,) * missing_leading_dims + shape
    axis = channel_axis if channel_axis >= 0 else channel_axis + len(shape)
    return math.prod(shape[:axis]), shape[axis], math.prod(shape[axis + 1 :])


def _channel_layout(batch: torch.Tensor, channel_axis: Optional[int],
                    scratch: ScratchBuffers) -> tuple[torch.Tensor, bool]:
    """The batch as a contiguous matrix in the compute dtype, and whether channels are its columns.

    Rows ``(channels, values)`` or columns ``(values, channels)``; both are read
    in place when the batch already has that layout, otherwise rows are copied."""
    compute_dtype = torch.float64 if batch.dtype == torch.float64 else torch.float32
    outer, channels, inner = _outer_channels_inner(tuple(batch.shape), channel_axis)
    as_3d = batch.reshape(outer, channels, inner)
    if batch.dtype == compute_dtype and as_3d.is_contiguous():
        if outer == 1:
            return as_3d[0], False  # already channel-major
        if inner == 1 and channels > 1:
            return as_3d[:, :, 0], True  # channel-last: the columns are the channels
    rows = scratch.get("rows", (channels, outer * inner), compute_dtype, batch.device)
    rows.view(channels, outer, inner).copy_(as_3d.transpose(0, 1))
    return rows, False


def _reference_rank(value_counts: torch.Tensor, q: float) -> torch.Tensor:
    """0-based ascending index of the q-quantile, ``floor(q * (n - 1))`` in float32 as torch.quantile."""
    q32 = torch.tensor(q, dtype=torch.float32, device=value_counts.device)
    return torch.floor(q32 * (value_counts - 1).to(torch.float32)).to(torch.int64)


@functools.lru_cache(maxsize=256)
def _host_reference_rank(width: int, q: float) -> int:
    return int(_reference_rank(torch.tensor(width), q))


def _moderate_and_finite(channel_min: torch.Tensor, channel_max: torch.Tensor, channel_sum: torch.Tensor,
                         sum_of_squares: torch.Tensor) -> bool:
    """Whether a float32 fast-path summary can be trusted (a few host reads; CPU only).

    NaN/Inf make min/max/sums non-finite (and NaN fails every comparison). The
    float32 sum of squares could under- or overflow for channel magnitudes
    outside [1e-15, 1e15]: those batches (rare, and the hostile ones) take the
    general path, exact in float64."""
    max_abs = torch.maximum(channel_max, channel_min.neg())
    largest = float(max_abs.max())
    smallest_nonzero = float(torch.where(max_abs == 0, 1.0, max_abs).min())
    low, high = _MODERATE_MAGNITUDE
    if not (largest < high and (smallest_nonzero > low or largest == 0)):
        return False
    return math.isfinite(float(channel_sum.sum()) + float(sum_of_squares.sum()))


# ---------------------------------------------------------- finite fast paths
def in_place_layout(batch: torch.Tensor, channel_axis: Optional[int]) -> Optional[tuple[int, int, int]]:
    """``(outer, channels, inner)`` when the compiled kernel can read ``batch`` where it lies (as
    :func:`kernel_view` would, without making the view), else None (it needs a copy)."""
    outer, channels, inner = _outer_channels_inner(tuple(batch.shape), channel_axis)
    if (1 < inner < _SHORT_RUN and outer > 1) or not batch.is_contiguous():
        return None
    return outer, channels, inner


def kernel_view(batch: torch.Tensor, channel_axis: Optional[int], scratch: ScratchBuffers) -> torch.Tensor:
    """A float32 CPU batch as the contiguous ``(outer, channels, inner)`` array the compiled kernel reads.

    In place where the layout allows; short runs ([N, C, 7, 7]) would be read a few values at a
    time, so they (and non-contiguous batches) are copied channel-major into a reused buffer:
    fresh megabyte-sized blocks per batch fragment glibc's heap (RSS grows)."""
    outer, channels, inner = _outer_channels_inner(tuple(batch.shape), channel_axis)
    values = batch.reshape(outer, channels, inner)
    short_runs = 1 < inner < _SHORT_RUN and outer > 1
    if short_runs or not values.is_contiguous():
        rows = scratch.get("rows", (channels, outer * inner), torch.float32, batch.device)
        rows.view(channels, outer, inner).copy_(values.transpose(0, 1))
        values = rows.view(1, channels, outer * inner)
    return values


def wanted_rank(width: int, q: float) -> int:
    """The reference quantile of ``width`` values is their wanted_rank-th largest."""
    return width - _host_reference_rank(width, q)


def _summarize_finite_with_kernel(batch: torch.Tensor, channel_axis: Optional[int], q: float, percentile: bool,
                                  histogram: bool, scratch: ScratchBuffers) -> Optional[BatchSummary]:
    """Compiled fast path (float32 CPU): every statistic in one read, in place in any layout.

    None when the batch is not finite or of moderate magnitude: the general path takes it."""
    if batch.device.type != "cpu":
        return None
    values = kernel_view(batch, channel_axis, scratch)
    outer, channels, inner = values.shape
    width = outer * inner
    wanted = wanted_rank(width, q) if percentile else None
    result = kernel.summarize_channels(values, wanted, histogram=histogram)
    if not result.trusted:
        return None
    packed = result.packed
    channel_min, channel_max, channel_sum, sum_of_squares, reference, _ = packed.unbind(0)
    key_counts = result.key_counts
    return BatchSummary(channels, channel_min, channel_max, channel_sum, sum_of_squares, width, 0, 0,
                        reference if percentile else None,
                        histogram_of_key_counts(key_counts) if key_counts is not None else None,
                        packed=packed)


def _summarize_finite_rows(rows: torch.Tensor, q: float, scratch: ScratchBuffers, percentile: bool,
                           histogram: Optional[torch.Tensor]) -> Optional[BatchSummary]:
    """Fast path for finite rows of moderate magnitude; None (after one host read) otherwise."""
    channels, width = rows.shape
    wanted = width - _host_reference_rank(width, q)  # reference = wanted-th largest
    block_max = selection.block_maxima_of_rows(rows, wanted) if percentile else None
    channel_max = (rows if block_max is None else block_max).amax(1)
    channel_min = rows.amin(1)
    channel_sum = rows.sum(1)
    if channels == 1:  # a per-tensor point: BLAS dot is the cheapest sum of squares
        sum_of_squares = torch.dot(rows[0], rows[0]).reshape(1)
    else:
        sum_of_squares = torch.linalg.vector_norm(rows, dim=1).double().square()
    if not _moderate_and_finite(channel_min, channel_max, channel_sum, sum_of_squares):
        return None
    reference = None
    if percentile:
        above = scratch.get("above", tuple(rows.shape), torch.bool, rows.device)
        reference = selection.kth_largest_of_rows(rows, block_max, wanted, above)
    return BatchSummary(channels, channel_min, channel_max, channel_sum, sum_of_squares, width, 0, 0,
                        reference, histogram)


def _summarize_finite_columns(columns: torch.Tensor, q: float, scratch: ScratchBuffers, percentile: bool,
                              histogram: Optional[torch.Tensor]) -> Optional[BatchSummary]:
    """Fast path for finite channel-last data: every reduction runs down the columns,
    contiguous across channels, so nothing is transposed."""
    width, channels = columns.shape
    channel_min = columns.amin(0)
    channel_sum = columns.sum(0)
    squares = scratch.get("squares", tuple(columns.shape), columns.dtype, columns.device)
    sum_of_squares = torch.mul(columns, columns, out=squares).sum(0)
    reference = None
    if percentile:  # the selection's tournament yields the maxima too
        channel_max, reference = selection.max_and_kth_largest_of_columns(
            columns, width - _host_reference_rank(width, q))
    else:
        channel_max = columns.amax(0)
    if not _moderate_and_finite(channel_min, channel_max, channel_sum, sum_of_squares):
        return None
    return BatchSummary(channels, channel_min, channel_max, channel_sum, sum_of_squares, width, 0, 0,
                        reference, histogram)


# --------------------------------------------------------------- general path
def _summarize_any_rows(rows: torch.Tensor, q: float, percentile: bool,
                        histogram: Optional[torch.Tensor]) -> BatchSummary:
    """General path: tolerates NaN/Inf and never reads a device value back.

    ``rows`` may be a transposed (non-contiguous) view: everything here is a
    reduction along dim 1."""
    channels, width = rows.shape
    finite = torch.isfinite(rows)
    nan_count = torch.isnan(rows).sum(1)
    count = finite.sum(1)
    inf_count = width - count - nan_count
    for_max = rows.masked_fill(~finite, -math.inf)
    finite_or_zero = rows.masked_fill(~finite, 0).to(torch.float64)
    # With NaN/Inf excluded each channel has its own number of values, so its
    # own quantile rank; one topk deep enough for the largest rank serves all.
    reference = None
    if percentile:
        rank = _reference_rank(count, q)
        wanted = count - rank  # the wanted value is the wanted-th largest
        deepest = min(width, width - _host_reference_rank(width, q) + 2)
        top = for_max.topk(deepest, dim=1).values
        reference = top.gather(1, (wanted - 1).clamp(0, deepest - 1).unsqueeze(1)).squeeze(1)
    return BatchSummary(channels, rows.masked_fill(~finite, math.inf).amin(1), for_max.amax(1),
                        finite_or_zero.sum(1), finite_or_zero.square().sum(1), count, nan_count, inf_count,
                        reference, histogram)


def _exponent_histogram(values: torch.Tensor, scratch: ScratchBuffers) -> torch.Tensor:
    """(sign, float32 exponent) counts of the finite values; see the accumulator docstring."""
    if values.dtype == torch.float64:
        as_float32 = values.clamp(-_FLOAT32_MAX, _FLOAT32_MAX).to(torch.float32)
        # The clamp turned +-Inf into the top finite bin; keep them out.
        infinities = torch.stack([(values == math.inf).sum(), (values == -math.inf).sum()])
    else:
        as_float32, infinities = values, None
    keys = scratch.get("keys", tuple(as_float32.shape), torch.int32, values.device)
    # An arithmetic shift leaves the sign-extended (sign, exponent) pair:
    # exponent for positives, exponent - 256 for negatives.
    torch.bitwise_right_shift(as_float32.view(torch.int32), 23, out=keys)
    keys += 256
    histogram = histogram_of_key_counts(_count_keys(keys.view(-1), 512))
    if infinities is not None:
        histogram[:, 254] -= infinities
    return histogram


def histogram_of_key_counts(counts: torch.Tensor) -> torch.Tensor:
    """(sign, exponent) histogram from counts of ``(float32 bits >> 23) + 256``."""
    histogram = torch.stack([counts[256:], counts[:256]])
    histogram[:, 255] = 0  # NaN/Inf are counted by nan_count / inf_count
    return histogram


def _count_keys(keys: torch.Tensor, num_bins: int, avoid_sync: Optional[bool] = None) -> torch.Tensor:
    """Occurrences of each key in [0, num_bins), as int64."""
    if avoid_sync is None:
        avoid_sync = keys.device.type != "cpu"
    if not avoid_sync:
        return torch.bincount(keys, minlength=num_bins)
    # bincount on accelerators reads the max key back to size its output (a
    # sync); a scatter into a fixed-size result needs no host round trip.
    ones = torch.ones(1, dtype=torch.int64, device=keys.device).expand(keys.numel())
    return torch.zeros(num_bins, dtype=torch.int64, device=keys.device).scatter_add_(0, keys.long(), ones)
