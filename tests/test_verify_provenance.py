"""A verified plan's credits describe the plan verify returns (qlint/advice/verify_provenance.py).

QA on real models: after the scheme search, MiniLM's dynamic layer was still credited with
QL203's static percentile observer, and digit_cnn's fc_layers.2 with a gain measured while
fc_layers.0, which a later flip set back to static, was dynamic too."""

import pytest
import torch
import torch.nn as nn

from qlint.advice.plan import ActivationSpec, ModuleDecision, Provenance, QuantPlan, default_plan
from qlint.advice.verify import verify
from qlint.advice.verify_provenance import KeptFlip, reconciled

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


class SpikedHead(nn.Module):
    """fc_in reads an input whose scale drifts from batch to batch (dynamic wins); fc_out reads the
    normalized features plus a spike its weights ignore, which dynamic quantization spends its
    per-batch range on and a static histogram observer clips (static wins)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc_in = nn.Linear(16, 32)
        self.norm = nn.LayerNorm(32)
        self.fc_out = nn.Linear(33, 8)
        with torch.no_grad():
            self.fc_out.weight[:, 32] = 0.0

    def forward(self, x, spike):
        return self.fc_out(torch.cat([torch.relu(self.norm(self.fc_in(x))), spike], dim=1))


def _batches(generator, n):
    out = []
    for _ in range(n):
        x = torch.randn(32, 16, generator=generator) * float(
            10 ** torch.empty(1).uniform_(-2.0, 1.0, generator=generator)
        )
        spike = torch.zeros(32, 1)
        spike[0, 0] = 10.0
        out.append((x, spike))
    return out


@pytest.fixture(scope="module")
def spiked():
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    return SpikedHead().eval(), _batches(generator, 4), _batches(generator, 4)


def _eight_bit_plan(**update):
    """x86 defaults with 8-bit activations: static fc_out then beats dynamic on every CPU (no
    8-bit activation trial, which runs only on VNNI CPUs)."""
    plan = default_plan("x86")
    return plan.model_copy(update={"activation": plan.activation.changed(reduce_range=False), **update})


def _kept_scheme(report):
    return [d for d in report.decisions if d.kind == "scheme" and d.kept]


def test_a_group_gain_is_re_measured_when_a_later_flip_sets_a_member_back(spiked):
    model, calibration, eval_data = spiked
    report = verify(model, _eight_bit_plan(), calibration, eval_data, bias_correction=False)
    group, back = _kept_scheme(report)[:2]
    # what the search did: both Linears dynamic at once, then fc_out back to static
    assert group.target == "fc_out, fc_in" and back.target == "fc_out" and back.detail.startswith("dynamic -> static")
    plan = report.verified_plan
    assert plan.decision("fc_out") is None and plan.decision("fc_in").mode == "dynamic"
    (credit,) = plan.decision("fc_in").provenance
    # the credit is the plan it is in: fc_in dynamic alone, measured by the flip back's trial
    assert "together with" not in credit.metric and "fc_out went back to static" in credit.metric
    assert credit.gain_db == pytest.approx(back.sqnr_with_db - group.sqnr_without_db, abs=1e-3)
    assert credit.gain_db != pytest.approx(group.sqnr_with_db - group.sqnr_without_db, abs=1e-2)


def test_a_finding_credit_whose_observer_a_dynamic_layer_lacks_is_dropped_and_noted(spiked):
    model, calibration, eval_data = spiked
    percentile = ActivationSpec(observer="percentile", percentile=99.9)
    finding = Provenance(source="finding", rule="QL203", target="fc_in", gain_db=0.6)
    plan = _eight_bit_plan(modules=[ModuleDecision(fqn="fc_in", activation=percentile, provenance=[finding])])
    # no pruning trial (its share is 0), so the finding's decision reaches the scheme search
    report = verify(model, plan, calibration, eval_data, bias_correction=False, max_prune_trials=0)
    decision = report.verified_plan.decision("fc_in")
    assert decision.mode == "dynamic"
    assert finding not in decision.provenance and all(p.rule != "QL203" for p in decision.provenance)
    assert decision.provenance and all(p.detail and "scheme search" in p.detail for p in decision.provenance)
    (note,) = [n for n in report.verified_plan.notes if "QL203" in n]
    assert note.startswith("fc_in: dropped") and "percentile" in note and "dynamic layer does not have" in note
    # the plan file says the same after a round trip
    again = QuantPlan.from_json(report.verified_plan.model_dump_json())
    assert "QL203" not in again.pretty().split("notes:")[0]


def test_bias_correction_added_back_after_the_scheme_search_is_credited_with_its_trial(spiked):
    """Rejected on its own before the search, bias correction is retried after it: its credit
    was 'measured ?' (no metric, no value)."""
    model, calibration, eval_data = spiked
    report = verify(model, _eight_bit_plan(), calibration, eval_data)
    first = next(d for d in report.decisions if d.kind == "bias_correction")
    retried = next(d for d in report.decisions if d.kind == "group" and d.detail == "bias correction")
    assert not first.kept and retried.kept
    (credit,) = report.verified_plan.bias_correction.provenance
    assert credit.metric and "added back after the scheme search" in credit.metric
    assert credit.gain_db == pytest.approx(retried.sqnr_with_db - retried.sqnr_without_db, abs=1e-3)
    assert "?" not in credit.describe()


def test_a_group_credit_is_labelled_when_verify_has_no_number_for_the_group_as_it_is():
    """A member left the group by another step (the target fallback kept it float): the gain
    measured with it dynamic is kept as a value, labelled, and credits nothing."""
    flip = KeptFlip(("fc1", "fc0"), "dynamic", 10.0, 13.5)
    verified = default_plan("x86").model_copy(
        update={
            "modules": [
                ModuleDecision(fqn="fc0", mode="dynamic", provenance=[flip.credit]),
                ModuleDecision(fqn="fc1", quantize=False, provenance=[Provenance(source="measurement", gain_db=0.2)]),
            ]
        }
    )
    (credit,) = reconciled(default_plan("x86"), verified, [flip]).decision("fc0").provenance
    assert credit.gain_db is None and credit.credited_db() is None
    assert credit.value == pytest.approx(3.5) and "while fc1 also ran dynamic (not this plan)" in credit.metric


def test_a_flip_credit_for_a_mode_the_layer_left_is_dropped():
    """A lint decision (its own observer) made dynamic with a group, then set back to static:
    the group's credit describes a mode the layer no longer runs; the finding's fix applies again."""
    finding = Provenance(source="finding", rule="QL203", target="fc0", gain_db=0.6)
    percentile = ActivationSpec(observer="percentile", percentile=99.9)
    given = default_plan("x86").model_copy(
        update={"modules": [ModuleDecision(fqn="fc0", activation=percentile, provenance=[finding])]}
    )
    group, back = KeptFlip(("fc1", "fc0"), "dynamic", 10.0, 13.0), KeptFlip(("fc0",), "static", 13.0, 13.4)
    static_again = ModuleDecision(fqn="fc0", activation=percentile, provenance=[finding, group.credit, back.credit])
    plan = reconciled(given, given.model_copy(update={"modules": [static_again]}), [group, back])
    assert plan.decision("fc0").provenance == [finding, back.credit]
    assert any(n.startswith("fc0: dropped 'measured output SQNR gain (dB) when dynamic together") for n in plan.notes)
