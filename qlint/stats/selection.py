"""Exact per-channel selection: the m-th largest value of every channel of one batch.

This is the costly part of the percentile-ratio statistic (the reference
quantile of each channel), so it has two layouts, and each avoids a full sort:

* **rows** ``(channels, values)``, channel-major (conv inputs after the
  channel-major copy): a block-maximum prefilter leaves ~3 % of each row as
  candidates, then one partition (see :func:`kth_largest_of_rows`).
* **columns** ``(values, channels)``, channel-last (the ``[..., features]``
  input of a Linear, read in place): a tournament of block maxima, see
  :func:`kth_largest_of_columns`. It reads every value once (one max-reduction
  that is contiguous across channels) and then touches only ``fan * m`` values
  per channel per level, so no transposed copy of the batch is ever made.

Both are exact: they return the very element ``torch.kthvalue`` would. Both
need finite values (the general path in :mod:`qlint.stats.accumulator`
handles NaN/Inf). On CPU, numpy's partition (SIMD introselect) is used when
numpy is installed; it is several times faster than ``torch.kthvalue``, which
also tracks indices. Without numpy (or off-CPU) torch does the same work.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

try:  # optional: numpy's SIMD partition makes the CPU percentile search much cheaper
    import numpy as _numpy
except ImportError:  # pragma: no cover - exercised only where numpy is absent
    _numpy = None

# Largest block of the row prefilter; bigger blocks make the threshold search
# cheaper but the threshold looser (more candidates).
_MAX_PREFILTER_BLOCK = 32
# Rows shorter than this go straight to a full selection: prefiltering does not pay.
_MIN_PREFILTER_ROW = 1024
# Tournament of the column layout: values per block at each level, and the
# size below which the top level is selected directly.
_TOURNAMENT_FAN = 8
_TOURNAMENT_TOP = 64


def _uses_numpy(values: torch.Tensor) -> bool:
    return _numpy is not None and values.device.type == "cpu"


# ------------------------------------------------------------------- rows
def block_maxima_of_rows(rows: torch.Tensor, m: int) -> Optional[torch.Tensor]:
    """Maxima of disjoint blocks of each row (at least 2m blocks), or None for short rows.

    Blocks are strided, {j, j + g, j + 2g, ...}, so this is one vectorised
    reduction over a middle axis; leftover values are singleton blocks. Its
    row maxima are the row maxima, so callers reuse it for ``amax``."""
    channels, width = rows.shape
    if width < _MIN_PREFILTER_ROW or 8 * m > width:
        return None
    block = min(_MAX_PREFILTER_BLOCK, width // (2 * m))
    groups = width // block
    block_max = rows[:, : block * groups].view(channels, block, groups).amax(1)
    if block * groups < width:
        block_max = torch.cat([block_max, rows[:, block * groups :]], dim=1)
    return block_max


def kth_largest_of_rows(rows: torch.Tensor, block_max: Optional[torch.Tensor], m: int,
                        scratch_above: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per row, the m-th largest value (1-based) of finite rows, exactly.

    Long rows are prefiltered with their :func:`block_maxima_of_rows`: t = the
    m-th largest block maximum. Those m blocks hold m distinct values >= t, so
    the answer is >= t; if fewer than m values exceed t the answer is t
    itself, otherwise it is the m-th largest of the few values > t (~3 % of a
    row for q = 0.975). ``scratch_above`` is an optional bool work buffer of
    ``rows``' shape for the torch path.
    """
    channels, width = rows.shape
    if block_max is None:
        if _uses_numpy(rows):
            return torch.from_numpy(_numpy.partition(rows.numpy(), width - m, axis=1)[:, width - m].copy())
        return rows.kthvalue(width - m + 1, dim=1).values
    if _uses_numpy(rows):
        return torch.from_numpy(_numpy.ascontiguousarray(
            _select_above_block_threshold_numpy(rows.numpy(), block_max.numpy(), m)))
    threshold = block_max.kthvalue(block_max.shape[1] - m + 1, dim=1).values
    above = scratch_above if scratch_above is not None else torch.empty_like(rows, dtype=torch.bool)
    torch.gt(rows, threshold.unsqueeze(1), out=above)
    flat_index = above.view(-1).nonzero().squeeze(1)
    row_of = torch.div(flat_index, width, rounding_mode="floor")
    counts = torch.bincount(row_of, minlength=channels)
    tail_width = int(counts.max()) if row_of.numel() else 0
    if tail_width < m:
        return threshold
    # Pack each row's values above t left-aligned into a -inf padded matrix;
    # padding sorts first, so one kthvalue with a shared k finds the answer.
    padded = rows.new_full((channels, tail_width), -math.inf)
    slot = torch.arange(row_of.numel(), device=rows.device) - (torch.cumsum(counts, 0) - counts)[row_of]
    padded.view(-1).index_copy_(0, row_of * tail_width + slot, rows.view(-1).index_select(0, flat_index))
    in_tail = padded.kthvalue(tail_width - m + 1, dim=1).values
    return torch.where(counts >= m, in_tail, threshold)


