"""verify counts int8 coverage as lint does, and says why it dropped a decision.

On silero_vad lint's trial said "int8 6/7 conv/linear/recurrent/attention ops" and verify
"conv+linear int8 6/6": two definitions of one number (verify left the LSTMCell out). Its
decision lines read "dropped bias_correction ...: 17.96 dB with, 17.88 dB without" with no word
on why a decision that gains was dropped (it gains less than the 0.1 dB bias correction must).
"""

from __future__ import annotations

import re

import torch
import torch.nn as nn

import qlint
from qlint.advice.plan import default_plan
from qlint.advice.verify_report import DecisionOutcome
from qlint.cli.verify import render_verify


class _Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.cell = nn.LSTMCell(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        h, _ = self.cell(torch.relu(self.fc(x)))
        return self.head(h)


def _batches(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(8, 8, generator=generator) for _ in range(4)]


def test_verify_counts_int8_ops_as_lints_trial_does():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = _Tagger().eval()
    report = qlint.lint(model, (_batches(0)[0],), calibration=_batches(0))
    assert report.trial is not None
    verified = qlint.verify(model, default_plan("x86"), _batches(0), _batches(1), max_trials=0)
    assert (verified.default.int8_layers, verified.default.total_layers) == (
        report.trial.int8_ops,
        report.trial.weighted_ops,
    )
    assert (report.trial.int8_ops, report.trial.weighted_ops) == (2, 3)  # the LSTMCell stays float
    assert "cell" in verified.default.float_modules
    text = render_verify(verified)
    assert re.search(r"int8 conv/linear/recurrent/attention ops\s*│\s*2/3 \(67%\)", text), text


def test_a_dropped_decision_says_why():
    report = qlint.verify(_Tagger().eval(), default_plan("x86"), _batches(0), _batches(1), max_trials=0)
    decisions = [
        DecisionOutcome(
            kind="bias_correction", target="all", kept=False, sqnr_with_db=17.96, sqnr_without_db=17.88, bar_db=0.1
        ),
        DecisionOutcome(kind="module", target="fc", kept=False, sqnr_with_db=10.0, sqnr_without_db=10.5),
        DecisionOutcome(kind="module", target="head", kept=True, sqnr_with_db=11.0, sqnr_without_db=10.0),
        DecisionOutcome(kind="activation_bits", target="all", kept=False, sqnr_with_db=18.0, sqnr_without_db=17.6),
    ]
    text = render_verify(report.model_copy(update={"decisions": decisions}), width=200)
    assert (
        "dropped bias_correction all: 17.96 dB with, 17.88 dB without (+0.08 dB: under the 0.1 dB it must gain)" in text
    )
    assert "dropped module fc: 10.00 dB with, 10.50 dB without (-0.50 dB: it gains nothing)" in text
    assert "kept    module head: 11.00 dB with, 10.00 dB without (+1.00 dB)" in text
    # dropped on the swapped folds though it gains on the selection batches
    assert "dropped activation_bits all: 18.00 dB with, 17.60 dB without (+0.40 dB, but not on its second check" in text
    long_note = "pruning stopped at its share of the trial budget: " + "x " * 60
    narrow = render_verify(report.model_copy(update={"decisions": decisions, "notes": [long_note]}), width=60)
    assert all(len(line) <= 60 for line in narrow.splitlines() if "dB with" in line or line.startswith("    "))
    assert [line for line in narrow.splitlines() if line.startswith("note:")] and all(
        len(line) <= 60 for line in narrow.splitlines() if line.startswith("note:")
    )
