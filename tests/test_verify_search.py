"""The static <-> dynamic scheme search of qlint.advice.verify (qlint/advice/verify_search.py), on real quantization runs."""

import pytest
import torch
import torch.nn as nn

from qlint.advice.plan import ModuleDecision, Provenance, default_plan
from qlint.advice.verify import SQNR_TOLERANCE_DB, verify
from qlint.advice.verify_session import Session
from qlint.linter.suggestions import WeightSpec

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


class DriftNet(nn.Module):
    """fc_in sees an input whose scale drifts from batch to batch; LayerNorm makes fc_out's input stationary."""

    def __init__(self) -> None:
        super().__init__()
        self.fc_in = nn.Linear(16, 32)
        self.norm = nn.LayerNorm(32)
        self.fc_out = nn.Linear(32, 8)

    def forward(self, x):
        return self.fc_out(torch.relu(self.norm(self.fc_in(x))))


class TwoHeads(nn.Module):
    """Two linears reading the same input, summed."""

    def __init__(self) -> None:
        super().__init__()
        self.fc_a = nn.Linear(16, 16)
        self.fc_b = nn.Linear(16, 16)

    def forward(self, x):
        return self.fc_a(x) + self.fc_b(x)


class TwoInputs(nn.Module):
    """fc_a reads a drifting input, fc_b (later in graph order) a stationary one."""

    def __init__(self) -> None:
        super().__init__()
        self.fc_a = nn.Linear(16, 8)
        self.fc_b = nn.Linear(16, 8)

    def forward(self, x, y):
        return torch.cat([self.fc_a(x), self.fc_b(y)], dim=1)


def _drifting(generator, n=8):
    scale = lambda: float(10 ** torch.empty(1).uniform_(-2.0, 1.0, generator=generator))  # noqa: E731
    return [torch.randn(32, 16, generator=generator) * scale() for _ in range(n)]


@pytest.fixture(scope="module")
def drift():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    return DriftNet().eval(), _drifting(g, 4), _drifting(g, 4)


@pytest.fixture(scope="module")
def drift_report(drift):
    model, calibration, eval_data = drift
    return verify(model, None, calibration, eval_data)


def _scheme(report):
    return [d for d in report.decisions if d.kind == "scheme"]


def test_search_keeps_dynamic_for_drifting_linear(drift, drift_report):
    model, calibration, eval_data = drift
    off = verify(model, None, calibration, eval_data, search_schemes=False)
    assert not _scheme(off) and off.verified_plan.decision("fc_in") is None
    report = drift_report
    # the kept flip that made fc_in dynamic, with its measured outcome
    flip = next(d for d in _scheme(report) if d.kept and "fc_in" in d.target.split(", "))
    assert flip.sqnr_with_db > flip.sqnr_without_db + 3.0
    decision = report.verified_plan.decision("fc_in")
    assert decision.quantize and decision.mode == "dynamic"
    provenance = decision.provenance[-1]
    assert provenance.source == "measurement" and provenance.detail == "qlint verify scheme search"
    assert provenance.value == pytest.approx(flip.sqnr_with_db - flip.sqnr_without_db, abs=1e-3)
    # fc_in's own contribution: switching it back to static was measured and rejected
    back = next(d for d in _scheme(report) if d.target == "fc_in" and d.detail.startswith("dynamic -> static"))
    assert not back.kept and back.sqnr_with_db < back.sqnr_without_db
    # the flips were chosen on the calibration batches; the report's numbers come from the eval
    # batches, which chose nothing, and there the kept flips still win, at full int8 coverage
    assert report.selection_batches == 4 and "calibration" in report.selected_on
    assert report.plan.sqnr_db > off.plan.sqnr_db + 3.0
    assert report.plan.int8_fraction == 1.0 == off.plan.int8_fraction


def test_every_rejected_flip_lowered_sqnr_or_coverage(drift_report):
    for d in _scheme(drift_report):
        if not d.kept:
            assert (
                d.sqnr_with_db <= d.sqnr_without_db + SQNR_TOLERANCE_DB
                or "int8 conv/linear/recurrent/attention ops" in d.detail
            )


def test_search_keeps_no_flip_when_static_is_better(monkeypatch):
    """A large feature the layers ignore (zero weight column) shows up in a few rows: a percentile
    observer clips it, while dynamic quantization spends its whole per-batch range on it."""
    import qlint.advice.verify_search as search

    monkeypatch.setattr(search, "host_vnni", lambda: None)  # 7-bit activations throughout: only flips change
    torch.manual_seed(0)
    model = TwoHeads().eval()
    with torch.no_grad():
        model.fc_a.weight[:, 0] = 0.0
        model.fc_b.weight[:, 0] = 0.0
    g = torch.Generator().manual_seed(3)

    def batch():
        x = torch.randn(128, 16, generator=g)
        x[0, 0] = 500.0  # 1 value in 2048: beyond the 99.9th percentile
        return x

    calibration, eval_data = [batch() for _ in range(4)], [batch() for _ in range(3)]
    base = default_plan("x86")
    plan = base.model_copy(update={"activation": base.activation.changed(observer="percentile", percentile=99.9)})
    report = verify(model, plan, calibration, eval_data)
    trials = _scheme(report)
    assert {d.target for d in trials} == {"fc_a", "fc_b", "fc_b, fc_a"}  # each alone and both together
    for d in trials:
        assert not d.kept and d.sqnr_with_db is not None and d.sqnr_with_db < d.sqnr_without_db - 1.0
    assert report.verified_plan.decision("fc_a") is None and report.verified_plan.decision("fc_b") is None
    assert report.plan.sqnr_db == pytest.approx(report.requested.sqnr_db, abs=1e-3)


