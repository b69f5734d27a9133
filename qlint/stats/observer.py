"""``StatsObserver``: an identity module that accumulates :class:`TensorStats`.

Insert it wherever calibration statistics are needed (before a conv, after a
linear, ...). It returns its input unchanged -- the very same object -- and
never records autograd history.
"""

from __future__ import annotations

import threading
from typing import Any, Optional

import torch
from torch import nn

from qlint.stats.accumulator import ScratchBuffers, TensorStats
from qlint.stats.batch import SummaryChunk, summarize_values

_thread_local = threading.local()
# Per-batch summaries are folded into the running stats this many at a time:
# the fold's bookkeeping (ratios, flags, merge) then costs once per chunk, and
# a chunk holds only a few per-channel vectors per batch, never activations.
# 8 already amortizes the fold; more would only grow the chunk buffers
# (8 rows x 8 bytes per channel and batch slot, for every observer).
FOLD_EVERY = 8


class _SelectionHint:
    """The latest selection hint of a stream, in a buffer of its own.

    Copied rather than referenced: the summary it comes from is a per-batch
    allocation, and keeping one alive until the next batch, among that batch's
    large temporaries, fragments the heap (resident memory grows)."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value: Optional[torch.Tensor] = None

    def keep(self, hint: Optional[torch.Tensor]) -> None:
        if hint is None:
            self.value = None
        elif self.value is None or self.value.shape != hint.shape or self.value.device != hint.device:
            self.value = hint.clone()
        else:
            self.value.copy_(hint)


def thread_scratch_buffers() -> ScratchBuffers:
    """One :class:`ScratchBuffers` per thread, shared by all observers of that thread.

    Its buffers grow to the largest batch observed; ``.clear()`` frees them."""
    buffers = getattr(_thread_local, "buffers", None)
    if buffers is None:
        buffers = _thread_local.buffers = ScratchBuffers()
    return buffers


class StatsObserver(nn.Module):
    """Identity module that folds every floating tensor it sees into ``self.stats``.

    Args:
        channel_axis: axis holding channels (``None``: whole tensor is one
            channel). Inputs with too few dims are read as unbatched.
        reference_percentile: the ``q`` of the percentile ratio
            ``max / quantile(q)`` (torch's OutlierDetector default 0.975).
        percentile, histogram: compute these two costly statistics (when off
            they stay zero; every other statistic is always computed).

    Non-tensors, non-floating tensors and empty tensors pass through ignored.
    Statistics live on the device of the tensors observed; the forward reads
    device values back only on CPU, where that costs nothing.
    Work buffers are shared by all observers of a thread (see
    :func:`thread_scratch_buffers`).
    """

    def __init__(self, channel_axis: Optional[int] = 1, reference_percentile: float = 0.975, *,
                 percentile: bool = True, histogram: bool = True):
        super().__init__()
        self.channel_axis = channel_axis
        self.reference_percentile = reference_percentile
        self.percentile = percentile
        self.histogram = histogram
        self._folded = TensorStats.empty(channel_axis, reference_percentile)
        self._chunk: Optional[SummaryChunk] = None
        # Not a statistic: guesses that speed up the next batch's percentile. A plain
        # holder object, so the per-batch update skips nn.Module.__setattr__.
        self._hint = _SelectionHint()

    @property
    def stats(self) -> TensorStats:
        """Statistics of every batch observed so far."""
        self._fold()
        return self._folded

    @stats.setter
    def stats(self, stats: TensorStats) -> None:
        self._chunk = None
        self._folded = stats

    def forward(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel() > 0:
            summary = summarize_values(value, self.channel_axis, self.reference_percentile,
                                       scratch=thread_scratch_buffers(), percentile=self.percentile,
                                       histogram=self.histogram, selection_hint=self._hint.value)
            self._hint.keep(summary.selection_hint)
            width = self._chunk.channels if self._chunk is not None else self._folded.num_channels
            if width and summary.channels != width:
                raise ValueError(f"channel count changed from {width} to {summary.channels}")
            if self._chunk is not None and not self._chunk.accepts(summary):
                self._fold()  # full, or the data moved to another device
            if self._chunk is None or self._chunk.device != summary.device:
                self._chunk = SummaryChunk(FOLD_EVERY, summary.channels, summary.device)
            self._chunk.add(summary)
        return value

    def _fold(self) -> None:
        if self._chunk is not None and len(self._chunk):
            self._folded = self._folded.merge(self._chunk.stats(self.channel_axis, self.reference_percentile))
            self._chunk.clear()

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
