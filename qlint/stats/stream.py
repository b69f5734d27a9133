"""``KernelStream``: a stream's statistics folded batch by batch on the compiled path.

An observer sees every batch of a calibration run. For the batches the
compiled kernel takes (finite float32 CPU tensors of moderate magnitude), the
kernel writes the batch's per-channel summary into a buffer this object owns
and a compiled fold adds it to running float64 totals at once. Nothing is
allocated per batch and nothing is left to fold later: folding summaries in
chunks with tensor ops cost ~60 small ops per chunk and observer, which on the
encoder benchmark was a tenth of the plain forward time.

The totals are the same arithmetic as :class:`~qlint.stats.batch.SummaryChunk`
(min/max, float64 sums, ``max / m-th largest`` ratios, flags, batch ranges);
only the order of the float64 additions differs. Batches the kernel refuses
go to the caller's general path, and :meth:`take` is merged with those.
"""

from __future__ import annotations

from typing import Optional

import torch

from qlint.stats import kernel
from qlint.stats.accumulator import HISTOGRAM_SHAPE, ScratchBuffers, TensorStats
from qlint.stats.batch import histogram_of_key_counts, in_place_layout, kernel_view, wanted_rank
from qlint.stats.memory import off_heap_empty


class KernelStream:
    """Running statistics of the batches of one stream that the compiled kernel takes.

    Holds ~20 float64 values per channel, whatever the number of batches. Use
    only where :func:`qlint.stats.kernel.available` is True.

    ``expected_channels``: allocate the buffers now rather than during the first
    batch. Objects that live on, allocated in the middle of a forward pass, end
    up among that pass's activations and the heap grows around them (measured
    on the encoder benchmark: +50 MiB resident in about half the runs); a
    first batch of another width still works (the buffers are re-made)."""

    __slots__ = ("channel_axis", "reference_percentile", "percentile", "histogram", "channels", "_started",
                 "_buffers", "_batches", "_values", "_range_sum")

    def __init__(self, channel_axis: Optional[int], reference_percentile: float, *, percentile: bool,
                 histogram: bool, expected_channels: Optional[int] = None) -> None:
        self.channel_axis = channel_axis
        self.reference_percentile = reference_percentile
        self.percentile = percentile
        self.histogram = histogram
        self.channels = 0  # the width of the buffers
        self._started = False  # whether a batch was ever folded in: the width is then fixed
        self._buffers: Optional[kernel.StreamBuffers] = None
        self._clear_totals()
        if expected_channels:
            self._allocate(expected_channels)

    def __len__(self) -> int:
        return self._batches

    @property
    def observed_channels(self) -> int:
        """The width of the batches folded in so far (0 before the first)."""
        return self.channels if self._started else 0

    def add(self, batch: torch.Tensor, scratch: ScratchBuffers) -> bool:
        """Fold one non-empty floating batch in; False when the kernel does not take it (other device
        or dtype, NaN/Inf, extreme magnitudes, another width): the caller must then summarize it."""
        if batch.dtype != torch.float32 or batch.device.type != "cpu" or not kernel.available():
            return False
        # Called for every observed tensor of every batch: the common case (a contiguous
        # batch) is read where it lies, with no view made and no check repeated.
        layout = in_place_layout(batch, self.channel_axis)
        if layout is None:
            values = kernel_view(batch.detach(), self.channel_axis, scratch)
            layout, address = tuple(values.shape), values.data_ptr()
        else:
            address = batch.data_ptr()
        outer, channels, inner = layout
        if channels != self.channels:
            if self._started:
                return False
            self._allocate(channels)
        width = outer * inner
        m = wanted_rank(width, self.reference_percentile) if self.percentile else None
        batch_range = self._buffers.add_at(address, outer, channels, inner, m)
        if batch_range is None:
            return False
        self._started = True
        self._range_sum += batch_range
        self._values += width
        self._batches += 1
        return True

    def take(self) -> TensorStats:
        """Statistics of the batches added since the last ``take`` (which are then forgotten)."""
        stats = self._stats()
        self._clear_totals()
        return stats

    def _stats(self) -> TensorStats:
        q = self.reference_percentile
        if not self._batches:
            return TensorStats.empty(self.channel_axis, q, self.channels)
        counts = torch.zeros(6, self.channels, dtype=torch.int64)
        counts[0] = self._values  # no NaN/Inf (rows 1, 2) reach this path
        buffers = self._buffers
        counts[3:] = buffers.flags
        histogram = (histogram_of_key_counts(buffers.key_counts.sum(0)) if buffers.key_counts is not None
                     else torch.zeros(HISTOGRAM_SHAPE, dtype=torch.int64))
        return TensorStats._packed(
            self.channel_axis, q,
            extrema=buffers.totals[:2].clone(),
            channel_sums=buffers.totals[2:].clone(),
            channel_counts=counts,
            histogram=histogram,
            # every batch here has values, so each counts towards the batch range
            batch_counts=torch.tensor([self._batches, self._batches], dtype=torch.int64),
            batch_range_sum=torch.tensor(self._range_sum, dtype=torch.float64),
        )

    def _allocate(self, channels: int) -> None:
        self.channels = channels
        # Mappings of their own, outside malloc's heap (see qlint.stats.memory).
        self._buffers = kernel.StreamBuffers(channels, histogram=self.histogram, allocate=off_heap_empty)
        self._clear_totals()

    def _clear_totals(self) -> None:
        self._batches = 0
        self._values = 0  # per channel: every channel of a batch has the same count
        self._range_sum = 0.0
        if self._buffers is not None:
            self._buffers.clear()
