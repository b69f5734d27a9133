"""Running statistics on the compiled path (qlint.stats.stream) and the memory
helpers calibration relies on.

A KernelStream folds each batch into running totals as it arrives; its
statistics must equal those of the per-batch summaries merged one by one
(the path every other batch takes), up to float64 re-association."""

from __future__ import annotations

import ctypes
import platform

import pytest
import torch

from qlint.linter.calibration import insert_observers
from qlint.stats import StatsObserver, TensorStats, kernel, summarize_batch
from qlint.stats.accumulator import ScratchBuffers
from qlint.stats.memory import FreeHeapReturner, off_heap_empty, resident_bytes
from qlint.stats.stream import KernelStream

from .test_stats_merge import assert_stats_equal

needs_kernel = pytest.mark.skipif(not kernel.available(), reason="the compiled statistics kernel is not built here")


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
    "whole-tensor": ((5, 7, 300), None),
}


@needs_kernel
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("percentile", [True, False])
@pytest.mark.parametrize("histogram", [True, False])
def test_stream_equals_merged_batches(layout, percentile, histogram):
    shape, axis = LAYOUTS[layout]
    batches = _batches(shape, 7)
    stream = KernelStream(axis, 0.975, percentile=percentile, histogram=histogram)
    scratch = ScratchBuffers()
    for batch in batches:
        assert stream.add(batch, scratch)
    assert len(stream) == len(batches)
    expected = _merged(batches, axis, percentile=percentile, histogram=histogram)
    assert_stats_equal(stream.take(), expected, sum_rtol=1e-6, ratio_scale=_ratio_scale(batches, axis))
    assert len(stream) == 0 and int(stream.take().batches) == 0  # take() forgets what it returned


@needs_kernel
def test_stream_counts_constant_and_zero_quantile_batches():
    zeros = torch.zeros(64, 3)
    spikes = torch.zeros(64, 3)
    spikes[0] = torch.tensor([5.0, -1.0, 0.0])  # quantile 0 with a non-zero max in channel 0 only
    # positive: float32 partial sums carry relative error only against sums that do not cancel
    batches = [zeros, spikes, torch.rand(64, 3, generator=torch.Generator().manual_seed(5)) + 0.5]
    stream = KernelStream(-1, 0.975, percentile=True, histogram=False)
    for batch in batches:
        assert stream.add(batch, ScratchBuffers())
    stats = stream.take()
    assert stats.constant_batches.tolist() == [1, 1, 2]
    assert stats.zero_denominator_batches.tolist() == [1, 0, 0]
    assert_stats_equal(stats, _merged(batches, -1, histogram=False), sum_rtol=1e-6)


@needs_kernel
def test_stream_refuses_what_the_kernel_cannot_take():
    stream = KernelStream(1, 0.975, percentile=True, histogram=False)
    scratch = ScratchBuffers()
    poisoned = torch.randn(2, 4, 50)
    poisoned[1, 2, 7] = float("nan")
    assert not stream.add(poisoned, scratch)
    assert not stream.add(torch.randn(2, 4, 50, dtype=torch.float64), scratch)
    assert stream.add(torch.randn(2, 4, 50), scratch)
    assert not stream.add(torch.randn(2, 5, 50), scratch)  # the width is fixed once a batch is in
    assert len(stream) == 1


@needs_kernel
def test_observer_mixes_compiled_and_general_batches_like_one_stream():
    batches = _batches((3, 5, 40), 6)
    batches[2] = batches[2].clone()
    batches[2][0, 1, 3] = float("inf")  # refused by the kernel: the general path counts it
    batches[4] = batches[4].double()  # not float32: general path
    observer = StatsObserver(channel_axis=1, histogram=True)
    for batch in batches:
        observer(batch)
    stats = observer.stats
    assert int(stats.inf_count.sum()) == 1 and int(stats.batches) == 6
    assert_stats_equal(stats, _merged(batches, 1), sum_rtol=1e-6, ratio_scale=_ratio_scale(batches, 1))


@needs_kernel
def test_observer_with_a_wrong_expected_width_still_measures_the_first_batch():
    observer = StatsObserver(channel_axis=-1, expected_channels=9)
    assert observer._stream is not None and observer._stream.channels == 9  # allocated up front
    batches = _batches((4, 16, 3), 3)
    for batch in batches:
        observer(batch)
    assert_stats_equal(observer.stats, _merged(batches, -1), sum_rtol=1e-6, ratio_scale=_ratio_scale(batches, -1))
    with pytest.raises(ValueError, match="channel count changed from 3 to 4"):
        observer(torch.randn(4, 16, 4))


