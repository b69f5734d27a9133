"""The reference quantile (qlint.stats.selection): exact for small batches or on request,
estimated from a bounded sample otherwise, within the documented level bounds.

Expected values come from torch.quantile and torch.kthvalue on the raw data."""

from __future__ import annotations

import pytest
import torch

from qlint.stats import PERCENTILE_SAMPLE, StatsObserver, summarize_batch
from qlint.stats.batch import summarize_values
from qlint.stats.selection import EXACT_VALUES, host_reference_rank, sample_plan

# The batch level of the sampled reference (the fraction of the channel's values below it)
# lies in [0.937, 0.993] for q = 0.975 and in [0.834, 0.936] for q = 0.9 with probability
# 98 % (1 % each side; bench/percentile_bound.py, docs/architecture.md "Statistics"). The
# tests take a slightly wider band and require 98 % of 512 channels inside it.
LEVEL_BOUNDS = {0.975: (0.925, 0.995), 0.9: (0.82, 0.945)}


def _quantile_ratio(per_channel: torch.Tensor, q: float) -> torch.Tensor:
    quantiles = torch.quantile(per_channel, torch.tensor([q, 1.0]), dim=1, interpolation="lower").double()
    return quantiles[1] / quantiles[0]


@pytest.mark.parametrize(
    "shape", [(8, 128, 64), (3, 1500, 16), (64, 32), (4, 8, 96)]
)  # last: 32 values each, torch picks the second largest
@pytest.mark.parametrize("q", [0.975, 0.9])
def test_exact_reference_matches_quantile_per_feature(shape, q):
    batch = torch.randn(*shape, generator=torch.Generator().manual_seed(5)).relu() + 0.01
    stats = summarize_batch(batch, -1, q, percentile_sample=None)
    per_feature = batch.reshape(-1, shape[-1]).T  # (features, values)
    torch.testing.assert_close(stats.percentile_ratio_sum, _quantile_ratio(per_feature, q), rtol=1e-12, atol=0)
    assert torch.equal(stats.channel_min, per_feature.amin(1).double())
    assert torch.equal(stats.channel_max, per_feature.amax(1).double())
    torch.testing.assert_close(stats.sum, per_feature.double().sum(1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(stats.sum_of_squares, per_feature.double().square().sum(1), rtol=1e-5, atol=0)


@pytest.mark.parametrize(
    "shape, axis",
    [
        ((4, 16, 20, 20), 1),
        ((2, 64, 100), -1),
        ((1, 3, 10_000), 1),
        ((4096, 8), 1),
        ((2, 16384), None),
        ((8, 129, 4), 1),
    ],
)
def test_small_batches_get_the_exact_reference_by_default(shape, axis):
    batch = torch.randn(*shape, generator=torch.Generator().manual_seed(2)).exp()
    assert batch.numel() <= EXACT_VALUES
    assert torch.equal(
        summarize_batch(batch, axis).percentile_ratio_sum,
        summarize_batch(batch, axis, percentile_sample=None).percentile_ratio_sum,
    )


def _reference_levels(batch: torch.Tensor, channel_axis: int, q: float) -> torch.Tensor:
    """Per channel: the fraction of the batch's values below the sampled reference."""
    summary = summarize_values(batch, channel_axis, q, histogram=False)
    per_channel = batch.movedim(channel_axis, 0).reshape(batch.shape[channel_axis], -1)
    return (per_channel < summary.reference.unsqueeze(1)).double().mean(1)


@pytest.mark.parametrize(
    "make, channel_axis",
    [
        (lambda g: torch.randn(64, 48, 512, generator=g), -1),  # channel-last, 3072 values per channel
        (lambda g: torch.randn(16, 512, 32, 32, generator=g).relu() + 1e-3, 1),  # NCHW, sampled
        (lambda g: torch.randn(200, 512, generator=g).exp() ** 3, 1),  # 200 values: all of them, in groups
        (lambda g: torch.randn(4, 512, 8, 8, generator=g).pow(3), 1),  # short runs, copied channel-major
    ],
    ids=["channel-last", "nchw", "all-values", "short-runs"],
)
@pytest.mark.parametrize("q", [0.975, 0.9])
def test_sampled_reference_lies_within_the_documented_level_bounds(make, channel_axis, q):
    batch = make(torch.Generator().manual_seed(11))
    assert batch.numel() > EXACT_VALUES
    levels = _reference_levels(batch, channel_axis, q)
    low, high = LEVEL_BOUNDS[q]
    inside = ((levels >= low) & (levels <= high)).double().mean()
    assert inside >= 0.98, (float(levels.min()), float(levels.max()), float(inside))
    # biased by less than one level point (group maxima, the sample rank's rounding): the
    # error mostly averages out over batches
    width = batch.numel() // batch.shape[channel_axis]
    assert abs(float(levels.mean()) - host_reference_rank(width, q) / width) < 0.01


def test_sample_positions_are_fixed_and_leave_the_global_rng_alone():
    state = torch.random.get_rng_state()
    plan = sample_plan(100_000, 0.975, PERCENTILE_SAMPLE, torch.device("cpu"))
    again = sample_plan(100_000, 0.975, PERCENTILE_SAMPLE, torch.device("cpu"))
    assert torch.equal(torch.random.get_rng_state(), state)
    assert torch.equal(plan.positions, again.positions)
    assert plan.positions.numel() == plan.groups * plan.group_size <= PERCENTILE_SAMPLE
    assert int(plan.positions.min()) >= 0 and int(plan.positions.max()) < 100_000
    assert 1 <= plan.from_top <= plan.groups
    # all values, each once, when a channel has fewer than the sample
    small = sample_plan(200, 0.975, PERCENTILE_SAMPLE, torch.device("cpu"))
    assert small.positions.unique().numel() == small.positions.numel() > 200 - small.group_size


def test_exact_ranks_follow_torch_quantile_arithmetic():
    # floor(0.7 * 90) is 62 in float64 but 63 in float32, which torch.quantile uses.
    assert host_reference_rank(91, 0.7) == 63


def test_channel_last_non_finite_batch_takes_general_path():
    batch = torch.randn(6, 50, 4)
    batch[0, 0, 1] = float("nan")
    batch[1, 2, 2] = float("inf")
    stats = summarize_batch(batch, -1, 0.975)
    assert stats.nan_count.tolist() == [0, 1, 0, 0] and stats.inf_count.tolist() == [0, 0, 1, 0]
    assert stats.count.tolist() == [300, 299, 299, 300]
    finite_feature = batch[..., 0].reshape(-1)
    expected = finite_feature.max() / torch.quantile(finite_feature, 0.975, interpolation="lower")
    torch.testing.assert_close(stats.percentile_ratio_sum[0], expected.double(), rtol=1e-6, atol=0)


def test_sampled_general_path_equals_fast_path_on_finite_data():
    batch = torch.randn(64, 48, 512, generator=torch.Generator().manual_seed(4))
    fast = summarize_batch(batch, -1, sync_free=False)
    general = summarize_batch(batch, -1, sync_free=True)
    assert torch.equal(fast.percentile_ratio_sum, general.percentile_ratio_sum)


def test_observer_reports_a_width_change():
    observer = StatsObserver(channel_axis=1)
    observer(torch.randn(2, 3, 4))
    with pytest.raises(ValueError, match="channel count changed from 3 to 5"):
        observer(torch.randn(2, 5, 4))
    assert int(observer.stats.batches) == 1


def test_lint_releases_the_thread_work_buffers():
    import qlint
    from qlint.stats import thread_scratch_buffers

    conv_input = torch.randn(4, 3, 16, 16)
    summarize_batch(conv_input, 1, 0.975, scratch=thread_scratch_buffers())  # a channel-major copy
    assert thread_scratch_buffers().nbytes > 0
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU())
    qlint.lint(
        model,
        (conv_input,),
        calibration=[conv_input, conv_input],
        select=["QL203"],
        calibration_options={"quiet": True},
    )
    assert thread_scratch_buffers().nbytes == 0
