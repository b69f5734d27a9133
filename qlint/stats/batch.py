"""One batch reduced to a :class:`BatchSummary`: the only step that reads an activation.

A summary is a few per-channel vectors (min, max, counts, and where asked
for: sum and sum of squares, the reference quantile, the histogram); :mod:`qlint.stats.fold` folds
summaries into running statistics.

Layout: the channel axis splits a batch into a view ``(outer, channels,
inner)``, and every reduction runs over dims 0 and 2 of that view, so
channel-last (``[..., features]``), channel-major and ``[N, C, H, W]`` data are
all read where they lie, with one torch op per statistic. The reference
quantile is selected from a bounded sample of each channel
(:mod:`qlint.stats.selection`).

Finite CPU batches of moderate magnitude take a fast path (sums in float32
per batch, float64 across batches) after one host read that checks them;
other batches, and every batch off-CPU, take a general path that masks
NaN/Inf, sums in float64 and never reads a device value back.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch

from qlint.stats.accumulator import ScratchBuffers
from qlint.stats.selection import (
    PERCENTILE_SAMPLE,
    SamplePlan,
    host_reference_rank,
    is_exact,
    reference_rank,
    sample_plan,
    sample_rank,
)

_FLOAT32_MAX = torch.finfo(torch.float32).max
# A channel's float32 sum of squares below this is zero or lost precision to underflow.
_SMALLEST_TRUSTED_SQUARES = 1e-30
# Channel runs shorter than this are copied channel-major before reducing (see _reduction).
_SHORT_RUN = 256
# Temporaries of at least this many values (64 KiB in float32) go to reused buffers; smaller
# ones come from the allocator's free lists without page faults.
_SCRATCH_FROM = 1 << 14

PerChannel = torch.Tensor | int  # an int stands for the same count in every channel
Dims = int | tuple[int, int]  # the dims a per-channel reduction runs over


@dataclasses.dataclass(frozen=True)
class BatchSummary:
    """Per-channel reductions of one batch: all :class:`~qlint.stats.fold.RunningStats` needs.

    Tensors are 1-D of length ``channels`` on the batch's device (0-d when ``channels`` is 1)."""

    channels: int
    channel_min: torch.Tensor
    channel_max: torch.Tensor
    sum: torch.Tensor | None  # None: moments were not requested
    sum_of_squares: torch.Tensor | None
    count: PerChannel
    nan_count: PerChannel
    inf_count: PerChannel
    reference: torch.Tensor | None  # None: the percentile was not requested
    histogram: torch.Tensor | None  # None: not requested
    # The (3, channels) block whose rows are channel_min, channel_max and reference, when
    # they were written into one (a stream then copies or keeps them with no stack).
    block: torch.Tensor | None = None

    @property
    def device(self) -> torch.device:
        return self.channel_max.device


@dataclasses.dataclass(frozen=True)
class SummaryRow:
    """Where a finite batch's minimum, maximum and reference are written: the three rows of
    one ``(3, channels)`` block (0-d views for one channel), made once per block."""

    block: torch.Tensor
    channel_min: torch.Tensor
    channel_max: torch.Tensor
    reference: torch.Tensor
    extrema: torch.Tensor  # minimum and maximum together: one finiteness check reads both
    indices: torch.Tensor  # kthvalue's indices (unused)

    @classmethod
    def of(cls, block: torch.Tensor, indices: torch.Tensor | None = None) -> SummaryRow:
        """The row of ``block``; ``indices`` (int64, one per channel, 0-d for one) may be shared
        by every row of a stream."""
        one = block.shape[1] == 1
        low, high, reference = (block[0, 0], block[1, 0], block[2, 0]) if one else block.unbind(0)
        if indices is None:
            indices = torch.empty(reference.shape, dtype=torch.int64, device=block.device)
        return cls(block, low, high, reference, block[:2].reshape(-1) if one else block[:2], indices)

    def extrema_are_finite(self) -> bool:
        """Whether every minimum and maximum is finite (one host read; CPU only).

        amin/amax propagate NaN and keep +-Inf, so a batch with a non-finite value fails;
        so does a sum of many extrema beyond float32 (that batch merely takes the general
        path)."""
        if self.extrema.dim() == 1:  # one channel: two values, read as they are
            low, high = self.extrema.tolist()
            return math.isfinite(low) and math.isfinite(high)
        return math.isfinite(float(self.extrema.sum()))


