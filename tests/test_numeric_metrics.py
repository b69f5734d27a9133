"""Streaming metrics against torch's own numeric-suite formulas."""

import json
import math
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

# The reference implementations (private module: tests only, never product code).
from torch.ao.ns.fx.utils import compute_cosine_similarity, compute_normalized_l2_error, compute_sqnr

from qlint.linter.findings import CompareRow
from qlint.measure.metrics import (
    SQNR_CAP_DB,
    UNIFORM_ROUNDING_RMSE_OVER_SCALE,
    PairwiseErrorStats,
    sqnr_db,
)

warnings.filterwarnings("ignore", category=UserWarning)


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def _noisy_pair(seed: int, shape, noise: float, scale: float = 1.0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=generator) * scale
    y = x + noise * scale * torch.randn(*shape, generator=generator)
    return x, y


@pytest.mark.parametrize("noise", [1e-4, 1e-2, 0.3, 2.0])
def test_single_pair_sqnr_equals_compute_sqnr(noise):
    x, y = _noisy_pair(0, (4, 8, 5, 5), noise)
    assert abs(sqnr_db(x, y) - float(compute_sqnr(x, y))) < 0.01


@settings(max_examples=25, deadline=None)
@given(
    batches=st.integers(min_value=1, max_value=6),
    width=st.integers(min_value=1, max_value=40),
    noise_exponent=st.floats(min_value=-5.0, max_value=0.5),
    scale_exponent=st.floats(min_value=-3.0, max_value=3.0),
    seed=st.integers(min_value=0, max_value=10_000),
)
def test_streamed_sqnr_equals_sqnr_of_the_concatenation(batches, width, noise_exponent, scale_exponent, seed):
    # SQNR over a stream is total signal power over total noise power, i.e. the SQNR of
    # all batches concatenated, not the mean of per-batch SQNRs.
    stats = PairwiseErrorStats()
    xs, ys = [], []
    for index in range(batches):
        x, y = _noisy_pair(seed + index, (3, width), 10.0**noise_exponent, 10.0**scale_exponent)
        stats.update(x, y)
        xs.append(x)
        ys.append(y)
    expected = float(compute_sqnr(torch.cat(xs), torch.cat(ys)))
    assert abs(stats.sqnr_db() - expected) < 0.01


def test_stream_is_not_the_mean_of_batch_sqnrs():
    # Two batches with very different noise: the streamed value must follow the powers.
    quiet, loud = _noisy_pair(1, (64,), 1e-3), _noisy_pair(2, (64,), 0.5)
    stats = PairwiseErrorStats()
    stats.update(*quiet)
    stats.update(*loud)
    mean_of_batches = (sqnr_db(*quiet) + sqnr_db(*loud)) / 2
    concatenated = float(compute_sqnr(torch.cat([quiet[0], loud[0]]), torch.cat([quiet[1], loud[1]])))
    assert abs(stats.sqnr_db() - concatenated) < 0.01
    assert abs(stats.sqnr_db() - mean_of_batches) > 5.0


def test_cosine_and_normalized_l2_match_torch():
    x, y = _noisy_pair(3, (6, 33), 0.2)
    stats = PairwiseErrorStats()
    stats.update(x, y)
    assert abs(stats.cosine() - float(compute_cosine_similarity(x, y))) < 1e-5
    assert abs(stats.normalized_l2() - float(compute_normalized_l2_error(x, y))) < 1e-5
    assert stats.max_abs_error == pytest.approx(float((x - y).abs().max()), rel=1e-6)
    assert stats.rmse() == pytest.approx(float((x - y).pow(2).mean().sqrt()), rel=1e-5)


def test_quantized_tensors_are_dequantized_and_rounding_baseline_holds():
    # Values spread evenly inside the quantization range: the error is pure rounding,
    # whose RMS is scale/sqrt(12) (the baseline the docs describe).
    x = torch.linspace(-1.0, 1.0, 20011)
    scale = 2.0 / 255
    quantized = torch.quantize_per_tensor(x, scale, 128, torch.quint8)
    stats = PairwiseErrorStats()
    stats.update(x, quantized)
    assert stats.mean_scale() == pytest.approx(scale, rel=1e-6)
    assert abs(stats.rmse_over_scale() - UNIFORM_ROUNDING_RMSE_OVER_SCALE) < 0.01
    assert abs(stats.sqnr_db() - float(compute_sqnr(x, quantized))) < 0.01


def test_clipping_shows_as_rmse_far_above_rounding():
    x = torch.linspace(-4.0, 4.0, 8001)
    clipped = torch.quantize_per_tensor(x, 2.0 / 255, 128, torch.quint8)  # range only [-1, 1]
    stats = PairwiseErrorStats()
    stats.update(x, clipped)
    assert stats.rmse_over_scale() > 10 * UNIFORM_ROUNDING_RMSE_OVER_SCALE


def test_identical_and_degenerate_streams_stay_finite_json():
    x = torch.randn(10, 10)
    identical = PairwiseErrorStats()
    identical.update(x, x.clone())
    assert identical.sqnr_db() == SQNR_CAP_DB
    assert identical.cosine() == pytest.approx(1.0)
    zeros = PairwiseErrorStats()
    zeros.update(torch.zeros(5), torch.zeros(5))
    assert zeros.sqnr_db() == SQNR_CAP_DB and zeros.cosine() == 1.0
    broken = PairwiseErrorStats()
    broken.update(torch.zeros(5), torch.ones(5))
    assert broken.sqnr_db() == -SQNR_CAP_DB and broken.cosine() == 0.0
    for stats in (identical, zeros, broken):
        summary = stats.summary()
        json.dumps(summary, allow_nan=False)
        row = CompareRow(name="layer", sqnr_propagated=stats.sqnr_db(), cosine=stats.cosine(), extra=summary)
        assert CompareRow.model_validate_json(row.model_dump_json()) == row


def test_nonfinite_values_are_counted_not_propagated():
    x = torch.randn(100)
    y = x.clone()
    y[3] = float("nan")
    y[7] = float("inf")
    stats = PairwiseErrorStats()
    stats.update(x, y)
    assert stats.nonfinite_values == 2
    assert math.isfinite(stats.sqnr_db())
    assert stats.summary()["nonfinite_values"] == 2


def test_mismatched_sizes_are_rejected():
    with pytest.raises(ValueError):
        PairwiseErrorStats().update(torch.zeros(3), torch.zeros(4))


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_sqnr_of_a_non_finite_value_is_unknown_never_the_cap(bad):
    """An Inf in the reference and in its approximation leaves NaN noise; min(200, nan) is 200 in
    Python, so an unguarded clamp would report a perfect match. (PairwiseErrorStats, the numeric
    suite's, drops non-finite pairs and counts them instead.)"""
    from qlint.core.sqnr import SqnrSums, sqnr_db_from_powers

    reference = torch.tensor([1.0, bad, 3.0])
    sums = SqnrSums()
    sums.add(reference, reference.clone())
    assert sums.sqnr_db() is None
    assert sqnr_db_from_powers(1.0, math.nan) is None and sqnr_db_from_powers(math.inf, 1.0) is None
    assert sqnr_db_from_powers(1.0, 0.0) == 200.0  # an exact match is still the cap
