"""Running statistics (qlint.stats.fold.RunningStats) and the observer's stream.

An observer folds each batch's summary into running totals, a few batches at
a time; its statistics must equal those of the per-batch stats merged one by
one, up to float64 re-association, whatever the layout, the fold size and the
mix of finite and non-finite batches."""

from __future__ import annotations

import math

import pytest
import torch

from qlint.linter.calibration import ObservationPoint, insert_observers
from qlint.stats import StatsObserver, TensorStats, summarize_batch
from qlint.stats import fold as fold_module
from qlint.stats.batch import summarize_values
from qlint.stats.fold import RunningStats

from .test_stats_merge import assert_stats_equal


def _merged(batches, channel_axis, q=0.975, **kwargs) -> TensorStats:
    stats = TensorStats.empty(channel_axis, q)
    for batch in batches:
        stats = stats.merge(summarize_batch(batch, channel_axis, q, **kwargs))
    return stats


def _ratio_scale(batches, channel_axis, q=0.975):
    return sum(summarize_batch(b, channel_axis, q).percentile_ratio_sum.abs() for b in batches)


def _batches(shape, count, seed=0):
    generator = torch.Generator().manual_seed(seed)
    # Shifted and scaled per batch so minima, maxima, ranges and ratios differ between batches.
    return [torch.randn(shape, generator=generator) * (1 + i) + 0.3 * i for i in range(count)]


