"""Human output: a rich table of findings grouped by severity, then a summary line.

Every name and message goes in as a ``Text`` (never as markup) and through
:func:`printable`, so a module called ``[/]`` or one holding an ESC sequence is shown
as it is spelled instead of crashing rich or recolouring the terminal.
"""

from __future__ import annotations

import io

from rich.console import Console
from rich.measure import Measurement
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from qlint.core.sqnr import sqnr_text
from qlint.linter.findings import Finding, Report, Severity
from qlint.render.literal import printable

_STYLE = {Severity.ERROR: "bold red", Severity.WARNING: "yellow", Severity.INFO: "cyan"}
# Findings wrap their long messages; this is their width when no terminal says otherwise.
READABLE_WIDTH = 120
TABLE_MIN_WIDTH = 110  # narrower, findings print as blocks (the message column would be ~20 wide)
# Wide tables (per-layer, --show-qconfig) printed to a file or pipe keep their natural width
# up to this many columns rather than being cut to the readable width.
MAX_NATURAL_WIDTH = 400


def make_console(file=None, color: bool | None = None, width: int | None = None) -> Console:
    return Console(
        file=file,
        force_terminal=color,
        no_color=color is False,
        width=width,
        soft_wrap=False,
        highlight=False,
        markup=False,
        emoji=False,
    )


def literal(text: object, style: str = "") -> Text:
    """A cell or line that shows ``text`` exactly (no markup, no emoji codes, no control characters)."""
    return Text(printable(text), style=style)


def render_text(
    report: Report,
    *,
    color: bool | None = False,
    width: int | None = READABLE_WIDTH,
    show_qconfig: bool = False,
    quiet: bool = False,
) -> str:
    """The report as text. ``width=None``: no terminal width is known (a pipe or a file), so
    findings wrap at READABLE_WIDTH and wide tables keep their natural width.
    ``quiet``: one line per finding and the summary, nothing else (pre-commit, CI)."""
    buffer = io.StringIO()
    console = make_console(buffer, color=color, width=width or MAX_NATURAL_WIDTH)
    if quiet:
        print_quiet(console, report, show_qconfig=show_qconfig, width=width)
    else:
        print_report(console, report, show_qconfig=show_qconfig, width=width)
    return buffer.getvalue()


def print_report(console: Console, report: Report, *, show_qconfig: bool = False, width: int | None = None) -> None:
    findings_width = width or READABLE_WIDTH
    console.print(_header(report), width=findings_width)
    trial = trial_line(report)
    if trial is not None:
        console.print(literal(trial, "dim"), width=findings_width)
    for notice in report.notices:
        console.print(literal(f"note: {notice.message}", _STYLE.get(notice.level, "")), width=findings_width)
    if report.findings and findings_width < TABLE_MIN_WIDTH:
        _print_findings_blocks(console, report, findings_width)
    elif report.findings:
        console.print(_findings_table(report), width=findings_width)
    if report.lint_rows():
        _print_wide(console, _layers_table(report), width)
    if show_qconfig and report.qconfig_table:
        _print_wide(console, _qconfig_table(report), width)
    by_reason: dict[str, list[str]] = {}
    for skipped in report.skipped:
        by_reason.setdefault(skipped.reason, []).append(f"{skipped.rule} {skipped.name}")
    for reason, rules in by_reason.items():
        console.print(literal(f"skipped {', '.join(rules)}: {reason}", "dim"), width=findings_width)
    console.print(summary_line(report), width=findings_width)


def print_quiet(console: Console, report: Report, *, show_qconfig: bool = False, width: int | None = None) -> None:
    """``-q``: ``MODEL: severity RULE name TARGET: message`` per finding, warnings about the
    run itself, and the summary; no tables unless --show-qconfig asks for one."""
    model = printable(report.model)
    for severity in (Severity.ERROR, Severity.WARNING, Severity.INFO):
        for finding in (f for f in report.findings if f.severity == severity):
            line = Text(f"{model}: ")
            line.append(severity.value, style=_STYLE[severity])
            line.append(printable(f" {finding.rule} {finding.name} {finding.target}: {finding.message}"))
            console.print(line, soft_wrap=True)
    for notice in report.notices:
        if notice.level.at_least(Severity.WARNING):
            console.print(
                literal(f"{model}: {notice.level.value}: {notice.message}", _STYLE.get(notice.level, "")),
                soft_wrap=True,
            )
    if show_qconfig and report.qconfig_table:
        _print_wide(console, _qconfig_table(report), width)
    console.print(literal(f"{model}: {summary_line(report)}"), soft_wrap=True)


