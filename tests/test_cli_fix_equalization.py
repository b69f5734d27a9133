"""`qlint fix --calibration` writes the model with the plan's equalization rescale applied.

QL202's fix is qlint's own cross-layer rescale (qlint.measure.equalization), which
QuantPlan.quantize and verify apply from calibration data. The exported path used to hand
the user torch's `_equalization_config` for it instead (build_equalization_mapping in the
emitted file, the finding's message), and `qlint fix` skipped it: on silero_vad that path
measured 1.06 dB held-out where `qlint quantize` of the same plan gave 12.64 dB. Here the
user's path (fixed model + the emitted mapping through prepare_fx/convert_fx) must give the
int8 model QuantPlan.quantize gives, on held-out data.
"""

from __future__ import annotations

import copy
import inspect
import json
import runpy

import torch
from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

from qlint.advice.plan import QuantPlan
from qlint.core.batches import call_model
from qlint.core.sqnr import SqnrSums

MODEL_SOURCE = """
import torch
import torch.nn as nn


class ConvReluConv(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 1)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(8, 4, 3)

    def forward(self, x):
        return self.conv2(self.relu(self.conv1(x)))


def build():
    torch.manual_seed(0)
    model = ConvReluConv().eval()
    with torch.no_grad():
        # half of conv2's input channels 50x wider than the rest, and conv2's weights 50x narrower
        # for them: every channel counts as much in the output, and QL202 fires
        scale = torch.tensor([50.0] * 4 + [1.0] * 4)
        model.conv1.weight.mul_(scale.view(-1, 1, 1, 1))
        model.conv1.bias.mul_(scale)
        model.conv2.weight.div_(scale.view(1, -1, 1, 1))
    return model
"""
SHAPE = (4, 3, 8, 8)


def _batches(seed: int, count: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(SHAPE, generator=generator) for _ in range(count)]


def _sqnr(reference: torch.nn.Module, model: torch.nn.Module, batches: list[torch.Tensor]) -> float:
    sums = SqnrSums()
    with torch.no_grad():
        for batch in batches:
            sums.add(call_model(reference, batch), call_model(model, batch))
    value = sums.sqnr_db()
    assert value is not None
    return value


def _user_int8(fixed: torch.nn.Module, qconfig_file: str, calibration: list[torch.Tensor]) -> torch.nn.Module:
    """What the emitted file tells a user to do with the model qlint fix wrote."""
    namespace = runpy.run_path(qconfig_file)
    build = namespace["build_qconfig_mapping"]
    # rewritten=True: the mapping for the model qlint fix wrote (the file has it when the plan rewrites)
    mapping = build(rewritten=True) if "rewritten" in inspect.signature(build).parameters else build()
    prepared = prepare_fx(
        copy.deepcopy(fixed),
        mapping,
        (calibration[0],),
        backend_config=namespace["build_backend_config"](),
    )
    with torch.no_grad():
        for batch in calibration:
            prepared(batch)
    return convert_fx(prepared)


def test_fix_with_calibration_reproduces_quantize_of_an_equalizing_plan(run_main, tmp_path):
    (tmp_path / "eqmod.py").write_text(MODEL_SOURCE)
    calibration, held_out = _batches(0, 8), _batches(1, 8)
    torch.save(calibration, tmp_path / "cal.pt")
    model_spec = f"{tmp_path}/eqmod.py:build"
    lint = run_main(model_spec, "--calibration", "cal.pt", "--emit-plan", "plan.json", "--format", "json")
    assert lint.returncode == 1, lint.stderr
    (finding,) = [f for f in json.loads(lint.stdout)["findings"] if f["rule"] == "QL202"]
    assert "qlint fix" in finding["message"] and "--calibration" in finding["message"]
    assert "_equalization_config" not in finding["message"]
    plan = QuantPlan.load(str(tmp_path / "plan.json"))
    assert [pair.module for pair in plan.equalization] == ["conv2"] and plan.bias_correction is None

    fix = run_main(
        "fix", model_spec, "--plan", "plan.json", "--calibration", "cal.pt",
        "--input-shape", ",".join(map(str, SHAPE)), "--output", "fixed.pt", "--emit-qconfig", "q.py",
    )  # fmt: skip
    assert fix.returncode == 0, fix.stderr
    assert "equalize conv1+conv2: applied" in fix.stderr and "not applied" not in fix.stderr
    source = (tmp_path / "q.py").read_text()
    assert "_equalization_config" not in source and "build_equalization_mapping" not in source
    assert "qlint fix" in source and "--calibration" in source

    float_model = runpy.run_path(str(tmp_path / "eqmod.py"))["build"]()
    fixed = torch.load(tmp_path / "fixed.pt", weights_only=False)  # our own file
    with torch.no_grad():  # the rescale is float-preserving
        assert torch.allclose(fixed(held_out[0]), float_model(held_out[0]), rtol=1e-4, atol=1e-4)
    user = _sqnr(float_model, _user_int8(fixed, str(tmp_path / "q.py"), calibration), held_out)
    measured = _sqnr(float_model, plan.quantize(float_model, calibration), held_out)
    assert abs(user - measured) < 0.1, (user, measured)

    # without calibration data the rescale is not applied, and fix says so
    plain = run_main(
        "fix", model_spec, "--plan", "plan.json",
        "--input-shape", ",".join(map(str, SHAPE)), "--output", "plain.pt",
    )  # fmt: skip
    assert plain.returncode == 0, plain.stderr
    assert "equalization" in plain.stderr and "not applied" in plain.stderr and "--calibration" in plain.stderr
    unequalized = torch.load(tmp_path / "plain.pt", weights_only=False)
    without = _sqnr(float_model, _user_int8(unequalized, str(tmp_path / "q.py"), calibration), held_out)
    assert measured > without + 1.0, (measured, without)  # the rescale is what the plan's gain is
