"""How the reference quantile of every channel of one batch is selected: exactly, or from a bounded sample.

torch's OutlierDetector compares each channel's maximum with its
``torch.quantile(..., q, interpolation="lower")``: the ascending element at
index ``r = floor(float32(q) * float32(n - 1))`` of the channel's ``n`` values.
Selecting that element costs a partial sort of every value: ``torch.kthvalue``
spends 3-10 ns per value, 30-100x a reduction such as ``amax``, and on a
transformer layer (few tokens, many channels) that alone exceeds the 30 % of a
forward pass calibration may add. So:

* a batch with at most :data:`EXACT_VALUES` values at a point (every channel
  together) gets the exact element torch picks;
* a larger one gets the estimate of a :class:`SamplePlan`: the values at
  ``s <= percentile_sample`` fixed random positions (all positions, in random
  order, when a channel has fewer), taken in groups of ``g`` and reduced to the
  group maxima (one cheap ``amax``); the reference is the ``m``-th largest group
  maximum, ``m`` the sample's rank from the top whose expected batch rank is
  torch's. Selecting among ``s / g`` maxima instead of ``n`` values is what
  makes it cheap; the groups are small enough (at least
  :data:`_MAXIMA_PER_RANK` ``* m`` of them) that the top values rarely share one.

Where asked (the ``percentile_every`` calibration option), a point of more than
:data:`SELECT_EVERY_BATCH_UP_TO` channels selects its reference on the first batch and
one in ``percentile_every`` after it (:func:`selects_reference`): torch's selection costs
a fixed ~0.3 us per channel, so on a transformer layer it outweighs every other statistic
together. The ratio's mean is then over those batches (``TensorStats.reference_batches``
counts them).

The positions come from a local ``torch.Generator`` of fixed seed (never the
global RNG) and depend only on ``n``: every channel and every batch of the same
shape use the same ones, so results are reproducible and independent of batch
order, and merging stays exact.

Error bound: sampled positions are uniform, so the batch ranks of the sampled
values are uniform whatever the data, and the batch level of the estimate
(the fraction of the channel's values below it) has a distribution that
depends on ``n``, ``q`` and the plan only. ``bench/percentile_bound.py``
computes it; for q = 0.975 and the default 512 values it lies in
[0.955, 0.985] with probability 99 % (docs/architecture.md, "Statistics").
The group maxima make the estimate never exceed the sample's exact order
statistic (it errs towards larger ratios, never hiding an outlier the exact
statistic would show).
"""

from __future__ import annotations

import dataclasses
import functools

import torch

# Values per channel and batch the reference quantile is estimated from.
PERCENTILE_SAMPLE = 256
# Asked for (percentile_every > 1), a point of more than SELECT_EVERY_BATCH_UP_TO channels
# selects its reference on one batch in percentile_every (the first, then every k-th):
# selecting costs ~0.3 us per channel whatever the sample (torch's selection runs channel by
# channel), more than every other statistic together on a transformer layer. Narrower points,
# a few microseconds, select on every batch. By default every point selects on every batch:
# on 8 batches of the real models one in 2 changes 6-9 % of QL203's channel verdicts against
# torch's exact statistic, one in 4 10-16 % (the sample alone 0-4.5 %; docs/performance.md).
PERCENTILE_EVERY = 1
SELECT_EVERY_BATCH_UP_TO = 32
# A batch with at most this many values at a point gets the exact reference (a
# kthvalue over all of them costs ~0.1-0.3 ms).
EXACT_VALUES = 32768
# Largest group whose maximum stands for its values.
_LARGEST_GROUP = 8
# At least this many group maxima per rank from the top: the top values then rarely share a group.
_MAXIMA_PER_RANK = 4
# Fixed seed of the sample positions: results are reproducible run to run.
_SAMPLE_SEED = 0x51A7


def reference_rank(value_counts: torch.Tensor, q: float) -> torch.Tensor:
    """0-based ascending index of the q-quantile, ``floor(q * (n - 1))`` in float32 as torch.quantile."""
    q32 = torch.tensor(q, dtype=torch.float32, device=value_counts.device)
    return torch.floor(q32 * (value_counts - 1).to(torch.float32)).to(torch.int64)


