"""A self-contained HTML report of a numeric comparison.

One file, no scripts and no network: styles are inline and every chart is an
inline SVG (``qlint.numeric.charts``).  Sections: summary, per-layer SQNR in
forward order (propagated and shadow on one chart, threshold line),
float-vs-quantized histograms of the worst layers, the sensitivity ranking, the
findings and the full layer table.  SQNR values at the cap (no error) are
written as words, not as the cap's number (``qlint.numeric.display``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from qlint.linter.findings import Report
from qlint.numeric.charts import (
    FLOAT_HISTOGRAM_COLOR,
    PROPAGATED_COLOR,
    QUANTIZED_HISTOGRAM_COLOR,
    SENSITIVITY_COLOR,
    SHADOW_COLOR,
    THRESHOLD_COLOR,
    WEIGHT_COLOR,
    escape,
    has_exact_values,
    histogram_svg,
    sensitivity_svg,
    sqnr_chart_svg,
)
from qlint.numeric.diagnose import DEFAULT_SQNR_THRESHOLD_DB
from qlint.numeric.display import EXACT, format_sqnr, layer_label, ranked_label, sqnr_notes
from qlint.render.text import counted

_STYLE = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px;color:#222;background:#fff}
h1{font-size:22px;margin:0 0 4px} h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #ddd;padding-bottom:4px}
.meta{color:#666;font-size:13px} table{border-collapse:collapse;font-size:12px;margin-top:6px}
th,td{border:1px solid #ddd;padding:3px 7px;text-align:left;vertical-align:top} th{background:#f4f4f4}
td.num{text-align:right;font-variant-numeric:tabular-nums} .error{color:#b00020;font-weight:600}
.warning{color:#a15c00;font-weight:600} .info{color:#555} .grid{display:flex;flex-wrap:wrap;gap:12px}
.legend span{display:inline-block;margin-right:14px;font-size:12px} .swatch{display:inline-block;width:12px;
height:12px;margin-right:4px;vertical-align:-2px;opacity:.75} .swatch.hollow{box-sizing:border-box;
border:2px solid #555;border-radius:50%} svg{background:#fff}
"""


def _number(value: float | None, digits: int = 1) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def _sensitivity_items(sensitivity: Sequence[Any]) -> list[dict[str, Any]]:
    items = []
    for entry in sensitivity:
        if isinstance(entry, tuple):
            items.append({"name": entry[0], "score": float(entry[1])})
        else:
            items.append(
                {
                    "name": ranked_label(entry.name, entry.calls),
                    "score": entry.score,
                    "flops_share": entry.flops_share,
                    "params_share": entry.params_share,
                    "local": entry.local_sqnr_db,
                }
            )
    return items


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
    header = (
        "<tr><th>#</th><th>layer</th><th>kind</th><th>quantized</th><th>weight SQNR</th><th>propagated</th>"
        "<th>shadow</th><th>cosine</th><th>max |err|</th><th>RMSE/scale</th></tr>"
    )
    body = []
    for index, row in enumerate(report.compare_rows()):
        summary = row.extra.get("propagated") or row.extra.get("shadow") or {}
        body.append(
            f"<tr><td class=num>{index}</td><td>{escape(layer_label(row))}</td><td>{escape(row.kind or '')}</td>"
            f"<td>{escape(row.extra.get('quantized_class', ''))}</td><td class=num>{format_sqnr(row.weight_sqnr)}</td>"
            f"<td class=num>{format_sqnr(row.sqnr_propagated)}</td><td class=num>{format_sqnr(row.sqnr_shadow)}</td>"
            f"<td class=num>{_number(row.cosine, 5)}</td><td class=num>{_number(summary.get('max_abs_error'), 4)}</td>"
            f"<td class=num>{_number(summary.get('rmse_over_scale'), 3)}</td></tr>"
        )
    values = [
        value for row in report.compare_rows() for value in (row.weight_sqnr, row.sqnr_propagated, row.sqnr_shadow)
    ]
    return f"<table>{header}{''.join(body)}</table>{_notes(values)}"


def _sensitivity_table(items: Sequence[Mapping[str, Any]]) -> str:
    if not items or "flops_share" not in items[0]:
        return ""
    rows = "".join(
        f"<tr><td class=num>{rank + 1}</td><td>{escape(item['name'])}</td><td class=num>{item['score']:.3e}</td>"
        f"<td class=num>{format_sqnr(item.get('local'))}</td><td class=num>{100 * item['flops_share']:.1f}%</td>"
        f"<td class=num>{100 * item['params_share']:.1f}%</td></tr>"
        for rank, item in enumerate(items)
    )
    return (
        "<table><tr><th>rank</th><th>layer</th><th>score (noise/signal)</th>"
        '<th title="the layer quantized alone, everything else float">isolated SQNR</th>'
        f"<th>FLOPs</th><th>params</th></tr>{rows}</table>{_notes([item.get('local') for item in items])}"
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
    sections.append("<h2>Per-layer SQNR (forward order)</h2>")
    sections.append(
        _legend(
            [
                ("propagated", PROPAGATED_COLOR),
                ("shadow (the layer's own error)", SHADOW_COLOR),
                ("weight", WEIGHT_COLOR),
                (f"threshold {sqnr_threshold:g} dB", THRESHOLD_COLOR),
            ],
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
        items = _sensitivity_items(sensitivity)
        sections.append("<h2>Sensitivity ranking</h2>")
        sections.append(
            '<p class="meta">Estimated output noise, relative to the output signal, if only this '
            "layer were quantized (higher bars hurt more).</p>"
        )
        sections.append(f'<div id="sensitivity">{sensitivity_svg(items)}</div>')
        sections.append(_sensitivity_table(items))
    sections.append("<h2>Findings</h2>")
    sections.append(_findings_table(report))
    sections.append("<h2>Layers</h2>")
    sections.append(_layer_table(report))
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
) -> Path:
    """Write the report as one self-contained HTML file and return its path.

    ``sensitivity``: ``sensitivity()`` tuples or ``sensitivity_rows()`` rows.
    ``histograms``: ``compare.activation_histograms()`` output.
    """
    path = Path(path)
    path.write_text(
        render_html(report, sensitivity=sensitivity, histograms=histograms, title=title, sqnr_threshold=sqnr_threshold),
        encoding="utf-8",
    )
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