def _select_above_block_threshold_numpy(values, block_max, m: int):
    """numpy twin of the prefiltered branch of :func:`kth_largest_of_rows`."""
    np = _numpy
    channels = values.shape[0]
    threshold = np.partition(block_max, block_max.shape[1] - m, axis=1)[:, block_max.shape[1] - m]
    above = values > threshold[:, None]
    counts = np.array([np.count_nonzero(row) for row in above])  # 1-D popcount beats axis=1
    tail_width = int(counts.max())
    if tail_width < m:
        return threshold
    tail = values[above]  # row-major, so grouped by row
    row_of = np.repeat(np.arange(channels), counts)
    slot = np.arange(tail.size) - np.repeat(np.cumsum(counts) - counts, counts)
    padded = np.full((channels, tail_width), -np.inf, dtype=values.dtype)
    padded[row_of, slot] = tail
    in_tail = np.partition(padded, tail_width - m, axis=1)[:, tail_width - m]
    return np.where(counts >= m, in_tail, threshold)


# ---------------------------------------------------------------- columns
def kth_largest_of_columns(columns: torch.Tensor, m: int) -> torch.Tensor:
    """Per column of a contiguous finite ``(values, channels)`` matrix, the m-th largest value, exactly."""
    return max_and_kth_largest_of_columns(columns, m)[1]


def max_and_kth_largest_of_columns(columns: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per column of a contiguous finite ``(values, channels)`` matrix: (maximum, m-th largest value), exactly.

    The maximum comes free with the tournament below (it is the top level's
    maximum), so callers need no separate pass over the data for it.

    A tournament: level 0 is the matrix; level L+1 holds the maxima of blocks
    of ``fan`` level-L rows (strided blocks, so each level is one reduction
    that is contiguous across channels). At the top (at most ~64 rows) the m
    largest entries per channel are selected directly. Going down, the m
    largest entries of level L are among the children of the m largest of
    level L+1 (plus the few rows a level leaves out of its blocks): an entry
    outside them is beaten by m parents, each of which is, or holds, a larger
    child. Repeating this to level 0 leaves ``fan * m`` candidates per channel,
    whose m-th largest is the answer (by value; ties can swap which equal
    element is picked, never the value).
    """
    width, channels = columns.shape
    if not 1 <= m <= width:
        raise ValueError(f"m must be in [1, {width}], got {m}")
    if not _uses_numpy(columns):
        return columns.amax(0), kth_largest_of_rows(columns.t().contiguous(), None, m)
    np = _numpy
    # levels[i]: (level i as a flat array, number of whole blocks of fan rows in it)
    levels: list[tuple[object, int]] = []
    current = columns
    while current.shape[0] // _TOURNAMENT_FAN >= max(_TOURNAMENT_TOP, 2 * m):
        groups = current.shape[0] // _TOURNAMENT_FAN
        levels.append((current.numpy().reshape(-1), groups))
        current = current[: groups * _TOURNAMENT_FAN].view(_TOURNAMENT_FAN, groups, channels).amax(0)
    top = np.ascontiguousarray(current.numpy().T)  # (channels, rows): small
    column_max = torch.from_numpy(top.max(axis=1))
    if not levels:
        return column_max, torch.from_numpy(_mth_largest_per_row(top, m))
    channel = np.arange(channels)[:, None]
    flat = _top_m_per_row(top, m) * channels + channel  # flat indices into the top level
    for level in range(len(levels) - 1, -1, -1):
        values, groups = levels[level]
        child_offsets = np.arange(_TOURNAMENT_FAN) * (groups * channels)
        candidates = (flat[:, :, None] + child_offsets).reshape(channels, -1)
        leftover = np.arange(groups * _TOURNAMENT_FAN, values.size // channels)
        if leftover.size:  # rows outside whole blocks have no parent: always candidates
            candidates = np.concatenate([candidates, leftover[None, :] * channels + channel], axis=1)
        gathered = values[candidates]
        if level > 0:
            flat = np.take_along_axis(candidates, _top_m_per_row(gathered, m), axis=1)
    return column_max, torch.from_numpy(_mth_largest_per_row(gathered, m))


def _top_m_per_row(values, m: int):
    """Column indices of the m largest entries of each row (in no particular order)."""
    width = values.shape[1]
    return _numpy.argpartition(values, width - m, axis=1)[:, width - m :]


def _mth_largest_per_row(values, m: int):
    width = values.shape[1]
    return _numpy.partition(values, width - m, axis=1)[:, width - m].copy()