def test_the_sensitivity_pass_orders_layers_by_their_own_error():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(5)
    batches = [(x, torch.randn(32, 16, generator=g)) for x in _drifting(g, 7)]
    # selection on the eval batches themselves, so that the report's per-layer table shows the ranking
    report = verify(TwoInputs().eval(), None, batches[:4], batches[4:], selection_data=batches[4:], max_scheme_trials=0)
    by_layer = {row.fqn: row.default_sqnr_db for row in report.layers}
    assert by_layer["fc_a"] < by_layer["fc_b"]  # the drifting one; graph order alone would pick fc_b
    # with fewer trials than candidates, the search tries the layers in this order
    session = Session(TwoInputs().eval(), batches[:4], batches[4:], batches[4:], max_trials=1)
    assert session.sensitivity_order(default_plan("x86"), ["fc_b", "fc_a"]) == ["fc_a", "fc_b"]
    assert session.trials == 1  # the sensitivity pass is a quantization like any trial's


def test_no_prune_leaves_plan_decisions_unflipped(drift):
    model, calibration, eval_data = drift
    keep_static = ModuleDecision(fqn="fc_in", provenance=[Provenance(source="user", detail="test")])
    plan = default_plan("x86").model_copy(update={"modules": [keep_static]})
    report = verify(model, plan, calibration, eval_data, prune=False)
    trials = _scheme(report)
    assert trials and all("fc_in" not in d.target.split(", ") for d in trials)
    assert report.verified_plan.decision("fc_in").mode == "static"


class MaskedMix(nn.Module):
    """A -10000 attention-style mask added between two Linears: any int8 rounding of the sum
    (one scale for -10000 and the logits) wipes out the softmax's input."""

    def __init__(self) -> None:
        super().__init__()
        self.fc_a = nn.Linear(16, 16)
        self.fc_b = nn.Linear(16, 8)

    def forward(self, x, mask):
        return self.fc_b(torch.softmax(self.fc_a(x) + mask, dim=-1))


def _masked(generator, n=4):
    batches = []
    for _ in range(n):
        mask = torch.zeros(32, 16)
        mask[:, 12:] = -10000.0
        batches.append((torch.randn(32, 16, generator=generator), mask))
    return batches


def test_search_finds_the_quantize_dynamic_recipe_where_static_ops_cannot_stay():
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(3)
    model, calibration, eval_data = MaskedMix().eval(), _masked(generator), _masked(generator)
    report = verify(model, None, calibration, eval_data, prune=False)
    plan = report.verified_plan
    assert plan.float_by_default
    assert {d.fqn: d.mode for d in plan.modules} == {"fc_a": "dynamic", "fc_b": "dynamic"}
    recipe = next(d for d in _scheme(report) if d.kept and "everything else float" in d.detail)
    assert recipe.sqnr_with_db > recipe.sqnr_without_db + 10.0
    # measured on the evaluation batches, which chose nothing, at full int8 coverage of the Linears
    assert report.plan.sqnr_db > report.default.sqnr_db + 10.0
    assert report.plan.int8_fraction == 1.0
    # the plan's own mapping: nothing global, the two Linears dynamic
    mapping = plan.to_qconfig_mapping()
    assert mapping.global_qconfig is None and not mapping.object_type_qconfigs
    assert set(mapping.module_name_qconfigs) == {"fc_a", "fc_b"}
    assert "QConfigMapping()" in plan.to_python()


@pytest.mark.parametrize("vnni", ["avx512_vnni", None])
def test_8_bit_activations_are_tried_only_on_a_vnni_cpu(monkeypatch, vnni):
    """x86 quantizes activations to 7 bits for CPUs whose kernels sum in 16 bits; on a CPU with
    VNNI verify measures the eighth bit, and the kept plan says which CPUs it needs."""
    import qlint.advice.verify_search as search

    monkeypatch.setattr(search, "host_vnni", lambda: vnni)  # our CPU probe, not torch
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 8)).eval()
    g = torch.Generator().manual_seed(1)

    def batch() -> torch.Tensor:  # bounded data: the observer's range is its range, held-out batches too
        return torch.rand(64, 16, generator=g) * 2 - 1

    calibration, eval_data = [batch() for _ in range(8)], [batch() for _ in range(2)]
    report = verify(model, None, calibration, eval_data, search_schemes=False)
    tried = [d for d in report.decisions if d.kind == "activation_bits"]
    if vnni is None:
        assert tried == [] and report.verified_plan.activation.reduce_range
        return
    (decision,) = tried
    # one bit is ~6 dB; measured on selection batches the trial models were not calibrated on
    assert decision.kept and decision.sqnr_with_db > decision.sqnr_without_db + 2.0
    assert not report.verified_plan.activation.reduce_range
    assert any("VNNI" in note for note in report.verified_plan.notes)
    assert report.plan.sqnr_db > report.default.sqnr_db + 2.0
    assert "judged on trials calibrated on the other 4" in report.selected_on


