"""Mergeability and correctness of qlint.stats.

Expected values are recomputed here from the raw batches with plain torch
(sorting via torch.quantile, frexp for histogram bins, float64 sums), never
from qlint's own helpers, and merged stats are compared with the stats of the
concatenated stream.
"""

from __future__ import annotations

import math
from collections import Counter
from functools import reduce

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qlint.stats import (
    HISTOGRAM_SHAPE,
    StatsObserver,
    TensorStats,
    histogram_bin_edges,
    summarize_batch,
    update_stats,
)
from qlint.stats import batch as batch_module
from qlint.stats.accumulator import TENSOR_FIELDS

EXACT_FIELDS = [name for name in TENSOR_FIELDS if getattr(TensorStats.empty(), name).dtype == torch.int64] + [
    "channel_min",
    "channel_max",
]
SUMMED_FLOAT_FIELDS = ["sum", "sum_of_squares", "percentile_ratio_sum", "batch_range_sum"]


def stream_stats(batches, channel_axis=1, q=0.975, **kwargs) -> TensorStats:
    start = TensorStats.empty(channel_axis, q)
    return reduce(lambda stats, batch: stats.merge(summarize_batch(batch, channel_axis, q, **kwargs)), batches, start)


def assert_stats_equal(
    actual: TensorStats, expected: TensorStats, sum_rtol: float = 1e-12, ratio_scale: torch.Tensor | None = None
) -> None:
    """Counts, extrema and histograms bit-exact; float64 sums up to re-association.

    ``ratio_scale``: per channel, the sum of |per-batch ratio sums|. Percentile
    ratios are signed (a negative reference quantile, e.g. q = 0.5 of signed
    data), so their sum can cancel to near zero, where re-association error is
    only small relative to the magnitudes summed, not to the result."""
    assert actual.channel_axis == expected.channel_axis
    assert actual.reference_percentile == expected.reference_percentile
    for name in EXACT_FIELDS:
        assert torch.equal(getattr(actual, name), getattr(expected, name)), name
    for name in SUMMED_FLOAT_FIELDS:
        rtol = sum_rtol if name in ("sum", "sum_of_squares") else 1e-12
        got, want = getattr(actual, name), getattr(expected, name)
        if name == "percentile_ratio_sum" and ratio_scale is not None:
            assert bool(((got - want).abs() <= 1e-12 * ratio_scale + rtol * want.abs()).all()), (name, got, want)
        else:
            torch.testing.assert_close(got, want, rtol=rtol, atol=0, msg=name)


def as_channel_rows(batch: torch.Tensor, channel_axis: int) -> torch.Tensor:
    return batch.movedim(channel_axis, 0).reshape(batch.shape[channel_axis], -1).double()


def expected_histogram(values: torch.Tensor) -> torch.Tensor:
    """Histogram by frexp: |x| = mantissa * 2**e, mantissa in [0.5, 1) -> bin e + 126."""
    finite = values[torch.isfinite(values)].float()
    _, exponent = torch.frexp(finite)
    biased = torch.where(finite.abs() < torch.finfo(torch.float32).tiny, 0, exponent + 126)
    sign = torch.signbit(finite).long()
    histogram = torch.zeros(HISTOGRAM_SHAPE, dtype=torch.int64)
    for (s, e), n in Counter(zip(sign.tolist(), biased.tolist())).items():
        histogram[s, e] += n
    return histogram


def expected_percentile_terms(rows: torch.Tensor, q: float):
    """Per channel: (ratio or None, zero_denominator, constant) following torch's rules."""
    terms = []
    for row in rows:
        row = row[torch.isfinite(row)].float()
        if row.numel() == 0:
            terms.append((None, False, False))
            continue
        low, ref, top = torch.quantile(row, torch.tensor([0.0, q, 1.0]), interpolation="lower").double().tolist()
        ratio = top / ref if ref != 0 else None
        terms.append((ratio, ref == 0 and top != 0, top == low))
    return terms


