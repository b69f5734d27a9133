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
from qlint.stats.batch import histogram_of_key_counts, kernel_view, wanted_rank
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
                 "_summaries", "_latest", "_totals", "_flags", "_key_counts", "_batch_keys", "_batches",
                 "_values", "_range_sum")

    def __init__(self, channel_axis: Optional[int], reference_percentile: float, *, percentile: bool,
                 histogram: bool, expected_channels: Optional[int] = None) -> None:
        self.channel_axis = channel_axis
        self.reference_percentile = reference_percentile
        self.percentile = percentile
        self.histogram = histogram
        self.channels = 0  # the width of the buffers
        self._started = False  # whether a batch was ever folded in: the width is then fixed
        # Two summary buffers used in turn: the one not being written holds the
        # previous batch's selection hints (the kernel reads them while writing).
        self._summaries: Optional[torch.Tensor] = None  # float64 [2, 6, C]
        self._latest: Optional[int] = None  # which buffer holds the latest trusted summary
        self._totals: Optional[torch.Tensor] = None  # float64 [5, C]
        self._flags: Optional[torch.Tensor] = None  # int64 [3, C]
        self._key_counts: Optional[torch.Tensor] = None  # int64 [threads, 512]
        self._batch_keys: Optional[torch.Tensor] = None  # a batch's key counts, kept only once trusted
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
        values = kernel_view(batch.detach(), self.channel_axis, scratch)
        outer, channels, inner = values.shape
        if channels != self.channels:
            if self._started:
                return False
            self._allocate(channels)
        width = outer * inner
        wanted = wanted_rank(width, self.reference_percentile) if self.percentile else None
        target = 0 if self._latest is None else 1 - self._latest
        hint = None if self._latest is None or wanted is None else self._summaries[self._latest, kernel.NEXT_HINT]
        batch_keys = None
        if self.histogram:
            batch_keys = self._batch_keys
            batch_keys.zero_()
        out = self._summaries[target]
        if not kernel.summarize_into(values, wanted, out, hint=hint, key_counts=batch_keys):
            return False
        self._latest = target
        self._started = True
        self._range_sum += kernel.fold(out, self._totals, self._flags, wanted is not None)
        self._values += width
        self._batches += 1
        if batch_keys is not None:
            self._key_counts += batch_keys
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
        counts[3:] = self._flags
        histogram = (histogram_of_key_counts(self._key_counts.sum(0)) if self._key_counts is not None
                     else torch.zeros(HISTOGRAM_SHAPE, dtype=torch.int64))
        return TensorStats._packed(
            self.channel_axis, q,
            extrema=self._totals[:2].clone(),
            channel_sums=self._totals[2:].clone(),
            channel_counts=counts,
            histogram=histogram,
            # every batch here has values, so each counts towards the batch range
            batch_counts=torch.tensor([self._batches, self._batches], dtype=torch.int64),
            batch_range_sum=torch.tensor(self._range_sum, dtype=torch.float64),
        )

    def _allocate(self, channels: int) -> None:
        self.channels = channels
        # One mapping of its own, outside malloc's heap (see qlint.stats.memory).
        floats = off_heap_empty(17 * channels, torch.float64)
        self._summaries = floats[: 12 * channels].view(2, 6, channels)
        self._totals = floats[12 * channels :].view(5, channels)
        threads = max(torch.get_num_threads(), 1) if self.histogram else 0
        counts = off_heap_empty(3 * channels + 2 * threads * kernel.HISTOGRAM_KEYS, torch.int64)
        self._flags = counts[: 3 * channels].view(3, channels)
        if self.histogram:
            keys = counts[3 * channels :].view(2, threads, kernel.HISTOGRAM_KEYS)
            self._key_counts, self._batch_keys = keys[0], keys[1]
        self._clear_totals()

    def _clear_totals(self) -> None:
        self._batches = 0
        self._values = 0  # per channel: every channel of a batch has the same count
        self._range_sum = 0.0
        if self._totals is None:
            return
        self._totals[0].fill_(float("inf"))
        self._totals[1].fill_(float("-inf"))
        self._totals[2:].zero_()
        self._flags.zero_()
        if self._key_counts is not None:
            self._key_counts.zero_()
