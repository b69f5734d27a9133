"""Mergeable streaming statistics for one observed tensor point.

A :class:`TensorStats` summarises every batch seen at one point of a model
(for example the input of a conv) without keeping any activation around.
:func:`summarize_batch` turns one batch into a ``TensorStats``; updating is
merging (:func:`update_stats`), so "update" and "merge" cannot drift apart.

The statistics follow torch's ``ModelReportObserver`` (what the
``DynamicStaticDetector``, ``InputWeightEqualizationDetector`` and
``OutlierDetector`` read), re-derived so that they merge exactly:

* batch range   = max(batch) - min(batch) over the whole batch;
  epoch range   = max over all batches - min over all batches;
  S             = mean(batch range) / epoch range.
* percentile ratio, per channel and batch, with ``q`` the reference percentile:
  ``top / ref`` where ``top`` is the channel maximum and ``ref`` the
  ``torch.quantile(..., q, interpolation="lower")`` value, i.e. the sorted
  value at index ``floor(float32(q) * float32(n - 1))`` (torch does this
  arithmetic in float32, and so do we, so the same element is picked).
  A batch counts for a channel when ``ref != 0``; when ``ref == 0`` and
  ``top != 0`` torch counts it with ratio ``float32 max`` -- we count it
  separately in ``zero_denominator_batches``; ``ref == top == 0`` is skipped
  (as in torch). A batch is "constant" for a channel when ``top == min``.
* input-weight equalisation uses the per-channel input range
  ``channel_max - channel_min`` and the global range over channels.

How each statistic merges (``a.merge(b)`` == stats of ``a``'s batches followed
by ``b``'s):

======================================  ======================================
field                                   merge
======================================  ======================================
channel_min / channel_max               elementwise min / max
count, nan_count, inf_count             add (per channel)
sum, sum_of_squares (float64)           add (per channel)
percentile_ratio_sum (float64)          add (per channel)
percentile_ratio_batches                add (per channel)
zero_denominator_batches                add (per channel)
constant_batches                        add (per channel)
histogram (2 x 256 int64)               add
batches, range_batches                  add
batch_range_sum (float64)               add
derived: epoch min/max                  min/max over channel_min/channel_max
derived: average batch range            batch_range_sum / range_batches
derived: average percentile ratio       percentile_ratio_sum / ..._batches
derived: mean / variance                sum / count, sum_of_squares / count
======================================  ======================================

Float sums are merged by float64 addition, so merge equals the concatenated
stream up to float64 re-association (~1e-15 relative); everything else is
bit-exact. Unlike torch's running float32 averages, nothing here depends on
the order in which batches arrive.

Non-finite values: NaN and +-Inf are counted in ``nan_count`` / ``inf_count``
and excluded from every other statistic (a batch whose values are all
non-finite adds to ``batches`` only).

Histogram: bins are keyed by the float32 sign bit and the 8-bit float32
exponent, so ``histogram[s, e]`` counts values of sign ``s`` (0 positive,
1 negative) with magnitude in ``[2**(e-127), 2**(e-126))`` for ``e >= 1`` and
in ``[0, 2**-126)`` (zero and subnormals) for ``e == 0``. Edges never depend
on the data, so histograms merge by addition exactly, and they are computed
with a shift of the bit pattern, the cheapest binning there is. Column 255
(Inf/NaN) is always zero. float64 inputs are binned by their float32 rounding,
with magnitudes beyond float32 range put in the top finite bin.
"""

from __future__ import annotations

import math
import threading
from typing import Optional

import torch

HISTOGRAM_SHAPE = (2, 256)
_FLOAT32_MAX = torch.finfo(torch.float32).max
# Largest block of the block-maximum prefilter; bigger blocks make the
# threshold search cheaper but the threshold looser (more candidates).
_MAX_PREFILTER_BLOCK = 32
# Rows shorter than this go straight to kthvalue: the prefilter does not pay.
_MIN_PREFILTER_ROW = 2048
# Channel max-abs range where float32 sums of squares neither under- nor overflow.
_MODERATE_MAGNITUDE = (1e-15, 1e15)