def _header(report: Report) -> Text:
    line = Text("qlint", style="bold")
    line.append(printable(f" {report.model} · backend {report.backend} · front end {report.frontend}"))
    return line


def _print_wide(console: Console, table: Table, width: int | None) -> None:
    """At the terminal's width when there is one; otherwise at the table's natural width."""
    if width is None:
        natural = Measurement.get(console, console.options.update_width(MAX_NATURAL_WIDTH), table).maximum
        width = max(READABLE_WIDTH, min(natural, MAX_NATURAL_WIDTH))
    console.print(table, width=width)


def _print_findings_blocks(console: Console, report: Report, width: int) -> None:
    """Below TABLE_MIN_WIDTH a table would squeeze the message into a sliver: each finding is a
    heading line (severity, rule, target, impact) and its message at the full width."""
    console.print(Text("Findings", style="italic"), width=width)
    for severity in (Severity.ERROR, Severity.WARNING, Severity.INFO):
        for finding in (f for f in report.findings if f.severity == severity):
            heading = literal(severity.value, _STYLE[severity])
            heading.append(printable(f" {finding.rule} {finding.name} · {finding.target}"))
            if finding.impact is not None:
                heading.append(printable(f" · {' '.join(impact_text(finding))}"), style="bold")
            console.print(heading, width=width, overflow="fold")
            console.print(Padding(literal(finding.message), (0, 0, 1, 4), expand=False), width=width, overflow="fold")


def _findings_table(report: Report) -> Table:
    table = Table(title="Findings", show_lines=True, expand=True)
    table.add_column("Severity", no_wrap=True)
    # Narrow terminals give the message the room: a long rule name or target folds, and code
    # in a message (mapping.set_object_type(...)) folds instead of being cut off.
    table.add_column("Rule", overflow="fold", max_width=18)
    table.add_column("Target", overflow="fold", max_width=28)
    with_impact = any(f.impact is not None for f in report.findings)
    if with_impact:
        table.add_column("Impact", no_wrap=True)
    table.add_column("Message", ratio=1, overflow="fold")
    for severity in (Severity.ERROR, Severity.WARNING, Severity.INFO):
        for finding in (f for f in report.findings if f.severity == severity):
            cells = [
                literal(severity.value, _STYLE[severity]),
                Text("\n").join([literal(finding.rule), literal(finding.name)]),
                literal(finding.target),
            ]
            if with_impact:
                cells.append(Text("\n").join(literal(line) for line in impact_text(finding)))
            table.add_row(*cells, literal(finding.message))
    return table


_BASIS = {
    "fix-trial": "fix trial",
    "keep-float-trial": "kept float",
    "already-float": "already float",
    "group-trial": "group trial",
    "rule-trial": "rule trial",
    "not-executed": "never runs",
    "stays-float": "stays float",
    "local-error": "estimate",
}


def impact_text(finding: Finding) -> tuple[str, ...]:
    """The finding's measured impact in two short lines: dB and how it was measured."""
    impact = finding.impact
    if impact is None:
        return ("-",)
    if impact.kind == "coverage":
        if impact.basis == "stays-float":
            return ("float", "no fix here")
        return (f"+{counted(impact.int8_ops_gained, 'int8 op')}", f"{impact.db:+.1f} dB")
    if _from_a_failure(finding):
        return (f"fails → {sqnr_text(impact.fixed_sqnr_db)}", _BASIS[impact.basis])
    return (f"{impact.db:+.1f} dB", _BASIS[impact.basis])


def _from_a_failure(finding: Finding) -> bool:
    """The fix makes a model that fails as intended run: there is no SQNR to gain from."""
    impact = finding.impact
    return impact is not None and impact.base_sqnr_db is None and impact.fixed_sqnr_db is not None