@functools.lru_cache(maxsize=256)
def host_reference_rank(width: int, q: float) -> int:
    """:func:`reference_rank` of ``width`` values, as a Python int."""
    return int(reference_rank(torch.tensor(width), q))


def sample_rank(rank: torch.Tensor, width: torch.Tensor, sample_size: torch.Tensor) -> torch.Tensor:
    """0-based ascending index, in a sorted sample of ``sample_size`` of ``width`` values, whose
    expected batch index is ``rank``: the j-th smallest (1-based) of s values drawn from n has
    expected rank ``j (n + 1) / (s + 1)``. Exact (``rank`` itself) when ``s == n``."""
    one_based = torch.div((rank + 1) * (sample_size + 1) * 2 + width + 1, (width + 1) * 2, rounding_mode="floor")
    return torch.minimum((one_based - 1).clamp(min=0), (sample_size - 1).clamp(min=0))


@dataclasses.dataclass(frozen=True)
class SamplePlan:
    """Where the reference of a channel of ``width`` values is estimated from.

    ``positions``: ``groups * group_size`` positions in [0, width), in random order
    (consecutive entries form a group); ``from_top``: the reference is the
    ``from_top``-th largest of the ``groups`` group maxima."""

    positions: torch.Tensor
    groups: int
    group_size: int
    from_top: int

    @property
    def kth(self) -> int:
        """``torch.kthvalue``'s (1-based, ascending) k among the group maxima."""
        return self.groups - self.from_top + 1


def selects_reference(batch_number: int, channels: int, every: int) -> bool:
    """Whether a point of ``channels`` channels selects its reference on its ``batch_number``-th
    batch (0-based), when wide points select on one batch in ``every``."""
    return channels <= SELECT_EVERY_BATCH_UP_TO or batch_number % every == 0


def is_exact(width: int, channels: int, sample_size: int | None) -> bool:
    """Whether the reference of a batch of ``channels`` x ``width`` values is selected exactly."""
    return sample_size is None or width * channels <= EXACT_VALUES


def sample_plan(width: int, q: float, sample_size: int, device: torch.device) -> SamplePlan:
    """The (cached) :class:`SamplePlan` for channels of ``width`` values."""
    return _device_plan(width, q, sample_size, torch.device(device))


@functools.lru_cache(maxsize=128)
def _device_plan(width: int, q: float, sample_size: int, device: torch.device) -> SamplePlan:
    plan = _plan(width, q, sample_size)
    return dataclasses.replace(plan, positions=plan.positions.to(device))


@functools.lru_cache(maxsize=128)
def _plan(width: int, q: float, sample_size: int) -> SamplePlan:
    if sample_size < 1:
        raise ValueError(f"percentile_sample must be a positive number of values, got {sample_size}")
    taken = min(width, sample_size)
    rank = host_reference_rank(width, q)
    from_top = taken - int(sample_rank(torch.tensor(rank), torch.tensor(width), torch.tensor(taken)))
    group_size = max(1, min(_LARGEST_GROUP, taken // (_MAXIMA_PER_RANK * from_top)))
    groups = taken // group_size
    generator = torch.Generator().manual_seed(_SAMPLE_SEED)
    if width <= sample_size:
        # Every value, in random order; up to group_size - 1 of them left out so groups are whole.
        positions = torch.randperm(width, generator=generator)[: groups * group_size]
    else:
        # Independent uniform draws: no stride can line up with periodic structure (image rows,
        # token positions), and the sampled ranks are exactly uniform.
        positions = torch.randint(width, (groups * group_size,), generator=generator)
    kept = groups * group_size  # the rank among the values kept (exact when all are)
    from_top = kept - int(sample_rank(torch.tensor(rank), torch.tensor(width), torch.tensor(kept)))
    return SamplePlan(positions, groups, group_size, min(from_top, groups))
