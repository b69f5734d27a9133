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

from qlint.stats import kernel
from qlint.stats.accumulator import ScratchBuffers, TensorStats
from qlint.stats.batch import SummaryChunk, channel_count, summarize_values
from qlint.stats.stream import KernelStream

_thread_local = threading.local()
# Batches off the compiled path (other devices or dtypes, NaN/Inf): their
# summaries are folded into the running stats this many at a time, so the
# fold's bookkeeping (ratios, flags, merge) costs once per chunk, and
# a chunk holds only a few per-channel vectors per batch, never activations.
# 8 already amortizes the fold; more would only grow the chunk buffers
# (8 rows x 8 bytes per channel and batch slot, for every observer).
FOLD_EVERY = 8


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
        expected_channels: the channel count the first batch will likely have
            (from shape propagation); lets the observer allocate its buffers
            before calibration rather than during its first forward pass.

    Non-tensors, non-floating tensors and empty tensors pass through ignored.
    Statistics live on the device of the tensors observed; the forward reads
    device values back only on CPU, where that costs nothing.
    Work buffers are shared by all observers of a thread (see
    :func:`thread_scratch_buffers`).
    """

    def __init__(self, channel_axis: Optional[int] = 1, reference_percentile: float = 0.975, *,
                 percentile: bool = True, histogram: bool = True, expected_channels: Optional[int] = None):
        super().__init__()
        self.channel_axis = channel_axis
        self.reference_percentile = reference_percentile
        self.percentile = percentile
        self.histogram = histogram
        self._folded = TensorStats.empty(channel_axis, reference_percentile)
        # float32 CPU batches: folded as they arrive (see qlint.stats.stream)
        self._stream: Optional[KernelStream] = None
        if expected_channels and kernel.available():  # buffers made now, not mid-forward
            self._stream = self._new_stream(expected_channels)
        # every other batch: summaries kept in a chunk, folded FOLD_EVERY at a time
        self._chunk: Optional[SummaryChunk] = None

    @property
    def stats(self) -> TensorStats:
        """Statistics of every batch observed so far."""
        self._fold()
        return self._folded

    @stats.setter
    def stats(self, stats: TensorStats) -> None:
        self._stream = None
        self._chunk = None
        self._folded = stats

    def forward(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel() > 0:
            self._observe(value)
        return value

    def _observe(self, value: torch.Tensor) -> None:
        scratch = thread_scratch_buffers()
        if self._stream is not None and self._stream.add(value, scratch):
            return  # the common case, first: a stream refuses a batch of another width
        width, channels = self._width(), channel_count(value.shape, self.channel_axis)
        if width and channels != width:
            raise ValueError(f"channel count changed from {width} to {channels}")
        if self._stream is None and value.dtype == torch.float32 and value.device.type == "cpu" and kernel.available():
            self._stream = self._new_stream(None)
            if self._stream.add(value, scratch):
                return
        # The compiled path refused this batch (or does not apply): the tensor-op paths take it.
        summary = summarize_values(value, self.channel_axis, self.reference_percentile, scratch=scratch,
                                   percentile=self.percentile, histogram=self.histogram, use_kernel=False)
        if self._chunk is not None and not self._chunk.accepts(summary):
            self._fold()  # full, or the data moved to another device
        if self._chunk is None or self._chunk.device != summary.device:
            self._chunk = SummaryChunk(FOLD_EVERY, summary.channels, summary.device)
        self._chunk.add(summary)

    def _new_stream(self, expected_channels: Optional[int]) -> KernelStream:
        return KernelStream(self.channel_axis, self.reference_percentile, percentile=self.percentile,
                            histogram=self.histogram, expected_channels=expected_channels)

    def _width(self) -> int:
        """Channels seen so far (0 before the first batch)."""
        if self._stream is not None and self._stream.observed_channels:
            return self._stream.observed_channels
        if self._chunk is not None:
            return self._chunk.channels
        return self._folded.num_channels

    def _fold(self) -> None:
        if self._stream is not None and len(self._stream):
            self._folded = self._folded.merge(self._stream.take())
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