def test_the_fallback_predicts_its_gain_from_each_layer_own_error():
    from qlint.core.sqnr import predicted_gain_db

    # a layer whose own noise is the output's whole noise: everything is gained (capped at 20 dB)
    assert predicted_gain_db(20.0, [20.0]) == pytest.approx(20.0)
    # half the output's noise power: 3 dB
    assert predicted_gain_db(20.0, [23.0103]) == pytest.approx(3.0103, abs=1e-3)
    # layers far cleaner than the output: nothing worth a trial
    assert predicted_gain_db(20.0, [45.0, 50.0]) < 0.05
    assert predicted_gain_db(20.0, []) == 0.0


def test_the_fallback_tries_layers_from_the_worst_own_error_up():
    from tests.test_rewrite import make_same_conv_net

    g = torch.Generator().manual_seed(2)
    calibration = [torch.randn(4, 3, 12, 12, generator=g) for _ in range(4)]
    eval_data = [torch.randn(4, 3, 12, 12, generator=g) for _ in range(2)]
    report = verify(make_same_conv_net(), None, calibration, eval_data, target_sqnr=150.0, prune=False)
    tried = [d for d in report.decisions if d.kind == "keep_float"]
    assert tried, report.notes
    own = [float(d.detail.split("own SQNR ")[1].split(" dB")[0]) for d in tried]
    assert own == sorted(own)  # the worst own error first
    assert [d.target for d in tried if d.kept] == report.kept_float


def test_a_layer_flipped_back_to_static_leaves_no_decision_equal_to_the_globals():
    """The scheme search wrote 'fc_layers.0: static' (the global default) into digit_cnn's verified
    plan after flipping it dynamic and back, and measured that plan again as if it were new."""
    from qlint.advice.verify_search import _flipped
    from qlint.advice.verify_session import plan_key

    plan = default_plan("x86")
    back = _flipped(_flipped(plan, ["fc"], 1.0), ["fc"], 0.5)
    assert back.decision("fc") is None and plan_key(back) == plan_key(plan)
    # where the plan keeps everything else float, static must stay explicit
    floating = plan.model_copy(update={"float_by_default": True})
    assert _flipped(_flipped(floating, ["fc"], 1.0), ["fc"], 0.5).decision("fc").mode == "static"
    # a decision with a spec of its own keeps it, and its history
    own = ModuleDecision(
        fqn="fc", mode="dynamic", weight=WeightSpec(per_channel=False), provenance=[Provenance(source="user")]
    )
    kept = _flipped(plan.model_copy(update={"modules": [own]}), ["fc"], 0.5).decision("fc")
    assert kept.mode == "static" and kept.weight == own.weight and len(kept.provenance) == 2


def test_a_decision_on_a_parent_module_covers_its_layers_as_in_torch():
    """A QConfigMapping's module name covers the submodules: a plan keeping 'block' float keeps
    'block.fc' float. The scheme search read decisions by exact name only, so it offered to
    quantize block.fc dynamically inside the float block, and a new decision under a quantized
    parent dropped the parent's weight spec."""
    from qlint.advice.verify_search import _flipped, _quantized_by, scheme_candidates

    class Blocks(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
            self.head = nn.Linear(8, 4)

        def forward(self, x):
            return self.head(self.block(x))

    gm = torch.fx.symbolic_trace(Blocks())
    user = Provenance(source="user")
    float_block = default_plan("x86").model_copy(
        update={"modules": [ModuleDecision(fqn="block", quantize=False, provenance=[user])]}
    )
    assert scheme_candidates(gm, float_block, "x86") == ["head"]
    assert not _quantized_by(float_block, "block.0") and _quantized_by(float_block, "head")
    per_tensor = WeightSpec(per_channel=False)
    dynamic_block = default_plan("x86").model_copy(
        update={"modules": [ModuleDecision(fqn="block", mode="dynamic", weight=per_tensor, provenance=[user])]}
    )
    # --no-prune freezes the plan's decisions, and with them the layers they cover
    assert scheme_candidates(gm, dynamic_block, "x86", frozen=["block"]) == ["head"]
    assert dynamic_block.effective_weight("block.2") == per_tensor
    child = _flipped(dynamic_block, ["block.2"], 1.0).decision("block.2")
    assert child.mode == "static" and child.weight == per_tensor
    # flipped back, the layer is what its parent makes it: no decision of its own is left
    back = _flipped(_flipped(dynamic_block, ["block.2"], 1.0), ["block.2"], 0.5)
    assert back.decision("block.2") is None and back.governing_decision("block.2").fqn == "block"