LAYOUTS = {  # shape, channel axis
    "channel-last": ((6, 40, 24), -1),
    "channel-major": ((1, 8, 3000), 1),
    "nchw-short-runs": ((4, 6, 5, 5), 1),
    "nchw-long-runs": ((2, 3, 40, 40), 1),
    "sampled-channel-last": ((64, 128, 8), -1),
    "whole-tensor": ((5, 7, 300), None),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("percentile", [True, False])
@pytest.mark.parametrize("histogram", [True, False])
def test_running_stats_equal_merged_batches(layout, percentile, histogram):
    shape, axis = LAYOUTS[layout]
    batches = _batches(shape, 7)
    summaries = [summarize_values(b, axis, 0.975, percentile=percentile, histogram=histogram) for b in batches]
    running = RunningStats(summaries[0].channels, "cpu", capacity=3)  # two folds and a partial one
    for summary in summaries:
        running.add(summary)
    assert len(running) == len(batches)
    expected = _merged(batches, axis, percentile=percentile, histogram=histogram)
    assert_stats_equal(running.stats(axis, 0.975), expected, ratio_scale=_ratio_scale(batches, axis))
    # stats() is a snapshot: batches added later do not change it
    snapshot = running.stats(axis, 0.975)
    running.add(summaries[0])
    assert int(snapshot.batches) == len(batches) and int(running.stats(axis, 0.975).batches) == len(batches) + 1


def test_running_stats_count_constant_and_zero_quantile_batches():
    zeros = torch.zeros(64, 3)
    spikes = torch.zeros(64, 3)
    spikes[0] = torch.tensor([5.0, -1.0, 0.0])  # quantile 0 with a non-zero max in channel 0 only
    batches = [zeros, spikes, torch.rand(64, 3, generator=torch.Generator().manual_seed(5)) + 0.5]
    running = RunningStats(3, "cpu")
    for batch in batches:
        running.add(summarize_values(batch, -1, 0.975, histogram=False))
    stats = running.stats(-1, 0.975)
    assert stats.constant_batches.tolist() == [1, 1, 2]
    assert stats.zero_denominator_batches.tolist() == [1, 0, 0]
    assert stats.percentile_ratio_batches.tolist() == [1, 1, 1]  # channel 1 of `spikes`: max 0, quantile 0
    assert int(stats.batches) == 3 and int(stats.range_batches) == 3


def test_running_stats_refuse_another_width_or_dtype():
    running = RunningStats(4, "cpu")
    with pytest.raises(ValueError, match="does not fit"):
        running.add(summarize_values(torch.randn(2, 5, 3), 1, 0.975))
    with pytest.raises(ValueError, match="does not fit"):
        running.add(summarize_values(torch.randn(2, 4, 3, dtype=torch.float64), 1, 0.975))
    running.add(summarize_values(torch.randn(2, 4, 3), 1, 0.975))
    assert len(running) == 1


@pytest.mark.parametrize("layout", ["channel-last", "whole-tensor", "sampled-channel-last"])
def test_a_stream_counts_the_reference_of_the_batches_that_selected_it(layout):
    """Batches without a reference (a wide point selects it on some batches only) add to every
    statistic but the percentile ratio's, as the merged per-batch stats do."""
    shape, axis = LAYOUTS[layout]
    batches = _batches(shape, 7)
    selected = [True, False, False, True, False, True, True]
    summaries = [summarize_values(b, axis, 0.975, percentile=s, histogram=False) for b, s in zip(batches, selected)]
    running = RunningStats(summaries[0].channels, "cpu", capacity=3)
    for summary in summaries:
        running.add(summary)
    stats = running.stats(axis, 0.975)
    expected = TensorStats.empty(axis, 0.975)
    for batch, taken in zip(batches, selected):
        expected = expected.merge(summarize_batch(batch, axis, percentile=taken, histogram=False))
    assert int(stats.reference_batches) == sum(selected) == int(expected.reference_batches)
    assert int(stats.batches) == len(batches)
    assert_stats_equal(stats, expected, ratio_scale=_ratio_scale(batches, axis))


def test_a_wide_observer_selects_its_reference_on_every_other_batch_and_a_narrow_one_on_each():
    wide = StatsObserver(-1, histogram=False, percentile_every=2)
    narrow = StatsObserver(-1, histogram=False, percentile_every=2)
    wide_batches, narrow_batches = _batches((8, 16, 40), 5), _batches((8, 16, 32), 5)
    for wide_batch, narrow_batch in zip(wide_batches, narrow_batches):
        wide(wide_batch)
        narrow(narrow_batch)
    assert int(wide.stats.reference_batches) == 3 and int(narrow.stats.reference_batches) == 5
    expected = TensorStats.empty(-1, 0.975)
    for number, batch in enumerate(wide_batches):
        expected = expected.merge(summarize_batch(batch, -1, percentile=number % 2 == 0, histogram=False))
    assert_stats_equal(wide.stats, expected, ratio_scale=_ratio_scale(wide_batches, -1))
    every = StatsObserver(-1, histogram=False, percentile_every=1)
    for batch in wide_batches:
        every(batch)
    assert int(every.stats.reference_batches) == 5


def test_observer_mixes_finite_and_non_finite_batches_like_one_stream(monkeypatch):
    monkeypatch.setattr(fold_module, "FOLD_EVERY", 4)
    batches = _batches((3, 5, 40), 9)
    batches[2] = batches[2].clone()
    batches[2][0, 1, 3] = float("inf")  # the general path counts it
    batches[4] = batches[4].double()  # float64: summed in float64
    batches[6] = torch.full((3, 5, 40), math.nan)  # no finite value at all
    observer = StatsObserver(channel_axis=1, histogram=True)
    for batch in batches:
        observer(batch)
    stats = observer.stats
    assert int(stats.inf_count.sum()) == 1 and int(stats.batches) == 9 and int(stats.range_batches) == 8
    assert_stats_equal(stats, _merged(batches, 1), ratio_scale=_ratio_scale(batches, 1))


def test_observer_with_a_wrong_expected_width_still_measures_the_first_batch():
    observer = StatsObserver(channel_axis=-1, expected_channels=9)
    assert observer._running is not None and observer._running.channels == 9  # allocated up front
    batches = _batches((4, 16, 3), 3)
    for batch in batches:
        observer(batch)
    assert_stats_equal(observer.stats, _merged(batches, -1), ratio_scale=_ratio_scale(batches, -1))
    with pytest.raises(ValueError, match="channel count changed from 3 to 4"):
        observer(torch.randn(4, 16, 4))


def test_observer_continues_from_a_loaded_state():
    batches = _batches((2, 3, 50), 4)
    first = StatsObserver(channel_axis=1)
    for batch in batches[:2]:
        first(batch)
    resumed = StatsObserver(channel_axis=1)
    resumed.load_state_dict(first.state_dict())
    for batch in batches[2:]:
        resumed(batch)
    assert_stats_equal(resumed.stats, _merged(batches, 1), ratio_scale=_ratio_scale(batches, 1))


def test_inserted_observers_allocate_their_buffers_before_calibration():
    model = torch.nn.Sequential(torch.nn.Linear(12, 20), torch.nn.ReLU(), torch.nn.Linear(20, 7))
    traced = torch.fx.symbolic_trace(model)
    torch.fx.passes.shape_prop.ShapeProp(traced).propagate(torch.randn(5, 12))
    points = [
        ObservationPoint("_0", "input", 0, -1),
        ObservationPoint("_2", "input", 0, -1),
        ObservationPoint("_2", "output", 0, None),
    ]
    observed, observers, skipped = insert_observers(traced, points)
    assert not skipped
    widths = {point: observer._running.channels for point, observer in observers.items()}
    assert widths == {points[0]: 12, points[1]: 20, points[2]: 1}
    observed(torch.randn(5, 12))
    assert [int(observers[point].stats.batches) for point in points] == [1, 1, 1]


def test_observers_of_one_tensor_summarize_it_once_across_other_settings(monkeypatch):
    """The q/k/v pattern: three per-channel observers of one tensor, each followed by a
    per-tensor observer of another tensor. The tensor is summarized once; an in-place change
    in between makes the next observer summarize it again; the stats equal separate streams."""
    from qlint.stats.batch import BatchReader

    calls = []
    real = BatchReader.summarize

    def counting(reader, value, *args, **kwargs):
        calls.append(value.shape)
        return real(reader, value, *args, **kwargs)

    monkeypatch.setattr(BatchReader, "summarize", counting)
    shared = torch.randn(2, 5, 8)
    per_channel = [StatsObserver(-1) for _ in range(3)]
    per_tensor = [StatsObserver(None) for _ in range(3)]
    for channel_observer, tensor_observer in zip(per_channel, per_tensor):
        channel_observer(shared)
        tensor_observer(torch.randn(2, 5, 4))
    assert len(calls) == 1 + 3  # the shared tensor once, each other tensor once
    for observer in per_channel[1:]:
        assert_stats_equal(observer.stats, per_channel[0].stats)
    expected = per_channel[0].stats
    shared.mul_(2.0)
    StatsObserver(-1)(shared)
    assert len(calls) == 5
    assert_stats_equal(expected, summarize_batch(shared / 2.0, -1))


def test_an_observer_works_under_inference_mode():
    """Inference tensors have no version counter: the summary reuse must not need one."""
    observer = StatsObserver(1)
    with torch.inference_mode():
        batch = torch.randn(4, 3, 5)
        observer(batch)
        observer(batch)
    assert int(observer.stats.batches) == 2
    assert torch.equal(observer.stats.count, torch.full((3,), 40))
