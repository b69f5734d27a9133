"""The trial quantization and the measured impact of findings, checked against torch done by hand."""

import copy
import math

import pytest
import torch
import torch.nn as nn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.ao.quantization import QConfig, QConfigMapping, default_dynamic_qconfig, get_default_qconfig_mapping
from torch.ao.quantization.observer import HistogramObserver, MinMaxObserver, PerChannelMinMaxObserver
from torch.ao.quantization.qconfig import qconfig_equals
from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

import qlint
from qlint.core.sqnr import sqnr_db
from qlint.core.trace import symbolic_graph
from qlint.linter.fixes import SetQConfig
from qlint.linter.impact import fix_mapping
from qlint.rules.ql106_float_fallback import _LSTMClassifier


class _Spread(nn.Module):
    """Conv weight channels scaled 1..2^5 (the head undoes it, so every channel counts equally at
    the output): per-tensor weights leave the narrow channels few levels."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 12, 3, padding=1)
        self.head = nn.Linear(12, 4)
        gains = 2.0 ** (torch.arange(12.0) % 6)
        with torch.no_grad():
            self.conv.weight.mul_(gains.view(12, 1, 1, 1))
            self.conv.bias.mul_(gains)
            self.head.weight.div_(gains)

    def forward(self, x):
        return self.head(torch.relu(self.conv(x)).mean((2, 3)))


def _per_tensor() -> QConfigMapping:
    return QConfigMapping().set_global(
        QConfig(
            activation=HistogramObserver.with_args(reduce_range=True),
            weight=MinMaxObserver.with_args(dtype=torch.qint8, qscheme=torch.per_tensor_symmetric),
        )
    )


def _per_channel_weights() -> QConfig:
    """QL104's fix for the per-tensor mapping, built by hand: the same activations, per-channel weights."""
    return QConfig(
        activation=HistogramObserver.with_args(reduce_range=True),
        weight=PerChannelMinMaxObserver.with_args(dtype=torch.qint8, qscheme=torch.per_channel_symmetric),
    )


def _batches(count=6):
    generator = torch.Generator().manual_seed(3)
    return [torch.randn(4, 3, 8, 8, generator=generator) for _ in range(count)]


def _model():
    torch.manual_seed(0)
    return _Spread().eval()


def _lint_ql104(model, data, trial_options):
    """QL104 alone on ``model``, calibrated on ``data``, its intent per-tensor weights."""
    return qlint.lint(
        model,
        (data[0],),
        calibration=data,
        qconfig_mapping=_per_tensor(),
        select=["QL104"],
        trial_options=trial_options,
    )


def _per_channel_fix(targets) -> QConfigMapping:
    """The per-tensor intent with QL104's fix: per-channel weights on ``targets``."""
    mapping = _per_tensor()
    for name in targets:
        mapping.set_module_name(name, _per_channel_weights())
    return mapping


def _by_hand(model, mapping, calibration, evaluation, backend="x86"):
    """Output SQNR of torch's prepare_fx/convert_fx, done the way a user would."""
    previous = torch.backends.quantized.engine
    torch.backends.quantized.engine = backend
    try:
        prepared = prepare_fx(copy.deepcopy(symbolic_graph(copy.deepcopy(model))), mapping, (calibration[0],))
        with torch.no_grad():
            for batch in calibration:
                prepared(batch)
            converted = convert_fx(prepared)
            return sqnr_db([model(b) for b in evaluation], [converted(b) for b in evaluation])
    finally:
        torch.backends.quantized.engine = previous


def test_trial_and_fix_impact_match_torch_by_hand():
    model, data = _model(), _batches()
    report = _lint_ql104(model, data, {"batches": 4, "min_impact_db": 0.0})
    trial = report.trial
    assert trial is not None and trial.converted
    # batches=4 reads 4 + 1 batches: the trial calibrates on 4 and evaluates on the 5th, held out
    calibration, evaluation = data[:4], data[4:5]
    assert trial.calibrated_on == "4 batches of the calibration data"
    assert trial.output_sqnr_db == pytest.approx(_by_hand(model, _per_tensor(), calibration, evaluation), abs=0.01)
    [finding] = report.by_rule("QL104")
    impact = finding.impact
    assert impact is not None and impact.basis == "fix-trial" and impact.kind == "sqnr-gain"
    assert finding.suggestion.targets == ["conv", "head"]
    fixed_mapping = _per_channel_fix(finding.suggestion.targets)
    assert impact.fixed_sqnr_db == pytest.approx(_by_hand(model, fixed_mapping, calibration, evaluation), abs=0.01)
    assert impact.db == pytest.approx(impact.fixed_sqnr_db - impact.base_sqnr_db, abs=1e-3)
    assert impact.db > 0 and finding.severity.value == "warning"
    # the summary measured every kept fix at once
    assert trial.fixed_sqnr_db is not None and trial.recoverable_db == pytest.approx(
        trial.fixed_sqnr_db - trial.output_sqnr_db, abs=1e-3
    )


