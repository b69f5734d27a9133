"""QL302 at a BatchNorm that reads an unfused functional conv's int8 output (efficientnet_lite0's
pattern): the fix is folding the BN into the conv, not keeping the BN float, and the onset rule
finds a large drop that stops just above the threshold."""

from __future__ import annotations

import copy
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.ao.quantization import get_default_qconfig_mapping
from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

from qlint.core.sqnr import sqnr_db_from_powers
from qlint.linter.findings import CompareRow
from qlint.linter.fixes import Fuse
from qlint.measure.rewrite import apply_rewrites
from qlint.numeric.compare import compare
from qlint.numeric.diagnose import error_onset_findings


class FunctionalConv(nn.Conv2d):
    """A conv whose forward is traced through (EfficientNet-Lite's same-padding convs)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)


class ConvBn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = FunctionalConv(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.head = nn.Conv2d(8, 4, 1)
        with torch.no_grad():
            self.conv.weight[4:] *= 1e-3  # half the channels are tiny next to the others
            self.conv.bias[4:] *= 1e-3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.bn(self.conv(x))))


def _calibrated_bn(model: ConvBn, batches: list[torch.Tensor]) -> None:
    """BN statistics of the conv outputs: the tiny channels get a tiny variance, which the BN scales up."""
    with torch.no_grad():
        out = torch.cat([model.conv(b) for b in batches])
        model.bn.running_mean.copy_(out.mean(dim=(0, 2, 3)))
        model.bn.running_var.copy_(out.var(dim=(0, 2, 3)))


def _quantized(model: nn.Module, batches: list[torch.Tensor]) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = prepare_fx(copy.deepcopy(model), get_default_qconfig_mapping("x86"), (batches[0],))
        with torch.no_grad():
            for batch in batches:
                prepared(batch)
        return convert_fx(prepared)


def _output_sqnr(float_model: nn.Module, quantized: nn.Module, batches: list[torch.Tensor]) -> float:
    with torch.no_grad():
        signal = sum(float(float_model(b).pow(2).sum()) for b in batches)
        noise = sum(float((float_model(b) - quantized(b)).pow(2).sum()) for b in batches)
    return sqnr_db_from_powers(signal, noise)


def test_an_amplifying_bn_after_an_unfused_conv_is_fixed_by_the_fold_not_by_keep_float():
    batches = [torch.randn(4, 3, 12, 12) for _ in range(4)]
    model = ConvBn().eval()
    _calibrated_bn(model, batches)
    quantized = _quantized(model, batches)
    report = compare(model, quantized, batches)

    onsets = [f for f in report.findings if f.rule == "QL302" and f.target == "bn"]
    assert len(onsets) == 1, [(f.rule, f.target, f.data.get("kind")) for f in report.findings]
    onset = onsets[0]
    assert onset.data["kind"] == "unfused-norm"
    assert isinstance(onset.suggestion, Fuse)
    assert onset.suggestion.modules == ["conv", "bn"]
    assert onset.suggestion.blockers == ["functional-op"]  # a plan maps it to fold_bn_into_functional_conv
    assert "keep bn in float" not in onset.message
    assert "fold bn into conv" in onset.message

    # the suggested fold is a real fix: measured on other data, it raises the output SQNR a lot
    held_out = [torch.randn(4, 3, 12, 12) for _ in range(2)]
    folded, applied = apply_rewrites(model, None, (batches[0],), kinds=["fold_bn_into_functional_conv"])
    assert [(a.modules, a.applied) for a in applied] == [(["conv", "bn"], True)]
    before = _output_sqnr(model, quantized, held_out)
    after = _output_sqnr(model, _quantized(folded, batches), held_out)
    assert after > before + 10.0, (before, after)


def _row(name: str, propagated: float, predecessors: list[str], shadow: float | None = None) -> CompareRow:
    return CompareRow(
        name=name,
        kind="batch_norm",
        module=name,
        sqnr_propagated=propagated,
        sqnr_shadow=shadow,
        extra={"predecessors": predecessors},
    )


def test_a_large_drop_stopping_just_above_the_threshold_is_the_onset_of_the_crossing_after_it():
    # efficientnet_lite0's stem: conv2d 29.1 dB, _bn0 20.2 (an 8.9 dB drop), _swish 17.1 (3.1 dB)
    rows = [
        _row("conv", 29.1, []),
        _row("bn0", 20.2, ["conv"], shadow=22.0),
        _row("act", 17.1, ["bn0"], shadow=35.0),
        _row("conv1", 12.0, ["act"]),  # 5.1 dB: under the jump, after the crossing
    ]
    findings = error_onset_findings(rows, sqnr_threshold=20.0, onset_jump_db=6.0)
    assert [(f.target, f.data["crosses_threshold_at"]) for f in findings] == [("bn0", "act")]
    assert "crosses at act" in findings[0].message


def test_small_steps_across_the_threshold_and_healthy_drops_are_no_onset():
    rows = [
        _row("a", 40.0, []),
        _row("b", 33.0, ["a"]),  # a 7 dB drop, but far above the threshold: healthy int8
        _row("c", 23.0, ["b"]),  # a 10 dB drop that stops just above the threshold
        _row("d", 19.0, ["c"]),
    ]
    findings = error_onset_findings(rows, sqnr_threshold=20.0, onset_jump_db=6.0)
    # the crossing d (4 dB) walks back to c (23 < 26) and stops at b (33 >= 26): c's 10 dB drop is the onset
    assert [f.target for f in findings] == ["c"]
    steady = [_row("a", 40.0, []), _row("b", 35.0, ["a"]), _row("c", 31.0, ["b"]), _row("d", 27.0, ["c"])]
    assert error_onset_findings(steady, 20.0, 6.0) == []