@needs_kernel
def test_inserted_observers_allocate_their_buffers_before_calibration():
    model = torch.nn.Sequential(torch.nn.Linear(12, 20), torch.nn.ReLU(), torch.nn.Linear(20, 7))
    traced = torch.fx.symbolic_trace(model)
    torch.fx.passes.shape_prop.ShapeProp(traced).propagate(torch.randn(5, 12))
    from qlint.linter.calibration import ObservationPoint

    points = [ObservationPoint("_0", "input", 0, -1), ObservationPoint("_2", "input", 0, -1),
              ObservationPoint("_2", "output", 0, None)]
    observed, observers, skipped = insert_observers(traced, points)
    assert not skipped
    widths = {point: observer._stream.channels for point, observer in observers.items()}
    assert widths == {points[0]: 12, points[1]: 20, points[2]: 1}
    observed(torch.randn(5, 12))
    assert [int(observers[point].stats.batches) for point in points] == [1, 1, 1]


@needs_kernel
def test_kernel_buffers_are_checked():
    values = torch.randn(4, 3, 1)
    out = torch.empty(6, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match="out must be"):
        kernel.summarize_into(values, 2, torch.empty(6, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="out must be"):
        kernel.summarize_into(values, 2, torch.empty(6, 3))
    with pytest.raises(ValueError, match="share memory"):
        kernel.summarize_into(values, 2, out, hint=out[5])
    with pytest.raises(ValueError, match="key_counts must be"):
        kernel.summarize_into(values, 2, out, key_counts=torch.zeros(2, 256, dtype=torch.int64))
    assert kernel.summarize_into(values, 2, out)
    with pytest.raises(ValueError, match="totals must be"):
        kernel.fold(out, torch.zeros(5, 2, dtype=torch.float64), torch.zeros(3, 3, dtype=torch.int64), True)
    with pytest.raises(ValueError, match="flags must be"):
        kernel.fold(out, torch.zeros(5, 3, dtype=torch.float64), torch.zeros(3, 3, dtype=torch.int32), True)


@needs_kernel
def test_fold_adds_one_summary_to_running_totals():
    values = torch.randn(50, 4, 1)
    summary = torch.empty(6, 4, dtype=torch.float64)
    assert kernel.summarize_into(values, 3, summary)
    totals = torch.tensor([[float("inf")] * 4, [float("-inf")] * 4, [1.0] * 4, [2.0] * 4, [0.5] * 4],
                          dtype=torch.float64)
    flags = torch.zeros(3, 4, dtype=torch.int64)
    batch_range = kernel.fold(summary, totals, flags, True)
    columns = values[:, :, 0].double()
    assert batch_range == float(columns.max() - columns.min())
    assert torch.equal(totals[0], columns.amin(0)) and torch.equal(totals[1], columns.amax(0))
    torch.testing.assert_close(totals[2], 1.0 + summary[2], rtol=0, atol=0)
    torch.testing.assert_close(totals[4], 0.5 + summary[1] / summary[4], rtol=0, atol=0)
    assert flags.tolist() == [[1] * 4, [0] * 4, [0] * 4]


def test_off_heap_buffers_live_outside_the_malloc_heap():
    tensor = off_heap_empty(3000, torch.float64)
    tensor.fill_(2.0)
    assert tensor.shape == (3000,) and float(tensor.sum()) == 6000.0
    address = tensor.data_ptr()
    with open("/proc/self/maps") as maps:
        regions = [line.split() for line in maps]
    holding = [r for r in regions if int(r[0].split("-")[0], 16) <= address < int(r[0].split("-")[1], 16)]
    assert len(holding) == 1 and not (len(holding[0]) > 5 and holding[0][5] == "[heap]")
    assert off_heap_empty(0, torch.int64).numel() == 0


@pytest.mark.skipif(platform.system() != "Linux" or not hasattr(ctypes.CDLL(None), "malloc_trim"),
                    reason="glibc's malloc_trim on Linux only")
def test_heap_is_trimmed_after_the_first_batch_and_then_only_when_rss_grows():
    returner = FreeHeapReturner(growth=16 << 20)
    returner()
    assert returner.trims == 1
    returner()
    assert returner.trims == 1  # resident memory did not grow
    held = torch.ones(40 << 20, dtype=torch.uint8)  # 40 MiB, touched: resident
    assert resident_bytes() is not None
    returner()
    assert returner.trims == 2 and int(held[-1]) == 1
