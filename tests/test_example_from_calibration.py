"""Calibration data without example inputs: lint takes the first batch as the example.

A user who passes calibration data has inputs; without this, lint skipped the trial (and the
rules that need it) and QL205 called the model with no arguments and crashed.
"""

from __future__ import annotations

import torch
import torch.nn as nn

import qlint


def _token_model():
    generator = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    return model.eval()


def _batches(count=4):
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(2, 6, 16, generator=generator) for _ in range(count)]


def test_the_first_calibration_batch_is_the_example_and_the_report_says_so():
    batches = _batches()
    implicit = qlint.lint(_token_model(), calibration=batches)
    explicit = qlint.lint(_token_model(), (batches[0],), calibration=batches)
    assert not [rule for rule in implicit.skipped if rule.crashed], implicit.skipped
    assert implicit.trial is not None and implicit.trial.output_sqnr_db == explicit.trial.output_sqnr_db
    assert [f.rule for f in implicit.findings] == [f.rule for f in explicit.findings]
    assert any("first calibration batch" in notice.message for notice in implicit.notices)
    assert not any("first calibration batch" in notice.message for notice in explicit.notices)


def test_a_one_shot_iterator_is_not_read_for_an_example_and_no_rule_crashes():
    report = qlint.lint(_token_model(), calibration=iter(_batches()))
    assert not [rule for rule in report.skipped if rule.crashed], report.skipped
    assert report.trial is None
    assert "QL201" in {row.rule for row in report.layers}  # the data rules still ran on the iterator