def summary_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a batch of floating ``dtype`` is summarized in (narrower floats as float32)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# ------------------------------------------------------------------ public API
def summarize_values(
    batch: torch.Tensor,
    channel_axis: int | None,
    reference_percentile: float,
    *,
    scratch: ScratchBuffers | None = None,
    sync_free: bool | None = None,
    percentile: bool = True,
    histogram: bool = True,
    moments: bool = True,
    percentile_sample: int | None = PERCENTILE_SAMPLE,
) -> BatchSummary | None:
    """Reduce one floating batch to its :class:`BatchSummary` (None for an empty batch).

    ``percentile``, ``histogram``, ``moments``: compute the reference quantile, the
    histogram, the per-channel sums and sums of squares; a point whose rules read none
    of them pays for min, max and counts only."""
    if not batch.is_floating_point():
        raise TypeError(f"summarize_batch needs a floating tensor, got {batch.dtype}")
    if batch.numel() == 0:
        return None
    reader = batch_reader(
        batch.shape, channel_axis, reference_percentile, percentile, histogram, moments, percentile_sample
    )
    return reader.summarize(batch, scratch, sync_free=sync_free)


@dataclasses.dataclass(frozen=True)
class BatchReader:
    """How every batch of one shape is read at one observer's settings, worked out once: the
    split around the channel axis and the rank or sample plan of the reference quantile."""

    outer: int
    channels: int
    inner: int
    reference_percentile: float
    sample_size: int | None  # 0: no reference; None: the exact one
    histogram: bool
    moments: bool

    @property
    def width(self) -> int:
        """Values per channel."""
        return self.outer * self.inner

    def summarize(
        self,
        batch: torch.Tensor,
        scratch: ScratchBuffers | None = None,
        *,
        sync_free: bool | None = None,
        row: SummaryRow | None = None,
    ) -> BatchSummary:
        """The :class:`BatchSummary` of a non-empty floating ``batch`` of this reader's shape.

        ``row``: where a finite batch's minimum, maximum and reference are written (of the
        batch's dtype, float32 for narrower floats): the row of a
        :class:`~qlint.stats.fold.RunningStats` that would otherwise copy them there."""
        if sync_free is None:
            sync_free = not batch.is_cpu
        scratch = scratch if scratch is not None else ScratchBuffers()
        # Detached tensors record no autograd history, so no no_grad() context is needed.
        values = batch.detach() if batch.requires_grad else batch
        dtype = summary_dtype(values.dtype)
        if values.dtype != dtype:  # no .to() call at all for float32 and float64
            values = values.to(dtype)
        data, dims = _reduction(values, self.outer, self.channels, self.inner, scratch)
        hist = _exponent_histogram(data, scratch) if self.histogram else None
        summary = None
        if not sync_free:
            if row is None:
                row = SummaryRow.of(torch.empty(3, self.channels, dtype=data.dtype, device=data.device))
            elif row.block.dtype != data.dtype or row.block.shape != (3, self.channels):
                raise ValueError(f"a row for {self.channels} channels of {data.dtype} is needed, got {row.block}")
            summary = self._summarize_finite(data, dims, hist, scratch, row)
        if summary is None:
            summary = self._summarize_any(data, dims, hist)
        return summary

    def _summarize_finite(
        self, data: torch.Tensor, dims: Dims, histogram: torch.Tensor | None, scratch: ScratchBuffers, row: SummaryRow
    ) -> BatchSummary | None:
        """Fast path for finite batches of moderate magnitude; None (after a host read) otherwise.

        Minimum, maximum and reference go into ``row``: each is one op writing where the
        stream keeps it."""
        channel_sum = sum_of_squares = None
        if self.channels == 1:  # a whole-tensor point: one-pass full reductions, 0-d results
            flat = data.reshape(-1)
            torch.aminmax(flat, out=(row.channel_min, row.channel_max))
            if self.moments:
                channel_sum, sum_of_squares = flat.sum(), torch.dot(flat, flat)
        else:
            torch.amin(data, dims, out=row.channel_min)
            torch.amax(data, dims, out=row.channel_max)
            if self.moments:
                channel_sum = data.sum(dims)
                sum_of_squares = _sum_of_squares(data, dims, scratch)
        if sum_of_squares is not None:
            if not _trusted_squares(sum_of_squares, row.channel_min, row.channel_max):
                return None
        elif not row.extrema_are_finite():
            return None
        reference = None
        if self.sample_size != 0:
            values, dim, k = self._selection(data, dims)
            reference = torch.kthvalue(values, k, dim=dim, out=(row.reference, row.indices)).values
        return BatchSummary(
            self.channels,
            row.channel_min,
            row.channel_max,
            channel_sum,
            sum_of_squares,
            self.width,
            0,
            0,
            reference,
            histogram,
            row.block,
        )

    def _sample_plan(self, device: torch.device) -> SamplePlan | None:
        """The plan the reference is estimated from; None where it is selected from every value."""
        if self.sample_size is None or is_exact(self.width, self.channels, self.sample_size):
            return None
        return sample_plan(self.width, self.reference_percentile, self.sample_size, device)

    def _selection(self, data: torch.Tensor, dims: Dims) -> tuple[torch.Tensor, int, int]:
        """What the reference is the k-th smallest of, per channel: (values, their dim, k)."""
        plan = self._sample_plan(data.device)
        if plan is None:
            values, dim = _all_values(data, dims)
            k = host_reference_rank(self.width, self.reference_percentile) + 1
        else:
            values, dim = _group_maxima(data, dims, plan)
            k = plan.kth
        if self.channels == 1:  # 0-d result, shaped like the other whole-tensor statistics
            return values.reshape(-1), 0, k
        return values, dim, k

    def _summarize_any(self, data: torch.Tensor, dims: Dims, histogram: torch.Tensor | None) -> BatchSummary:
        """General path: tolerates NaN/Inf, sums in float64 and never reads a device value back."""
        width, channels = self.width, self.channels
        finite = torch.isfinite(data)
        nan_count = torch.isnan(data).sum(dims)
        count = finite.sum(dims)
        inf_count = width - count - nan_count
        channel_sum = sum_of_squares = None
        if self.moments:
            finite_or_zero = data.masked_fill(~finite, 0).to(torch.float64)
            channel_sum, sum_of_squares = finite_or_zero.sum(dims), finite_or_zero.square().sum(dims)
        channel_max = data.masked_fill(~finite, -math.inf).amax(dims)
        reference = None
        if self.sample_size != 0:
            # With NaN/Inf excluded each channel has its own number of values, so its own rank.
            rank = reference_rank(count, self.reference_percentile)
            plan = self._sample_plan(data.device)
            if plan is None:
                values, dim = _all_values(data, dims)
                # Non-finite values sort last as +inf, after every finite one.
                ordered = values.masked_fill(~torch.isfinite(values), math.inf).sort(dim=dim).values
                index = rank.clamp(min=0)
            else:
                maxima, dim = _group_maxima(data, dims, plan, finite_only=True)
                kept = _sampled_finite_count(data, dims, plan)
                from_top = (kept - sample_rank(rank, count, kept)).clamp(max=plan.groups)
                ordered = maxima.sort(dim=dim, descending=True).values
                index = (from_top - 1).clamp(min=0)
            reference = ordered.gather(dim, index.unsqueeze(dim)).squeeze(dim)
            # A channel whose few finite values all escaped the sample has no estimate: its
            # maximum stands in (ratio 1, never an outlier).
            reference = torch.where(torch.isfinite(reference), reference, channel_max)
        return BatchSummary(
            channels,
            data.masked_fill(~finite, math.inf).amin(dims),
            channel_max,
            channel_sum,
            sum_of_squares,
            count,
            nan_count,
            inf_count,
            reference,
            histogram,
        )


