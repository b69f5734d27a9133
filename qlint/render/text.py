"""Human output: a rich table of findings grouped by severity, then a summary line."""

from __future__ import annotations

import io
from typing import Optional

from rich.console import Console
from rich.table import Table
from rich.text import Text

from qlint.linter.findings import Report, Severity

_STYLE = {Severity.ERROR: "bold red", Severity.WARNING: "yellow", Severity.INFO: "cyan"}


def make_console(file=None, color: Optional[bool] = None, width: Optional[int] = None) -> Console:
    return Console(file=file, force_terminal=color, no_color=color is False,
                   width=width, soft_wrap=False, highlight=False)


def render_text(report: Report, *, color: Optional[bool] = False, width: int = 120,
                show_qconfig: bool = False) -> str:
    buffer = io.StringIO()
    console = make_console(buffer, color=color, width=width)
    print_report(console, report, show_qconfig=show_qconfig)
    return buffer.getvalue()


def print_report(console: Console, report: Report, *, show_qconfig: bool = False) -> None:
    console.print(f"[bold]qlint[/bold] {report.model} · backend {report.backend} · "
                  f"front end {report.frontend}")
    for notice in report.notices:
        console.print(Text(f"note: {notice.message}", style=_STYLE.get(notice.level, "")))
    if report.findings:
        console.print(_findings_table(report))
    if report.lint_rows():
        console.print(_layers_table(report))
    if show_qconfig and report.qconfig_table:
        console.print(_qconfig_table(report))
    by_reason: dict[str, list[str]] = {}
    for skipped in report.skipped:
        by_reason.setdefault(skipped.reason, []).append(f"{skipped.rule} {skipped.name}")
    for reason, rules in by_reason.items():
        console.print(Text(f"skipped {', '.join(rules)}: {reason}", style="dim"))
    console.print(summary_line(report))


def _findings_table(report: Report) -> Table:
    table = Table(title="Findings", show_lines=True, expand=True)
    table.add_column("Severity", no_wrap=True)
    table.add_column("Rule", no_wrap=True)
    table.add_column("Target", overflow="fold", max_width=28)
    table.add_column("Message", ratio=1)
    for severity in (Severity.ERROR, Severity.WARNING, Severity.INFO):
        for finding in (f for f in report.findings if f.severity == severity):
            table.add_row(Text(severity.value, style=_STYLE[severity]),
                          f"{finding.rule}\n{finding.name}", finding.target, finding.message)
    return table


def _layers_table(report: Report) -> Table:
    table = Table(title="Per-layer statistics", expand=False)
    for column in ("Layer", "Rule", "Statistic", "Value", "Verdict"):
        table.add_column(column)
    for row in report.lint_rows():
        value = "" if row.value is None else f"{row.value:.4g}"
        table.add_row(row.name, row.rule or "", row.statistic or "", value, row.verdict or "")
    return table


def _qconfig_table(report: Report) -> Table:
    table = Table(title="Resolved qconfig per node", expand=False)
    for column in ("Node", "Target", "Kind", "In dtype", "Out dtype", "Activation observer",
                   "Weight observer", "ch_axis"):
        table.add_column(column)
    for row in report.qconfig_table:
        table.add_row(row.node, row.target, row.kind, _short(row.input_dtype), _short(row.output_dtype),
                      row.activation_observer or "-", row.weight_observer or "-",
                      "" if row.ch_axis is None else str(row.ch_axis))
    return table


def _short(dtype: Optional[str]) -> str:
    return "-" if dtype is None else dtype.replace("torch.", "")


def summary_line(report: Report) -> str:
    counts = {s: sum(1 for f in report.findings if f.severity == s) for s in Severity}
    if not report.findings:
        head = "No quantization problems found."
    else:
        head = (f"Found {len(report.findings)} finding{'s' if len(report.findings) != 1 else ''}: "
                f"{counts[Severity.ERROR]} error, {counts[Severity.WARNING]} warning, "
                f"{counts[Severity.INFO]} info.")
    if report.skipped:
        head += f" {len(report.skipped)} rule{'s' if len(report.skipped) != 1 else ''} skipped."
    return head
