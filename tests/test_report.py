import re

import pydantic
import pytest
import torch

import qlint
from examples.badnet import build, qconfig_mapping
from qlint.linter.findings import Finding, Report, Severity


def test_report_json_round_trip():
    report = qlint.lint(build(), (torch.randn(1, 3, 32, 32),), qconfig_mapping=qconfig_mapping())
    assert report.findings and report.qconfig_table and report.timings
    again = Report.model_validate_json(report.model_dump_json())
    assert again == report


def test_finding_is_frozen_and_rejects_non_json_data():
    finding = Finding(rule="QL101", name="x", severity="warning", target="t", message="m", data={"a": 1})
    with pytest.raises(pydantic.ValidationError):
        finding.target = "other"
    with pytest.raises(pydantic.ValidationError):
        Finding(rule="QL101", name="x", severity="warning", target="t", message="m", data={"bad": torch.zeros(1)})
    with pytest.raises(pydantic.ValidationError):
        Finding(rule="QL101", name="x", severity="warning", target="t", message="m", data={"nan": float("nan")})


def test_example_command_json_has_all_static_rules(run_cli, repo_root):
    result = run_cli(
        "examples.badnet:build",
        "--input-shape",
        "1,3,32,32",
        "--qconfig-mapping",
        "examples.badnet:qconfig_mapping",
        "--format",
        "json",
        cwd=repo_root,
    )
    assert result.returncode == 1, result.stderr
    report = Report.model_validate_json(result.stdout)
    assert {"QL101", "QL102", "QL103", "QL104"} <= {f.rule for f in report.findings}
    assert report.backend == "x86" and report.frontend == "fx.symbolic_trace"
    # the trial ran, and within each severity the findings are sorted by measured impact
    assert report.trial is not None and report.trial.converted and report.trial.output_sqnr_db is not None
    for severity in ("error", "warning", "info"):
        gains = [
            f.impact.db
            for f in report.findings
            if f.severity.value == severity and f.impact is not None and f.impact.kind == "sqnr-gain"
        ]
        assert gains == sorted(gains, reverse=True), (severity, gains)


def test_text_output_table_and_summary(run_cli, repo_root):
    result = run_cli(
        "examples.badnet:build",
        "--input-shape",
        "1,3,32,32",
        "--no-trial",
        "--qconfig-mapping",
        "examples.badnet:qconfig_mapping",
        "--show-qconfig",
        cwd=repo_root,
    )
    assert result.returncode == 1
    assert "Findings" in result.stdout and "unfused-pattern" in result.stdout
    assert "Resolved qconfig per node" in result.stdout
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith("Found ")
    # counts read as English: "1 error", "2 warnings", "0 errors"
    for count, noun in re.findall(r"(\d+) (error|warning)s?\b", last):
        assert f"{count} {noun}{'' if count == '1' else 's'}" in last, last


def test_fail_on_and_select(run_cli, repo_root):
    args = ["examples.badnet:build", "--input-shape", "1,3,32,32", "--no-trial"]
    only_errors = run_cli(*args, "--select", "QL102", "--fail-on", "error", cwd=repo_root)
    assert only_errors.returncode == 0, only_errors.stdout
    warnings = run_cli(*args, "--select", "QL102", cwd=repo_root)
    assert warnings.returncode == 1
    clean = run_cli(*args, "--select", "QL101", "--ignore", "QL101", cwd=repo_root)
    assert clean.returncode == 0


@pytest.mark.parametrize("width", [80, 100, 160])
def test_every_message_and_target_reads_whole_at_any_width(width):
    """Nothing is cut off: at 80 or 100 columns findings print as blocks, wider as a table, and
    every message (code in it included) and target can be read in full."""
    from qlint.render.text import TABLE_MIN_WIDTH, render_text

    report = qlint.lint(build(), (torch.randn(1, 3, 32, 32),), qconfig_mapping=qconfig_mapping())
    text = render_text(report, width=width)
    assert "…" not in text
    assert all(len(line.rstrip()) <= width for line in text.splitlines())
    if width < TABLE_MIN_WIDTH:
        flat = " ".join(text.split())
        for finding in report.findings:
            assert " ".join(finding.message.split()) in flat, finding.message
            assert f"{finding.rule} {finding.name} · {finding.target}" in flat
    else:
        assert "┃ Message" in text


def test_printing_a_report_gives_its_findings_not_pydantics_field_dump():
    """print(report) in a notebook dumped every field of every finding and layer row (pages)."""
    report = qlint.lint(build(), (torch.randn(2, 3, 32, 32),), qconfig_mapping=qconfig_mapping())
    counts = {severity: sum(f.severity is severity for f in report.findings) for severity in Severity}
    assert repr(report) == (
        f"Report(model={report.model!r}, backend='x86', findings: {counts[Severity.ERROR]} error, "
        f"{counts[Severity.WARNING]} warning, {counts[Severity.INFO]} info, layers: {len(report.layers)})"
    )
    lines = str(report).splitlines()
    assert lines[0] == repr(report) and len(lines) == 1 + len(report.findings)
    ranks = [next(s for s in Severity if line.strip().startswith(s.value + " ")).rank for line in lines[1:]]
    assert ranks == sorted(ranks, reverse=True)  # worst first
    for finding in report.findings:
        assert f"  {finding.severity.value} {finding.rule} {finding.target}: {finding.message}" in lines