@functools.lru_cache(maxsize=1024)
def batch_reader(
    shape: tuple[int, ...],
    channel_axis: int | None,
    reference_percentile: float,
    percentile: bool,
    histogram: bool,
    moments: bool,
    percentile_sample: int | None,
) -> BatchReader:
    """The (cached) :class:`BatchReader` of batches of ``shape`` at these settings (positional
    arguments: the cache hashes them, once per batch and observer, faster than keywords)."""
    if not 0.0 < reference_percentile < 1.0:
        raise ValueError(f"reference_percentile must be in (0, 1), got {reference_percentile}")
    if percentile_sample is not None and percentile_sample < 1:
        raise ValueError(f"percentile_sample must be a positive number of values or None, got {percentile_sample}")
    outer, channels, inner = _outer_channels_inner(tuple(shape), channel_axis)
    sample_size = percentile_sample if percentile else 0
    return BatchReader(outer, channels, inner, reference_percentile, sample_size, histogram, moments)


# -------------------------------------------------------------------- layout
def channel_count(shape: tuple[int, ...], channel_axis: int | None) -> int:
    """Channels of a tensor of this shape (see ``summarize_batch`` for short shapes)."""
    return _outer_channels_inner(tuple(shape), channel_axis)[1]


def _outer_channels_inner(shape: tuple[int, ...], channel_axis: int | None) -> tuple[int, int, int]:
    """Split a shape around its channel axis: (product before, channels, product after).

    A shape with too few dims for ``channel_axis`` is read as unbatched (leading singleton dims)."""
    if channel_axis is None:
        return 1, 1, math.prod(shape)
    missing_leading_dims = channel_axis + 1 - len(shape) if channel_axis >= 0 else -channel_axis - len(shape)
    if missing_leading_dims > 0:
        shape = (1,) * missing_leading_dims + shape
    axis = channel_axis if channel_axis >= 0 else channel_axis + len(shape)
    return math.prod(shape[:axis]), shape[axis], math.prod(shape[axis + 1 :])


