"""A self-contained HTML report of a numeric comparison.

One file, no scripts and no network: styles are inline and every chart is an
inline SVG (``qlint.numeric.charts``).  Sections: summary, the next step (when the model
output is below the threshold: ``qlint.numeric.next_step``), per-layer SQNR in
forward order (propagated and shadow on one chart, threshold line),
float-vs-quantized histograms of the worst layers, the sensitivity ranking, the
findings, the full layer table and the worst inputs (``--badcases``) with the
comparison on them.  SQNR values at the cap (no error) are
written as words, not as the cap's number (``qlint.numeric.display``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from qlint.core.sqnr import sqnr_db_from_powers
from qlint.linter.findings import Report
from qlint.numeric.badcase_summary import BadCaseSummary
from qlint.numeric.charts import (
    FLOAT_HISTOGRAM_COLOR,
    PROPAGATED_COLOR,
    QUANTIZED_HISTOGRAM_COLOR,
    SENSITIVITY_COLOR,
    SHADOW_COLOR,
    THRESHOLD_COLOR,
    WEIGHT_COLOR,
    SensitivityBar,
    escape,
    has_exact_values,
    histogram_svg,
    sensitivity_svg,
    sqnr_chart_svg,
)
from qlint.numeric.diagnose import DEFAULT_SQNR_THRESHOLD_DB
from qlint.numeric.display import (
    EXACT,
    badcase_cells,
    badcase_column,
    badcase_title,
    error_cell,
    error_heading,
    error_notes,
    error_summary,
    format_sqnr,
    layer_label,
    ranked_label,
    sqnr_columns,
    sqnr_notes,
    worst_inputs_heading,
)
from qlint.numeric.next_step import NextStep
from qlint.render.text import counted

_STYLE = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px;color:#222;background:#fff}
h1{font-size:22px;margin:0 0 4px} h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #ddd;padding-bottom:4px}
h3{font-size:14px;margin:18px 0 6px}
.meta{color:#666;font-size:13px} table{border-collapse:collapse;font-size:12px;margin-top:6px}
th,td{border:1px solid #ddd;padding:3px 7px;text-align:left;vertical-align:top} th{background:#f4f4f4}
td.num{text-align:right;font-variant-numeric:tabular-nums} .error{color:#b00020;font-weight:600}
.warning{color:#a15c00;font-weight:600} .info{color:#555} .grid{display:flex;flex-wrap:wrap;gap:12px}
.legend span{display:inline-block;margin-right:14px;font-size:12px} .swatch{display:inline-block;width:12px;
height:12px;margin-right:4px;vertical-align:-2px;opacity:.75} .swatch.hollow{box-sizing:border-box;
border:2px solid #555;border-radius:50%} svg{background:#fff}
pre{background:#f4f4f4;padding:8px;font-size:12px;white-space:pre-wrap}
"""


# The SQNR chart's series, as its legend names them.
_SERIES = (
    ("propagated", "propagated", PROPAGATED_COLOR),
    ("shadow", "shadow (the layer's own error)", SHADOW_COLOR),
    ("weight", "weight", WEIGHT_COLOR),
)
# The layer table's heading of each SQNR column (``display.SQNR_COLUMNS``).
_SQNR_HEADINGS = {"weight": "weight SQNR", "propagated": "propagated", "shadow": "shadow"}


def _number(value: float | None, digits: int = 1) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def _sensitivity_bars(sensitivity: Sequence[Any]) -> list[SensitivityBar]:
    """``sensitivity()`` tuples or ``sensitivity_rows()`` rows as the chart and table show them."""
    bars = []
    for entry in sensitivity:
        if isinstance(entry, tuple):
            # the score is output noise over output signal: the SQNR it means, as the rows hold it
            bars.append(SensitivityBar(entry[0], float(entry[1]), sqnr_db_from_powers(1.0, float(entry[1]))))
        else:
            bars.append(
                SensitivityBar(
                    ranked_label(entry.name, entry.calls),
                    entry.score,
                    entry.output_sqnr_db,
                    entry.local_sqnr_db,
                    entry.flops_share,
                    entry.params_share,
                )
            )
    return bars


def _findings_table(report: Report) -> str:
    if not report.findings:
        return "<p>No findings.</p>"
    rows = "".join(
        f'<tr><td>{escape(f.rule)}</td><td>{escape(f.name)}</td><td class="{f.severity.value}">'
        f"{escape(f.severity.value)}</td><td>{escape(f.target)}</td><td>{escape(f.message)}</td></tr>"
        for f in report.findings
    )
    return f"<table><tr><th>rule</th><th>name</th><th>severity</th><th>target</th><th>message</th></tr>{rows}</table>"


