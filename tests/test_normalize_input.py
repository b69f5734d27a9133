"""Per-sample input normalization (QL204, the normalize_input rewrite) and functions kept float.

The rewrite must be exact in float for every sample of a batch, refused where the front end
does not scale with the input, kept float by the plan's mapping, and worth its finding on
batches the lint never saw."""

import operator

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from pydantic import ValidationError

import qlint
from qlint.advice.plan import FloatFunction, Provenance, QuantPlan, Rewrite, default_plan, plan_from_report
from qlint.linter.mapping import qconfig_mapping
from qlint.measure.normalize import find_normalizable_inputs, helper_modules, normalize_input
from qlint.rules.ql204_input_scale_spread import _SpectrumFrontEnd, _SquashedFrontEnd, _waveforms
from tests.models import output_sqnr

USER = [Provenance(source="user", detail="test")]


def _held_out(count: int = 4) -> list[torch.Tensor]:
    """Waveforms of the same loudness spread as the calibration data, from another seed."""
    generator = torch.Generator().manual_seed(7)
    return [
        torch.randn(8, 256, generator=generator) * 10.0 ** (torch.rand(8, 1, generator=generator) * 3 - 3)
        for _ in range(count)
    ]


def _normalized(model: nn.Module) -> fx.GraphModule:
    gm = fx.symbolic_trace(model)
    (candidate,) = find_normalizable_inputs(gm)
    normalize_input(gm, candidate.placeholder, candidate.layers)
    gm.graph.lint()
    gm.recompile()
    return gm


def test_rewrite_is_exact_for_every_sample_and_batch_size():
    model = _SpectrumFrontEnd().eval()
    rewritten = _normalized(_SpectrumFrontEnd().eval())
    batch = _held_out(1)[0]
    with torch.no_grad():
        expected, batched = model(batch), rewritten(batch)
        one_at_a_time = torch.cat([rewritten(batch[i : i + 1]) for i in range(batch.shape[0])])
    for got in (batched, one_at_a_time):
        per_sample = (got - expected).flatten(1).norm(dim=1) / expected.flatten(1).norm(dim=1)
        assert float(per_sample.max()) < 1e-5  # the quietest sample too, not just the batch as a whole


def test_the_front_end_runs_on_each_sample_at_full_scale():
    rewritten = _normalized(_SpectrumFrontEnd().eval())
    seen: list[torch.Tensor] = []
    rewritten.get_submodule("stft").register_forward_hook(lambda _m, args, _o: seen.append(args[0]))
    with torch.no_grad():
        rewritten(_held_out(1)[0])
    peaks = seen[0].abs().flatten(1).amax(dim=1)
    assert torch.allclose(peaks, torch.ones_like(peaks))


class _BatchMixer(nn.Module):
    """Mixes samples (a transpose of the batch dimension) before a bias-free conv."""

    def __init__(self) -> None:
        super().__init__()
        self.stft = nn.Conv1d(1, 4, 8, bias=False)
        self.conv = nn.Conv1d(4, 4, 3)

    def forward(self, x):
        return self.conv(self.stft(x.transpose(0, 1).unsqueeze(1)))


class _Offset(_SpectrumFrontEnd):
    def forward(self, x):
        return super().forward(x + 1.0)


class _NoBiasedLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stft = nn.Conv1d(1, 4, 8, bias=False)

    def forward(self, x):
        return self.stft(x.unsqueeze(1))


@pytest.mark.parametrize("model", [_SquashedFrontEnd, _BatchMixer, _Offset, _NoBiasedLayer])
def test_no_candidate_where_the_front_end_does_not_scale_with_the_input(model):
    assert list(find_normalizable_inputs(fx.symbolic_trace(model()))) == []


def _sqnr(plan: QuantPlan, calibration, held_out) -> float:
    model = _SpectrumFrontEnd().eval()
    return output_sqnr(model, plan.quantize(model, calibration), held_out)


def test_the_rewrite_alone_gains_on_held_out_batches_and_its_arithmetic_stays_float():
    calibration = _waveforms(3.0)(8)
    plan = default_plan().model_copy(
        update={"rewrites": [Rewrite(kind="normalize_input", modules=["conv"], params={"input": "x"}, provenance=USER)]}
    )
    mapping = qconfig_mapping(plan)
    for helper in helper_modules("x", ["conv"]):
        assert mapping.module_name_qconfigs[helper] is None
    converted = plan.quantize(_SpectrumFrontEnd().eval(), calibration)
    scale = next(n for n in converted.graph.nodes if n.op == "call_method" and n.target == "clamp_min")
    assert all(user.target is not torch.quantize_per_tensor for user in scale.users)  # never rounded
    held_out = _held_out()
    assert _sqnr(plan, calibration, held_out) > _sqnr(default_plan(), calibration, held_out) + 3.0


def test_lint_finds_both_fixes_and_the_plan_beats_the_default_on_held_out_batches():
    calibration = _waveforms(3.0)(8)
    report = qlint.lint(_SpectrumFrontEnd(), (calibration[0],), calibration=calibration, select=["QL105", "QL204"])
    by_rule = {f.rule: f for f in report.findings}
    spread = by_rule["QL204"]
    assert spread.suggestion is not None and spread.suggestion.action == "normalize_input"
    assert spread.suggestion.modules == ["conv"] and spread.data["bits_lost"] <= 8
    assert spread.impact is not None and spread.impact.db > 1.0  # measured by a trial, not estimated
    # QL105 looks past the onset layer at the functional ops before it
    assert by_rule["QL105"].suggestion.action == "keep_float_function"
    plan = plan_from_report(report)
    assert [r.kind for r in plan.rewrites] == ["normalize_input"]
    assert [f.function for f in plan.float_functions] == ["operator.add"]
    held_out = _held_out()
    assert _sqnr(plan, calibration, held_out) > _sqnr(default_plan(), calibration, held_out) + 6.0


