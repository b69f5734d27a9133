"""QL105 on a functional conv called with int (or default) stride/padding/dilation: convert_fx
passes them as written to the quantized prepack op, which takes only lists. QL105 said "two
connected ops disagree on the tensor's dtype" (or "not one of the known conversion failures")."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import qlint
from qlint.advice.plan import plan_from_report
from tests.models import output_sqnr


class _FunctionalConvNet(nn.Module):
    def __init__(self, as_tuples: bool) -> None:
        super().__init__()
        self.as_tuples = as_tuples
        self.weight = nn.Parameter(torch.randn(8, 3, 3, 3) * 0.2)
        self.bias = nn.Parameter(torch.zeros(8))
        self.head = nn.Conv2d(8, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.as_tuples:
            y = F.conv2d(x, self.weight, self.bias, stride=(1, 1), padding=(1, 1), dilation=(1, 1), groups=1)
        else:
            y = F.conv2d(x, self.weight, self.bias, padding=1)
        return self.head(torch.relu(y))


def _batches(count: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 3, 12, 12, generator=generator) for _ in range(count)]


def _conversion_errors(model: nn.Module, calibration: list[torch.Tensor]):
    report = qlint.lint(model, (calibration[0],), calibration=[(b,) for b in calibration], select=["QL105"])
    return report, [f for f in report.findings if f.severity.value == "error"]


def test_int_arguments_of_a_functional_conv_are_diagnosed_and_the_plan_converts():
    torch.manual_seed(0)
    model, calibration = _FunctionalConvNet(as_tuples=False).eval(), _batches(8, 1)
    report, [failure] = _conversion_errors(model, calibration)
    assert failure.data["kind"] == "functional-conv-arguments"
    assert "pass them as tuples" in failure.message and "disagree on the tensor's dtype" not in failure.message
    fix = failure.suggestion
    assert fix is not None and fix.action == "keep_float_function" and fix.function == "torch.conv2d"
    assert fix.node == "conv2d"  # the functional conv of the float graph, not convert_fx's prepack node
    quantized = plan_from_report(report).quantize(model, calibration)
    assert output_sqnr(model, quantized, _batches(2, 2)) > 15.0


def test_the_same_conv_with_tuple_arguments_converts():
    torch.manual_seed(0)
    model, calibration = _FunctionalConvNet(as_tuples=True).eval(), _batches(8, 1)
    _, errors = _conversion_errors(model, calibration)
    assert errors == []