def trial_line(report: Report) -> str | None:
    trial = report.trial
    if trial is None:
        return None
    if not trial.converted and trial.workaround is None:
        return f"trial quantization ({trial.backend}): failed at {trial.failed_stage}; see QL105."
    sqnr = "n/a" if trial.output_sqnr_db is None else sqnr_text(trial.output_sqnr_db)
    if trial.weighted_ops and not trial.int8_ops and trial.output_sqnr_db is not None:
        # "exact" claims nothing about int8 when nothing runs in int8 (QL105 warns)
        sqnr = f"{sqnr}, as nothing runs in int8 (QL105)"
    elif trial.output_tensor_sqnr_db and trial.output_sqnr_db is not None:
        each = ", ".join("n/a" if value is None else sqnr_text(value) for value in trial.output_tensor_sqnr_db)
        sqnr += f" (the powers of {len(trial.output_tensor_sqnr_db)} output tensors pooled; each: {each})"
    return (
        f"trial quantization ({trial.backend}, {trial.seconds:.1f} s, {trial.fix_trials} fix trials): "
        f"calibrated on {trial.calibrated_on}, evaluated on {trial.evaluated_on}; output SQNR {sqnr}; "
        f"int8 {trial.int8_ops}/{trial.weighted_ops} conv/linear/recurrent/attention ops."
        + (
            f" Quantized as you intend, the model fails at {trial.failed_stage} (QL105); {trial.workaround}."
            if trial.workaround
            else ""
        )
    )


def _layers_table(report: Report) -> Table:
    table = Table(title="Per-layer statistics", expand=False)
    for column in ("Layer", "Rule", "Statistic", "Value", "Verdict"):
        table.add_column(column, overflow="fold")  # q, k and v differ only at the end of the name
    for row in report.lint_rows():
        value = "" if row.value is None else f"{row.value:.4g}"
        table.add_row(
            *(literal(cell) for cell in (row.name, row.rule or "", row.statistic or "", value, row.verdict or ""))
        )
    return table


def _qconfig_table(report: Report) -> Table:
    table = Table(title="Resolved qconfig per node", expand=False)
    for column in (
        "Node",
        "Target",
        "Kind",
        "In dtype",
        "Out dtype",
        "Activation observer",
        "Weight observer",
        "ch_axis",
    ):
        table.add_column(column)
    for row in report.qconfig_table:
        cells = (
            row.node,
            row.target,
            row.kind,
            _short(row.input_dtype),
            _short(row.output_dtype),
            row.activation_observer or "-",
            row.weight_observer or "-",
            "" if row.ch_axis is None else str(row.ch_axis),
        )
        table.add_row(*(literal(cell) for cell in cells))
    return table


def _short(dtype: str | None) -> str:
    return "-" if dtype is None else dtype.replace("torch.", "")


def summary_line(report: Report) -> str:
    counts = {s: sum(1 for f in report.findings if f.severity == s) for s in Severity}
    if not report.findings:
        head = "No quantization problems found."
    else:
        head = (
            f"Found {len(report.findings)} finding{'s' if len(report.findings) != 1 else ''}: "
            f"{counted(counts[Severity.ERROR], 'error')}, {counted(counts[Severity.WARNING], 'warning')}, "
            f"{counts[Severity.INFO]} info."
        )
    if report.skipped:
        head += f" {len(report.skipped)} rule{'s' if len(report.skipped) != 1 else ''} skipped."
    return head + _impact_summary(report)


def counted(count: int, noun: str) -> str:
    """``1 warning``, ``3 warnings``: a count and its noun (regular plural)."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _impact_summary(report: Report) -> str:
    """The findings that matter most, by measured output-SQNR gain, and what fixing them recovers."""
    gains = [f for f in report.findings if f.recovers_output_sqnr()]
    if not gains:
        return ""
    top = sorted(gains, key=lambda f: -f.impact.ranked_db() if f.impact else 0.0)[:3]
    text = " Top by impact: " + ", ".join(f"{f.rule} {printable(f.target)} {impact_text(f)[0]}" for f in top) + "."
    trial = report.trial
    if trial is not None and trial.workaround is not None and trial.fixed_sqnr_db is not None:
        # the trial's own SQNR was measured with the workaround, so "before" is the failure
        text += (
            f" Every such fix applied together in one trial: fails → {sqnr_text(trial.fixed_sqnr_db)} "
            "(quantized as you intend, the model fails without them)."
        )
    elif trial is not None and trial.recoverable_db is not None and trial.fixed_sqnr_db is not None:
        text += (
            f" Every such fix applied together in one trial: {sqnr_text(trial.output_sqnr_db)} → "
            f"{sqnr_text(trial.fixed_sqnr_db)} ({trial.recoverable_db:+.1f} dB, measured)."
        )
    return text