_PER_CHANNEL_FLOAT = ("channel_min", "channel_max", "sum", "sum_of_squares", "percentile_ratio_sum")
_PER_CHANNEL_COUNT = (
    "count",
    "nan_count",
    "inf_count",
    "percentile_ratio_batches",
    "zero_denominator_batches",
    "constant_batches",
)
_SCALAR_COUNT = ("batches", "range_batches")
_SCALAR_FLOAT = ("batch_range_sum",)
TENSOR_FIELDS = _PER_CHANNEL_FLOAT + _PER_CHANNEL_COUNT + ("histogram",) + _SCALAR_COUNT + _SCALAR_FLOAT


class TensorStats:
    """Statistics of every batch seen at one tensor point; see module docstring.

    Per-channel fields are 1-D tensors of length ``num_channels`` (0 until the
    first batch). With ``channel_axis=None`` the whole tensor is one channel.
    Instances are treated as immutable: :meth:`merge` returns a new object.
    """

    channel_min: torch.Tensor
    channel_max: torch.Tensor
    sum: torch.Tensor
    sum_of_squares: torch.Tensor
    percentile_ratio_sum: torch.Tensor
    count: torch.Tensor
    nan_count: torch.Tensor
    inf_count: torch.Tensor
    percentile_ratio_batches: torch.Tensor
    zero_denominator_batches: torch.Tensor
    constant_batches: torch.Tensor
    histogram: torch.Tensor
    batches: torch.Tensor
    range_batches: torch.Tensor
    batch_range_sum: torch.Tensor

    def __init__(self, channel_axis: Optional[int], reference_percentile: float, **tensors: torch.Tensor):
        if not 0.0 < reference_percentile < 1.0:
            raise ValueError(f"reference_percentile must be in (0, 1), got {reference_percentile}")
        missing = set(TENSOR_FIELDS) - set(tensors)
        unknown = set(tensors) - set(TENSOR_FIELDS)
        if missing or unknown:
            raise ValueError(f"TensorStats fields: missing {sorted(missing)}, unknown {sorted(unknown)}")
        self.channel_axis = channel_axis
        self.reference_percentile = float(reference_percentile)
        for name in TENSOR_FIELDS:
            setattr(self, name, tensors[name])
        widths = {tensors[name].shape for name in _PER_CHANNEL_FLOAT + _PER_CHANNEL_COUNT}
        if len(widths) != 1 or len(next(iter(widths))) != 1:
            raise ValueError(f"per-channel fields must be 1-D of one length, got shapes {widths}")
        if tuple(self.histogram.shape) != HISTOGRAM_SHAPE:
            raise ValueError(f"histogram must have shape {HISTOGRAM_SHAPE}, got {tuple(self.histogram.shape)}")

    # ------------------------------------------------------------------ build
    @classmethod
    def empty(
        cls,
        channel_axis: Optional[int] = 1,
        reference_percentile: float = 0.975,
        num_channels: int = 0,
        device: torch.device | str | None = None,
    ) -> "TensorStats":
        """Stats of no batches: the identity element of :meth:`merge`."""
        f64 = dict(dtype=torch.float64, device=device)
        i64 = dict(dtype=torch.int64, device=device)
        tensors = {name: torch.zeros(num_channels, **f64) for name in _PER_CHANNEL_FLOAT}
        tensors["channel_min"] = torch.full((num_channels,), math.inf, **f64)
        tensors["channel_max"] = torch.full((num_channels,), -math.inf, **f64)
        tensors.update({name: torch.zeros(num_channels, **i64) for name in _PER_CHANNEL_COUNT})
        tensors["histogram"] = torch.zeros(HISTOGRAM_SHAPE, **i64)
        tensors.update({name: torch.zeros((), **i64) for name in _SCALAR_COUNT})
        tensors["batch_range_sum"] = torch.zeros((), **f64)
        return cls(channel_axis, reference_percentile, **tensors)

    @property
    def num_channels(self) -> int:
        return int(self.channel_min.shape[0])

    @property
    def device(self) -> torch.device:
        return self.channel_min.device

    def to(self, device: torch.device | str) -> "TensorStats":
        return TensorStats(
            self.channel_axis,
            self.reference_percentile,
            **{name: getattr(self, name).to(device) for name in TENSOR_FIELDS},
        )

    # ------------------------------------------------------------------ merge
    def merge(self, other: "TensorStats") -> "TensorStats":
        """Stats of this stream followed by ``other``'s; neither is mutated."""
        if other.channel_axis != self.channel_axis or other.reference_percentile != self.reference_percentile:
            raise ValueError(
                "cannot merge stats with different settings: "
                f"(channel_axis={self.channel_axis}, q={self.reference_percentile}) vs "
                f"(channel_axis={other.channel_axis}, q={other.reference_percentile})"
            )
        other = other.to(self.device) if other.device != self.device else other
        # An empty side (no channels known yet) adopts the other's width.
        left = self if self.num_channels or not other.num_channels else self._widened(other.num_channels)
        right = other if other.num_channels or not left.num_channels else other._widened(left.num_channels)
        if left.num_channels != right.num_channels:
            raise ValueError(f"channel count changed from {left.num_channels} to {right.num_channels}")
        merged = {name: getattr(left, name) + getattr(right, name) for name in TENSOR_FIELDS}
        merged["channel_min"] = torch.minimum(left.channel_min, right.channel_min)
        merged["channel_max"] = torch.maximum(left.channel_max, right.channel_max)
        return TensorStats(self.channel_axis, self.reference_percentile, **merged)

    def _widened(self, num_channels: int) -> "TensorStats":
        """This (channel-less) stats object with identity values for ``num_channels``."""
        widened = TensorStats.empty(self.channel_axis, self.reference_percentile, num_channels, self.device)
        for name in ("histogram",) + _SCALAR_COUNT + _SCALAR_FLOAT:
            setattr(widened, name, getattr(self, name))
        return widened

    # ------------------------------------------------------------ state I/O
    def to_state(self) -> dict[str, torch.Tensor]:
        """Flat (1-D) tensors, suitable for ``torch.save`` or a state dict."""
        state = {name: getattr(self, name).reshape(-1).clone() for name in TENSOR_FIELDS}
        axis = [] if self.channel_axis is None else [self.channel_axis]
        state["channel_axis"] = torch.tensor(axis, dtype=torch.int64)
        state["reference_percentile"] = torch.tensor([self.reference_percentile], dtype=torch.float64)
        return state

    @classmethod
    def from_state(cls, state: dict[str, torch.Tensor]) -> "TensorStats":
        axis = state["channel_axis"].tolist()
        if len(axis) > 1:
            raise ValueError(f"channel_axis state must hold 0 or 1 value, got {axis}")
        tensors = {name: state[name].clone() for name in TENSOR_FIELDS}
        tensors["histogram"] = tensors["histogram"].reshape(HISTOGRAM_SHAPE)
        for name in _SCALAR_COUNT + _SCALAR_FLOAT:
            tensors[name] = tensors[name].reshape(())
        return cls(axis[0] if axis else None, float(state["reference_percentile"].item()), **tensors)

    # ------------------------------------------------------ derived values
    @property
    def epoch_min(self) -> torch.Tensor:
        """Smallest finite value seen (``inf`` before any)."""
        return self.channel_min.amin() if self.num_channels else torch.tensor(math.inf, dtype=torch.float64)

    @property
    def epoch_max(self) -> torch.Tensor:
        return self.channel_max.amax() if self.num_channels else torch.tensor(-math.inf, dtype=torch.float64)

    def epoch_range(self) -> torch.Tensor:
        return self.epoch_max - self.epoch_min

    def average_batch_range(self) -> torch.Tensor:
        """Mean over batches (with any finite value) of max(batch) - min(batch)."""
        return self.batch_range_sum / self.range_batches

    def batch_to_epoch_range_ratio(self) -> torch.Tensor:
        """torch's DynamicStaticDetector statistic S; NaN where torch raises (no data, zero range)."""
        epoch_range = self.epoch_range()
        undefined = ~torch.isfinite(epoch_range) | (epoch_range == 0)
        return torch.where(undefined, math.nan, self.average_batch_range() / epoch_range)

    def channel_range(self) -> torch.Tensor:
        """Per-channel ``max - min``: the ``i_c`` of the equalisation statistic."""
        return self.channel_max - self.channel_min

    def channel_max_abs(self) -> torch.Tensor:
        return torch.maximum(self.channel_max.abs(), self.channel_min.abs())

    def percentile_batches_tracked(self) -> torch.Tensor:
        """Batches torch's observer would count per channel (including zero denominators)."""
        return self.percentile_ratio_batches + self.zero_denominator_batches

    def average_percentile_ratio(self) -> torch.Tensor:
        """Mean of ``max / q-quantile`` per channel over counted batches.

        ``+inf`` where some batch had a zero reference quantile under a
        non-zero max (torch reports a value of at least ``float32 max / n``
        there); ``0`` where no batch counted (as torch)."""
        average = self.percentile_ratio_sum / self.percentile_ratio_batches.clamp(min=1)
        return torch.where(self.zero_denominator_batches > 0, math.inf, average)

    def channel_mean(self) -> torch.Tensor:
        return self.sum / self.count

    def channel_variance(self) -> torch.Tensor:
        """Population variance per channel (clamped at 0 against cancellation)."""
        mean = self.channel_mean()
        return (self.sum_of_squares / self.count - mean * mean).clamp(min=0)

    def tensor_mean(self) -> torch.Tensor:
        return self.sum.sum() / self.count.sum()

    def tensor_variance(self) -> torch.Tensor:
        mean = self.tensor_mean()
        return (self.sum_of_squares.sum() / self.count.sum() - mean * mean).clamp(min=0)

    def __repr__(self) -> str:
        return (
            f"TensorStats(channel_axis={self.channel_axis}, q={self.reference_percentile}, "
            f"channels={self.num_channels}, batches={int(self.batches)})"
        )