def test_the_trial_reads_no_more_batches_than_num_batches():
    """QA: with --num-batches 1, 2 or 8 the trial always calibrated on 4 batches and evaluated
    on 4 more, while the statistics read N: one report on two sets of data."""
    model, data = _model(), _batches(8)
    report = qlint.lint(
        model,
        (data[0],),
        calibration=data,
        qconfig_mapping=_per_tensor(),
        select=["QL104"],
        calibration_options={"num_batches": 3},
        trial_options={"batches": 4, "min_impact_db": 0.0},
    )
    trial = report.trial
    assert trial is not None and trial.calibrated_on == "2 batches of the calibration data"
    assert trial.evaluated_on.startswith("1 later calibration batch ")
    assert trial.output_sqnr_db == pytest.approx(_by_hand(model, _per_tensor(), data[:2], data[2:3]), abs=0.01)


def test_threshold_turns_a_small_impact_into_info_and_says_so():
    model, data = _model(), _batches()
    strict = _lint_ql104(model, data, {"batches": 4, "min_impact_db": 1000.0})
    [finding] = strict.by_rule("QL104")
    assert finding.severity.value == "info"
    assert "below the 1000 dB threshold" in finding.message
    off = _lint_ql104(model, data, {"enabled": False})
    [raw] = off.by_rule("QL104")
    assert raw.severity.value == "warning" and raw.impact is None and off.trial is None


def test_without_calibration_the_trial_says_it_evaluates_on_its_calibration_data():
    model, data = _model(), _batches(1)
    report = qlint.lint(model, (data[0],), qconfig_mapping=_per_tensor(), select=["QL104"])
    assert report.trial.calibrated_on == "the example inputs"
    assert "the data it was calibrated on" in report.trial.evaluated_on


def test_no_trial_without_example_inputs_and_rules_that_need_it_say_why():
    report = qlint.lint(_model(), select=["QL105", "QL106"])
    assert report.trial is None
    assert {s.rule for s in report.skipped} == {"QL105", "QL106"}
    assert all("example inputs" in s.reason for s in report.skipped)


def test_float_fallback_measures_its_dynamic_fix_like_torch():
    torch.manual_seed(0)
    model = _LSTMClassifier().eval()
    generator = torch.Generator().manual_seed(1)
    data = [torch.randn(4, 12, 16, generator=generator) for _ in range(4)]
    report = qlint.lint(model, (data[0],), calibration=data, select=["QL106"])
    [finding] = report.by_rule("QL106")
    assert finding.target == "lstm" and finding.severity.value == "warning"
    assert report.trial.int8_ops == 1 and report.trial.weighted_ops == 2 and report.trial.float_layers == ["lstm"]
    impact = finding.impact
    assert impact.kind == "coverage" and impact.int8_ops_gained == 1
    assert finding.suggestion == SetQConfig(targets=["lstm"], mode="dynamic")
    # by hand: the default mapping plus a dynamic entry for the LSTM (qlint keeps the backend's
    # per-channel weights; torch's default_dynamic_qconfig is per-tensor, so compare loosely)
    mapping = get_default_qconfig_mapping("x86").set_module_name("lstm", default_dynamic_qconfig)
    by_hand = _by_hand(model, mapping, data[:3], data[3:])
    assert impact.fixed_sqnr_db == pytest.approx(by_hand, abs=3.0)
    assert impact.fixed_sqnr_db < impact.base_sqnr_db + 0.5  # int8 is never more accurate than float


# --- property: bits lost stay physical -----------------------------------------------------------


