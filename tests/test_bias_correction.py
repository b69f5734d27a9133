"""Empirical bias correction (qlint.measure.bias_correction): the streamed correction equals the mean
weight-rounding shift computed by brute force on the calibration data, it touches only int8
layers, and as a plan step it is measured, kept where it gains and reproduced by QuantPlan.quantize."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.ao.quantization import get_default_qconfig_mapping

from qlint.advice.plan import BiasCorrection, Provenance, QuantPlan, default_plan
from qlint.advice.verify import verify
from qlint.measure.trial import quantize_fx
from tests.models import mobilenet_style, output_sqnr


class ConvNet(nn.Module):
    """A padded strided conv, a depthwise conv, and a Linear on a (B, T, D) input."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False)
        self.fc = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.dw(torch.relu(self.conv(x)))
        return self.fc(y.flatten(2).transpose(1, 2))  # (B, H*W, 8)


def _calibration(seed: int, count: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(3, 3, 10, 10, generator=g) * 2 for _ in range(count)]  # mean far from zero


def _inputs(model: nn.Module, batches: list[torch.Tensor]) -> dict[str, list[torch.Tensor]]:
    """Every layer's float input on every batch (the brute-force reference keeps them all)."""
    seen: dict[str, list[torch.Tensor]] = {}
    handles = [
        getattr(model, name).register_forward_pre_hook(lambda _m, i, name=name: seen.setdefault(name, []).append(i[0]))
        for name in ("conv", "dw", "fc")
    ]
    with torch.no_grad():
        for batch in batches:
            model(batch)
    for h in handles:
        h.remove()
    return seen


def _brute_force_shift(layer: nn.Module, weight_error: torch.Tensor, inputs: list[torch.Tensor]) -> torch.Tensor:
    error = weight_error.double()
    if isinstance(layer, nn.Linear):
        outputs = [F.linear(x.double(), error).reshape(-1, error.shape[0]) for x in inputs]
        return torch.cat(outputs).mean(0)
    outputs = [
        F.conv2d(x.double(), error, None, layer.stride, layer.padding, layer.dilation, layer.groups) for x in inputs
    ]
    return torch.cat([o.transpose(0, 1).reshape(error.shape[0], -1) for o in outputs], dim=1).mean(1)


def _quantized(model: nn.Module, calibration, *, correct: bool, mapping=None):
    import copy

    mapping = mapping if mapping is not None else get_default_qconfig_mapping("x86")
    return quantize_fx(copy.deepcopy(model), mapping, "x86", calibration, bias_correction=correct)[0]


def test_streamed_correction_equals_the_brute_force_mean_shift():
    torch.manual_seed(0)
    model, calibration = ConvNet().eval(), _calibration(1, 4)
    plain = _quantized(model, calibration, correct=False)
    corrected = _quantized(model, calibration, correct=True)
    inputs = _inputs(model, calibration)
    for name in ("conv", "dw", "fc"):
        float_layer, before, after = getattr(model, name), plain.get_submodule(name), corrected.get_submodule(name)
        int8_weight = after.weight()
        assert torch.equal(int8_weight.int_repr(), before.weight().int_repr())  # weights untouched
        expected = _brute_force_shift(float_layer, int8_weight.dequantize() - float_layer.weight, inputs[name])
        assert expected.abs().max() > 1e-6  # there is a shift to correct
        old_bias = before.bias() if before.bias() is not None else torch.zeros_like(expected)
        applied = (old_bias.double() - after.bias().double()).detach()
        torch.testing.assert_close(applied, expected, atol=2e-7, rtol=1e-3)


def test_a_layer_left_float_keeps_its_bias():
    torch.manual_seed(0)
    model, calibration = ConvNet().eval(), _calibration(2, 2)
    mapping = get_default_qconfig_mapping("x86").set_module_name("fc", None)
    corrected = _quantized(model, calibration, correct=True, mapping=mapping)
    assert isinstance(corrected.get_submodule("fc"), nn.Linear)  # stayed float
    assert torch.equal(corrected.get_submodule("fc").bias, model.fc.bias)
    assert not torch.equal(corrected.get_submodule("conv").bias(), model.conv.bias)


def test_the_model_and_its_parameters_are_left_as_they_were():
    torch.manual_seed(0)
    model, calibration = ConvNet().eval(), _calibration(3, 2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    default_plan().model_copy(
        update={"bias_correction": BiasCorrection(provenance=[Provenance(source="user")])}
    ).quantize(model, calibration)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_bias_correction_gains_on_held_out_data_and_round_trips():
    torch.manual_seed(0)
    model = mobilenet_style().eval()
    g = torch.Generator().manual_seed(4)
    calibration = [torch.randn(4, 3, 32, 32, generator=g).abs() for _ in range(8)]
    held_out = [torch.randn(4, 3, 32, 32, generator=g).abs() for _ in range(4)]
    plain = default_plan("x86")
    corrected = plain.model_copy(update={"bias_correction": BiasCorrection(provenance=[Provenance(source="user")])})
    assert QuantPlan.from_json(corrected.model_dump_json()) == corrected
    gain = output_sqnr(model, corrected.quantize(model, calibration), held_out) - output_sqnr(
        model, plain.quantize(model, calibration), held_out
    )
    assert gain > 0.5
    assert "bias correction" in corrected.pretty()
    assert "qlint quantize" in corrected.to_python()  # the mapping file says what it cannot express
    compile(corrected.to_python(), "qconfig.py", "exec")


def test_verify_measures_bias_correction_and_quantize_reproduces_it():
    torch.manual_seed(0)
    model = mobilenet_style().eval()
    g = torch.Generator().manual_seed(5)
    calibration = [torch.randn(4, 3, 32, 32, generator=g).abs() for _ in range(8)]
    held_out = [torch.randn(4, 3, 32, 32, generator=g).abs() for _ in range(3)]
    report = verify(model, None, calibration, held_out, max_trials=2)
    outcome = next(d for d in report.decisions if d.kind == "bias_correction")
    assert outcome.kept == (outcome.sqnr_with_db > outcome.sqnr_without_db + 0.1)
    assert (report.verified_plan.bias_correction is not None) == outcome.kept
    assert outcome.kept  # this model's rounding shifts are worth more than 0.1 dB
    gain = report.verified_plan.bias_correction.provenance[0].gain_db
    assert gain == pytest.approx(outcome.sqnr_with_db - outcome.sqnr_without_db, abs=1e-3)
    rebuilt = report.verified_plan.quantize(model, calibration)
    assert output_sqnr(model, rebuilt, held_out) == pytest.approx(report.plan.sqnr_db, abs=0.1)
    skipped = verify(model, None, calibration, held_out, max_trials=2, bias_correction=False)
    assert not any(d.kind == "bias_correction" for d in skipped.decisions)
    assert skipped.verified_plan.bias_correction is None