def histogram_bin_edges() -> tuple[torch.Tensor, torch.Tensor]:
    """``(low, high)`` float64 tensors of ``HISTOGRAM_SHAPE``: each bin's value interval.

    Positive bins are ``[low, high)``, negative bins ``(low, high]``; the Inf/NaN
    column (exponent 255) has NaN edges."""
    exponent = torch.arange(256, dtype=torch.float64)
    lower_magnitude = torch.where(exponent == 0, 0.0, torch.exp2(exponent - 127))
    upper_magnitude = torch.exp2(exponent - 126)
    lower_magnitude[255] = upper_magnitude[255] = math.nan
    low = torch.stack([lower_magnitude, -upper_magnitude])
    high = torch.stack([upper_magnitude, -lower_magnitude])
    return low, high


class ScratchBuffers:
    """Reusable work buffers for :func:`summarize_batch`.

    Fresh multi-megabyte tensors cost a page fault per 4 KiB on first touch,
    which on small VMs rivals the arithmetic; reusing buffers avoids that.
    Not thread-safe: use one per thread."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        numel = math.prod(shape)
        buffer = self._buffers.get(name)
        if buffer is None or buffer.numel() < numel or buffer.dtype != dtype or buffer.device != device:
            buffer = torch.empty(numel, dtype=dtype, device=device)
            self._buffers[name] = buffer
        return buffer[:numel].view(shape)

    def clear(self) -> None:
        self._buffers.clear()


_thread_local = threading.local()


def thread_scratch_buffers() -> ScratchBuffers:
    """One shared :class:`ScratchBuffers` per thread, so observers share memory."""
    buffers = getattr(_thread_local, "buffers", None)
    if buffers is None:
        buffers = _thread_local.buffers = ScratchBuffers()
    return buffers


# ---------------------------------------------------------------- one batch
def update_stats(stats: TensorStats, batch: torch.Tensor, scratch: Optional[ScratchBuffers] = None) -> TensorStats:
    """Pure update: ``stats`` followed by one batch (``stats`` is not mutated)."""
    batch_stats = summarize_batch(batch, stats.channel_axis, stats.reference_percentile, scratch=scratch)
    return stats.merge(batch_stats)


def summarize_batch(
    batch: torch.Tensor,
    channel_axis: Optional[int] = 1,
    reference_percentile: float = 0.975,
    *,
    scratch: Optional[ScratchBuffers] = None,
    sync_free: Optional[bool] = None,
) -> TensorStats:
    """Stats of one batch, on the batch's device.

    ``channel_axis`` may be negative; a tensor with too few dimensions for it
    is read as unbatched (leading singleton dims are assumed), so a 1-D input
    to a Linear with ``channel_axis=1`` has one channel per feature.
    ``sync_free`` picks the path: False uses host reads to take a cheaper
    route when all values are finite (free on CPU), True never reads device
    values back (default: True off-CPU). Both give identical results.
    """
    if not batch.is_floating_point():
        raise TypeError(f"summarize_batch needs a floating tensor, got {batch.dtype}")
    if not 0.0 < reference_percentile < 1.0:
        raise ValueError(f"reference_percentile must be in (0, 1), got {reference_percentile}")
    if batch.numel() == 0:
        return TensorStats.empty(channel_axis, reference_percentile, device=batch.device)
    scratch = scratch if scratch is not None else ScratchBuffers()
    if sync_free is None:
        sync_free = batch.device.type != "cpu"
    with torch.no_grad():
        rows = _channel_rows(batch.detach(), channel_axis, scratch)
        summary = None if sync_free else _summarize_finite_rows(rows, reference_percentile, scratch)
        if summary is None:
            summary = _summarize_any_rows(rows, reference_percentile)
        summary["histogram"] = _exponent_histogram(rows, scratch)
        return _batch_stats(channel_axis, reference_percentile, summary)


def _channel_rows(batch: torch.Tensor, channel_axis: Optional[int], scratch: ScratchBuffers) -> torch.Tensor:
    """The batch as a (channels, values) matrix in the compute dtype."""
    compute_dtype = torch.float64 if batch.dtype == torch.float64 else torch.float32
    if channel_axis is None:
        return batch.reshape(1, -1).to(compute_dtype)
    shape = tuple(batch.shape)
    axis = channel_axis
    missing_leading_dims = axis + 1 - len(shape) if axis >= 0 else -axis - len(shape)
    if missing_leading_dims > 0:
        shape = (1,) * missing_leading_dims + shape
    axis = axis if axis >= 0 else axis + len(shape)
    outer, channels, inner = math.prod(shape[:axis]), shape[axis], math.prod(shape[axis + 1 :])
    as_3d = batch.reshape(outer, channels, inner)
    if outer == 1 and batch.dtype == compute_dtype:
        return as_3d[0]
    rows = scratch.get("rows", (channels, outer * inner), compute_dtype, batch.device)
    rows.view(channels, outer, inner).copy_(as_3d.transpose(0, 1))
    return rows


def _reference_rank(value_counts: torch.Tensor, q: float) -> torch.Tensor:
    """0-based ascending index of the q-quantile, ``floor(q * (n - 1))`` in float32 as torch.quantile."""
    q32 = torch.tensor(q, dtype=torch.float32, device=value_counts.device)
    return torch.floor(q32 * (value_counts - 1).to(torch.float32)).to(torch.int64)


def _summarize_finite_rows(rows: torch.Tensor, q: float, scratch: ScratchBuffers) -> Optional[dict]:
    """Fast path for finite rows of moderate magnitude; None (after one host read) otherwise."""
    channel_min = rows.amin(1)
    channel_max = rows.amax(1)
    channel_sum = rows.sum(1)
    channel_norm = torch.linalg.vector_norm(rows, dim=1)
    # NaN/Inf make min/max/sum non-finite. The float32 norm squares values, so
    # magnitudes outside [1e-15, 1e15] could under/overflow it: those batches
    # (rare, and the hostile ones) take the general path, exact in float64.
    max_abs = torch.maximum(-channel_min, channel_max)
    moderate = (max_abs == 0) | ((max_abs > _MODERATE_MAGNITUDE[0]) & (max_abs < _MODERATE_MAGNITUDE[1]))
    if not bool((moderate & torch.isfinite(channel_sum) & torch.isfinite(channel_norm)).all()):
        return None
    channels, width = rows.shape
    rank = int(_reference_rank(torch.tensor(width), q))
    counts = torch.full((channels,), width, dtype=torch.int64, device=rows.device)
    zeros = torch.zeros_like(counts)
    return dict(
        channel_min=channel_min,
        channel_max=channel_max,
        reference=_kth_largest_of_finite_rows(rows, width - rank, scratch),
        count=counts,
        nan_count=zeros,
        inf_count=zeros,
        sum=channel_sum.to(torch.float64),
        sum_of_squares=channel_norm.to(torch.float64).square(),
    )


def _kth_largest_of_finite_rows(rows: torch.Tensor, m: int, scratch: ScratchBuffers) -> torch.Tensor:
    """Per row, the m-th largest value (1-based) of finite rows, exactly.

    kthvalue over whole rows is the dominant cost of the statistics, so large
    rows are prefiltered: split each row into disjoint blocks (at least 2m of
    them) and take t = the m-th largest block maximum. Those m blocks hold m
    distinct values >= t, so the answer is >= t; if fewer than m values exceed
    t the answer is t itself, otherwise it is the m-th largest of the few
    values > t (a few percent of the row for the usual q = 0.975).
    """
    channels, width = rows.shape
    if width < _MIN_PREFILTER_ROW or 8 * m > width:
        return rows.kthvalue(width - m + 1, dim=1).values
    block = min(_MAX_PREFILTER_BLOCK, width // (2 * m))
    groups = width // block
    # Strided blocks {j, j + groups, j + 2 * groups, ...}: a cheap vectorised
    # reduction over the middle axis. Leftover values are singleton blocks.
    block_max = rows[:, : block * groups].view(channels, block, groups).amax(1)
    if block * groups < width:
        block_max = torch.cat([block_max, rows[:, block * groups :]], dim=1)
    threshold = block_max.kthvalue(block_max.shape[1] - m + 1, dim=1).values
    above = scratch.get("above", tuple(rows.shape), torch.bool, rows.device)
    torch.gt(rows, threshold.unsqueeze(1), out=above)
    row_index, column_index = above.nonzero(as_tuple=True)
    counts = torch.bincount(row_index, minlength=channels)
    tail_width = int(counts.max()) if row_index.numel() else 0
    if tail_width < m:
        return threshold
    # Pack each row's values above t left-aligned into a -inf padded matrix;
    # padding sorts first, so one kthvalue with a shared k finds the answer.
    padded = rows.new_full((channels, tail_width), -math.inf)
    row_starts = torch.cumsum(counts, 0) - counts
    slot = torch.arange(row_index.numel(), device=rows.device) - row_starts[row_index]
    padded[row_index, slot] = rows[row_index, column_index]
    in_tail = padded.kthvalue(tail_width - m + 1, dim=1).values
    return torch.where(counts >= m, in_tail, threshold)


def _summarize_any_rows(rows: torch.Tensor, q: float) -> dict:
    """General path: tolerates NaN/Inf and never reads a device value back."""
    channels, width = rows.shape
    finite = torch.isfinite(rows)
    nan_count = torch.isnan(rows).sum(1)
    count = finite.sum(1)
    inf_count = width - count - nan_count
    for_max = rows.masked_fill(~finite, -math.inf)
    finite_or_zero = rows.masked_fill(~finite, 0).to(torch.float64)
    # With NaN/Inf excluded each channel has its own number of values, so its
    # own quantile rank; one topk deep enough for the largest rank serves all.
    rank = _reference_rank(count, q)
    wanted = count - rank  # the wanted value is the wanted-th largest
    deepest = min(width, width - int(_reference_rank(torch.tensor(width), q)) + 2)
    top = for_max.topk(deepest, dim=1).values
    reference = top.gather(1, (wanted - 1).clamp(0, deepest - 1).unsqueeze(1)).squeeze(1)
    return dict(
        channel_min=rows.masked_fill(~finite, math.inf).amin(1),
        channel_max=for_max.amax(1),
        reference=reference,
        count=count,
        nan_count=nan_count,
        inf_count=inf_count,
        sum=finite_or_zero.sum(1),
        sum_of_squares=finite_or_zero.square().sum(1),
    )


def _exponent_histogram(rows: torch.Tensor, scratch: ScratchBuffers) -> torch.Tensor:
    """(sign, float32 exponent) counts of the finite values; see module docstring."""
    if rows.dtype == torch.float64:
        as_float32 = rows.clamp(-_FLOAT32_MAX, _FLOAT32_MAX).to(torch.float32)
        # The clamp turned +-Inf into the top finite bin; keep them out.
        infinities = torch.stack([(rows == math.inf).sum(), (rows == -math.inf).sum()])
    else:
        as_float32, infinities = rows, None
    keys = scratch.get("keys", tuple(as_float32.shape), torch.int32, rows.device)
    # An arithmetic shift leaves the sign-extended (sign, exponent) pair:
    # exponent for positives, exponent - 256 for negatives.
    torch.bitwise_right_shift(as_float32.view(torch.int32), 23, out=keys)
    keys += 256
    counts = torch.bincount(keys.view(-1), minlength=512)
    histogram = torch.stack([counts[256:], counts[:256]])
    histogram[:, 255] = 0  # NaN/Inf are counted by nan_count / inf_count
    if infinities is not None:
        histogram[:, 254] -= infinities
    return histogram


def _batch_stats(channel_axis: Optional[int], q: float, summary: dict) -> TensorStats:
    """Assemble a one-batch TensorStats from per-channel summaries (all on device)."""
    count = summary["count"]
    has_values = count > 0
    channel_min = summary["channel_min"].to(torch.float64)
    channel_max = summary["channel_max"].to(torch.float64)
    reference = summary["reference"].to(torch.float64)
    counted = has_values & (reference != 0)
    zero_denominator = has_values & (reference == 0) & (channel_max != 0)
    ratio = torch.where(counted, channel_max / torch.where(counted, reference, 1.0), 0.0)
    any_values = has_values.any()
    batch_range = torch.where(any_values, channel_max.amax() - channel_min.amin(), 0.0)
    as_count = lambda flags: flags.to(torch.int64)  # noqa: E731
    return TensorStats(
        channel_axis,
        q,
        channel_min=channel_min,
        channel_max=channel_max,
        sum=summary["sum"],
        sum_of_squares=summary["sum_of_squares"],
        percentile_ratio_sum=ratio,
        count=count,
        nan_count=summary["nan_count"],
        inf_count=summary["inf_count"],
        percentile_ratio_batches=as_count(counted),
        zero_denominator_batches=as_count(zero_denominator),
        constant_batches=as_count(has_values & (channel_max == channel_min)),
        histogram=summary["histogram"],
        batches=torch.ones((), dtype=torch.int64, device=count.device),
        range_batches=as_count(any_values),
        batch_range_sum=batch_range,
    )
