"""What a rule's check() may yield: findings and per-layer rows, nothing else."""

from __future__ import annotations

import torch
import torch.nn as nn

import qlint
from qlint.linter.findings import LayerRow, Severity
from qlint.linter.registry import Registry
from qlint.linter.rule import Need, Rule

# The docstring sections every rule must have (the registry checks them).
_SECTIONS = """
## What it does
Test rule.
## Why is this bad?
It is a test.
## Example
Any model.
## Use instead
Nothing.
## Options
None.
## References
- none
"""


class _RowsOnly(Rule):
    __doc__ = "Reports one row per linear layer and no finding.\n" + _SECTIONS

    code = "XQ101"
    name = "rows-only"
    summary = "Rows only."
    severity = Severity.INFO
    requires = frozenset({Need.GRAPH})

    def check(self, ctx):
        for node in ctx.graph.by_kind("linear"):
            yield LayerRow(name=node.display, kind=node.kind, rule=self.code, statistic="out", value=1.0, verdict="ok")


class _YieldsText(Rule):
    __doc__ = "Yields something that is neither a finding nor a row.\n" + _SECTIONS

    code = "XQ102"
    name = "yields-text"
    summary = "Broken."
    severity = Severity.INFO
    requires = frozenset({Need.GRAPH})

    def check(self, ctx):
        yield self.finding("x", "half a result")
        yield "not a finding"


def _model():
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def test_rows_go_to_the_layer_table_in_graph_order_and_are_not_findings():
    report = qlint.lint(_model(), (torch.randn(2, 4),), registry=Registry([_RowsOnly]))
    assert report.findings == []
    assert [row.name for row in report.layers] == ["0", "2"]
    assert {row.rule for row in report.layers} == {"XQ101"}


def test_a_rule_yielding_anything_else_is_reported_as_crashed_and_contributes_nothing():
    report = qlint.lint(_model(), (torch.randn(2, 4),), registry=Registry([_YieldsText, _RowsOnly]))
    assert [s.rule for s in report.skipped] == ["XQ102"]
    assert "expected Finding or LayerRow" in report.skipped[0].reason
    assert report.findings == []  # the half result of the broken rule is dropped
    assert len(report.layers) == 2  # the other rule still ran


def test_data_rules_report_a_row_for_layers_that_do_not_fire():
    model = _model()
    batches = [torch.randn(16, 4) for _ in range(4)]
    report = qlint.lint(
        model,
        (batches[0],),
        calibration=batches,
        select=["QL201", "QL202", "QL203"],
        calibration_options={"quiet": True},
    )
    rows = {(row.name, row.rule) for row in report.layers}
    assert {("0", "QL201"), ("2", "QL201"), ("0", "QL202"), ("2", "QL203")} <= rows
    flagged = {(f.target, f.rule) for f in report.findings}
    assert rows - flagged, "every measured layer also fired: the test data is degenerate"
