"""Exact per-channel selection (qlint.stats.selection) and the channel-last / chunked paths.

Expected values come from torch.kthvalue and torch.quantile on the raw data."""

from __future__ import annotations

import pytest
import torch

from qlint.stats import StatsObserver, TensorStats, selection, summarize_batch
from qlint.stats import observer as observer_module


def _expected_kth_largest(columns: torch.Tensor, m: int) -> torch.Tensor:
    return columns.kthvalue(columns.shape[0] - m + 1, dim=0).values


@pytest.mark.parametrize(
    "make",
    [
        lambda g: torch.randn(1024, 256, generator=g),
        lambda g: torch.randn(8192 + 77, 33, generator=g),  # leftover rows at several levels
        lambda g: torch.randn(5000, 7, generator=g).relu(),  # many ties at 0
        lambda g: torch.randint(0, 4, (3000, 9), generator=g).float(),  # heavy ties
        lambda g: torch.randn(700, 5, generator=g).exp() ** 3,
        lambda g: torch.full((2048, 3), 1.5),  # constant
        lambda g: torch.arange(4096.0).repeat(6, 1).T.contiguous(),  # sorted columns
        lambda g: torch.arange(4096.0).flip(0).repeat(6, 1).T.contiguous(),
        lambda g: torch.randn(40, 12, generator=g),  # too short for a tournament
    ],
)
@pytest.mark.parametrize("fraction", [0.025, 0.0, 0.3, 1.0])
def test_kth_largest_of_columns_is_exact(make, fraction, selection_backend):
    columns = make(torch.Generator().manual_seed(11))
    width = columns.shape[0]
    m = min(width, max(1, round(fraction * width)))
    column_max, got = selection.max_and_kth_largest_of_columns(columns, m)
    assert torch.equal(got, _expected_kth_largest(columns, m))
    assert torch.equal(column_max, columns.amax(0))
    assert torch.equal(selection.kth_largest_of_columns(columns, m), got)


def test_kth_largest_of_columns_rejects_bad_m():
    with pytest.raises(ValueError):
        selection.kth_largest_of_columns(torch.randn(10, 2), 0)
    with pytest.raises(ValueError):
        selection.kth_largest_of_columns(torch.randn(10, 2), 11)


@pytest.mark.parametrize("shape", [(8, 128, 64), (3, 1500, 16), (64, 32)])
@pytest.mark.parametrize("q", [0.975, 0.9])
def test_channel_last_batch_matches_quantile_per_feature(shape, q, selection_backend):
    batch = torch.randn(*shape, generator=torch.Generator().manual_seed(5)).relu() + 0.01
    stats = summarize_batch(batch, -1, q)
    per_feature = batch.reshape(-1, shape[-1]).T  # (features, values)
    quantiles = torch.quantile(per_feature, torch.tensor([q, 1.0]), dim=1, interpolation="lower").double()
    torch.testing.assert_close(stats.percentile_ratio_sum, quantiles[1] / quantiles[0], rtol=1e-12, atol=0)
    assert torch.equal(stats.channel_min, per_feature.amin(1).double())
    assert torch.equal(stats.channel_max, per_feature.amax(1).double())
    torch.testing.assert_close(stats.sum, per_feature.double().sum(1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(stats.sum_of_squares, per_feature.double().square().sum(1), rtol=1e-5, atol=0)


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


def test_observer_folds_chunks_like_one_stream(monkeypatch):
    monkeypatch.setattr(observer_module, "FOLD_EVERY", 3)
    batches = [torch.randn(4, 6, 5, generator=torch.Generator().manual_seed(i)) for i in range(8)]
    observer = StatsObserver(channel_axis=1)
    for batch in batches:
        observer(batch)
    expected = TensorStats.empty(1, 0.975)
    for batch in batches:
        expected = expected.merge(summarize_batch(batch, 1, 0.975))
    stats = observer.stats
    assert int(stats.batches) == 8
    for name in ("channel_min", "channel_max", "count", "constant_batches", "percentile_ratio_batches"):
        assert torch.equal(getattr(stats, name), getattr(expected, name)), name
    for name in ("sum", "sum_of_squares", "percentile_ratio_sum", "batch_range_sum"):
        torch.testing.assert_close(getattr(stats, name), getattr(expected, name), rtol=1e-12, atol=0)


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
    qlint.lint(model, (conv_input,), calibration=[conv_input, conv_input], select=["QL203"],
               calibration_options={"quiet": True})
    assert thread_scratch_buffers().nbytes == 0
