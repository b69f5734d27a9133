"""--format github: workflow-command annotations with GitHub's escaping rules."""

from __future__ import annotations

import re

from qlint.linter.findings import Finding, Notice, Report, Severity, SkippedRule
from qlint.render.github import escape_data, escape_property, render_github

COMMAND = re.compile(r"^::(error|warning|notice) ([^:]*)::(.*)$")


def _report(findings, model="models/a,b:c.pt2", **extra) -> Report:
    return Report(
        qlint_version="0.1.0",
        torch_version="2.x",
        model=model,
        backend="x86",
        frontend="fx.symbolic_trace",
        findings=findings,
        **extra,
    )


def _finding(severity=Severity.WARNING, message="plain", target="stem", rule="QL101", name="unfused-pattern"):
    return Finding(rule=rule, name=name, severity=severity, target=target, message=message, data={"kind": "k"})


def test_escaping_rules():
    assert escape_data("100%\r\nnext") == "100%25%0D%0Anext"
    assert escape_property("a:b,c%\n") == "a%3Ab%2Cc%25%0A"
    assert escape_data("a:b,c") == "a:b,c"  # data keeps : and ,


def test_one_annotation_per_finding_with_file_and_title():
    text = render_github(_report([_finding(Severity.ERROR), _finding(Severity.WARNING), _finding(Severity.INFO)]))
    lines = text.splitlines()
    assert [COMMAND.match(line).group(1) for line in lines] == ["error", "warning", "notice"]
    props = COMMAND.match(lines[0]).group(2)
    assert props == "file=models/a%2Cb%3Ac.pt2,title=QL101 unfused-pattern"
    assert lines[0].endswith("::stem: plain")


def test_multiline_message_stays_on_one_line():
    text = render_github(_report([_finding(message="line one\nline two: 50% worse\r\n")]))
    assert len(text.splitlines()) == 1
    assert "line one%0Aline two: 50%25 worse%0D%0A" in text


def test_skipped_and_notices_are_annotations_and_factory_has_no_file():
    report = _report(
        [],
        model="examples.badnet:build",
        skipped=[SkippedRule(rule="QL201", name="range", reason="no calibration data")],
        notices=[Notice(level=Severity.WARNING, message="random data")],
    )
    lines = render_github(report).splitlines()
    assert lines[0].startswith("::notice title=QL201 skipped::") and "no calibration data" in lines[0]
    assert lines[1] == "::warning title=qlint::random data"
    assert all("file=" not in line for line in lines)


def test_empty_report_prints_nothing():
    assert render_github(_report([])) == ""


def test_cli_github_format(run_cli, repo_root):
    result = run_cli(
        "examples.badnet:build",
        "--input-shape",
        "1,3,32,32",
        "--no-trial",
        "--qconfig-mapping",
        "examples.badnet:qconfig_mapping",
        "--format",
        "github",
        cwd=repo_root,
    )
    assert result.returncode == 1, result.stderr
    lines = result.stdout.splitlines()
    assert lines and all(COMMAND.match(line) for line in lines)
    assert any("title=QL101 unfused-pattern::" in line for line in lines)