def _reduction(
    values: torch.Tensor, outer: int, channels: int, inner: int, scratch: ScratchBuffers
) -> tuple[torch.Tensor, Dims]:
    """The batch and the dims to reduce for per-channel results: ``(values, channels)`` over
    dim 0, ``(channels, values)`` over dim 1, or ``(outer, channels, inner)`` over dims (0, 2);
    views where the batch's strides allow (as ``reshape`` decides).

    Singleton outer or inner dims are dropped (one-dim reductions are torch's fastest). Short
    channel runs (``[N, C, 7, 7]``) are copied channel-major once, into a reused buffer: torch
    reduces (0, 2) with a short inner dim several times slower than the copy costs."""
    if inner == 1:
        return values.reshape(outer, channels), 0
    if outer == 1:
        return values.reshape(channels, inner), 1
    if inner < _SHORT_RUN:
        rows = scratch.get("rows", (channels, outer * inner), values.dtype, values.device)
        rows.view(channels, outer, inner).copy_(values.reshape(outer, channels, inner).transpose(0, 1))
        return rows, 1
    return values.reshape(outer, channels, inner), (0, 2)


def _all_values(data: torch.Tensor, dims: Dims) -> tuple[torch.Tensor, int]:
    """Every value of each channel, and the dim they lie along: ``(n, C)`` along 0 as it is,
    ``(C, n)`` rows along 1 (a copy for ``(outer, C, inner)``)."""
    if dims == 0 or dims == 1:
        return data, dims
    return data.transpose(0, 1).reshape(data.shape[1], -1), 1


def _group_maxima(
    data: torch.Tensor, dims: Dims, plan: SamplePlan, *, finite_only: bool = False
) -> tuple[torch.Tensor, int]:
    """Per channel the maxima of the plan's groups of sampled values, and the dim they lie along:
    ``(C, groups)`` along 1 or ``(groups, C)`` along 0.

    Values are gathered where they are contiguous (whole rows of channels, or within each
    channel's row). ``finite_only``: NaN/Inf are left out (a group of only those gives -inf)."""
    if dims == 1:  # (C, n): each row gathers its sample
        picked = data.index_select(1, plan.positions).view(data.shape[0], plan.groups, plan.group_size)
        group_dim = 2
    else:  # (n, C) or (outer, C, inner): whole rows of channels are gathered
        if dims == 0:
            picked = data.index_select(0, plan.positions)
        else:
            inner = data.shape[2]
            picked = data[torch.div(plan.positions, inner, rounding_mode="floor"), :, plan.positions % inner]
        picked = picked.view(plan.groups, plan.group_size, -1)
        group_dim = 1
    if finite_only:
        picked = picked.masked_fill(~torch.isfinite(picked), -math.inf)
    maxima = picked.amax(group_dim) if plan.group_size > 1 else picked.squeeze(group_dim)
    return maxima, group_dim - 1


