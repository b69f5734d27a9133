"""Safe front end of the optional compiled statistics kernel (``_channel_kernel.c``).

:func:`summarize_channels` reads one contiguous float32 CPU batch, viewed as
``(outer, channels, inner)``, once (twice for a selection without a hint), and
returns per-channel min, max, sum and sum of squares, optionally the exact
m-th largest value and the (sign, exponent) key counts. Work is cut into up to
``torch.get_num_threads()`` parts (channel ranges, or value ranges for a single
channel without selection) that run in torch's OpenMP team where it can be found
(:func:`_use_openmp_team`). :class:`StreamBuffers` keeps a stream's running totals
and folds each batch in with the same call.

Everything the kernel is given is checked here: dtype, device, contiguity,
sizes, and the output buffers it writes, which this module allocates itself.
When the extension was not built (no C compiler at install time),
:func:`available` is False and callers use their tensor-op path, which gives
the same statistics.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import threading
from typing import Callable, Optional

import torch

try:
    from qlint.stats import _channel_kernel as _compiled
except ImportError:  # built optionally: see setup.py
    _compiled = None

HISTOGRAM_KEYS = 512
# Below this many values per part, waking another team member costs more than it saves
# (a spinning member takes work in ~2 us, a sleeping one in ~20-50 us; the kernel reads ~1
# value/ns with a selection and ~4 without).
MIN_VALUES_PER_PART = 1 << 15
MIN_VALUES_PER_PART_WITHOUT_SELECTION = 1 << 16
MOST_PARTS = 64  # as the kernel's MOST_PARTS
# Rows of KernelSummary.packed
MIN, MAX, SUM, SUM_OF_SQUARES, KTH_LARGEST, NEXT_HINT = range(6)

# Set once, at the first use with more than one part (see _use_openmp_team)
_team_checked = False
_team_in_use = False
_team_lock = threading.Lock()


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
    _check_batch(values, m)
    channels = values.shape[1]
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
    parts = part_count(values.numel(), m is not None, threads, key_counts.shape[0] if key_counts is not None else None)
    outer, channels, inner = values.shape
    return _compiled.summarize(values.data_ptr(), outer, channels, inner, m or 0, parts, out.data_ptr(),
                               hint.data_ptr() if hint is not None else 0,
                               key_counts.data_ptr() if key_counts is not None else 0)


def part_count(values: int, selection: bool, threads: Optional[int] = None,
               key_rows: Optional[int] = None) -> int:
    """Parts a batch of this many values is cut into: one per thread of torch's OpenMP team
    (where qlint can enter it), fewer for small batches; 1 without the team."""
    threads = threads if threads is not None else torch.get_num_threads()
    per_part = MIN_VALUES_PER_PART if selection else MIN_VALUES_PER_PART_WITHOUT_SELECTION
    parts = max(1, min(threads, values // per_part, MOST_PARTS, key_rows if key_rows is not None else threads))
    if parts > 1 and not _use_openmp_team():
        return 1
    return parts


def _check_batch(values: torch.Tensor, m: Optional[int]) -> None:
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


class StreamBuffers:
    """The buffers of one stream's running totals on the compiled path, made once for a width.

    ``summaries``: float64 ``[2, 6, C]``, used in turn (the other holds the previous batch's
    hints); ``totals``: float64 ``[5, C]`` (min, max, sum, sum of squares, sum of
    max / m-th largest); ``flags``: int64 ``[3, C]`` (ratio batches, zero-quantile batches,
    constant batches); with a histogram, ``key_counts`` int64 ``[parts, 512]`` (running) and a
    batch's own. ``allocate(count, dtype)`` makes each flat buffer (qlint passes
    :func:`qlint.stats.memory.off_heap_empty`). Nothing is allocated per batch and nothing
    is checked per batch but the batch itself: this class made every buffer."""

    __slots__ = ("channels", "summaries", "totals", "flags", "key_counts", "batch_keys", "latest", "_addresses")

    def __init__(self, channels: int, *, histogram: bool,
                 allocate: Optional[Callable[[int, torch.dtype], torch.Tensor]] = None) -> None:
        if _compiled is None:
            raise RuntimeError("qlint's compiled statistics kernel is not built; check kernel.available() first")
        if channels < 1:
            raise ValueError(f"need at least one channel, got {channels}")
        self.channels = channels
        if allocate is None:
            allocate = _allocate_on_heap
        floats = allocate(17 * channels, torch.float64)
        self.summaries = floats[: 12 * channels].view(2, 6, channels)
        self.totals = floats[12 * channels :].view(5, channels)
        rows = max(1, min(torch.get_num_threads(), MOST_PARTS)) if histogram else 0
        counts = allocate(3 * channels + 2 * rows * HISTOGRAM_KEYS, torch.int64)
        self.flags = counts[: 3 * channels].view(3, channels)
        self.key_counts = self.batch_keys = None
        if histogram:
            keys = counts[3 * channels :].view(2, rows, HISTOGRAM_KEYS)
            self.key_counts, self.batch_keys = keys[0], keys[1]
        # Addresses taken once: indexing a tensor per batch costs microseconds, per observer.
        self._addresses = (tuple(summary.data_ptr() for summary in self.summaries),
                           tuple(summary[NEXT_HINT].data_ptr() for summary in self.summaries),
                           self.totals.data_ptr(), self.flags.data_ptr(),
                           self.batch_keys.data_ptr() if histogram else 0)
        self.latest: Optional[int] = None  # which summary holds the latest trusted batch
        self.clear()

    def clear(self) -> None:
        """Forget the totals (the hints of the latest batch are kept)."""
        self.totals[0].fill_(float("inf"))
        self.totals[1].fill_(float("-inf"))
        self.totals[2:].zero_()
        self.flags.zero_()
        if self.key_counts is not None:
            self.key_counts.zero_()

    def add(self, values: torch.Tensor, m: Optional[int]) -> Optional[float]:
        """Summarize one batch (as :func:`summarize_into`, with the previous batch's hints) and
        add it to the totals; returns its range over all channels, or None when the batch is
        not trusted (the totals are then untouched)."""
        _check_batch(values, m)
        outer, channels, inner = values.shape
        return self.add_at(values.data_ptr(), outer, channels, inner, m)

    def add_at(self, address: int, outer: int, channels: int, inner: int, m: Optional[int]) -> Optional[float]:
        """:meth:`add` for a batch given by the address of a contiguous float32 CPU array of shape
        ``(outer, channels, inner)``, alive for the call: the caller has checked it."""
        if channels != self.channels:
            raise ValueError(f"these buffers hold {self.channels} channels, the batch has {channels}")
        latest = self.latest
        target = 0 if latest is None else 1 - latest
        summaries, hints, totals, flags, keys_address = self._addresses
        hint = 0 if latest is None or m is None else hints[latest]
        keys = self.batch_keys
        if keys is not None:
            keys.zero_()
        parts = part_count(outer * channels * inner, m is not None,
                           key_rows=keys.shape[0] if keys is not None else None)
        batch_range = _compiled.add_batch(address, outer, channels, inner, m or 0, parts, summaries[target], hint,
                                          keys_address, totals, flags)
        if batch_range is None:
            return None
        self.latest = target
        if keys is not None:
            self.key_counts += keys
        return batch_range


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


def _allocate_on_heap(count: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(count, dtype=dtype)


def _check_buffer(name: str, buffer: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    if (tuple(buffer.shape) != shape or buffer.dtype != dtype or buffer.device.type != "cpu"
            or not buffer.is_contiguous()):
        raise ValueError(f"{name} must be a contiguous {dtype} CPU tensor of shape {shape}, got "
                         f"{buffer.dtype} {tuple(buffer.shape)} on {buffer.device}")


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    a_start, b_start = a.data_ptr(), b.data_ptr()
    a_end, b_end = a_start + a.numel() * a.element_size(), b_start + b.numel() * b.element_size()
    return a_start < b_end and b_start < a_end


def _use_openmp_team() -> bool:
    """Whether parts run at once, in torch's OpenMP team (found and handed to the kernel once).

    The kernel enters the team through the OpenMP runtime's ``GOMP_parallel`` entry point
    (GNU libgomp's; LLVM's and Intel's runtimes provide it too). It is looked up among the
    libraries this process has loaded, preferring the one inside torch's package. Without
    it (torch built with another parallel backend, or no /proc/self/maps to read) the parts
    run one after another: threads of qlint's own ran slower than one thread in the
    measurements, as they share cores with the team's spinning members (see
    ``_channel_kernel.c``, "parallel runs")."""
    global _team_checked
    if not _team_checked:
        with _team_lock:
            if not _team_checked:
                _set_team(_find_openmp_entries())
                _team_checked = True
    return _team_in_use


def _set_team(entries: Optional[tuple[int, int, int]]) -> None:
    global _team_in_use
    if _compiled is None:
        return
    _compiled.set_team(*(entries or (0, 0, 0)))
    _team_in_use = entries is not None


def _calling_thread_only_after_fork() -> None:
    # A forked child inherits the parent's OpenMP state but not its team's threads, and GNU
    # libgomp is not fork-safe: in a child the kernel's parts run in the calling thread.
    global _team_checked
    _set_team(None)
    _team_checked = True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_calling_thread_only_after_fork)


def _find_openmp_entries() -> Optional[tuple[int, int, int]]:
    """Addresses of GOMP_parallel, omp_get_thread_num and omp_get_num_threads in the OpenMP
    runtime torch uses, or None."""
    if os.environ.get("QLINT_KERNEL_TEAM", "1") == "0" or "parallel backend: OpenMP" not in _parallel_info():
        return None
    try:
        with open("/proc/self/maps") as handle:
            paths = {line.split()[-1] for line in handle if line.rstrip().endswith(".so") or ".so." in line}
    except OSError:
        return None
    torch_dir = os.path.dirname(torch.__file__)
    runtimes = sorted((not path.startswith(torch_dir), path) for path in paths
                      if os.path.basename(path).startswith(("libgomp", "libiomp", "libomp")))
    for _, path in runtimes:
        try:
            library = ctypes.CDLL(path)
            return tuple(ctypes.cast(getattr(library, name), ctypes.c_void_p).value
                         for name in ("GOMP_parallel", "omp_get_thread_num", "omp_get_num_threads"))
        except (OSError, AttributeError):
            continue
    return None


def _parallel_info() -> str:
    try:
        return torch.__config__.parallel_info()
    except (AttributeError, RuntimeError):
        return ""


def prepare_parallel() -> None:
    """Find torch's OpenMP team now (calibration calls this before its first batch)."""
    if _compiled is not None:
        _use_openmp_team()


def release_workspaces() -> None:
    """Free the kernel's work buffers: this thread's and those of its OpenMP team's members.

    The kernel keeps one buffer per thread between calls (re-allocating it for
    every batch fragments the heap); calibration releases them when done."""
    if _compiled is None:
        return
    _compiled.release_team_workspaces()
