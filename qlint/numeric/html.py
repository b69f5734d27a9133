"""A self-contained HTML report of a numeric comparison.

One file, no scripts and no network: styles are inline and every chart is an
SVG drawn here.  Sections: summary, per-layer SQNR in forward order
(propagated and shadow on one chart, threshold line), float-vs-quantized
histograms of the worst layers, the sensitivity ranking, the findings and the
full layer table.  Series colours are fixed constants so that a renderer test
can find each chart's pixels in a screenshot (legend swatches are drawn
translucent, so only chart pixels carry the exact colours).
"""

from __future__ import annotations

import html
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from qlint.linter.findings import CompareRow, Report
from qlint.numeric.diagnose import DEFAULT_SQNR_THRESHOLD_DB

PROPAGATED_COLOR = "#1f77b4"
SHADOW_COLOR = "#ff7f0e"
WEIGHT_COLOR = "#7f7f7f"
THRESHOLD_COLOR = "#d62728"
FLOAT_HISTOGRAM_COLOR = "#17becf"
QUANTIZED_HISTOGRAM_COLOR = "#9467bd"
SENSITIVITY_COLOR = "#2ca02c"
# SQNR values above this are drawn at the top edge (error-free layers sit at the 200 dB cap).
DISPLAY_CEILING_DB = 80.0

