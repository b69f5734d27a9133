"""QL101 on conv → BN → ReLU6 chains the backend cannot fuse: a fixed saturating output range, and
an op of its own for a conv input that nothing quantized produces (the observe_input rewrite).
Measured on held-out batches, through the plan, as a user would apply it."""

from __future__ import annotations

import operator

import torch
import torch.nn as nn

import qlint
from qlint.advice.plan import default_plan, plan_from_report
from qlint.measure.rewrite import apply_requested_rewrites
from tests.models import output_sqnr


class Relu6Net(nn.Module):
    """Two conv → BN → ReLU6 blocks whose pre-activations reach well past 6; the stem reads the model input."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.bn1, self.act1 = nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU6()
        self.conv2, self.bn2, self.act2 = nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU6()
        self.pool, self.fc = nn.AdaptiveAvgPool2d(1), nn.Linear(16, 10)
        with torch.no_grad():
            self.bn1.weight.fill_(8.0)
            self.bn2.weight.fill_(3.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act1(self.bn1(self.stem(x)))
        x = self.act2(self.bn2(self.conv2(x)))
        return self.fc(self.pool(x).flatten(1))


def _data():
    g = torch.Generator().manual_seed(1)
    calibration = [torch.randn(4, 3, 16, 16, generator=g) for _ in range(4)]
    held_out = [torch.randn(4, 3, 16, 16, generator=g) for _ in range(3)]
    return calibration, held_out


def _lint_ql101(model, images, *, as_tuples=True):
    """QL101's report calibrated on ``images`` (each batch a one-tuple, or the bare tensor), and
    its one fixed-range finding."""
    calibration = [(b,) for b in images] if as_tuples else images
    report = qlint.lint(model, (images[0],), calibration=calibration, select=["QL101"])
    assert not report.skipped, report.skipped
    [finding] = [f for f in report.findings if f.data.get("kind") == "unfusable-activation"]
    return report, finding


def test_fixed_ranges_with_the_stem_input_observed_gain_on_held_out_data():
    torch.manual_seed(0)
    model, (calibration, held_out) = Relu6Net().eval(), _data()
    report, finding = _lint_ql101(model, calibration)
    fix = finding.suggestion
    assert fix.activation == "FixedQParamsObserver" and set(fix.targets) == {"stem", "conv2"}
    assert fix.zero_point == 0 and fix.scale * fix.quant_max == 6.0  # [0, 6]: the clip itself, not widened
    assert fix.observe_inputs == ["stem"]  # the model input feeds it; conv2's input is quantized already
    assert finding.impact is not None and finding.impact.db > 3.0
    # the gain holds on every evaluation batch: it does not rest on one of them
    assert finding.impact.steady_db is not None and 3.0 < finding.impact.steady_db <= finding.impact.db + 1e-3
    # the rounding before each ReLU6 is the trial's error at the fused conv (the BN node is folded away)
    assert len(finding.data["rounding_sqnr_db"]) == 2
    assert all(isinstance(db, float) and 10.0 < db < 60.0 for db in finding.data["rounding_sqnr_db"])
    assert "(rounding before relu6: " in finding.message
    plan = plan_from_report(report)
    assert [(r.kind, r.modules) for r in plan.rewrites] == [("observe_input", ["stem"])]
    default = output_sqnr(model, default_plan().quantize(model, calibration), held_out)
    fixed = output_sqnr(model, plan.quantize(model, calibration), held_out)
    assert fixed > default + 3.0
    without_rewrite = plan.model_copy(update={"rewrites": []})  # the stem then clips its own input at 0
    assert output_sqnr(model, without_rewrite.quantize(model, calibration), held_out) < fixed - 3.0


def test_observe_input_rewrite_is_exact_and_adds_one_op_before_the_conv():
    torch.manual_seed(0)
    model, (calibration, _) = Relu6Net().eval(), _data()
    report = qlint.lint(model, (calibration[0],), calibration=[(b,) for b in calibration], select=["QL101"])
    gm, applied = apply_requested_rewrites(model, plan_from_report(report), (calibration[0],))
    [rewrite] = [r for r in applied if r.kind == "observe_input"]
    assert rewrite.applied and rewrite.requested_by_plan and rewrite.max_relative_error == 0.0
    stem = next(n for n in gm.graph.nodes if n.op == "call_module" and n.target == "stem")
    source = stem.args[0]
    assert source.op == "call_function" and source.target is operator.add and source.args[1] == 0.0
    assert source.args[0].op == "placeholder"
    with torch.no_grad():
        assert torch.equal(gm(calibration[1]), model(calibration[1]))


class FunctionalConv(nn.Module):
    """A conv that calls F.conv2d on its own weight (as padding-same convs do): traced, it is a
    call_function that no qconfig by module name reaches until its BN is folded into it."""

    def __init__(self, channels_in: int, channels_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(channels_out, channels_in, 3, 3) * 0.3)
        self.bias = nn.Parameter(torch.zeros(channels_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # every argument positional and as lists, as convert_fx needs them (as padding-same convs pass them)
        return nn.functional.conv2d(x, self.weight, self.bias, [1, 1], [1, 1], [1, 1], 1)


class FunctionalRelu6Net(Relu6Net):
    def __init__(self) -> None:
        super().__init__()
        self.stem, self.conv2 = FunctionalConv(3, 16), FunctionalConv(16, 16)


def test_fixed_ranges_on_functional_convs_ask_for_the_fold_and_the_report_measures_them_together():
    torch.manual_seed(0)
    model, (calibration, held_out) = FunctionalRelu6Net().eval(), _data()
    report, finding = _lint_ql101(model, calibration)
    fix = finding.suggestion
    assert set(fix.targets) == {"stem", "conv2"} and set(fix.fold_functional) == {"stem", "conv2"}
    assert finding.impact is not None and finding.impact.db > 3.0
    # the report's "every warning's fix together" applies the fold the fix asks for: without it
    # the fixed ranges would name no module and the trial would measure the default
    assert report.trial is not None and report.trial.fixed_sqnr_db is not None
    assert report.trial.fixed_sqnr_db > report.trial.output_sqnr_db + 3.0
    plan = plan_from_report(report)
    assert ("fold_bn_into_functional_conv", ["stem", "conv2"]) in [(r.kind, r.modules) for r in plan.rewrites]
    default = output_sqnr(model, default_plan().quantize(model, calibration), held_out)
    assert output_sqnr(model, plan.quantize(model, calibration), held_out) > default + 3.0


def test_bare_tensor_calibration_batches_are_read_as_one_argument_each():
    torch.manual_seed(0)
    model, (calibration, _) = Relu6Net().eval(), _data()
    _, finding = _lint_ql101(model, calibration, as_tuples=False)  # QL101 was skipped as crashed on these
    assert (
        set(finding.suggestion.targets) == {"stem", "conv2"}
        and finding.suggestion.scale * finding.suggestion.quant_max == 6.0
    )
