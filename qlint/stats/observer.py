"""``StatsObserver``: an identity module that accumulates :class:`TensorStats`.

Insert it wherever calibration statistics are needed (before a conv, after a
linear, ...). It returns its input unchanged -- the very same object -- and
never records autograd history.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch
from torch import nn

from qlint.stats.accumulator import ScratchBuffers, TensorStats
from qlint.stats.batch import BatchSummary, batch_reader, summary_dtype
from qlint.stats.fold import RunningStats
from qlint.stats.selection import PERCENTILE_EVERY, PERCENTILE_SAMPLE, selects_reference

_thread_local = threading.local()


def thread_scratch_buffers() -> ScratchBuffers:
    """One :class:`ScratchBuffers` per thread, shared by all observers of that thread.

    Its buffers grow to the largest batch observed; ``.clear()`` frees them."""
    buffers = getattr(_thread_local, "buffers", None)
    if buffers is None:
        buffers = _thread_local.buffers = ScratchBuffers()
    return buffers


# Observers at several points that see one tensor (the shared input of a transformer's q, k
# and v projections, observed before each) summarize it once: each thread keeps the last
# summary made with each observer setting. One per setting, not a longer history: the
# summaries are small tensors, and every one kept while the next activations are allocated
# splits the allocator's free space (a ResNet-18's calibration peak RSS rose by ~40 MiB
# with the last 8 kept).
def _recent_summary(value: torch.Tensor, settings: tuple) -> BatchSummary | None:
    """The summary made for this very tensor (same object, unchanged since) with these settings, if last."""
    recent = getattr(_thread_local, "recent", None)
    entry = recent.get(settings) if recent is not None else None
    # The weak reference tells a live tensor from a new one at a reused id; the version
    # counter tells an in-place change.
    if entry is not None and entry[0]() is value and entry[1] == value._version:
        return entry[2]
    return None


def _remember_summary(value: torch.Tensor, settings: tuple, summary: BatchSummary) -> None:
    recent = getattr(_thread_local, "recent", None)
    if recent is None:
        recent = _thread_local.recent = {}
    recent[settings] = (weakref.ref(value), value._version, summary)


class StatsObserver(nn.Module):
    """Identity module that folds every floating tensor it sees into ``self.stats``.

    Args:
        channel_axis: axis holding channels (``None``: whole tensor is one
            channel). Inputs with too few dims are read as unbatched.
        reference_percentile: the ``q`` of the percentile ratio
            ``max / quantile(q)`` (torch's OutlierDetector default 0.975).
        percentile, histogram: compute these two costly statistics (when off
            they stay zero).
        moments: compute per-channel sums and sums of squares (mean and
            variance; when off they are NaN: unknown). Min, max, ranges and
            counts are always computed.
        expected_channels: the channel count the first batch will likely have
            (from shape propagation); the fold buffers are then allocated now,
            before calibration, rather than in the middle of its first forward
            pass, where a long-lived block among the activations makes the heap
            grow around it.
        percentile_sample: the most values per channel and batch the reference
            quantile is selected from (None: all of them, exact); see
            :mod:`qlint.stats.selection`.
        percentile_every: a point of more than 32 channels selects its reference
            quantile on the first batch and every ``percentile_every``-th after it (1,
            the default: every batch, as torch); see :mod:`qlint.stats.selection`.

    Non-tensors, non-floating tensors and empty tensors pass through ignored.
    Statistics live on the device of the tensors observed; the forward reads
    device values back only on CPU, where that costs nothing. Work buffers are
    shared by all observers of a thread (see :func:`thread_scratch_buffers`).
    """

    def __init__(
        self,
        channel_axis: int | None = 1,
        reference_percentile: float = 0.975,
        *,
        percentile: bool = True,
        histogram: bool = True,
        moments: bool = True,
        expected_channels: int | None = None,
        percentile_sample: int | None = PERCENTILE_SAMPLE,
        percentile_every: int = PERCENTILE_EVERY,
    ):
        super().__init__()
        self.channel_axis = channel_axis
        self.reference_percentile = reference_percentile
        self.percentile = percentile
        self.histogram = histogram
        self.moments = moments
        self.percentile_sample = percentile_sample
        if percentile_every < 1:
            raise ValueError(f"percentile_every must be at least 1, got {percentile_every}")
        self.percentile_every = percentile_every
        # Stats given through the setter (a saved state), then the batches observed since.
        self._base = TensorStats.empty(channel_axis, reference_percentile)
        self._base_batches = 0
        self._running: RunningStats | None = RunningStats(expected_channels, "cpu") if expected_channels else None

    @property
    def stats(self) -> TensorStats:
        """Statistics of every batch observed so far."""
        if self._running is None or not len(self._running):
            return self._base
        return self._base.merge(self._running.stats(self.channel_axis, self.reference_percentile))

    @stats.setter
    def stats(self, stats: TensorStats) -> None:
        self._running = None
        self._base = stats
        self._base_batches = int(stats.batches)

    def _batches_observed(self) -> int:
        """Batches since the last reset (they decide which batches select the reference). Counted
        by the stream rather than a counter here: every attribute set on a module costs a
        microsecond of ``nn.Module.__setattr__``."""
        return self._base_batches + (len(self._running) if self._running is not None else 0)

    def forward(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel() > 0:
            if value.is_inference():
                # Statistics made under inference_mode would be inference tensors, which
                # cannot be updated in place once the mode is left: make them normal ones.
                # An inference tensor has no version counter to tell an in-place change,
                # so its summary is never reused.
                with torch.inference_mode(False):
                    self._observe(value, reusable=False)
            else:
                self._observe(value, reusable=True)
        return value

    def _observe(self, value: torch.Tensor, reusable: bool) -> None:
        # The summary reuse is keyed by the settings, not the reader (which depends on the shape
        # too): the entry kept is then always the last one computed with them, whose row in its
        # stream no later batch has overwritten.
        settings = (
            self.channel_axis,
            self.reference_percentile,
            self.percentile,
            self.histogram,
            self.moments,
            self.percentile_sample,
        )
        reader = batch_reader(value.shape, *settings)
        if self.percentile and not selects_reference(self._batches_observed(), reader.channels, self.percentile_every):
            settings = settings[:2] + (False,) + settings[3:]
            reader = batch_reader(value.shape, *settings)
        running = self._running
        channels = reader.channels
        width = running.channels if running is not None and len(running) else self._base.num_channels
        if width and channels != width:
            raise ValueError(f"channel count changed from {width} to {channels}")
        summary = _recent_summary(value, settings) if reusable else None
        row = None
        if summary is None:
            if running is not None and running.fits(channels, summary_dtype(value.dtype), value.device):
                row = running.next_row()  # the finite path writes the summary where the stream keeps it
            summary = reader.summarize(value, thread_scratch_buffers(), row=row)
            if reusable:
                _remember_summary(value, settings, summary)
        # A summary written into this stream's row fits it; another observer's may not.
        if running is None or (row is None and not running.accepts(summary)):
            # First batch, another device, dtype or width than expected: start a stream there.
            self.stats = self.stats
            running = self._running = RunningStats(summary.channels, summary.device, dtype=summary.channel_max.dtype)
        running.add(summary)

    def reset(self) -> None:
        """Forget everything observed so far."""
        self.stats = TensorStats.empty(self.channel_axis, self.reference_percentile)

    # Statistics travel with ``state_dict()`` so a calibrated model can be saved.
    def get_extra_state(self) -> dict[str, torch.Tensor]:
        return self.stats.to_state()

    def set_extra_state(self, state: dict[str, torch.Tensor]) -> None:
        stats = TensorStats.from_state(state)
        if stats.channel_axis != self.channel_axis or stats.reference_percentile != self.reference_percentile:
            raise ValueError(
                "saved stats were taken with "
                f"channel_axis={stats.channel_axis}, reference_percentile={stats.reference_percentile}; "
                f"this observer has channel_axis={self.channel_axis}, "
                f"reference_percentile={self.reference_percentile}"
            )
        self.stats = stats

    def extra_repr(self) -> str:
        return f"channel_axis={self.channel_axis}, reference_percentile={self.reference_percentile}"
