"""A fix that torch builds into a model that cannot run: the finding stays, its fix goes, and it says why.

On MiniLM (bench/findings.py) QL203's clipping observer for the layers that read a LayerNorm's
output (q/k/v, intermediate.dense) makes the trial's quantized run fail. Any post-LN block, BERT's
``LayerNorm(dense(x) + x)``, does the same; here two of them and a token-classification head:

- block1.norm reads the quantized residual add; convert_fx lowers ``dequantize → LayerNorm →
  quantize`` to a quantized LayerNorm, though x86's BackendConfig has no LayerNorm pattern;
- its output is read by block2.dense and by block2's residual add. With the default qconfig both
  observe it with one observer: one quantize node, whose qparams the lowered LayerNorm takes. QL203
  gives block2.dense a PercentileObserver of its own, and convert_fx's second quantize node quantizes
  the lowered LayerNorm's int8 output again: the forward raises NotImplementedError ("Could not run
  'aten::quantize_per_tensor.tensor_qparams' with arguments from the 'QuantizedCPU' backend").
  Keeping block2.dense float fails too ("mat1 and mat2 must have the same dtype").

Impact records the failure, drops that fix with the error's first line in the finding's message,
and leaves it out of the group trials (it would only make its group fail). block1.dense reads the float input (quantized twice, each
time from float) and the head reads block2.norm alone: their clipping observers build and run, and
are measured.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.ao.quantization import QConfig, get_default_qconfig_mapping
from torch.ao.quantization.backend_config.x86 import get_x86_backend_config
from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

import qlint
from qlint.advice.plan import plan_from_report
from qlint.linter.findings import Finding, Report, Severity
from qlint.linter.mapping import PercentileObserver

WIDTH = 96
BROKEN = "block2.dense"  # reads block1.norm, as block2's residual add does
HEALTHY = ("block1.dense", "head")
# Single fix trials: block2.dense's fix and its keep-float bound (both fail) and one healthy fix; the
# healthy fix measured after block2.dense's is left to the group trials.
MAX_FIX_TRIALS = 3


class PostNormBlock(nn.Module):
    """BERT's residual sub-block: a Linear, the residual add, a LayerNorm."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.dense = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x):
        return self.norm(self.dense(x) + x)


class Encoder(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.block1 = PostNormBlock(width)
        self.block2 = PostNormBlock(width)
        self.head = nn.Linear(width, 2)

    def forward(self, x):
        return self.head(self.block2(self.block1(x)))


def _model() -> Encoder:
    torch.manual_seed(0)
    return Encoder(WIDTH).eval()


def _batches(count: int = 6) -> list[torch.Tensor]:
    """Hidden states (4 sequences of 32 tokens) whose channel 5 spikes on two tokens of each batch:
    the rare outliers QL203 flags in every layer's input, the LayerNorms' outputs included."""
    generator = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(count):
        batch = torch.randn(4, 32, WIDTH, generator=generator)
        for sequence in (0, 2):
            batch[sequence, int(torch.randint(32, (1,), generator=generator)), 5] += 100.0
        batches.append(batch)
    return batches


def _lint(max_fix_trials: int) -> Report:
    batches = _batches()
    # no threshold: no finding is made info for a small gain, so every kept fix goes into the plan
    # and the dropped one's absence from it is the drop
    options = {"max_fix_trials": max_fix_trials, "min_impact_db": 0.0}
    return qlint.lint(_model(), (batches[0],), calibration=batches, select=["QL203"], trial_options=options)


def _outlier(report: Report, target: str) -> Finding:
    (finding,) = [f for f in report.by_rule("QL203") if f.target == target and f.data["kind"] == "outlier"]
    return finding


@pytest.fixture(scope="module")
def report() -> Report:
    return _lint(MAX_FIX_TRIALS)


@pytest.fixture(scope="module")
def torch_error() -> BaseException:
    """What torch raises for the model QL203's fix of block2.dense asks for (the x86 default with
    qlint's PercentileObserver on block2.dense, as its plan writes it), built with torch alone."""
    batches = _batches()
    default = get_default_qconfig_mapping("x86").global_qconfig
    clipping = QConfig(
        activation=PercentileObserver.with_args(reduce_range=True, percentile=99.99), weight=default.weight
    )
    mapping = get_default_qconfig_mapping("x86").set_module_name(BROKEN, clipping)
    prepared = prepare_fx(_model(), mapping, (batches[0],), backend_config=get_x86_backend_config())
    with torch.no_grad():
        for batch in batches[:3]:
            prepared(batch)
        converted = convert_fx(prepared, backend_config=get_x86_backend_config())
        with pytest.raises(NotImplementedError) as raised:
            converted(batches[0])
    return raised.value


def test_the_fix_torch_cannot_run_is_dropped_and_the_finding_says_why(report, torch_error):
    assert report.trial is not None and report.trial.converted  # the model as intended runs
    finding = _outlier(report, BROKEN)
    assert 5 in finding.data["outlier_channels"]
    assert finding.severity is Severity.WARNING  # still reported, as a warning
    assert finding.suggestion is None
    assert not finding.fix_measured()  # no trial could
    quoted = f"{type(torch_error).__name__}: {str(torch_error).strip().splitlines()[0]}"
    sentence = quoted.split(". ")[0]  # NotImplementedError: Could not run '...' with arguments from the '...' backend
    assert f"Measured: with this fix the trial's quantized run fails ({sentence}" in finding.message
    assert finding.message.rstrip().endswith("so no fix is suggested here.")
    assert BROKEN not in [decision.fqn for decision in plan_from_report(report).modules]


def test_the_other_fixes_are_measured_around_it(report):
    # Impact measures the findings in the order of their local-error estimates (what a lint with no
    # trial budget reports). block2.dense's is not the smallest, so a healthy fix comes after it and
    # is left to the group trials. block2.dense's fix, whose own trial failed, joins no group: the
    # healthy fix is measured in one group trial, not in a group that fails and is split in halves.
    unmeasured = _lint(0)
    estimates = {target: _outlier(unmeasured, target).impact for target in (BROKEN, *HEALTHY)}
    assert all(impact is not None and impact.basis == "local-error" for impact in estimates.values())
    assert estimates[BROKEN].db > min(estimates[target].db for target in HEALTHY), estimates
    planned = [decision.fqn for decision in plan_from_report(report).modules]
    for target in HEALTHY:
        finding = _outlier(report, target)
        assert finding.suggestion is not None and "no fix is suggested" not in finding.message
        assert finding.fix_measured(), (target, finding.impact)
        # a kept warning's fix is planned; an info one's was measured not to help
        assert finding.severity is Severity.INFO or target in planned
    assert report.trial is not None and report.trial.fix_trials == MAX_FIX_TRIALS + 1
