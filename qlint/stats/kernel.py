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
# Below this many values per thread, handing work to another thread costs more than it saves
# (measured: a pool hand-off is ~50 us; the kernel reads ~4 values/ns without a selection).
MIN_VALUES_PER_THREAD = 1 << 18
MIN_VALUES_PER_THREAD_WITHOUT_SELECTION = 1 << 21
# Rows of KernelSummary.packed
MIN, MAX, SUM, SUM_OF_SQUARES, KTH_LARGEST, NEXT_HINT = range(6)

_pool_lock = threading.Lock()
_pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
_pool_workers = 0


@dataclasses.dataclass(frozen=True)
class KernelSummary:
    """Per-channel results of one batch.

    ``packed`` is float64 ``[6, channels]``: min, max, sum, sum of squares, the
    m-th largest value and a hint for the next batch (both NaN without a
    selection). ``trusted``
    is False when some channel holds NaN/Inf or a magnitude outside
    [1e-15, 1e15], where the float32 partial sums of squares lose accuracy;
    callers then use an exact general path instead."""

    packed: torch.Tensor
    trusted: bool
    key_counts: Optional[torch.Tensor]  # int64 [512]: counts of (float32 bits >> 23) + 256
    selected: bool  # whether the m-th largest values (and a next hint) were computed

    @property
    def next_hint(self) -> Optional[torch.Tensor]:
        """float64 [channels]: guesses that speed up the next batch's selection (None without one)."""
        return self.packed[NEXT_HINT] if self.selected else None


def available() -> bool:
    """Whether the compiled kernel was built for this interpreter."""
    return _compiled is not None


def summarize_channels(values: torch.Tensor, m: Optional[int], histogram: bool = False,
                       threads: Optional[int] = None, hint: Optional[torch.Tensor] = None) -> KernelSummary:
    """Per-channel summaries of a contiguous float32 CPU tensor of shape ``(outer, channels, inner)``.

    ``m``: also select each channel's m-th largest value (1 <= m <= outer * inner); None skips it.
    ``hint``: the ``next_hint`` of an earlier batch of the same stream (one per channel).
    It lets the selection read the data once instead of twice; results are exact with or
    without it, whatever its values.
    """
    channels = values.shape[1] if values.dim() == 3 else 0
    packed = torch.empty(6, max(channels, 1), dtype=torch.float64)
    threads = threads if threads is not None else torch.get_num_threads()
    key_counts = torch.zeros(max(threads, 1), HISTOGRAM_KEYS, dtype=torch.int64) if histogram else None
    trusted = summarize_into(values, m, packed, hint=hint, key_counts=key_counts, threads=threads)
    return KernelSummary(packed, trusted, key_counts.sum(0) if key_counts is not None else None, m is not None)


