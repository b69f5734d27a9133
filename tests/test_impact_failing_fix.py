"""Which fixes a plan may carry, by what their trials measured.

On MiniLM QL203's clipping observer for some layers' inputs made convert_fx build a model that
fails to run ("mat1 and mat2 must have the same dtype"): the trial recorded nothing, the
finding kept its fix on an estimate, and the plan carried it. Such a fix is now dropped with
the failure in its message, but only where the trial measured nothing: a failure the trial
bench works around (a ``.view`` on an int8 conv's channels-last output, run as ``reshape``)
measured the fix, which stays. A fix that cannot be built at all (MiniLM's case: two post-LN
blocks reproduce it) is tested in tests/test_impact_unbuildable_fix.py.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn as nn
from torch.ao.quantization import MinMaxObserver, QConfig, get_default_qconfig_mapping

import qlint
from qlint.linter.context import LintContext
from qlint.linter.findings import Finding, Severity
from qlint.linter.fixes import SetQConfig
from qlint.linter.registry import Registry
from qlint.linter.rule import Need, Rule, RuleOptions


class _ViewNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.fc = nn.Linear(4 * 6 * 6, 2)

    def forward(self, x):
        y = self.conv(x)
        return self.fc(y.view(y.shape[0], -1))  # an int8 conv's output is channels-last: view fails


class _QuantizeTheConv(Rule):
    """Asks for the conv to be quantized (a test rule).

    ## What it does
    Test only.

    ## Why is this bad?
    Test only.

    ## Example
    Test only.

    ## Use instead
    Test only.

    ## Options
    None.

    ## References
    None.
    """

    code = "QL901"
    name = "quantize-the-conv"
    summary = "Test rule."
    severity = Severity.WARNING
    requires = frozenset({Need.GRAPH})

    class Options(RuleOptions):
        pass

    def check(self, ctx: LintContext) -> Iterable[Finding]:
        yield self.finding(
            "conv",
            "conv is float: x86 has no conv for qint8 activations.",
            suggestion=SetQConfig(targets=["conv"], activation_dtype="torch.quint8"),
        )


def test_a_fix_measured_through_the_benchs_workaround_keeps_its_suggestion():
    """The review found the first version dropping this fix: the bench's run reports the failure
    it worked around next to the measurement it then made."""
    torch.manual_seed(0)
    model = _ViewNet().eval()
    batches = [torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    # qint8 activations: x86 has no such conv kernel, so conv stays float (not on purpose)
    default = get_default_qconfig_mapping("x86").global_qconfig
    qint8_activations = QConfig(activation=MinMaxObserver.with_args(dtype=torch.qint8), weight=default.weight)
    mapping = get_default_qconfig_mapping("x86").set_module_name("conv", qint8_activations)
    registry = Registry([*Registry.default(include_plugins=False).all(), _QuantizeTheConv])
    report = qlint.lint(
        model, (batches[0],), calibration=batches, qconfig_mapping=mapping, registry=registry, select=["QL901", "QL105"]
    )
    assert report.trial is not None and report.trial.output_sqnr_db is not None
    (finding,) = report.by_rule("QL901")
    assert finding.impact is not None and finding.impact.fixed_sqnr_db is not None  # measured
    assert finding.suggestion is not None and "no fix is suggested" not in finding.message


def test_a_fix_made_info_on_the_local_estimate_stays_out_of_the_plan():
    """The estimate that demoted a finding (no trial could apply its fix) is the estimate the plan
    goes by: on MiniLM 16 clipping observers that no trial could build went into the plan."""
    from qlint.linter.findings import Impact, Report
    from qlint.linter.fixes import SetActivationObserver

    def finding(target: str, severity: Severity, basis: str) -> Finding:
        return Finding(
            rule="QL203",
            name="activation-outlier",
            severity=severity,
            target=target,
            message="m",
            suggestion=SetActivationObserver(targets=[target], percentile=99.99),
            impact=Impact(db=0.01 if severity is Severity.INFO else 1.0, basis=basis),
        )

    report = Report(
        qlint_version="0",
        torch_version=torch.__version__,
        model="m",
        backend="x86",
        frontend="fx",
        findings=[
            finding("estimated_small", Severity.INFO, "local-error"),
            finding("estimated_large", Severity.WARNING, "local-error"),
            finding("measured_large", Severity.WARNING, "fix-trial"),
        ],
    )
    assert sorted(decision.fqn for decision in report.suggestions().modules) == ["estimated_large", "measured_large"]
