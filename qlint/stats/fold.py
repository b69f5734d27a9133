"""Folding batch summaries into running statistics, and the one-batch helpers built on it.

:class:`RunningStats` holds a stream's totals (float64 sums, min/max, counts) and
room for a few pending :class:`~qlint.stats.batch.BatchSummary` rows. A summary
is copied into its row with one op; every ``capacity`` batches the pending rows
are folded into the totals in place, with ~20 vectorised ops whatever their
number (ratios, flags and batch ranges for all of them at once). Nothing of an
activation is kept: a row is a few per-channel values.

``summarize_batch`` is the same fold for one batch and ``update_stats`` merges
its result, so "one batch at a time", "merged" and "streamed" are the same
arithmetic (float64 sums up to re-association).
"""

from __future__ import annotations

from typing import Any

import torch

from qlint.stats.accumulator import HISTOGRAM_SHAPE, ScratchBuffers, TensorStats
from qlint.stats.batch import BatchSummary, PerChannel, SummaryRow, summarize_values
from qlint.stats.selection import PERCENTILE_SAMPLE

# Pending batches per fold: the fold's ~20 ops are paid once per this many batches; each
# pending row costs 3 values per channel in the batches' dtype.
FOLD_EVERY = 32


class RunningStats:
    """Statistics of a stream of batch summaries of one width, dtype and device.

    ``add`` a :class:`BatchSummary` per batch; ``stats()`` gives the ``TensorStats`` of
    every batch added so far (a snapshot: later batches do not change it). A summarizer may
    write a batch's minimum, maximum and reference straight into :meth:`next_row` (with
    ``out=``); adding that summary then copies nothing."""

    _COUNT_ROWS = ("count", "nan_count", "inf_count")

    def __init__(
        self,
        channels: int,
        device: torch.device | str,
        capacity: int | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        capacity = capacity if capacity is not None else FOLD_EVERY
        self.channels, self.device, self.capacity, self.dtype = channels, torch.device(device), capacity, dtype
        f64: dict[str, Any] = dict(dtype=torch.float64, device=self.device)
        i64: dict[str, Any] = dict(dtype=torch.int64, device=self.device)
        # Minimum, maximum and reference per pending batch, in the batches' own dtype: values
        # of the data, so exact there (the fold reads them as float64).
        self._pending = torch.zeros(capacity, 3, channels, dtype=dtype, device=self.device)
        indices = torch.empty((channels,) if channels > 1 else (), dtype=torch.int64, device=self.device)
        self._pending_rows = [SummaryRow.of(block, indices) for block in self._pending.unbind(0)]  # views, made once
        self._pending_moments: torch.Tensor | None = None  # float64 sums, made with the first batch that has them
        # Which pending batches have a reference (a stream may take it on some batches only).
        self._with_reference_rows = [False] * capacity
        # Finite batches have one count for every channel and no NaN/Inf: kept as plain
        # ints (None: that batch's counts are in _pending_counts, made with the first such batch).
        self._uniform_counts: list[int | None] = [None] * capacity
        self._pending_counts: torch.Tensor | None = None
        self._size = 0
        self._with_moments: bool | None = None  # set by the first summary
        # Totals, laid out as TensorStats packs them.
        self._extrema = torch.tensor([[float("inf")], [float("-inf")]], **f64).expand(2, channels).clone()
        self._channel_sums = torch.zeros(3, channels, **f64)  # sum, sum of squares, ratio sum
        self._channel_counts = torch.zeros(6, channels, **i64)  # count, nan, inf, ratio, zero quantile, constant
        self._histogram = torch.zeros(HISTOGRAM_SHAPE, **i64)
        self._batch_counts = torch.zeros(3, **i64)  # batches, with a finite value, with a reference
        self._batch_range_sum = torch.zeros((), **f64)
        self._batches = 0

    def __len__(self) -> int:
        """Batches added so far."""
        return self._batches

    def fits(self, channels: int, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether summaries of this width, dtype and device belong in this stream."""
        return channels == self.channels and dtype == self.dtype and device == self.device

    def accepts(self, summary: BatchSummary) -> bool:
        return self.fits(summary.channels, summary.channel_max.dtype, summary.device)

    def next_row(self) -> SummaryRow:
        """The row the next summary's minimum, maximum and reference go into."""
        return self._pending_rows[self._size]

    def add(self, summary: BatchSummary) -> None:
        if not self.accepts(summary):
            raise ValueError(
                f"summary of {summary.channels} channels of {summary.channel_max.dtype} on {summary.device} does "
                f"not fit running stats of {self.channels} channels of {self.dtype} on {self.device}"
            )
        with_moments = summary.sum is not None
        if self._with_moments is None:
            self._with_moments = with_moments
        elif with_moments != self._with_moments:
            raise ValueError("summaries with and without the moments cannot share a stream")
        row = self._size
        target = self._pending_rows[row].block
        if summary.block is None:
            floats = [summary.channel_min, summary.channel_max]
            if summary.reference is not None:
                floats.append(summary.reference)
            target[: len(floats)].copy_(torch.stack(floats).view(len(floats), self.channels))
        elif summary.block.data_ptr() != target.data_ptr():  # written elsewhere (another observer's row)
            target.copy_(summary.block)
        self._with_reference_rows[row] = summary.reference is not None
        if summary.sum is not None and summary.sum_of_squares is not None:
            if self._pending_moments is None:
                self._pending_moments = torch.zeros(
                    self.capacity, 2, self.channels, dtype=torch.float64, device=self.device
                )
            moments = torch.stack([summary.sum, summary.sum_of_squares])
            self._pending_moments[row].copy_(moments.view(2, self.channels))
        counts = (summary.count, summary.nan_count, summary.inf_count)
        if type(counts[0]) is int and type(counts[1]) is int and type(counts[2]) is int and counts[1] == counts[2] == 0:
            self._uniform_counts[row] = counts[0]
        else:
            self._uniform_counts[row] = None
            if self._pending_counts is None:
                self._pending_counts = torch.zeros(
                    self.capacity, len(self._COUNT_ROWS), self.channels, dtype=torch.int64, device=self.device
                )
            torch.stack(
                [_per_channel(value, self.channels, self.device) for value in counts], out=self._pending_counts[row]
            )
        if summary.histogram is not None:
            self._histogram += summary.histogram
        self._size += 1
        self._batches += 1
        if self._size == self.capacity:
            self._fold()

    def stats(self, channel_axis: int | None, q: float) -> TensorStats:
        """The ``TensorStats`` of every batch added so far."""
        self._fold()
        return TensorStats._packed(
            channel_axis,
            q,
            extrema=self._extrema.clone(),
            channel_sums=self._channel_sums.clone(),
            channel_counts=self._channel_counts.clone(),
            histogram=self._histogram.clone(),
            batch_counts=self._batch_counts.clone(),
            batch_range_sum=self._batch_range_sum.clone(),
        )

    def _fold(self) -> None:
        """Add the pending rows to the totals (in place) and empty them."""
        size = self._size
        if not size:
            return
        pending = self._pending[:size].to(torch.float64)  # (batches, field, C)
        channel_min, channel_max, reference = pending[:, 0], pending[:, 1], pending[:, 2]
        uniform = self._uniform_counts[:size]
        if self._pending_counts is None:  # every batch finite (the common case): no count tensors
            has_values = None
            self._channel_counts[0] += sum(count for count in uniform if count is not None)
            range_batches: int | torch.Tensor = size
        else:
            counts = self._pending_counts[:size]
            for row, count in enumerate(uniform):
                if count is not None:  # plain slices: an index_put here costs ~1 ms per fold
                    counts[row, 1:].zero_()
                    counts[row, 0].fill_(count)
            has_values = counts[:, 0] > 0
            self._channel_counts[:3] += counts.sum(0)
            range_batches = has_values.any(1)
        torch.minimum(self._extrema[0], channel_min.amin(0), out=self._extrema[0])
        torch.maximum(self._extrema[1], channel_max.amax(0), out=self._extrema[1])
        if self._with_moments and self._pending_moments is not None:
            self._channel_sums[:2] += self._pending_moments[:size].sum(0)
        else:  # not observed: unknown, and stays so through merges
            self._channel_sums[:2] = float("nan")
        constant = channel_max == channel_min
        with_reference = self._with_reference_rows[:size]
        reference_batches = sum(with_reference)
        if reference_batches:
            counted = reference != 0
            zero_denominator = (reference == 0) & (channel_max != 0)
            if not all(with_reference):  # batches without a reference count towards none of its totals
                taken = torch.tensor(with_reference, device=self.device).unsqueeze(1)
                counted, zero_denominator = counted & taken, zero_denominator & taken
            if has_values is not None:
                counted, zero_denominator = counted & has_values, zero_denominator & has_values
            self._channel_sums[2] += torch.where(counted, channel_max / reference, 0.0).sum(0)
            self._channel_counts[3:5] += torch.stack([counted, zero_denominator]).sum(1)
        self._channel_counts[5] += (constant if has_values is None else constant & has_values).sum(0)
        batch_range = channel_max.amax(1) - channel_min.amin(1)
        if isinstance(range_batches, int):
            self._batch_range_sum += batch_range.sum()
            self._batch_counts += torch.tensor([size, range_batches, reference_batches], device=self.device)
        else:  # batches without a finite value have no range
            self._batch_range_sum += torch.where(range_batches, batch_range, 0.0).sum()
            self._batch_counts[0] += size
            self._batch_counts[1] += range_batches.sum()
            self._batch_counts[2] += reference_batches
        self._size = 0
        self._pending_counts = None


def _per_channel(value: PerChannel, channels: int, device: torch.device) -> torch.Tensor:
    if isinstance(value, int):
        return torch.full((channels,), value, dtype=torch.int64, device=device)
    return value.view(channels)


def summarize_batch(
    batch: torch.Tensor,
    channel_axis: int | None = 1,
    reference_percentile: float = 0.975,
    *,
    scratch: ScratchBuffers | None = None,
    sync_free: bool | None = None,
    percentile: bool = True,
    histogram: bool = True,
    moments: bool = True,
    percentile_sample: int | None = PERCENTILE_SAMPLE,
) -> TensorStats:
    """Stats of one batch, on the batch's device.

    ``channel_axis`` may be negative; a tensor with too few dimensions for it
    is read as unbatched (leading singleton dims are assumed), so a 1-D input
    to a Linear with ``channel_axis=1`` has one channel per feature.
    ``sync_free`` picks the path: False uses a host read to take a cheaper
    route when all values are finite (free on CPU), True never reads device
    values back (default: True off-CPU). Results are identical, except that
    the host-read path sums a finite batch in float32 (~1e-7 relative).
    ``percentile=False`` skips the percentile ratio and ``histogram=False`` the
    histogram (they stay zero): they are the two costly statistics, and a point
    whose rules read neither should not pay for them; ``moments=False`` skips the
    sums and sums of squares (they are NaN). ``percentile_sample``:
    the most values per channel the reference quantile is estimated from
    (None: always exact); see :mod:`qlint.stats.selection`.
    """
    summary = summarize_values(
        batch,
        channel_axis,
        reference_percentile,
        scratch=scratch,
        sync_free=sync_free,
        percentile=percentile,
        histogram=histogram,
        moments=moments,
        percentile_sample=percentile_sample,
    )
    if summary is None:
        return TensorStats.empty(channel_axis, reference_percentile, device=batch.device)
    running = RunningStats(summary.channels, summary.device, capacity=1, dtype=summary.channel_max.dtype)
    running.add(summary)
    return running.stats(channel_axis, reference_percentile)


def update_stats(
    stats: TensorStats,
    batch: torch.Tensor,
    scratch: ScratchBuffers | None = None,
    *,
    percentile: bool = True,
    histogram: bool = True,
    percentile_sample: int | None = PERCENTILE_SAMPLE,
) -> TensorStats:
    """Pure update: ``stats`` followed by one batch (``stats`` is not mutated)."""
    batch_stats = summarize_batch(
        batch,
        stats.channel_axis,
        stats.reference_percentile,
        scratch=scratch,
        percentile=percentile,
        histogram=histogram,
        percentile_sample=percentile_sample,
    )
    return stats.merge(batch_stats)