def test_a_function_kept_float_reaches_every_export():
    plan = default_plan().model_copy(
        update={"float_functions": [FloatFunction(function="operator.add", provenance=USER)]}
    )
    assert qconfig_mapping(plan).object_type_qconfigs[operator.add] is None
    source = plan.to_python()
    assert "mapping.set_object_type(operator.add, None)" in source
    namespace: dict = {}
    exec(compile(source, "plan.py", "exec"), namespace)
    assert namespace["qconfig_mapping"].object_type_qconfigs[operator.add] is None
    assert "operator.add" in plan.pretty()
    again = QuantPlan.from_json(plan.model_dump_json())
    assert again.float_functions == plan.float_functions


@pytest.mark.parametrize("path", ["os.system", "builtins.eval", "torch.nn.functional.not_a_function", "operator.__x"])
def test_a_plan_names_only_functions_of_operator_torch_and_functional(path):
    with pytest.raises(ValidationError):
        FloatFunction(function=path, provenance=USER)


@pytest.mark.parametrize("poison", ["nan", "inf"])
def test_spread_is_not_measured_where_a_sample_has_no_scale(poison):
    """Found by the fuzz: a NaN or Inf sample made QL204 store a non-finite float in its
    finding and crash. Such a sample has no scale: the rule stays quiet and nothing crashes."""
    calibration = _waveforms(3.0)(4)
    if poison == "nan":
        calibration[1][3, 5] = float("nan")
    else:
        calibration[2][0, 0] = float("inf")
    report = qlint.lint(_SpectrumFrontEnd(), (calibration[0],), calibration=calibration, select=["QL204"])
    assert not any("crashed" in notice.message for notice in report.notices)
    assert not [f for f in report.findings if f.rule == "QL204"]


def test_silent_samples_are_left_out_of_the_spread():
    """Mostly silent calibration data (6 of 8 samples all zeros) once gave an infinite ratio;
    the spread of the samples that are not silent is what costs bits, and it is measured."""
    calibration = [batch * (torch.arange(8) >= 6).unsqueeze(1) for batch in _waveforms(3.0)(4)]
    report = qlint.lint(_SpectrumFrontEnd(), (calibration[0],), calibration=calibration, select=["QL204"])
    assert not any("crashed" in notice.message for notice in report.notices)
    (spread,) = [f for f in report.findings if f.rule == "QL204"]
    audible = [float(v) for batch in calibration for v in batch.abs().amax(dim=1) if v > 0]
    assert spread.data["samples"] == len(audible) == 8 and spread.data["silent_samples"] == 24
    assert spread.data["largest"] == pytest.approx(max(audible))
    assert 0 < spread.data["bits_lost"] <= 8 and "24 silent ones left out" in spread.message


def test_the_fix_trial_measures_the_model_the_plan_builds():
    """QL204's fix trial quantized the rewrite's helper modules, which the plan keeps float: on
    silero_vad it reported +1.82 dB where the plan's model gains +4.18 dB (QA)."""
    calibration = _waveforms(3.0)(8)
    model = _SpectrumFrontEnd().eval()
    report = qlint.lint(model, (calibration[0],), calibration=calibration, select=["QL204"])
    [spread] = report.by_rule("QL204")
    assert spread.impact is not None and spread.impact.basis == "fix-trial"
    assert report.trial is not None and report.trial.calibrated_on.startswith("4 batches")
    # the trial calibrates on the first 4 batches and evaluates on the 4 after them
    planned = output_sqnr(model, plan_from_report(report).quantize(model, calibration[:4]), calibration[4:])
    assert spread.impact.fixed_sqnr_db == pytest.approx(planned, abs=0.05)


def test_qlint_fix_keeps_the_rewrite_helpers_as_modules_so_the_emitted_mapping_reaches_them():
    """QA (silero_vad): qlint fix plus the emitted mapping gave 6.40 dB held-out where
    QuantPlan.quantize gave 8.91 for a plan of the normalize_input rewrite alone. fix folded
    BatchNorms with torch's fuse, which re-traced the model and inlined qlint_normalize_x and
    qlint_denormalize_conv: the mapping keeps those modules float by name, so their arithmetic
    was quantized in the saved model."""
    from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

    from qlint.advice.apply import fixed_model

    calibration = _waveforms(3.0)(8)
    plan = default_plan().model_copy(
        update={"rewrites": [Rewrite(kind="normalize_input", modules=["conv"], params={"input": "x"}, provenance=USER)]}
    )
    model = _SpectrumFrontEnd().eval()
    fixed, applied, _ = fixed_model(model, plan, (calibration[0],), calibration)
    assert [r.kind for r in applied if r.applied] == ["normalize_input"]
    called = {str(node.target) for node in fixed.graph.nodes if node.op == "call_module"}
    assert set(helper_modules("x", ["conv"])) <= called
    prepared = prepare_fx(fixed, qconfig_mapping(plan), (calibration[0],))
    with torch.no_grad():
        for batch in calibration:
            prepared(batch)
    held_out = _held_out()
    by_hand = output_sqnr(model, convert_fx(prepared), held_out)
    assert by_hand == pytest.approx(_sqnr(plan, calibration, held_out), abs=0.01)
