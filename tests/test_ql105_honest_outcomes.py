"""QL105's outcomes say what was measured: a fix that makes a failing model run has no gain
(impact.db is null, the SQNR it runs at is fixed_sqnr_db), and a model of which nothing runs in
int8 is a warning whose "exact" SQNR is not offered as a result."""

import json

import torch
import torch.nn as nn

import qlint
from qlint.linter.rule import seeded
from qlint.render.text import trial_line
from qlint.rules.ql105_conversion_check import _ConvView, _image


def test_a_fix_that_makes_a_failing_model_run_carries_no_gain_but_the_sqnr_it_runs_at():
    generator = torch.Generator().manual_seed(0)
    data = [torch.randn(2, 3, 8, 8, generator=generator) for _ in range(6)]
    report = qlint.lint(seeded(_ConvView)(), _image(), calibration=data)
    [finding] = report.by_rule("QL105")
    impact = finding.impact
    assert impact is not None and report.trial is not None
    # before: db was the absolute SQNR (35.4 on digit_cnn), read as a +35 dB gain by anyone sorting by db
    assert impact.db is None and impact.base_sqnr_db is None
    assert impact.fixed_sqnr_db is not None and abs(impact.fixed_sqnr_db - report.trial.output_sqnr_db) < 1e-3
    assert json.loads(report.model_dump_json())["findings"][0]["impact"]["db"] is None
    assert finding.recovers_output_sqnr()  # still the fix the report applies first
    assert "Measured: measured" not in finding.message
    assert "Measured with .view → .reshape at view (identical in float), the int8 model runs at" in finding.message


class _ConvCell(nn.Module):
    """conv1d and an LSTMCell: X86InductorQuantizer annotates neither (silero_vad's layers)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(1, 8, 5)
        self.cell = nn.LSTMCell(8, 8)

    def forward(self, x):
        h, _ = self.cell(torch.relu(self.conv(x)).mean(2))
        return h


def test_a_pt2_the_quantizer_leaves_all_float_is_a_warning_not_an_exact_result():
    """silero_vad as a .pt2: 0 of 7 ops in int8, and QL105 was info with "output SQNR exact"."""
    model = seeded(_ConvCell)().eval()
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randn(4, 1, 32, generator=generator) for _ in range(8)]
    program = torch.export.export(model, (batches[0],))
    report = qlint.lint(
        program.module(),
        (batches[0],),
        exported_program=program,
        calibration=batches,
        calibration_options={"quiet": True},
        select=["QL105"],
    )
    assert report.trial is not None and report.trial.int8_ops == 0 and report.trial.weighted_ops == 2
    [finding] = report.by_rule("QL105")
    assert finding.severity.value == "warning" and finding.data["kind"] == "all-float"
    assert "none of the model's 2 conv/linear/recurrent/attention ops runs in int8" in finding.message
    assert "says nothing about int8" in finding.message
    assert "as nothing runs in int8" in (trial_line(report) or "")
