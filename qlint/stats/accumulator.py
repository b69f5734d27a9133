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
batches, range_batches,                 add
reference_batches
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
non-finite adds to ``batches`` only). torch's observer is poisoned by them.

Channels: any ``channel_axis`` works (torch's percentile code is only right
for ``ch_axis=1``: it takes quantiles along ``dim=ch_axis`` of the flattened
2-D tensor). How a batch is reduced (in place in every layout, chunked
folding of per-batch summaries) is in :mod:`qlint.stats.batch`; how the
reference quantile is selected (exactly, or from a bounded sample of each
channel of large batches) in :mod:`qlint.stats.selection`.

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
from typing import Any

import torch

HISTOGRAM_SHAPE = (2, 256)

# Fields grouped by dtype and merge operator; each group is stored packed in
# one tensor, so a merge is a handful of tensor ops whatever the field count.
_CHANNEL_COUNT_FIELDS = (  # int64 (C,), merge by add
    "count",
    "nan_count",
    "inf_count",
    "percentile_ratio_batches",
    "zero_denominator_batches",
    "constant_batches",
)
_CHANNEL_SUM_FIELDS = ("sum", "sum_of_squares", "percentile_ratio_sum")  # float64 (C,), add
_BATCH_COUNT_FIELDS = ("batches", "range_batches", "reference_batches")  # int64 scalars, add
_CHANNEL_FIELDS = ("channel_min", "channel_max") + _CHANNEL_SUM_FIELDS + _CHANNEL_COUNT_FIELDS  # min/max: float64
TENSOR_FIELDS = _CHANNEL_FIELDS + ("histogram",) + _BATCH_COUNT_FIELDS + ("batch_range_sum",)


def _packed_row(packed: str, index: int, doc: str) -> property:
    return property(lambda self: getattr(self, packed)[index], doc=doc)