def _layer_table(report: Report) -> str:
    rows = report.compare_rows()
    sqnr = sqnr_columns(rows)
    headings = ["#", "layer", "kind", "quantized", *(_SQNR_HEADINGS[mode] for mode, _ in sqnr)]
    headings += [error_heading(metric, rows) for metric in ("cosine", "max |err|", "RMSE/scale")]
    header = "<tr>" + "".join(f"<th>{escape(heading)}</th>" for heading in headings) + "</tr>"
    body = []
    for index, row in enumerate(rows):
        summary = error_summary(row)
        errors = (
            _number(row.cosine, 5),
            _number(summary.get("max_abs_error"), 4),
            _number(summary.get("rmse_over_scale"), 3),
        )
        body.append(
            f"<tr><td class=num>{index}</td><td>{escape(layer_label(row))}</td><td>{escape(row.kind or '')}</td>"
            f"<td>{escape(row.extra.get('quantized_class', ''))}</td>"
            + "".join(f"<td class=num>{format_sqnr(value(row))}</td>" for _, value in sqnr)
            + "".join(f"<td class=num>{escape(error_cell(text, row, rows))}</td>" for text in errors)
            + "</tr>"
        )
    values = [value(row) for row in rows for _, value in sqnr]
    notes = "".join(f'<p class="meta">{escape(note)}</p>' for note in error_notes(rows))
    return f"<table>{header}{''.join(body)}</table>{_notes(values)}{notes}"


def _sensitivity_table(bars: Sequence[SensitivityBar]) -> str:
    if not bars or bars[0].flops_share is None:
        return ""
    rows = "".join(
        f"<tr><td class=num>{rank + 1}</td><td>{escape(bar.label)}</td>"
        f"<td class=num>{format_sqnr(bar.output_sqnr_db)}</td><td class=num>{bar.score:.3e}</td>"
        f"<td class=num>{format_sqnr(bar.local_sqnr_db)}</td><td class=num>{100 * (bar.flops_share or 0.0):.1f}%</td>"
        f"<td class=num>{100 * (bar.params_share or 0.0):.1f}%</td></tr>"
        for rank, bar in enumerate(bars)
    )
    return (
        "<table><tr><th>rank</th><th>layer</th>"
        '<th title="the model output\'s SQNR measured with only this layer quantized">output SQNR, only it int8</th>'
        "<th>score (output noise/signal)</th>"
        '<th title="the SQNR of the layer\'s own output, the layer quantized alone, everything else float">isolated SQNR</th>'
        "<th>FLOPs</th><th>params</th></tr>"
        f"{rows}</table>{_notes([bar.output_sqnr_db for bar in bars] + [bar.local_sqnr_db for bar in bars])}"
    )


def _badcase_section(summary: BadCaseSummary) -> list[str]:
    """The worst inputs (per metric, as the text prints them) and the comparison on them alone."""
    column = badcase_column(summary)
    rows = "".join(
        f"<tr><td>{escape(metric.description)}</td><td>{escape(badcase_cells(metric, summary))}</td></tr>"
        for metric in summary.worst
    )
    saved = f" Saved to {escape(summary.saved_to)}." if summary.saved_to else ""
    sections = [
        '<h2 id="badcases">Worst inputs</h2>',
        f'<p class="meta">{escape(badcase_title(summary))}.{saved}</p>',
        f'<table id="badcase-table"><tr><th>metric</th><th>{escape(column)}</th></tr>{rows}</table>',
        f"<h3>{escape(worst_inputs_heading(summary))}</h3>",
    ]
    sections += [f'<p class="meta">{escape(notice.message)}</p>' for notice in summary.report.notices]
    return [*sections, _layer_table(summary.report), _findings_table(summary.report)]


def _next_step_section(step: NextStep) -> str:
    """The reason, the commands as one block to copy, and what they do."""
    commands = escape("\n".join(step.commands))
    return (
        '<h2 id="next-step">Next step</h2>'
        f"<p>{escape(step.reason[:1].upper() + step.reason[1:])}. Run:</p>"  # a sentence of its own here
        f"<pre>{commands}</pre>"
        f'<p class="meta">{escape(step.explanation)}</p>'
    )


def _notes(values: Sequence[float | None]) -> str:
    return "".join(f'<p class="meta">{escape(note)}</p>' for note in sqnr_notes(list(values)))


def _legend(entries: Sequence[tuple[str, str]], hollow: str | None = None) -> str:
    spans = "".join(
        f'<span><i class="swatch" style="background:{color}"></i>{escape(label)}</span>' for label, color in entries
    )
    if hollow:
        spans += f'<span><i class="swatch hollow"></i>{escape(hollow)}</span>'
    return f'<div class="legend">{spans}</div>'