# ----------------------------------------------------------------- strategies
@st.composite
def batch_streams(draw):
    seed = draw(st.integers(0, 2**31 - 1))
    generator = torch.Generator().manual_seed(seed)
    channels = draw(st.integers(1, 5))
    spatial = draw(st.sampled_from([(), (1,), (7,), (3, 5), (40, 60)]))
    num_batches = draw(st.integers(1, 6))
    batches = []
    for _ in range(num_batches):
        batch_size = draw(st.integers(1, 4))
        scale = draw(st.sampled_from([1.0, 1e-3, 1e30, 1e-30]))
        batch = torch.randn((batch_size, channels) + spatial, generator=generator) * scale
        kind = draw(st.sampled_from(["plain", "relu", "constant", "integers", "nan", "inf", "all_nan"]))
        if kind == "relu":
            batch = batch.relu()
        elif kind == "constant":
            batch[:, 0] = draw(st.sampled_from([0.0, 2.5, -1.0]))
        elif kind == "integers":
            batch = batch.round().clamp(-2, 2)
        elif kind in ("nan", "inf"):
            mask = torch.rand(batch.shape, generator=generator) < 0.2
            batch[mask] = math.nan if kind == "nan" else -math.inf
            batch.view(-1)[0] = math.inf
        elif kind == "all_nan":
            batch.fill_(math.nan)
        batches.append(batch)
    split = draw(st.integers(0, num_batches))
    return batches, split


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch_streams(), st.sampled_from([0.975, 0.9, 0.5]))
def test_merged_halves_equal_concatenated_stream(stream, q):
    batches, split = stream
    whole = stream_stats(batches, q=q)
    scale = sum(stream_stats([batch], q=q).percentile_ratio_sum.abs() for batch in batches)
    merged = stream_stats(batches[:split], q=q).merge(stream_stats(batches[split:], q=q))
    assert_stats_equal(merged, whole, ratio_scale=scale)
    assert_stats_equal(
        stream_stats(batches[split:], q=q).merge(stream_stats(batches[:split], q=q)), whole, ratio_scale=scale
    )


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch_streams())
def test_stream_stats_match_independent_computation(stream):
    batches, _ = stream
    q = 0.975
    # percentile_sample=None: the exact reference (larger batches are sampled by default,
    # see test_stats_selection.py), comparable element for element with torch.quantile
    stats = stream_stats(batches, q=q, percentile_sample=None)
    rows = [as_channel_rows(batch, 1) for batch in batches]
    all_values = torch.cat(rows, dim=1)
    finite = torch.isfinite(all_values)
    assert int(stats.batches) == len(batches)
    assert torch.equal(stats.count, finite.sum(1))
    assert torch.equal(stats.nan_count, all_values.isnan().sum(1))
    assert torch.equal(stats.inf_count, all_values.isinf().sum(1))
    finite_or_zero = torch.where(finite, all_values, 0.0)
    expected_min = torch.where(finite, all_values, math.inf).amin(1)
    expected_max = torch.where(finite, all_values, -math.inf).amax(1)
    assert torch.equal(stats.channel_min, expected_min)
    assert torch.equal(stats.channel_max, expected_max)
    # float32 per-batch sums: error bounded relative to the sum of magnitudes
    magnitude = finite_or_zero.abs().sum(1)
    assert ((stats.sum - finite_or_zero.sum(1)).abs() <= 1e-5 * magnitude).all()
    torch.testing.assert_close(stats.sum_of_squares, finite_or_zero.square().sum(1), rtol=1e-5, atol=1e-300)
    assert torch.equal(stats.histogram, expected_histogram(all_values))

    ranges = []
    ratio_sum = torch.zeros(stats.num_channels, dtype=torch.float64)
    ratio_batches = torch.zeros(stats.num_channels, dtype=torch.int64)
    zero_denominator = torch.zeros_like(ratio_batches)
    constant = torch.zeros_like(ratio_batches)
    for batch_rows in rows:
        finite_values = batch_rows[torch.isfinite(batch_rows)]
        if finite_values.numel():
            ranges.append(float(finite_values.max() - finite_values.min()))
        for channel, (ratio, zero_den, is_constant) in enumerate(expected_percentile_terms(batch_rows, q)):
            if ratio is not None:
                ratio_sum[channel] += ratio
                ratio_batches[channel] += 1
            zero_denominator[channel] += zero_den
            constant[channel] += is_constant
    assert int(stats.range_batches) == len(ranges)
    assert float(stats.batch_range_sum) == pytest.approx(sum(ranges), rel=1e-12)
    assert torch.equal(stats.percentile_ratio_batches, ratio_batches)
    assert torch.equal(stats.zero_denominator_batches, zero_denominator)
    assert torch.equal(stats.constant_batches, constant)
    torch.testing.assert_close(stats.percentile_ratio_sum, ratio_sum, rtol=1e-6, atol=0)