class TensorStats:
    """Statistics of every batch seen at one tensor point; see module docstring.

    Per-channel fields are 1-D tensors of length ``num_channels`` (0 until the
    first batch). With ``channel_axis=None`` the whole tensor is one channel.
    Instances are immutable: fields are read-only views (do not write into
    them) and :meth:`merge` returns a new object.
    """

    channel_min = _packed_row("_extrema", 0, "float64 (C,): smallest finite value per channel (inf: none yet)")
    channel_max = _packed_row("_extrema", 1, "float64 (C,): largest finite value per channel (-inf: none yet)")
    sum = _packed_row("_channel_sums", 0, "float64 (C,): sum of finite values")
    sum_of_squares = _packed_row("_channel_sums", 1, "float64 (C,): sum of squared finite values")
    percentile_ratio_sum = _packed_row("_channel_sums", 2, "float64 (C,): sum of per-batch max / q-quantile")
    count = _packed_row("_channel_counts", 0, "int64 (C,): finite values")
    nan_count = _packed_row("_channel_counts", 1, "int64 (C,): NaN values")
    inf_count = _packed_row("_channel_counts", 2, "int64 (C,): +-Inf values")
    percentile_ratio_batches = _packed_row("_channel_counts", 3, "int64 (C,): batches in percentile_ratio_sum")
    zero_denominator_batches = _packed_row("_channel_counts", 4, "int64 (C,): batches with q-quantile 0, max != 0")
    constant_batches = _packed_row("_channel_counts", 5, "int64 (C,): batches where the channel was constant")
    batches = _packed_row("_batch_counts", 0, "int64 scalar: batches observed (empty tensors are skipped)")
    range_batches = _packed_row("_batch_counts", 1, "int64 scalar: batches with at least one finite value")
    reference_batches = _packed_row(
        "_batch_counts", 2, "int64 scalar: batches whose reference quantile was selected (see qlint.stats.selection)"
    )

    def __init__(self, channel_axis: int | None, reference_percentile: float, **tensors: torch.Tensor):
        """Build from every field of ``TENSOR_FIELDS`` by name (see the class attributes)."""
        missing, unknown = set(TENSOR_FIELDS) - set(tensors), set(tensors) - set(TENSOR_FIELDS)
        if missing or unknown:
            raise ValueError(f"TensorStats fields: missing {sorted(missing)}, unknown {sorted(unknown)}")
        widths = {tuple(tensors[name].shape) for name in _CHANNEL_FIELDS}
        if len(widths) != 1 or len(next(iter(widths))) != 1:
            raise ValueError(f"per-channel fields must be 1-D of one length, got shapes {widths}")
        self._set(
            channel_axis,
            reference_percentile,
            extrema=torch.stack([tensors["channel_min"], tensors["channel_max"]]).to(torch.float64),
            channel_sums=torch.stack([tensors[name] for name in _CHANNEL_SUM_FIELDS]).to(torch.float64),
            channel_counts=torch.stack([tensors[name] for name in _CHANNEL_COUNT_FIELDS]).to(torch.int64),
            histogram=tensors["histogram"].to(torch.int64),
            batch_counts=torch.stack([tensors[name].reshape(()) for name in _BATCH_COUNT_FIELDS]).to(torch.int64),
            batch_range_sum=tensors["batch_range_sum"].reshape(()).to(torch.float64),
        )

    def _set(
        self,
        channel_axis,
        reference_percentile,
        *,
        extrema,
        channel_sums,
        channel_counts,
        histogram,
        batch_counts,
        batch_range_sum,
    ) -> TensorStats:
        if not 0.0 < reference_percentile < 1.0:
            raise ValueError(f"reference_percentile must be in (0, 1), got {reference_percentile}")
        if tuple(histogram.shape) != HISTOGRAM_SHAPE:
            raise ValueError(f"histogram must have shape {HISTOGRAM_SHAPE}, got {tuple(histogram.shape)}")
        self.channel_axis = channel_axis
        self.reference_percentile = float(reference_percentile)
        self._extrema, self._channel_sums, self._channel_counts = extrema, channel_sums, channel_counts
        self.histogram: torch.Tensor = histogram
        self._batch_counts = batch_counts
        self.batch_range_sum: torch.Tensor = batch_range_sum
        return self

    @classmethod
    def _packed(cls, channel_axis: int | None, reference_percentile: float, **packed: torch.Tensor) -> TensorStats:
        """Build from already packed tensors (the internal fast path)."""
        return cls.__new__(cls)._set(channel_axis, reference_percentile, **packed)

    def _packed_tensors(self) -> dict[str, torch.Tensor]:
        return dict(
            extrema=self._extrema,
            channel_sums=self._channel_sums,
            channel_counts=self._channel_counts,
            histogram=self.histogram,
            batch_counts=self._batch_counts,
            batch_range_sum=self.batch_range_sum,
        )

    # ------------------------------------------------------------------ build
    @classmethod
    def empty(
        cls,
        channel_axis: int | None = 1,
        reference_percentile: float = 0.975,
        num_channels: int = 0,
        device: torch.device | str | None = None,
    ) -> TensorStats:
        """Stats of no batches: the identity element of :meth:`merge`."""
        f64: dict[str, Any] = dict(dtype=torch.float64, device=device)
        i64: dict[str, Any] = dict(dtype=torch.int64, device=device)
        return cls._packed(
            channel_axis,
            reference_percentile,
            extrema=torch.tensor([[math.inf], [-math.inf]], **f64).expand(2, num_channels).clone(),
            channel_sums=torch.zeros(len(_CHANNEL_SUM_FIELDS), num_channels, **f64),
            channel_counts=torch.zeros(len(_CHANNEL_COUNT_FIELDS), num_channels, **i64),
            histogram=torch.zeros(HISTOGRAM_SHAPE, **i64),
            batch_counts=torch.zeros(len(_BATCH_COUNT_FIELDS), **i64),
            batch_range_sum=torch.zeros((), **f64),
        )

    @property
    def num_channels(self) -> int:
        return int(self._extrema.shape[1])

    @property
    def device(self) -> torch.device:
        return self._extrema.device

    def to(self, device: torch.device | str) -> TensorStats:
        moved = {name: tensor.to(device) for name, tensor in self._packed_tensors().items()}
        return TensorStats._packed(self.channel_axis, self.reference_percentile, **moved)

    # ------------------------------------------------------------------ merge
    def merge(self, other: TensorStats) -> TensorStats:
        """Stats of this stream followed by ``other``'s; neither is mutated."""
        if other.channel_axis != self.channel_axis or other.reference_percentile != self.reference_percentile:
            raise ValueError(
                "cannot merge stats with different settings: "
                f"(channel_axis={self.channel_axis}, q={self.reference_percentile}) vs "
                f"(channel_axis={other.channel_axis}, q={other.reference_percentile})"
            )
        # The result lives where the data does: a side without channels yet
        # (fresh stats, created on CPU) adopts the other's device and width,
        # so observing CUDA tensors never ships per-batch stats to the host.
        device = other.device if not self.num_channels and other.num_channels else self.device
        left = self if self.device == device else self.to(device)
        right = other if other.device == device else other.to(device)
        if not left.num_channels and right.num_channels:
            left = left._widened(right.num_channels)
        if not right.num_channels and left.num_channels:
            right = right._widened(left.num_channels)
        if left.num_channels != right.num_channels:
            raise ValueError(f"channel count changed from {left.num_channels} to {right.num_channels}")
        extrema = torch.stack(
            [torch.minimum(left.channel_min, right.channel_min), torch.maximum(left.channel_max, right.channel_max)]
        )
        return TensorStats._packed(
            self.channel_axis,
            self.reference_percentile,
            extrema=extrema,
            channel_sums=left._channel_sums + right._channel_sums,
            channel_counts=left._channel_counts + right._channel_counts,
            histogram=left.histogram + right.histogram,
            batch_counts=left._batch_counts + right._batch_counts,
            batch_range_sum=left.batch_range_sum + right.batch_range_sum,
        )

    def _widened(self, num_channels: int) -> TensorStats:
        """This (channel-less) stats object with identity values for ``num_channels``."""
        widened = TensorStats.empty(self.channel_axis, self.reference_percentile, num_channels, self.device)
        widened.histogram, widened._batch_counts = self.histogram, self._batch_counts
        widened.batch_range_sum = self.batch_range_sum
        return widened

    # ------------------------------------------------------------ state I/O
    def to_state(self) -> dict[str, torch.Tensor]:
        """One flat (1-D) tensor per field, suitable for ``torch.save`` or a state dict."""
        state = {name: getattr(self, name).reshape(-1).clone() for name in TENSOR_FIELDS}
        axis = [] if self.channel_axis is None else [self.channel_axis]
        state["channel_axis"] = torch.tensor(axis, dtype=torch.int64)
        state["reference_percentile"] = torch.tensor([self.reference_percentile], dtype=torch.float64)
        return state

    @classmethod
    def from_state(cls, state: dict[str, torch.Tensor]) -> TensorStats:
        axis = state["channel_axis"].tolist()
        if len(axis) > 1:
            raise ValueError(f"channel_axis state must hold 0 or 1 value, got {axis}")
        # States saved before reference_batches existed selected the reference on every batch.
        tensors = {
            name: state.get(name, state["batches"]) if name == "reference_batches" else state[name]
            for name in TENSOR_FIELDS
        }
        tensors["histogram"] = tensors["histogram"].reshape(HISTOGRAM_SHAPE)
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
        """Batches torch's observer would count per channel (including zero denominators), of
        the ``reference_batches``."""
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
    The view last handed out for a name is kept, so asking again for the same
    shape costs no tensor op.
    Not thread-safe: use one per thread (see ``thread_scratch_buffers``)."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._views: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        view = self._views.get(name)
        if view is not None and view.shape == shape and view.dtype == dtype and view.device == device:
            return view
        numel = math.prod(shape)
        buffer = self._buffers.get(name)
        if buffer is None or buffer.numel() < numel or buffer.dtype != dtype or buffer.device != device:
            buffer = torch.empty(numel, dtype=dtype, device=device)
            self._buffers[name] = buffer
        view = self._views[name] = buffer[:numel].view(shape)
        return view

    @property
    def nbytes(self) -> int:
        """Memory held by the buffers."""
        return sum(buffer.numel() * buffer.element_size() for buffer in self._buffers.values())

    def clear(self) -> None:
        self._buffers.clear()
        self._views.clear()