class _Fc(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(x)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    scales=st.lists(st.floats(min_value=1e-6, max_value=1e6), min_size=8, max_size=8),
    spike=st.floats(min_value=1.0, max_value=1e9),
    positive=st.booleans(),
    weight_scales=st.lists(st.floats(min_value=1e-9, max_value=1e9), min_size=4, max_size=4),
)
def test_no_finding_reports_more_bits_lost_than_the_dtype_has(scales, spike, positive, weight_scales):
    torch.manual_seed(0)
    model = _Fc().eval()
    with torch.no_grad():
        model.fc.weight.mul_(torch.tensor(weight_scales).view(4, 1))
    generator = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(4):
        batch = torch.randn(32, 8, generator=generator) * torch.tensor(scales)
        batch = batch.abs() if positive else batch
        batch[0, 0] = spike  # a rare spike in channel 0
        batches.append(batch)
    report = qlint.lint(
        model,
        (batches[0],),
        calibration=batches,
        qconfig_mapping=_per_tensor(),
        select=["QL104", "QL203"],
        trial_options={"enabled": False},
    )
    for finding in report.findings:
        bits = finding.data.get("dtype_bits", 8)
        for key, value in finding.data.items():
            if "bits" in key and key != "dtype_bits" and isinstance(value, float) and math.isfinite(value):
                assert 0.0 <= value <= bits, (finding.rule, key, value, bits)
        for layer in finding.data.get("layers", []):
            if isinstance(layer.get("bits_lost"), float):
                assert 0.0 <= layer["bits_lost"] <= 8.0


def test_a_fix_by_op_type_is_measured_with_the_backend_default_restored_for_every_spelling():
    # the README example's mapping gives torch.sigmoid a calibrated observer; QL103's fix is the
    # default mapping's fixed-qparams qconfig, which no module name reaches: it is set by type
    from examples.badnet import build, qconfig_mapping

    example = (torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(0)),)
    report = qlint.lint(build(), example, qconfig_mapping=qconfig_mapping(), select=["QL103"])
    (finding,) = [f for f in report.findings if f.rule == "QL103" and f.target == "sigmoid"]
    fixed = fix_mapping(qconfig_mapping(), [finding], "x86")
    assert fixed is not None
    default = get_default_qconfig_mapping("x86").object_type_qconfigs
    for spelling in (torch.sigmoid, "sigmoid", "sigmoid_"):
        assert qconfig_equals(fixed.object_type_qconfigs[spelling], default[spelling])
    # prepare_fx ignores a calibrated qconfig on a fixed-qparams op (with a warning), so the
    # measured fix changes nothing in the int8 model: 0 dB, info, not an estimate
    assert finding.impact is not None and finding.impact.basis == "fix-trial"
    assert finding.impact.db == pytest.approx(0.0, abs=1e-3) and finding.severity.value == "info"


def test_fixes_measured_useless_leave_the_plan_and_a_diagnosis_without_a_fix_suggests_none():
    # the README example on its calibration data: the output is destroyed (input scale drift),
    # and no single fix recovers it
    from examples.badnet import build, calibration_batches, qconfig_mapping

    batches = calibration_batches()
    report = qlint.lint(
        build(), (batches[0],), calibration=batches, qconfig_mapping=qconfig_mapping(), select=["QL105", "QL202"]
    )
    (diagnosis,) = report.by_rule("QL105")
    assert diagnosis.severity.value != "info" and diagnosis.impact is not None
    assert diagnosis.impact.kind == "diagnosis" and diagnosis.impact.db < 0.5
    assert "No single layer kept float recovers it" in diagnosis.message
    assert diagnosis.suggestion is None and diagnosis.data["fix_target"]  # measured, not suggested
    (equalize,) = report.by_rule("QL202")
    assert equalize.suggestion is not None and equalize.impact is not None
    # keeping the layer float, the most any fix of it recovers, gains less than the threshold
    assert equalize.impact.basis == "keep-float-trial" and equalize.severity.value == "info"
    plan = report.suggestions()
    assert plan.modules == [] and plan.equalization == []


@pytest.mark.parametrize(
    "base, fixed, expected",
    [
        (5.891, 5.891, "leaves the int8 model's output exactly as it was"),
        (5.891, 3.591, "-2.30 dB (fix-trial): the fix makes the output worse"),
        (5.891, 6.091, "+0.20 dB (fix-trial) is below the 0.5 dB threshold"),
        (5.891, 9.891, None),
    ],
)
def test_a_demoted_warning_says_why_in_what_the_fix_did(base, fixed, expected):
    """QA read 'Fix: ...; measured +0.00 dB, below the threshold' on a fix that changed nothing
    (an observer on a module that stays float) and 'below the threshold' on fixes that hurt."""
    from qlint.linter.findings import Impact
    from qlint.linter.impact import demotion_note

    impact = Impact(db=fixed - base, basis="fix-trial", base_sqnr_db=base, fixed_sqnr_db=fixed)
    note = demotion_note(impact, 0.5)
    assert (note is None) if expected is None else (expected in note and note.endswith("this is info.")), note