# ----------------------------------------------------------- fixed cases
def _fixed_stream():
    generator = torch.Generator().manual_seed(7)
    return [
        torch.randn(8, 6, 32, 32, generator=generator).relu() * 3,
        torch.randn(1, 6, 32, 32, generator=generator) + 5,
        torch.zeros(2, 6, 32, 32),
        torch.randn(4, 6, 32, 32, generator=generator) ** 3,
    ]


@pytest.mark.parametrize("split", [0, 1, 2, 3, 4])
def test_fixed_stream_split_points(split):
    batches = _fixed_stream()
    assert_stats_equal(stream_stats(batches[:split]).merge(stream_stats(batches[split:])), stream_stats(batches))


def test_merge_is_associative_and_pure():
    parts = [stream_stats([batch]) for batch in _fixed_stream()]
    snapshot = {name: getattr(parts[0], name).clone() for name in TENSOR_FIELDS}
    left = parts[0].merge(parts[1]).merge(parts[2])
    right = parts[0].merge(parts[1].merge(parts[2]))
    assert_stats_equal(left, right)
    for name in TENSOR_FIELDS:
        assert torch.equal(getattr(parts[0], name), snapshot[name]), f"merge mutated {name}"


def test_derived_statistics_follow_their_definitions():
    batches = _fixed_stream()
    stats = stream_stats(batches)
    ranges = [float(b.max()) - float(b.min()) for b in batches]
    epoch_range = max(float(b.max()) for b in batches) - min(float(b.min()) for b in batches)
    assert float(stats.average_batch_range()) == pytest.approx(sum(ranges) / len(ranges), rel=1e-12)
    assert float(stats.batch_to_epoch_range_ratio()) == pytest.approx(sum(ranges) / len(ranges) / epoch_range)
    values = torch.cat([as_channel_rows(b, 1) for b in batches], dim=1)
    torch.testing.assert_close(stats.channel_mean(), values.mean(1), rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(stats.channel_variance(), values.var(1, unbiased=False), rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(stats.tensor_variance(), values.var(unbiased=False), rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(stats.channel_range(), values.amax(1) - values.amin(1))
    torch.testing.assert_close(stats.channel_max_abs(), values.abs().amax(1))


def test_zero_denominator_batches_are_counted_apart_and_report_inf():
    sparse = torch.zeros(4, 3, 100)
    sparse[0, :2, 0] = 5.0  # channels 0, 1: 97.5th percentile 0, max 5
    sparse[:, 2] = torch.linspace(1, 2, 400).reshape(4, 100)
    stats = stream_stats([sparse, sparse])
    assert stats.zero_denominator_batches.tolist() == [2, 2, 0]
    assert stats.percentile_ratio_batches.tolist() == [0, 0, 2]
    ratio = stats.average_percentile_ratio()
    assert math.isinf(ratio[0]) and math.isinf(ratio[1]) and math.isfinite(ratio[2])


@pytest.mark.parametrize(
    "make_rows",
    [
        lambda g: torch.randn(16, 50_000, generator=g),
        lambda g: torch.randn(16, 50_000, generator=g).relu(),
        lambda g: torch.randint(0, 3, (16, 50_000), generator=g).float(),
        lambda g: (torch.rand(16, 50_000, generator=g) < 0.01) * torch.randn(16, 50_000, generator=g),
        lambda g: torch.randn(16, 50_000, generator=g).exp() ** 4,
        lambda g: torch.arange(50_000.0).flip(0).repeat(16, 1),
        lambda g: torch.full((16, 50_003), -2.0),
        lambda g: torch.randn(3, 401_408, generator=g) * 1e30,
    ],
)
@pytest.mark.parametrize("q", [0.975, 0.99, 0.7])
def test_reference_percentile_picks_torch_quantile_element(make_rows, q):
    # Large rows, selected exactly on request; torch.quantile is the reference.
    rows = make_rows(torch.Generator().manual_seed(3))
    batch = rows.unsqueeze(0)  # (1, C, n): one batch, channel axis 1
    stats = summarize_batch(batch, 1, q, percentile_sample=None)
    quantiles = torch.quantile(rows, torch.tensor([q, 1.0]), dim=1, interpolation="lower").double()
    reference, top = quantiles[0], quantiles[1]
    expected_ratio = torch.where(reference != 0, top / reference, 0.0)
    torch.testing.assert_close(stats.percentile_ratio_sum, expected_ratio, rtol=1e-12, atol=0)
    assert torch.equal(stats.percentile_ratio_batches, (reference != 0).long())


@pytest.mark.parametrize("seed", range(4))
def test_sync_free_path_equals_host_read_path(seed):
    generator = torch.Generator().manual_seed(seed)
    batch = torch.randn(4, 5, 64, 64, generator=generator).relu()
    if seed % 2:
        batch[0, 1, 0, :3] = torch.tensor([math.nan, math.inf, -math.inf])
    fast = summarize_batch(batch, 1, 0.975, sync_free=False)
    sync_free = summarize_batch(batch, 1, 0.975, sync_free=True)
    # The host-read path sums finite batches in float32 (then float64 across batches).
    assert_stats_equal(fast, sync_free, sum_rtol=1e-5)


# ------------------------------------------------------------ hostile inputs
@pytest.mark.parametrize(
    "batch",
    [
        torch.full((2, 3, 4), math.nan),
        torch.full((2, 3, 4), math.inf),
        torch.tensor([[1e30, -1e30, 0.0]]).T.expand(3, 4).contiguous(),
        torch.zeros(1, 3),
        torch.randn(1, 3, 1, 1),
        torch.randn(5).to(torch.float16),
        torch.randn(2, 3, 8).to(torch.bfloat16),
        torch.tensor([1e300, -1e300, math.inf, 1.0], dtype=torch.float64).reshape(1, 4),
        torch.tensor(3.0),
    ],
    ids=["all_nan", "all_inf", "huge", "batch1", "1x1", "fp16_1d", "bf16", "fp64_huge", "scalar"],
)
def test_hostile_batches_do_not_crash_and_count_correctly(batch):
    stats = stream_stats([batch, batch])
    values = as_channel_rows(batch.reshape((1,) * max(0, 2 - batch.dim()) + tuple(batch.shape)), 1)
    assert torch.equal(stats.count, 2 * torch.isfinite(values).sum(1))
    assert torch.equal(stats.nan_count, 2 * values.isnan().sum(1))
    assert torch.equal(stats.inf_count, 2 * values.isinf().sum(1))
    assert int(stats.histogram.sum()) == int(stats.count.sum())
    assert not stats.sum.isnan().any() and not stats.percentile_ratio_sum.isnan().any()
    assert int(stats.batches) == 2


@pytest.mark.parametrize("channel_axis", [1, None])
@pytest.mark.parametrize("poison", [None, math.nan, math.inf, -math.inf])
def test_without_moments_everything_else_is_unchanged_and_moments_are_unknown(channel_axis, poison):
    """``moments=False`` checks finiteness from the extrema alone: a NaN or Inf must still send
    the batch down the counting path, and every other statistic equals the full computation."""
    generator = torch.Generator().manual_seed(7)
    batches = [torch.randn(4, 6, 8, 8, generator=generator).relu() for _ in range(3)]
    if poison is not None:
        batches[1][2, 3, 4, 5] = poison
    full = stream_stats(batches, channel_axis)
    lean = stream_stats(batches, channel_axis, moments=False)
    for name in EXACT_FIELDS:
        assert torch.equal(getattr(lean, name), getattr(full, name)), name
    torch.testing.assert_close(lean.percentile_ratio_sum, full.percentile_ratio_sum, rtol=1e-12, atol=0)
    assert bool(lean.sum.isnan().all()) and bool(lean.sum_of_squares.isnan().all())
    assert bool(lean.channel_mean().isnan().all()) and not bool(full.channel_mean().isnan().any())
    if poison is not None:
        assert int(lean.nan_count.sum() + lean.inf_count.sum()) == 1


def test_a_stream_cannot_mix_summaries_with_and_without_moments():
    from qlint.stats.batch import summarize_values
    from qlint.stats.fold import RunningStats

    batch = torch.randn(4, 3)
    running = RunningStats(3, "cpu")
    running.add(summarize_values(batch, 1, 0.975))
    with pytest.raises(ValueError, match="moments"):
        running.add(summarize_values(batch, 1, 0.975, moments=False))


def test_float64_beyond_float32_range_goes_to_top_finite_bin():
    stats = stream_stats([torch.tensor([[1e300], [-1e300], [math.inf]], dtype=torch.float64).T], channel_axis=1)
    assert stats.histogram[0, 254] == 1 and stats.histogram[1, 254] == 1
    assert int(stats.histogram.sum()) == 2 and stats.inf_count.tolist() == [0, 0, 1]


def test_histogram_bin_edges_contain_their_values():
    low, high = histogram_bin_edges()
    values = torch.tensor([3.0, -3.0, 0.75, 1e-40, -1e-30, 0.0, 2.0**100, 1.0])
    for value in values.tolist():
        single = stream_stats([torch.tensor([[value]])], channel_axis=None).histogram
        assert int(single.sum()) == 1
        sign, exponent = single.nonzero().tolist()[0]
        if sign == 0:
            assert low[sign, exponent] <= value < high[sign, exponent]
        else:
            assert low[sign, exponent] < value <= high[sign, exponent]


def test_channel_axis_variants_agree_with_movedim():
    batch = torch.randn(3, 4, 5, 6)
    by_last = stream_stats([batch], channel_axis=-1)
    by_moved = stream_stats([batch.movedim(-1, 1)], channel_axis=1)
    # channel-last data is reduced in place down its columns, channel-major data along
    # rows: float32 per-batch sums then differ by rounding order only.
    assert_stats_equal(
        TensorStats.from_state({**by_last.to_state(), "channel_axis": torch.tensor([1])}), by_moved, sum_rtol=1e-5
    )
    per_tensor = stream_stats([batch], channel_axis=None)
    assert per_tensor.num_channels == 1 and int(per_tensor.count) == batch.numel()


def test_state_round_trip_and_mismatched_merges():
    stats = stream_stats(_fixed_stream())
    state = stats.to_state()
    assert all(tensor.dim() == 1 for tensor in state.values())
    assert_stats_equal(TensorStats.from_state(state), stats)
    with pytest.raises(ValueError):
        stats.merge(stream_stats([torch.randn(2, 5, 3)]))
    with pytest.raises(ValueError):
        stats.merge(TensorStats.empty(channel_axis=1, reference_percentile=0.9))


# ------------------------------------------------------------------ observer
def test_observer_is_identity_and_matches_pure_update():
    observer = StatsObserver(channel_axis=1)
    batches = _fixed_stream()
    for batch in batches:
        batch.requires_grad_(True)
        assert observer(batch) is batch
    assert_stats_equal(observer.stats, stream_stats([b.detach() for b in batches]))
    assert not any(getattr(observer.stats, name).requires_grad for name in TENSOR_FIELDS)
    ignored = ("text", torch.arange(6).reshape(2, 3), torch.empty(0, 6), None)
    for value in ignored:
        assert observer(value) is value
    assert int(observer.stats.batches) == len(batches)


def test_observer_state_dict_round_trip():
    observer = StatsObserver(channel_axis=1, reference_percentile=0.9)
    observer(torch.randn(2, 3, 10))
    restored = StatsObserver(channel_axis=1, reference_percentile=0.9)
    restored.load_state_dict(observer.state_dict())
    assert_stats_equal(restored.stats, observer.stats)
    with pytest.raises(ValueError):
        StatsObserver(channel_axis=0, reference_percentile=0.9).load_state_dict(observer.state_dict())


def test_update_stats_equals_merge_of_batch_summary():
    batch = torch.randn(2, 4, 9)
    base = stream_stats([torch.randn(3, 4, 9)])
    assert_stats_equal(update_stats(base, batch), base.merge(summarize_batch(batch, 1, 0.975)))


def test_quantile_rank_uses_float32_arithmetic_like_torch():
    # floor(0.7 * 90) is 62 in float64 but 63 in float32, which torch.quantile uses.
    q, n = 0.7, 91
    rows = torch.randperm(4 * n, generator=torch.Generator().manual_seed(1)).float().reshape(4, n) + 1
    assert int(q * (n - 1)) != int(torch.floor(torch.tensor(q) * (n - 1)))  # the case is a real one
    stats = summarize_batch(rows.unsqueeze(0), 1, q)
    quantiles = torch.quantile(rows, torch.tensor([q, 1.0]), dim=1, interpolation="lower").double()
    torch.testing.assert_close(stats.percentile_ratio_sum, quantiles[1] / quantiles[0], rtol=1e-12, atol=0)


def test_sync_free_key_counting_equals_bincount():
    # Accelerators count histogram keys by scatter_add (bincount would sync);
    # no accelerator here, so run that branch on CPU against bincount.
    keys = torch.randint(0, 512, (10_000,), generator=torch.Generator().manual_seed(2), dtype=torch.int32)
    keys[:100] = 511  # the top bin, where an off-by-one would show
    expected = torch.bincount(keys, minlength=512)
    assert torch.equal(batch_module._count_keys(keys, 512, avoid_sync=True), expected)
    assert torch.equal(batch_module._count_keys(keys, 512, avoid_sync=False), expected)