def summarize_into(values: torch.Tensor, m: Optional[int], out: torch.Tensor, *,
                   hint: Optional[torch.Tensor] = None, key_counts: Optional[torch.Tensor] = None,
                   threads: Optional[int] = None) -> bool:
    """:func:`summarize_channels` into buffers the caller keeps; returns ``trusted``.

    ``out``: float64 ``[6, channels]``, overwritten (rows as ``KernelSummary.packed``).
    ``key_counts``: int64 ``[k, 512]``, *added to* (at most k threads then take part).
    ``hint`` must not share memory with ``out``."""
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
    _check_buffer("out", out, (6, channels), torch.float64)
    if key_counts is not None:
        _check_buffer("key_counts", key_counts, (key_counts.shape[0], HISTOGRAM_KEYS), torch.int64)
        if key_counts.shape[0] < 1:
            raise ValueError("key_counts needs at least one row")
    if hint is not None:
        if m is None:
            raise ValueError("a hint needs m")
        if hint.device.type != "cpu" or tuple(hint.shape) != (channels,):
            raise ValueError(f"hint must have shape ({channels},) on the CPU")
        if hint.dtype != torch.float64 or not hint.is_contiguous():
            hint = hint.to(torch.float64).contiguous()
        if _overlaps(hint, out):
            raise ValueError("hint and out must not share memory")
    threads = threads if threads is not None else torch.get_num_threads()
    per_thread = MIN_VALUES_PER_THREAD if m is not None else MIN_VALUES_PER_THREAD_WITHOUT_SELECTION
    parts = max(1, min(threads, values.numel() // per_thread, key_counts.shape[0] if key_counts is not None else threads))
    if channels == 1 and m is None and outer == 1 and parts > 1:
        return _summarize_split_values(values, out, key_counts, parts)
    parts = min(parts, channels)
    address, out_address = values.data_ptr(), out.data_ptr()
    hint_address = hint.data_ptr() if hint is not None else 0
    bounds = [channels * part // parts for part in range(parts + 1)]
    return _run_jobs([(address, outer, channels, inner, m or 0, bounds[part], bounds[part + 1], out_address,
                       hint_address, key_counts[part].data_ptr() if key_counts is not None else 0)
                      for part in range(parts)])


def fold(summary: torch.Tensor, totals: torch.Tensor, flags: torch.Tensor, with_ratio: bool) -> float:
    """Add one trusted summary (``out`` of :func:`summarize_into`) to running totals; returns the
    batch's range over all channels. ``totals``: float64 ``[5, C]`` (min, max, sum, sum of squares,
    sum of max / m-th largest); ``flags``: int64 ``[3, C]`` (ratio batches, zero-quantile batches,
    constant batches). The ratio rows are untouched when ``with_ratio`` is False."""
    if _compiled is None:
        raise RuntimeError("qlint's compiled statistics kernel is not built; check kernel.available() first")
    channels = summary.shape[-1]
    _check_buffer("summary", summary, (6, channels), torch.float64)
    _check_buffer("totals", totals, (5, channels), torch.float64)
    _check_buffer("flags", flags, (3, channels), torch.int64)
    return _compiled.fold(summary.data_ptr(), channels, totals.data_ptr(), flags.data_ptr(), with_ratio)


def _check_buffer(name: str, buffer: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    if (tuple(buffer.shape) != shape or buffer.dtype != dtype or buffer.device.type != "cpu"
            or not buffer.is_contiguous()):
        raise ValueError(f"{name} must be a contiguous {dtype} CPU tensor of shape {shape}, got "
                         f"{buffer.dtype} {tuple(buffer.shape)} on {buffer.device}")


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    a_start, b_start = a.data_ptr(), b.data_ptr()
    a_end, b_end = a_start + a.numel() * a.element_size(), b_start + b.numel() * b.element_size()
    return a_start < b_end and b_start < a_end


def _summarize_split_values(values: torch.Tensor, out: torch.Tensor, key_counts: Optional[torch.Tensor],
                            parts: int) -> bool:
    """One channel, no selection: each thread summarizes a slice of the values as a
    one-channel array with its own output row; the rows are then combined into ``out``."""
    flat = values.view(-1)
    rows = torch.empty(parts, 6, dtype=torch.float64)
    bounds = [flat.numel() * part // parts for part in range(parts + 1)]
    element = flat.element_size()
    trusted = _run_jobs([(flat.data_ptr() + bounds[part] * element, 1, 1, bounds[part + 1] - bounds[part], 0, 0, 1,
                          rows[part].data_ptr(), 0, key_counts[part].data_ptr() if key_counts is not None else 0)
                         for part in range(parts)])
    column = out[:, 0]
    column[MIN], column[MAX] = rows[:, MIN].amin(), rows[:, MAX].amax()
    column[SUM], column[SUM_OF_SQUARES] = rows[:, SUM].sum(), rows[:, SUM_OF_SQUARES].sum()
    column[KTH_LARGEST:] = float("nan")
    return trusted


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


def start_workers(threads: Optional[int] = None) -> None:
    """Start the worker threads now (a no-op without the kernel or with one thread).

    Calibration calls this before its first batch: a thread started during a
    forward pass leaves its long-lived allocations among that pass's activations."""
    workers = (threads if threads is not None else torch.get_num_threads()) - 1
    if _compiled is None or workers < 1:
        return
    pool = _worker_pool(workers)
    barrier = threading.Barrier(workers)  # each task holds a worker until all have started
    for future in [pool.submit(barrier.wait, 10) for _ in range(workers)]:
        future.result()


def release_workspaces() -> None:
    """Free the kernel's work buffers: this thread's and every pool worker's.

    The kernel keeps one buffer per thread between calls (re-allocating it for
    every batch fragments the heap); calibration releases them when done."""
    if _compiled is None:
        return
    _compiled.release_workspace()
    with _pool_lock:
        pool, workers = _pool, _pool_workers
    if pool is None:
        return
    # One task per worker, each held at a barrier until all have started, so every
    # worker thread runs exactly one of them.
    barrier = threading.Barrier(workers)

    def release_on_this_worker() -> None:
        barrier.wait(timeout=10)
        _compiled.release_workspace()

    for future in [pool.submit(release_on_this_worker) for _ in range(workers)]:
        future.result()


def _forget_pool_after_fork() -> None:
    # A forked child inherits the pool object but none of its threads.
    global _pool, _pool_workers
    _pool, _pool_workers = None, 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool_after_fork)