_STYLE = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px;color:#222;background:#fff}
h1{font-size:22px;margin:0 0 4px} h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #ddd;padding-bottom:4px}
.meta{color:#666;font-size:13px} table{border-collapse:collapse;font-size:12px;margin-top:6px}
th,td{border:1px solid #ddd;padding:3px 7px;text-align:left;vertical-align:top} th{background:#f4f4f4}
td.num{text-align:right;font-variant-numeric:tabular-nums} .error{color:#b00020;font-weight:600}
.warning{color:#a15c00;font-weight:600} .info{color:#555} .grid{display:flex;flex-wrap:wrap;gap:12px}
.legend span{display:inline-block;margin-right:14px;font-size:12px} .swatch{display:inline-block;width:12px;
height:12px;margin-right:4px;vertical-align:-2px;opacity:.75} svg{background:#fff}
"""


def _escape(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _number(value: float | None, digits: int = 1) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def _clamp_db(value: float) -> float:
    return max(0.0, min(DISPLAY_CEILING_DB, value))


def sqnr_chart_svg(rows: Sequence[CompareRow], threshold: float, width: int = 960, height: int = 340) -> str:
    """Line chart of propagated and shadow SQNR (and weight SQNR dots) per layer, in forward order."""
    left, right, top, bottom = 48, 16, 16, 110
    plot_width, plot_height = width - left - right, height - top - bottom
    values = [v for row in rows for v in (row.sqnr_propagated, row.sqnr_shadow, row.weight_sqnr) if v is not None]
    ceiling = min(DISPLAY_CEILING_DB, max([threshold + 10.0] + [_clamp_db(v) for v in values]))
    ceiling = 10.0 * math.ceil(ceiling / 10.0)
    step = plot_width / max(1, len(rows))

    def x(index: int) -> float:
        return left + step * (index + 0.5)

    def y(value: float) -> float:
        return top + plot_height * (1.0 - min(_clamp_db(value), ceiling) / ceiling)

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" '
        f'aria-label="per-layer SQNR">'
    ]
    for tick in range(0, int(ceiling) + 1, 10):
        parts.append(f'<line x1="{left}" x2="{width - right}" y1="{y(tick):.1f}" y2="{y(tick):.1f}" stroke="#eee"/>')
        parts.append(f'<text x="{left - 6}" y="{y(tick) + 4:.1f}" font-size="10" text-anchor="end">{tick}</text>')
    parts.append(
        f'<text x="12" y="{top + plot_height / 2:.0f}" font-size="11" transform="rotate(-90 12 '
        f'{top + plot_height / 2:.0f})" text-anchor="middle">SQNR (dB)</text>'
    )
    parts.append(
        f'<line x1="{left}" x2="{width - right}" y1="{y(threshold):.1f}" y2="{y(threshold):.1f}" '
        f'stroke="{THRESHOLD_COLOR}" stroke-dasharray="6 4" stroke-width="1.5"/>'
    )
    for attribute, color in (("sqnr_propagated", PROPAGATED_COLOR), ("sqnr_shadow", SHADOW_COLOR)):
        values = [getattr(row, attribute) for row in rows]
        points = [(x(i), y(value)) for i, value in enumerate(values) if value is not None]
        # Lines join neighbouring layers only: a layer without this value (no shadow run for a
        # functional op) breaks the line instead of being bridged.
        for index in range(len(values) - 1):
            if values[index] is not None and values[index + 1] is not None:
                parts.append(
                    f'<line x1="{x(index):.1f}" y1="{y(values[index]):.1f}" x2="{x(index + 1):.1f}" '
                    f'y2="{y(values[index + 1]):.1f}" stroke="{color}" stroke-width="2.5"/>'
                )
        for px, py in points:
            parts.append(f'<circle cx="{px:.1f}" cy="{py:.1f}" r="4" fill="{color}"/>')
    for index, row in enumerate(rows):
        if row.weight_sqnr is not None:
            parts.append(
                f'<rect x="{x(index) - 3:.1f}" y="{y(row.weight_sqnr) - 3:.1f}" width="6" height="6" '
                f'fill="{WEIGHT_COLOR}"/>'
            )
        label_y = top + plot_height + 10
        parts.append(
            f'<text x="{x(index):.1f}" y="{label_y}" font-size="10" text-anchor="end" '
            f'transform="rotate(-50 {x(index):.1f} {label_y})">{_escape(row.name)}</text>'
        )
    parts.append(f'<rect x="{left}" y="{top}" width="{plot_width}" height="{plot_height}" fill="none" stroke="#999"/>')
    parts.append("</svg>")
    return "".join(parts)


def histogram_svg(
    name: str,
    low: float,
    high: float,
    float_counts: Sequence[int],
    quantized_counts: Sequence[int],
    width: int = 300,
    height: int = 170,
) -> str:
    """Overlaid float/quantized histograms with log-scaled counts (tails stay visible)."""
    left, right, top, bottom = 8, 8, 20, 22
    plot_width, plot_height = width - left - right, height - top - bottom
    bins = max(1, len(float_counts))
    peak = math.log10(1 + max(list(float_counts) + list(quantized_counts) + [1]))
    bar = plot_width / bins
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" '
        f'aria-label="histogram {_escape(name)}">',
        f'<text x="{left}" y="13" font-size="11" font-weight="600">{_escape(name)}</text>',
    ]
    for counts, color, inset in (
        (float_counts, FLOAT_HISTOGRAM_COLOR, 0.0),
        (quantized_counts, QUANTIZED_HISTOGRAM_COLOR, 0.5),
    ):
        for index, count in enumerate(counts):
            if count <= 0:
                continue
            bar_height = plot_height * math.log10(1 + count) / peak
            x = left + index * bar + inset * bar
            parts.append(
                f'<rect x="{x:.1f}" y="{top + plot_height - bar_height:.1f}" width="{bar / 2:.2f}" '
                f'height="{bar_height:.1f}" fill="{color}"/>'
            )
    parts.append(
        f'<line x1="{left}" x2="{width - right}" y1="{top + plot_height}" y2="{top + plot_height}" stroke="#999"/>'
    )
    parts.append(f'<text x="{left}" y="{height - 6}" font-size="10">{low:.3g}</text>')
    parts.append(f'<text x="{width - right}" y="{height - 6}" font-size="10" text-anchor="end">{high:.3g}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _sensitivity_items(sensitivity: Sequence[Any]) -> list[dict[str, Any]]:
    items = []
    for entry in sensitivity:
        if isinstance(entry, tuple):
            items.append({"name": entry[0], "score": float(entry[1])})
        else:
            items.append(
                {
                    "name": entry.name,
                    "score": entry.score,
                    "flops_share": entry.flops_share,
                    "params_share": entry.params_share,
                    "local": entry.local_sqnr_db,
                }
            )
    return items


def sensitivity_svg(items: Sequence[Mapping[str, Any]], width: int = 640, bar_height: int = 18) -> str:
    """Horizontal bars of output noise (dB relative to the output signal), most sensitive on top."""
    label_width, right = 170, 70
    shown = [item for item in items if item["score"] > 0][:20]
    height = 16 + bar_height * max(1, len(shown))
    decibels = [10.0 * math.log10(item["score"]) for item in shown]
    floor = min(decibels, default=-60.0) - 5.0
    span = max(1e-9, max(decibels, default=0.0) - floor)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" '
        f'aria-label="sensitivity ranking">'
    ]
    for index, (item, value) in enumerate(zip(shown, decibels)):
        y = 8 + index * bar_height
        length = (width - label_width - right) * (value - floor) / span
        parts.append(
            f'<text x="{label_width - 6}" y="{y + bar_height * 0.7:.1f}" font-size="11" '
            f'text-anchor="end">{_escape(item["name"])}</text>'
        )
        parts.append(
            f'<rect x="{label_width}" y="{y + 2}" width="{max(length, 1.0):.1f}" height="{bar_height - 4}" '
            f'fill="{SENSITIVITY_COLOR}"/>'
        )
        parts.append(
            f'<text x="{label_width + length + 4:.1f}" y="{y + bar_height * 0.7:.1f}" '
            f'font-size="10">{value:.1f} dB</text>'
        )
    parts.append("</svg>")
    return "".join(parts)


def _findings_table(report: Report) -> str:
    if not report.findings:
        return "<p>No findings.</p>"
    rows = "".join(
        f'<tr><td>{_escape(f.rule)}</td><td>{_escape(f.name)}</td><td class="{f.severity.value}">'
        f"{_escape(f.severity.value)}</td><td>{_escape(f.target)}</td><td>{_escape(f.message)}</td></tr>"
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
            f"<tr><td class=num>{index}</td><td>{_escape(row.name)}</td><td>{_escape(row.kind or '')}</td>"
            f"<td>{_escape(row.extra.get('quantized_class', ''))}</td><td class=num>{_number(row.weight_sqnr)}</td>"
            f"<td class=num>{_number(row.sqnr_propagated)}</td><td class=num>{_number(row.sqnr_shadow)}</td>"
            f"<td class=num>{_number(row.cosine, 5)}</td><td class=num>{_number(summary.get('max_abs_error'), 4)}</td>"
            f"<td class=num>{_number(summary.get('rmse_over_scale'), 3)}</td></tr>"
        )
    return f"<table>{header}{''.join(body)}</table>"


def _sensitivity_table(items: Sequence[Mapping[str, Any]]) -> str:
    if not items or "flops_share" not in items[0]:
        return ""
    rows = "".join(
        f"<tr><td class=num>{rank + 1}</td><td>{_escape(item['name'])}</td><td class=num>{item['score']:.3e}</td>"
        f"<td class=num>{_number(item.get('local'))}</td><td class=num>{100 * item['flops_share']:.1f}%</td>"
        f"<td class=num>{100 * item['params_share']:.1f}%</td></tr>"
        for rank, item in enumerate(items)
    )
    return (
        "<table><tr><th>rank</th><th>layer</th><th>score (noise/signal)</th><th>local SQNR</th>"
        f"<th>FLOPs</th><th>params</th></tr>{rows}</table>"
    )


def _legend(entries: Sequence[tuple[str, str]]) -> str:
    spans = "".join(
        f'<span><i class="swatch" style="background:{color}"></i>{_escape(label)}</span>' for label, color in entries
    )
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
        f"<h1>{_escape(title)}</h1>",
        f'<div class="meta">counterpart: {_escape(report.frontend)} &middot; backend: {_escape(report.backend)} '
        f"&middot; torch {_escape(report.torch_version)} &middot; qlint {_escape(report.qlint_version)} &middot; "
        f"{len(report.compare_rows())} layers &middot; {counts['error']} errors, {counts['warning']} warnings</div>",
    ]
    sections += [f'<p class="meta">{_escape(notice.message)}</p>' for notice in report.notices]
    sections.append("<h2>Per-layer SQNR (forward order)</h2>")
    sections.append(
        _legend(
            [
                ("propagated", PROPAGATED_COLOR),
                ("shadow (local)", SHADOW_COLOR),
                ("weight", WEIGHT_COLOR),
                (f"threshold {sqnr_threshold:g} dB", THRESHOLD_COLOR),
            ]
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
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{_escape(title)}</title>'
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
