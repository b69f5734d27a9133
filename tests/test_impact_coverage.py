"""Every warning and error carries an impact (issue 15, Acceptance).

QL105's low-output-SQNR error gets its ``diagnosis`` impact from keeping a module float
(the onset layer or the nearest weighted module upstream). When the error starts at a
functional op with no weighted module upstream of it (a BERT-style additive attention
mask: ``(1 - mask) * -10000``, as in the shared MiniLM model), no candidate is tried and
the error has no impact at all. Found by bench/findings.py on minilm_l6. Past the fix-trial
budget, findings on a conv module whose forward traces to F.conv2d get no local-error estimate
(found on efficientnet_lite0).
"""

import torch
import torch.nn as nn

import qlint
from qlint.linter.findings import Severity


class MaskedScores(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x, mask):
        scores = self.fc(x) + (1.0 - mask) * -10000.0  # additive attention mask
        return torch.softmax(scores, dim=-1)


def _model_and_data():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = MaskedScores().eval()
    generator = torch.Generator().manual_seed(1)
    data = [
        (torch.randn(4, 16, generator=generator), (torch.rand(4, 16, generator=generator) > 0.2).float())
        for _ in range(6)
    ]
    return model, data


def test_low_output_sqnr_error_at_a_functional_op_carries_an_impact():
    model, data = _model_and_data()
    report = qlint.lint(model, data[0], calibration=data)
    low = [f for f in report.by_rule("QL105") if f.data.get("kind") == "low-output-sqnr"]
    assert low and low[0].severity is Severity.ERROR, "the mask's mul should destroy the output SQNR"
    assert low[0].impact is not None


class SameConv(nn.Conv2d):
    """A conv subclass whose forward traces to F.conv2d (like efficientnet_lite0's convs)."""

    def forward(self, x):
        return nn.functional.conv2d(x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)


class FunctionalConvBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn, self.relu = SameConv(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()

    def forward(self, x):
        return self.relu(self.bn(self.conv(x)))


def test_warning_on_a_traced_through_conv_gets_an_impact_past_the_trial_budget():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = FunctionalConvBN().eval()
    generator = torch.Generator().manual_seed(1)
    data = [torch.randn(2, 3, 16, 16, generator=generator) for _ in range(6)]
    report = qlint.lint(model, (data[0],), calibration=data, trial_options={"max_fix_trials": 0})
    assert report.trial is not None and report.trial.converted
    serious = [f for f in report.findings if f.severity is not Severity.INFO]
    assert serious, "QL101 should report the conv-bn that module fusion cannot match"
    for finding in serious:
        assert finding.impact is not None, f"{finding.rule} {finding.target} has no impact"


class Branches(nn.Module):
    """Six Linear branches, each fed by the input with one channel scaled up: QL202 flags each."""

    def __init__(self, branches: int = 6) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(32, 8) for _ in range(branches))
        scales = torch.ones(branches, 32)
        for i in range(branches):
            scales[i, i] = 4.0 + 12.0 * i
        self.register_buffer("scales", scales)

    def forward(self, x):
        return torch.cat([layer(x * self.scales[i]) for i, layer in enumerate(self.layers)], dim=-1)


def _branches_report(max_fix_trials: int):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Branches().eval()
    generator = torch.Generator().manual_seed(1)
    data = [torch.randn(16, 32, generator=generator) for _ in range(12)]
    return qlint.lint(model, (data[0],), calibration=data, trial_options={"max_fix_trials": max_fix_trials})


def test_findings_past_the_budget_are_measured_in_groups_that_agree_with_single_trials():
    alone = {f.target: f.impact for f in _branches_report(50).findings if f.rule == "QL202"}
    grouped = [f for f in _branches_report(1).findings if f.rule == "QL202"]
    assert len(grouped) == len(alone) >= 4
    bases = {f.impact.basis for f in grouped if f.impact is not None}
    assert "group-trial" in bases and "local-error" not in bases, bases
    for finding in grouped:
        impact, single = finding.impact, alone[finding.target]
        assert impact is not None and single is not None
        if impact.basis == "group-trial":
            # the group's gain bounds each member's own: none that matters alone hides in a group
            assert impact.db >= single.db - 0.1, (finding.target, impact.db, single.db)
            assert "together with" in impact.detail
            if impact.db < 0.5:
                assert finding.severity is Severity.INFO
        else:
            assert abs(impact.db - single.db) < 0.01, (finding.target, impact.db, single.db)
