"""Streaming, mergeable calibration statistics (qlint's own ModelReport observer)."""

from qlint.stats.accumulator import HISTOGRAM_SHAPE, ScratchBuffers, TensorStats, histogram_bin_edges
from qlint.stats.distributed import all_reduce_stats
from qlint.stats.fold import summarize_batch, update_stats
from qlint.stats.observer import StatsObserver, thread_scratch_buffers
from qlint.stats.selection import PERCENTILE_SAMPLE

__all__ = [
    "HISTOGRAM_SHAPE",
    "PERCENTILE_SAMPLE",
    "ScratchBuffers",
    "StatsObserver",
    "TensorStats",
    "all_reduce_stats",
    "histogram_bin_edges",
    "summarize_batch",
    "thread_scratch_buffers",
    "update_stats",
]
