"""Safe front end of the optional compiled statistics kernel (``_channel_kernel.c``).

:func:`summarize_channels` reads one contiguous float32 CPU batch, viewed as
``(outer, channels, inner)``, once (twice for a selection without a hint), and
returns per-channel min, max, sum and sum of squares, optionally the exact
m-th largest value and the (sign, exponent) key counts. Work is split over
``torch.get_num_threads()`` threads (the kernel releases the GIL), by channel
ranges, or by value ranges for a single channel without selection.

Everything the kernel is given is checked here: dtype, device, contiguity,
sizes, and the output buffers it writes, which this module allocates itself.
When the extension was not built (no C compiler at install time),
:func:`available` is False and callers use their tensor-op path, which gives
the same statistics.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import threading
from typing import Optional

import torch

try:
    from qlint.stats import _channel_kernel as _compiled
except ImportError:  # built optionally: see setup.py
    _compiled = None

HISTOGRAM_KEYS = 512
# Below this many values per thread, handing work to a second thread costs more than it saves.
MIN_VALUES_PER_THREAD = 1 << 17
# Rows of KernelSummary.packed
MIN, MAX, SUM, SUM_OF_SQUARES, KTH_LARGEST = range(5)

_pool_lock = threading.Lock()
_pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
_pool_workers = 0


@dataclasses.dataclass(frozen=True)
class KernelSummary:
    """Per-channel results of one batch.

    ``packed`` is float64 ``[5, channels]``: min, max, sum, sum of squares and
    the m-th largest value (that row is NaN without a selection). ``trusted``
    is False when some channel holds NaN/Inf or a magnitude outside
    [1e-15, 1e15], where the float32 partial sums of squares lose accuracy;
    callers then use an exact general path instead."""

    packed: torch.Tensor
    trusted: bool
    key_counts: Optional[torch.Tensor]  # int64 [512]: counts of (float32 bits >> 23) + 256
    next_hint: Optional[torch.Tensor]  # float32 [channels]: guesses that speed up the next batch's selection


def available() -> bool:
    """Whether the compiled kernel was built for this interpreter."""
    return _compiled is not None


def summarize_channels(values: torch.Tensor, m: Optional[int], histogram: bool = False,
                       threads: Optional[int] = None, hint: Optional[torch.Tensor] = None) -> KernelSummary:
    """Per-channel summaries of a contiguous float32 CPU tensor of shape ``(outer, channels, inner)``.

    ``m``: also select each channel's m-th largest value (1 <= m <= outer * inner); None skips it.
    ``hint``: the ``next_hint`` of an earlier batch of the same stream (float32, one per channel).
    It lets the selection read the data once instead of twice; results are exact with or
    without it, whatever its values.
    """
    if _compiled is None:
        raise RuntimeError("qlint's compiled statistics kernel is not built; check kernel.available() first")
    if values.dtype != torch.float32 or values.device.type != "cpu" or values.dim() != 3:
        raise ValueError(f"need a 3-D float32 CPU tensor, got {values.dim()}-D {values.dtype} on {values.device}")
    if not values.is_contiguous():
        raise ValueError("need a contiguous tensor")
    outer, channels, inner = values.shape
    width = outer * inner
    if width == 0 or channels == 0:
        raise ValueError(f"need a non-empty tensor, got shape {tuple(values.shape)}")
    if m is not None and not 1 <= m <= width:
        raise ValueError(f"m must be in [1, {width}], got {m}")
    if hint is not None:
        if m is None:
            raise ValueError("a hint needs m")
        if hint.dtype != torch.float32 or hint.device.type != "cpu" or tuple(hint.shape) != (channels,):
            raise ValueError(f"hint must be float32 of shape ({channels},) on the CPU")
        hint = hint.contiguous()
    threads = threads if threads is not None else torch.get_num_threads()
    parts = max(1, min(threads, values.numel() // MIN_VALUES_PER_THREAD))
    if channels == 1 and m is None and outer == 1 and parts > 1:
        return _summarize_split_values(values, histogram, parts)
    parts = min(parts, channels)
    packed = torch.empty(5, channels, dtype=torch.float64)
    if m is None:
        packed[KTH_LARGEST].fill_(float("nan"))
    next_hint = torch.empty(channels, dtype=torch.float32) if m is not None else None
    key_counts = torch.zeros(parts, HISTOGRAM_KEYS, dtype=torch.int64) if histogram else None
    address, packed_address = values.data_ptr(), packed.data_ptr()
    hint_address = hint.data_ptr() if hint is not None else 0
    next_hint_address = next_hint.data_ptr() if next_hint is not None else 0
    bounds = [channels * part // parts for part in range(parts + 1)]
    jobs = [(address, outer, channels, inner, m or 0, bounds[part], bounds[part + 1], packed_address, hint_address,
             next_hint_address, key_counts[part].data_ptr() if key_counts is not None else 0)
            for part in range(parts)]
    trusted = _run_jobs(jobs)
    return KernelSummary(packed, trusted, key_counts.sum(0) if key_counts is not None else None, next_hint)


def _summarize_split_values(values: torch.Tensor, histogram: bool, parts: int) -> KernelSummary:
    """One channel, no selection: each thread summarizes a slice of the values as a
    one-channel array with its own [5] output row; the rows are then combined."""
    flat = values.view(-1)
    rows = torch.empty(parts, 5, dtype=torch.float64)
    key_counts = torch.zeros(parts, HISTOGRAM_KEYS, dtype=torch.int64) if histogram else None
    bounds = [flat.numel() * part // parts for part in range(parts + 1)]
    element = flat.element_size()
    trusted = _run_jobs([(flat.data_ptr() + bounds[part] * element, 1, 1, bounds[part + 1] - bounds[part], 0, 0, 1,
                          rows[part].data_ptr(), 0, 0, key_counts[part].data_ptr() if key_counts is not None else 0)
                         for part in range(parts)])
    packed = torch.stack([rows[:, MIN].amin(), rows[:, MAX].amax(), rows[:, SUM].sum(), rows[:, SUM_OF_SQUARES].sum(),
                          torch.tensor(float("nan"), dtype=torch.float64)]).reshape(5, 1)
    return KernelSummary(packed, trusted, key_counts.sum(0) if key_counts is not None else None, None)


def _run_jobs(jobs: list[tuple]) -> bool:
    """Run the kernel on every job (the first in this thread); True when all parts are trusted."""
    if len(jobs) == 1:
        return _compiled.summarize(*jobs[0])
    pool = _worker_pool(len(jobs) - 1)
    futures = [pool.submit(_compiled.summarize, *job) for job in jobs[1:]]
    trusted = _compiled.summarize(*jobs[0])
    for future in futures:
        trusted = future.result() and trusted
    return trusted


def _worker_pool(workers: int) -> concurrent.futures.ThreadPoolExecutor:
    global _pool, _pool_workers
    with _pool_lock:
        if _pool is None or _pool_workers < workers:
            if _pool is not None:
                _pool.shutdown(wait=False)
            _pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="qlint-stats")
            _pool_workers = workers
        return _pool


def _forget_pool_after_fork() -> None:
    # A forked child inherits the pool object but none of its threads.
    global _pool, _pool_workers
    _pool, _pool_workers = None, 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool_after_fork)
