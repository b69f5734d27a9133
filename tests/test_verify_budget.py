"""verify's trial budget: pruning's share grows with max_trials, and 8-bit activations say what
they were judged on.

QA on a VNNI CPU: bias correction (1 trial) and the 8-bit activation folds (5) used up the
fixed pruning share of 5, so pruning never ran, whatever --max-trials was; with 1 or 2
calibration batches, 8-bit activations were said to be "judged on batches it was not
calibrated on" when they were judged on the calibration batches themselves. The CPU probe is
replaced both ways, so that these tests do not depend on the machine that runs them."""

import pytest
import torch
import torch.nn as nn

import qlint.advice.verify_search as search
from qlint.advice.plan import ModuleDecision, Provenance, default_plan
from qlint.advice.verify import verify

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


@pytest.fixture
def vnni(monkeypatch):
    monkeypatch.setattr(search, "host_vnni", lambda: "avx512_vnni")  # our CPU probe, not torch


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 8)).eval()


def _batches(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # bounded data: an observer's range is the range, so the eighth bit gains ~6 dB on every fold
    return [torch.rand(64, 16, generator=g) * 2 - 1 for _ in range(n)]


def _plan_with_two_restated_decisions():
    """x86 defaults plus two decisions that restate the global weight spec (they cannot help),
    credited by findings with -0.01 dB and +0.5 dB."""
    base = default_plan("x86")

    def restated(fqn: str, gain: float) -> ModuleDecision:
        credit = Provenance(source="finding", rule="QL201", target=fqn, gain_db=gain)
        return ModuleDecision(fqn=fqn, weight=base.weight, provenance=[credit])

    return base.model_copy(update={"modules": [restated("0", -0.01), restated("2", 0.5)]})


def _pruned(report) -> list[str]:
    return [d.target for d in report.decisions if d.kind == "module"]


def _eight_bit(report):
    (decision,) = [d for d in report.decisions if d.kind == "activation_bits"]
    return decision


def test_the_default_budget_prunes_after_8_bit_activations(vnni):
    calibration, eval_data = _batches(8, 1), _batches(2, 2)
    plan = _plan_with_two_restated_decisions()
    report = verify(_model(), plan, calibration, eval_data, search_schemes=False)
    assert _eight_bit(report).kept  # its two folds and the plan on every batch: 5 trials
    # no step after pruning: it takes the 4 trials left, and both decisions get one
    assert sorted(_pruned(report)) == ["0", "2"]
    assert not any("pruning stopped" in note for note in report.notes)
    assert report.trials <= report.max_trials


def test_a_larger_max_trials_buys_pruning_before_the_scheme_search(vnni):
    calibration, eval_data = _batches(8, 1), _batches(2, 2)
    plan = _plan_with_two_restated_decisions()
    small = verify(_model(), plan, calibration, eval_data, max_trials=8)
    large = verify(_model(), plan, calibration, eval_data, max_trials=20)
    assert _eight_bit(small).kept and _eight_bit(large).kept
    # 2 trials left after bias correction and 8-bit activations: pruning takes half, the least credited first
    assert _pruned(small) == ["0"]
    (note,) = [n for n in small.notes if "pruning stopped" in n]
    assert "1 decision(s)" in note and "+0.50 dB" in note
    assert sorted(_pruned(large)) == ["0", "2"]
    assert not any("pruning stopped" in n for n in large.notes)
    assert any(d.kind == "scheme" for d in large.decisions)  # the scheme search still has trials
    assert small.trials <= 8 and large.trials <= 20


def test_the_note_on_untested_decisions_gives_their_lowest_credited_gain(vnni):
    calibration, eval_data = _batches(8, 1), _batches(2, 2)
    plan = _plan_with_two_restated_decisions()
    report = verify(_model(), plan, calibration, eval_data, search_schemes=False, max_prune_trials=0)
    assert _pruned(report) == []
    (note,) = [n for n in report.notes if "pruning stopped" in n]
    # a decision credited with -0.01 dB is not one "with the most measured gain"
    assert "most measured gain" not in note and "2 decision(s)" in note and "-0.01 dB" in note


@pytest.mark.parametrize("budget", [1, 3, 5])
def test_8_bit_activations_take_no_trial_past_the_budget(vnni, budget):
    calibration, eval_data = _batches(8, 1), _batches(2, 2)
    report = verify(_model(), None, calibration, eval_data, max_trials=budget, search_schemes=False)
    assert report.trials <= budget
    tried = [d for d in report.decisions if d.kind == "activation_bits"]
    assert bool(tried) == (budget >= 6)  # bias correction, then all five of its trials or none


@pytest.mark.parametrize("batches", [1, 2, 8])
def test_8_bit_activations_say_which_batches_judged_them(vnni, batches):
    calibration, eval_data = _batches(batches, 1), _batches(2, 2)
    report = verify(_model(), None, calibration, eval_data, search_schemes=False)
    detail = _eight_bit(report).detail
    in_sample = [n for n in report.notes if "judged on the batches they were calibrated on" in n]
    if batches <= 4:  # the default selection is every calibration batch: none is held apart
        assert "calibration batches themselves" in detail and "not calibrated on" not in detail
        assert "folds swapped" not in detail
        assert len(in_sample) == 1 and f"{batches} calibration batch(es)" in in_sample[0]
    else:
        assert "not calibrated on" in detail and "folds swapped" in detail
        assert in_sample == []


def test_no_vnni_no_8_bit_trial_and_pruning_keeps_its_share(monkeypatch):
    monkeypatch.setattr(search, "host_vnni", lambda: None)
    calibration, eval_data = _batches(8, 1), _batches(2, 2)
    plan = _plan_with_two_restated_decisions()
    report = verify(_model(), plan, calibration, eval_data, max_trials=4)
    assert not [d for d in report.decisions if d.kind == "activation_bits"]
    # 3 trials left after bias correction; the scheme search follows: pruning takes 2
    assert sorted(_pruned(report)) == ["0", "2"]
    assert report.trials <= 4


class _RecurrentHead(nn.Module):
    """An LSTM, which prepare_fx leaves float under the static default, then a Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(8, 16, batch_first=True)
        self.fc = nn.Linear(16, 4)

    def forward(self, x):
        out, _ = self.lstm(x)
        return self.fc(out)


def test_pruning_keeps_a_decision_whose_removal_lowers_int8_coverage(monkeypatch):
    """silero_vad's ``lstm_cell: dynamic`` was pruned for 0.03 dB on the selection batches: the
    LSTM then ran float, and int8 coverage fell from 100% to 86%. Float never costs SQNR."""
    monkeypatch.setattr(search, "host_vnni", lambda: None)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(3)
    calibration, eval_data = [torch.randn(4, 6, 8, generator=g) for _ in range(6)], [torch.randn(4, 6, 8, generator=g)]
    credit = Provenance(source="finding", rule="QL201", target="lstm", gain_db=-0.01)
    plan = default_plan("x86").model_copy(
        update={"modules": [ModuleDecision(fqn="lstm", mode="dynamic", provenance=[credit])]}
    )
    report = verify(_RecurrentHead().eval(), plan, calibration, eval_data, search_schemes=False)
    (outcome,) = [d for d in report.decisions if d.kind == "module" and d.target == "lstm"]
    assert outcome.sqnr_without_db > outcome.sqnr_with_db  # float gains, as it always does
    assert outcome.kept and "float conv/linear/recurrent/attention ops 0 -> 1" in outcome.detail
    assert report.verified_plan.decision("lstm") is not None
    assert report.plan.int8_fraction == 1.0
