"""QL101's fixed ranges follow the plan's activation bits: verify's 8-bit activations move them
from 128 levels to 256, and a plan never gives one more levels than its activations have.

EfficientNet-Lite0: verify kept 8-bit activations (reduce_range=False) but left the 33 fixed
[0, 6] ReLU6 ranges QL101 chose at 7 bits; at 8 bits the held-out SQNR went 16.6 -> 21.4 dB."""

from __future__ import annotations

import pytest
import torch

import qlint
from qlint.advice.plan import ActivationSpec, ModuleDecision, Provenance, default_plan, plan_from_report
from qlint.advice.verify import verify
from tests.models import output_sqnr
from tests.test_ql101_ranges import Relu6Net

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

_RELU6 = ActivationSpec(observer="fixed", quant_min=0, quant_max=127, scale=6 / 127, zero_point=0)
_SIGMOID = ActivationSpec(observer="fixed", quant_min=0, quant_max=255, scale=1 / 256, zero_point=0)


def _decision(fqn: str, activation: ActivationSpec) -> ModuleDecision:
    return ModuleDecision(fqn=fqn, activation=activation, provenance=[Provenance(source="user", detail="test")])


def _real_range(spec: ActivationSpec) -> tuple[float, float]:
    assert spec.scale is not None and spec.zero_point is not None
    assert spec.quant_min is not None and spec.quant_max is not None
    return (spec.quant_min - spec.zero_point) * spec.scale, (spec.quant_max - spec.zero_point) * spec.scale


def test_verify_moves_ql101_fixed_ranges_to_8_bits_with_the_activations(monkeypatch):
    import qlint.advice.verify_search as search

    monkeypatch.setattr(search, "host_vnni", lambda: "avx512_vnni")  # our CPU probe, not torch
    torch.manual_seed(0)
    model = Relu6Net().eval()
    g = torch.Generator().manual_seed(1)
    calibration = [torch.randn(4, 3, 16, 16, generator=g) for _ in range(8)]
    held_out = [torch.randn(4, 3, 16, 16, generator=g) for _ in range(3)]
    report = qlint.lint(model, (calibration[0],), calibration=[(b,) for b in calibration], select=["QL101"])
    plan = plan_from_report(report)
    fixed = [d for d in plan.modules if d.activation is not None and d.activation.observer == "fixed"]
    assert {d.fqn for d in fixed} == {"stem", "conv2"} and plan.activation.reduce_range
    assert all(d.activation.quant_max == 127 for d in fixed)  # x86: QL101 took the activations' 7 bits

    result = verify(model, plan, calibration, held_out, search_schemes=False, bias_correction=False)
    verified = result.verified_plan
    [bits] = [d for d in result.decisions if d.kind == "activation_bits"]
    assert bits.kept and not verified.activation.reduce_range
    kept = [d for d in verified.modules if d.activation is not None and d.activation.observer == "fixed"]
    assert kept, "pruning dropped every fixed range: the test no longer checks them"
    for decision in kept:
        assert (decision.activation.quant_min, decision.activation.quant_max) == (0, 255)
        assert _real_range(decision.activation) == pytest.approx((0.0, 6.0))  # the clip stays where it was
    # the decision and the plan's note say what it changed
    assert "2 fixed range(s)" in bits.target
    assert any("2 fixed range(s) at 256 levels" in note for note in verified.notes)
    # what moving them gains, on batches that decided nothing: the same plan with them at 7 bits
    at_7_bits = verified.model_copy(
        update={
            "modules": [
                d.model_copy(update={"activation": d.activation.changed(quant_max=127, scale=6 / 127)})
                if d in kept
                else d
                for d in verified.modules
            ]
        }
    )
    moved = output_sqnr(model, verified.quantize(model, calibration), held_out)
    assert moved == pytest.approx(result.plan.sqnr_db, abs=1e-3)
    assert moved > output_sqnr(model, at_7_bits.quantize(model, calibration), held_out) + 1.0


def test_a_fixed_range_never_has_more_levels_than_the_plans_activations():
    relu6_8_bits = _RELU6.with_levels(256)
    six_bits = ActivationSpec(observer="fixed", quant_min=0, quant_max=63, scale=6 / 63, zero_point=0)
    decisions = [
        _decision("conv", relu6_8_bits),
        _decision("sigmoid", _SIGMOID),  # the qparams x86 demands of a sigmoid: not a choice
        _decision("narrow", six_bits),  # fewer levels than either width: left as chosen
        _decision("fc", ActivationSpec(observer="minmax", reduce_range=True)),
    ]
    seven = default_plan("x86").model_copy(update={"modules": decisions})
    followed = seven.with_fixed_ranges_at_activation_bits()
    narrowed = followed.decision("conv").activation
    assert narrowed.quant_range() == (0, 127) and _real_range(narrowed) == pytest.approx((0.0, 6.0))
    assert [followed.decision(f).activation for f in ("sigmoid", "narrow", "fc")] == [
        d.activation for d in decisions[1:]
    ]
    # 8-bit activations (qnnpack's default): the 7-bit range widens over the same [0, 6]
    eight = default_plan("qnnpack").model_copy(update={"modules": [_decision("conv", _RELU6), decisions[1]]})
    widened = eight.with_fixed_ranges_at_activation_bits()
    assert widened.decision("conv").activation.quant_range() == (0, 255)
    assert _real_range(widened.decision("conv").activation) == pytest.approx((0.0, 6.0))
    assert widened.decision("sigmoid").activation == _SIGMOID
    assert widened.with_fixed_ranges_at_activation_bits() is widened  # already consistent: unchanged


def test_with_levels_keeps_the_real_range_of_an_offset_range():
    tanh_like = ActivationSpec(
        observer="fixed", dtype="qint8", quant_min=-128, quant_max=127, scale=0.05, zero_point=10
    )
    halved = tanh_like.with_levels(128)
    assert halved.quant_range() == (-64, 63)
    assert _real_range(halved) == pytest.approx(_real_range(tanh_like), abs=halved.scale)
    with pytest.raises(ValueError, match="only a fixed range"):
        ActivationSpec().with_levels(128)


def test_ql101_takes_the_levels_of_the_plans_activations_on_each_backend():
    torch.manual_seed(0)
    model = Relu6Net().eval()
    g = torch.Generator().manual_seed(1)
    calibration = [(torch.randn(4, 3, 16, 16, generator=g),) for _ in range(2)]
    for backend in ("x86", "qnnpack"):
        report = qlint.lint(
            model,
            calibration[0],
            calibration=calibration,
            select=["QL101"],
            backend=backend,
            trial_options={"enabled": False},
        )
        plan = plan_from_report(report)
        [spec] = {d.activation for d in plan.modules if d.activation is not None and d.activation.observer == "fixed"}
        assert spec.levels() == plan.activation.levels()
