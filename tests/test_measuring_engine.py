"""The engine a trial runs a backend's int8 model on: onednn for x86, measuring what x86 builds."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from torch.ao.quantization import get_default_qconfig_mapping
from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

from qlint.core.backends import measuring_engine
from qlint.core.sqnr import SqnrSums

needs_engines = pytest.mark.skipif(
    not {"x86", "onednn", "qnnpack"} <= set(torch.backends.quantized.supported_engines),
    reason="this torch build lacks the x86, onednn or qnnpack engine",
)


class WideDepthwise(nn.Module):
    """A depthwise 5x5 conv of more than 100 groups: the x86 engine runs it on fbgemm's kernel."""

    def __init__(self) -> None:
        super().__init__()
        self.expand = nn.Conv2d(8, 128, 1)
        self.depthwise = nn.Conv2d(128, 128, 5, padding=2, groups=128)
        self.project = nn.Conv2d(128, 16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(torch.relu(self.depthwise(torch.relu(self.expand(x)))))


def _output_sqnr(engine_context: object, model: nn.Module, calibration: list, evaluation: list) -> float:
    with engine_context:  # type: ignore[attr-defined]
        prepared = prepare_fx(copy.deepcopy(model), get_default_qconfig_mapping("x86"), (calibration[0],))
        with torch.no_grad():
            for batch in calibration:
                prepared(batch)
            converted = convert_fx(prepared)
            sums = SqnrSums()
            for batch in evaluation:
                sums.add(model(batch), converted(batch))
    return sums.sqnr_db()


@needs_engines
def test_x86_is_measured_on_onednn_and_the_callers_engine_comes_back() -> None:
    previous = torch.backends.quantized.engine
    with measuring_engine("x86") as available:
        assert available
        assert torch.backends.quantized.engine == "onednn"
    assert torch.backends.quantized.engine == previous
    with pytest.raises(RuntimeError, match="inside"), measuring_engine("x86"):
        raise RuntimeError("inside")
    assert torch.backends.quantized.engine == previous


@needs_engines
def test_other_backends_are_measured_on_their_own_engine() -> None:
    with measuring_engine("qnnpack") as available:
        assert available
        assert torch.backends.quantized.engine == "qnnpack"
    with measuring_engine("no-such-backend") as available:
        assert not available


@needs_engines
def test_onednn_measures_the_sqnr_the_x86_engine_gives() -> None:
    torch.manual_seed(0)
    model = WideDepthwise().eval()
    batches = [torch.randn(2, 8, 16, 16) for _ in range(6)]
    calibration, evaluation = batches[:4], batches[4:]
    previous = torch.backends.quantized.engine
    torch.backends.quantized.engine = "x86"
    try:
        on_x86 = _output_sqnr(torch.no_grad(), model, calibration, evaluation)
    finally:
        torch.backends.quantized.engine = previous
    measured = _output_sqnr(measuring_engine("x86"), model, calibration, evaluation)
    assert 20.0 < on_x86 < 60.0  # a real int8 error, not an identity or a broken model
    assert measured == pytest.approx(on_x86, abs=0.05)