def render_html(
    report: Report,
    *,
    sensitivity: Sequence[Any] | None = None,
    histograms: Mapping[str, Any] | None = None,
    title: str | None = None,
    sqnr_threshold: float = DEFAULT_SQNR_THRESHOLD_DB,
    badcases: BadCaseSummary | None = None,
    next_step: NextStep | None = None,
) -> str:
    title = title or f"qlint numeric report: {report.model}"
    counts = {
        severity: sum(1 for f in report.findings if f.severity.value == severity)
        for severity in ("error", "warning", "info")
    }
    sections = [
        f"<h1>{escape(title)}</h1>",
        f'<div class="meta">counterpart: {escape(report.frontend)} &middot; backend: {escape(report.backend)} '
        f"&middot; torch {escape(report.torch_version)} &middot; qlint {escape(report.qlint_version)} &middot; "
        f"{counted(len(report.compare_rows()), 'layer')} &middot; {counted(counts['error'], 'error')}, "
        f"{counted(counts['warning'], 'warning')}</div>",
    ]
    sections += [f'<p class="meta">{escape(notice.message)}</p>' for notice in report.notices]
    if next_step is not None:  # at the top: the report's verdict on the whole model
        sections.append(_next_step_section(next_step))
    sections.append("<h2>Per-layer SQNR (forward order)</h2>")
    # the legend names the series the chart draws: no "propagated" entry under --modes shadow
    drawn = {mode for mode, _ in sqnr_columns(report.compare_rows())}
    series = [(label, color) for mode, label, color in _SERIES if mode in drawn]
    sections.append(
        _legend(
            [*series, (f"threshold {sqnr_threshold:g} dB", THRESHOLD_COLOR)],
            hollow=f"{EXACT} (no error, off the dB scale)" if has_exact_values(report.compare_rows()) else None,
        )
    )
    sections.append(f'<div id="sqnr-chart">{sqnr_chart_svg(report.compare_rows(), sqnr_threshold)}</div>')
    if histograms:
        sections.append("<h2>Float vs quantized activations (worst layers)</h2>")
        sections.append(_legend([("float", FLOAT_HISTOGRAM_COLOR), ("quantized", QUANTIZED_HISTOGRAM_COLOR)]))
        charts = "".join(
            histogram_svg(name, h.low, h.high, h.float_counts, h.quantized_counts) for name, h in histograms.items()
        )
        sections.append(f'<div id="histograms" class="grid">{charts}</div>')
    if sensitivity:
        bars = _sensitivity_bars(sensitivity)
        sections.append("<h2>Sensitivity ranking</h2>")
        sections.append(
            '<p class="meta">Each bar is labelled with the SQNR of the model output measured with only this '
            "layer quantized, everything else float (dB, as in the text and the JSON). The bar's length is the output "
            "noise that layer causes: longer bars, lower SQNR, more harm.</p>"
        )
        sections.append(f'<div id="sensitivity">{sensitivity_svg(bars)}</div>')
        sections.append(_sensitivity_table(bars))
    sections.append("<h2>Findings</h2>")
    sections.append(_findings_table(report))
    sections.append("<h2>Layers</h2>")
    sections.append(_layer_table(report))
    if badcases is not None:
        sections += _badcase_section(badcases)
    return (
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>'
        f"<style>{_STYLE}</style></head><body>{''.join(sections)}</body></html>"
    )


def write_html(
    report: Report,
    path: str | Path,
    *,
    sensitivity: Sequence[Any] | None = None,
    histograms: Mapping[str, Any] | None = None,
    title: str | None = None,
    sqnr_threshold: float = DEFAULT_SQNR_THRESHOLD_DB,
    badcases: BadCaseSummary | None = None,
    next_step: NextStep | None = None,
) -> Path:
    """Write the report as one self-contained HTML file and return its path.

    ``sensitivity``: ``sensitivity()`` tuples or ``sensitivity_rows()`` rows.
    ``histograms``: ``histograms.activation_histograms()`` output.
    ``badcases``: ``BadCaseSet.summary()``, the worst inputs and the comparison on them.
    ``next_step``: ``CompareReport.next_step``, the commands that measure fixes.
    """
    path = Path(path)
    page = render_html(
        report,
        sensitivity=sensitivity,
        histograms=histograms,
        title=title,
        sqnr_threshold=sqnr_threshold,
        badcases=badcases,
        next_step=next_step,
    )
    path.write_text(page, encoding="utf-8")
    return path


__all__ = [
    "FLOAT_HISTOGRAM_COLOR",
    "PROPAGATED_COLOR",
    "QUANTIZED_HISTOGRAM_COLOR",
    "SENSITIVITY_COLOR",
    "SHADOW_COLOR",
    "THRESHOLD_COLOR",
    "WEIGHT_COLOR",
    "histogram_svg",
    "render_html",
    "sensitivity_svg",
    "sqnr_chart_svg",
    "write_html",
]