# ---------------------------------------------------------- finite fast path
def _sum_of_squares(data: torch.Tensor, dims: Dims, scratch: ScratchBuffers) -> torch.Tensor:
    """Per-channel sums of squares, float32. Along a contiguous last dim a norm reads each value
    once and writes nothing; across rows (``(n, C)`` over dim 0, where torch's norm is slow) the
    squares of a large batch go to a reused buffer: a fresh activation-sized temporary costs a
    page fault per 4 KiB, more than the arithmetic."""
    if dims == 1:
        return torch.linalg.vector_norm(data, dim=1).square()
    if dims != 0:
        return torch.linalg.vector_norm(data, dim=2).square().sum(0)
    if data.numel() < _SCRATCH_FROM:
        return torch.mul(data, data).sum(0)
    squares = scratch.get("squares", tuple(data.shape), data.dtype, data.device)
    return torch.mul(data, data, out=squares).sum(0)


def _trusted_squares(sum_of_squares: torch.Tensor, channel_min: torch.Tensor, channel_max: torch.Tensor) -> bool:
    """Whether a batch's float32 sums can be kept: every value finite, and no square over- or
    underflowed (host reads; CPU only).

    NaN and +-Inf make the sum of squares NaN or Inf, and so does a square beyond float32
    range. A channel whose sum of squares is below 1e-30 either is all zeros (fine: ReLU
    leaves many) or holds magnitudes below ~1e-15, whose squares lose precision in float32:
    the general path sums those in float64."""
    if sum_of_squares.dim() == 0:
        smallest = largest = sum_of_squares.item()
    else:
        low, high = torch.aminmax(sum_of_squares)
        smallest, largest = low.item(), high.item()
    if not largest < _FLOAT32_MAX:
        return False
    if smallest >= _SMALLEST_TRUSTED_SQUARES:
        return True
    tiny = sum_of_squares < _SMALLEST_TRUSTED_SQUARES
    return not bool((tiny & ((channel_max != 0) | (channel_min != 0))).any())


# --------------------------------------------------------------- general path
def _sampled_finite_count(data: torch.Tensor, dims: Dims, plan: SamplePlan) -> torch.Tensor:
    """Per channel, how many of the plan's sampled values are finite."""
    if dims == 1:
        return torch.isfinite(data.index_select(1, plan.positions)).sum(1)
    if dims == 0:
        picked = data.index_select(0, plan.positions)
    else:
        inner = data.shape[2]
        picked = data[torch.div(plan.positions, inner, rounding_mode="floor"), :, plan.positions % inner]
    return torch.isfinite(picked).sum(0)


# ----------------------------------------------------------------- histogram
def _exponent_histogram(values: torch.Tensor, scratch: ScratchBuffers) -> torch.Tensor:
    """(sign, float32 exponent) counts of the finite values; see the accumulator docstring."""
    if values.dtype == torch.float64:
        as_float32 = values.clamp(-_FLOAT32_MAX, _FLOAT32_MAX).to(torch.float32)
        # The clamp turned +-Inf into the top finite bin; keep them out.
        infinities = torch.stack([(values == math.inf).sum(), (values == -math.inf).sum()])
    else:
        as_float32, infinities = values, None
    # An arithmetic shift leaves the sign-extended (sign, exponent) pair:
    # exponent for positives, exponent - 256 for negatives.
    keys = scratch.get("keys", tuple(as_float32.shape), torch.int32, values.device)
    torch.bitwise_right_shift(as_float32.view(torch.int32), 23, out=keys)
    keys += 256
    histogram = histogram_of_key_counts(_count_keys(keys.reshape(-1), 512))
    if infinities is not None:
        histogram[:, 254] -= infinities
    return histogram


def histogram_of_key_counts(counts: torch.Tensor) -> torch.Tensor:
    """(sign, exponent) histogram from counts of ``(float32 bits >> 23) + 256``."""
    histogram = torch.stack([counts[256:], counts[:256]])
    histogram[:, 255] = 0  # NaN/Inf are counted by nan_count / inf_count
    return histogram


def _count_keys(keys: torch.Tensor, num_bins: int, avoid_sync: bool | None = None) -> torch.Tensor:
    """Occurrences of each key in [0, num_bins), as int64."""
    if avoid_sync is None:
        avoid_sync = keys.device.type != "cpu"
    if not avoid_sync:
        return torch.bincount(keys, minlength=num_bins)
    # bincount on accelerators reads the max key back to size its output (a
    # sync); a scatter into a fixed-size result needs no host round trip.
    ones = torch.ones(1, dtype=torch.int64, device=keys.device).expand(keys.numel())
    return torch.zeros(num_bins, dtype=torch.int64, device=keys.device).scatter_add_(0, keys.long(), ones)
