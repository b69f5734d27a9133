"""A fix's gain that rests on one evaluation batch: the per-batch powers behind the output SQNR,
the gain with the batch that gains most left out, and the trial's numbers against torch by hand."""

import pytest
import torch

from qlint.core.sqnr import BatchPowers, SqnrSums, sqnr_db, steady_gain_db
from qlint.linter.findings import Impact
from tests.test_impact import _batches, _by_hand, _lint_ql104, _model, _per_channel_fix, _per_tensor


def _powers(references, approximations) -> BatchPowers:
    batches = []
    for reference, approximation in zip(references, approximations):
        sums = SqnrSums()
        sums.add(reference, approximation)
        batches.append((sums.signal_power, sums.noise_power))
    return BatchPowers(tuple(batches))


def _noisy(references, sigmas, seed):
    generator = torch.Generator().manual_seed(seed)
    return [x + sigma * torch.randn(x.shape, generator=generator) for x, sigma in zip(references, sigmas)]


def test_batch_powers_give_the_sqnr_of_the_batches_they_hold():
    generator = torch.Generator().manual_seed(0)
    references = [torch.randn(16, 8, generator=generator) * scale for scale in (1.0, 3.0, 0.5, 2.0)]
    approximations = _noisy(references, (0.1, 0.2, 0.05, 0.3), seed=1)
    powers = _powers(references, approximations)
    assert powers.sqnr_db() == pytest.approx(sqnr_db(references, approximations), abs=1e-9)
    kept = [1, 2, 3]
    assert powers.sqnr_db(leave_out=0) == pytest.approx(
        sqnr_db([references[i] for i in kept], [approximations[i] for i in kept]), abs=1e-9
    )
    assert BatchPowers(()).sqnr_db() is None


def test_a_gain_one_batch_carries_is_not_steady():
    generator = torch.Generator().manual_seed(2)
    references = [torch.randn(16, 8, generator=generator) for _ in range(4)]
    base = _noisy(references, (0.1, 0.1, 0.1, 0.1), seed=3)
    # the fix leaves batches 0-2 exactly as they were and removes nearly all of batch 3's noise
    fixed = base[:3] + _noisy(references[3:], (0.001,), seed=4)
    base_powers, fixed_powers = _powers(references, base), _powers(references, fixed)
    total = sqnr_db(references, fixed) - sqnr_db(references, base)
    assert total > 1.0  # over all four batches the fix looks worth a warning
    assert base_powers.sqnr_db() is not None and fixed_powers.sqnr_db() - base_powers.sqnr_db() == pytest.approx(total)
    assert steady_gain_db(base_powers, fixed_powers) == pytest.approx(0.0, abs=1e-9)  # batch 3 left out
    # a gain every batch shares is steady: leaving one out changes it little
    everywhere = _noisy(references, (0.05, 0.05, 0.05, 0.05), seed=3)
    shared = steady_gain_db(base_powers, _powers(references, everywhere))
    assert shared == pytest.approx(sqnr_db(references, everywhere) - sqnr_db(references, base), abs=0.5)
    assert steady_gain_db(BatchPowers(base_powers.batches[:1]), BatchPowers(fixed_powers.batches[:1])) is None


def test_an_impact_resting_on_one_batch_is_told_apart_from_a_small_one():
    carried = Impact.measured(10.0, 11.2, "fix-trial", "", steady_db=0.1)
    assert carried.db == pytest.approx(1.2) and carried.rests_on_one_batch(0.5)
    assert not carried.rests_on_one_batch(2.0)  # below the threshold anyway: no batch to blame
    assert not Impact.measured(10.0, 11.2, "fix-trial", "", steady_db=0.9).rests_on_one_batch(0.5)
    assert not Impact.measured(10.0, 11.2, "fix-trial", "").rests_on_one_batch(0.5)  # one batch: unknown


def test_the_trial_reports_the_steady_gain_torch_gives_by_hand():
    model, data = _model(), _batches(8)
    report = _lint_ql104(model, data, {"batches": 16, "min_impact_db": 0.0})
    [finding] = report.by_rule("QL104")
    impact = finding.impact
    assert impact is not None and impact.basis == "fix-trial" and impact.steady_db is not None
    calibration, evaluation = data[:4], data[4:]
    per_channel = _per_channel_fix(finding.suggestion.targets)
    gains = []
    for left_out in range(len(evaluation)):
        kept = [batch for index, batch in enumerate(evaluation) if index != left_out]
        gains.append(
            _by_hand(model, per_channel, calibration, kept) - _by_hand(model, _per_tensor(), calibration, kept)
        )
    assert impact.steady_db == pytest.approx(min(gains), abs=0.01)
    assert impact.steady_db <= impact.db + 1e-3


def test_an_impact_between_two_trials_carries_its_steady_gain():
    generator = torch.Generator().manual_seed(5)
    references = [torch.randn(16, 8, generator=generator) for _ in range(3)]
    base = _powers(references, _noisy(references, (0.2, 0.2, 0.2), seed=6))
    fixed = _powers(references, _noisy(references, (0.1, 0.02, 0.1), seed=7))
    impact = Impact.between(base, fixed, "rule-trial", "a fix")
    assert impact is not None and impact.basis == "rule-trial"
    assert impact.db == pytest.approx(fixed.sqnr_db() - base.sqnr_db(), abs=1e-3)
    assert impact.steady_db == pytest.approx(steady_gain_db(base, fixed), abs=1e-3)
    assert impact.steady_db < impact.db  # batch 1 gains most: without it the gain is smaller
    assert Impact.between(base, None, "rule-trial", "") is None  # a failed trial measures nothing
    assert Impact.between(None, fixed, "rule-trial", "") is None
