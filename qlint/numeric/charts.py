"""The inline SVG charts of the HTML report: per-layer SQNR, histograms, sensitivity bars.

Series colours are fixed constants so that a renderer test can find each chart's pixels in
a screenshot (legend swatches are drawn translucent, so only chart pixels carry the exact
colours). No scripts: hovering a layer shows its name and values through SVG ``<title>``
tooltips, which every browser shows natively.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from qlint.linter.findings import CompareRow
from qlint.numeric.display import EXACT, describe_sqnr, layer_label, sqnr_word

PROPAGATED_COLOR = "#1f77b4"
SHADOW_COLOR = "#ff7f0e"
WEIGHT_COLOR = "#7f7f7f"
THRESHOLD_COLOR = "#d62728"
FLOAT_HISTOGRAM_COLOR = "#17becf"
QUANTIZED_HISTOGRAM_COLOR = "#9467bd"
SENSITIVITY_COLOR = "#2ca02c"
# Measured SQNR beyond +-this is drawn at the plot's edge (its tooltip has the value): float32
# round-off alone measures ~140 dB and would squash the range where layers differ.
DISPLAY_RANGE_DB = 80.0
# Text is sized, not measured: an average advance of 0.62 em fits DejaVu Sans, one of the
# widest common sans-serif fonts, for layer names (lowercase, digits, dots).
CHAR_WIDTH_EM = 0.62
AXIS_LABEL_FONT = 10
MIN_LABEL_STEP = 13.0  # vertical 10 px labels closer than this overlap: every k-th is shown
MAX_AXIS_LABEL_CHARS = 48
SENSITIVITY_FONT = 11
MAX_SENSITIVITY_LABEL_CHARS = 64


def escape(value: Any) -> str:
    return html.escape(str(value), quote=True)


def text_width(text: str, font_size: float) -> float:
    """A generous estimate of the width of ``text`` in pixels."""
    return len(text) * CHAR_WIDTH_EM * font_size


def shorten(name: str, limit: int) -> str:
    """``name`` cut in the middle to ``limit`` characters: the start and the (more specific) end stay."""
    if len(name) <= limit:
        return name
    head = (limit - 1) // 3
    return name[:head] + "\u2026" + name[len(name) - (limit - 1 - head) :]


def _series(rows: Sequence[CompareRow]) -> list[tuple[str, str, list[float | None]]]:
    return [
        ("propagated", PROPAGATED_COLOR, [row.sqnr_propagated for row in rows]),
        ("shadow", SHADOW_COLOR, [row.sqnr_shadow for row in rows]),
        ("weight", WEIGHT_COLOR, [row.weight_sqnr for row in rows]),
    ]


def _measured(value: float | None) -> bool:
    return value is not None and sqnr_word(value) is None


def sqnr_axis(values: Sequence[float | None], threshold: float) -> tuple[float, float]:
    """The dB range of the chart: every measured value (negatives too) and the threshold, in
    steps of 10 dB, within +-DISPLAY_RANGE_DB; capped values are not on the scale."""
    measured = [value for value in values if value is not None and sqnr_word(value) is None]
    low = max(-DISPLAY_RANGE_DB, min([0.0, threshold - 10.0] + measured))
    high = min(DISPLAY_RANGE_DB, max([threshold + 10.0] + measured))
    low, high = 10.0 * math.floor(low / 10.0), 10.0 * math.ceil(high / 10.0)
    return low, max(high, low + 10.0)


def has_exact_values(rows: Sequence[CompareRow]) -> bool:
    return any(sqnr_word(value) == EXACT for _, _, values in _series(rows) for value in values)


def _tooltip(row: CompareRow) -> str:
    parts = [f"{layer_label(row)} ({row.kind})" if row.kind else layer_label(row)]
    for label, _, values in _series([row]):
        if values[0] is not None:
            parts.append(f"{label} {describe_sqnr(values[0])}")
    return "; ".join(parts)


def sqnr_chart_svg(rows: Sequence[CompareRow], threshold: float, width: int = 1400, plot_height: int = 240) -> str:
    """Propagated and shadow SQNR (lines) and weight SQNR (grey squares) per layer, in forward order.

    The SVG scales to the page width. Layers without error (the SQNR cap) get hollow markers in
    an "exact" band above the plot and break the lines; "no signal" values are left out. When
    the layers are too many to label each, every k-th is labelled; hovering any layer's column
    shows its name and values."""
    left, right, top = 56, 16, 34
    band_y = top - 16.0
    plot_width = width - left - right
    step = plot_width / max(1, len(rows))
    every = max(1, math.ceil(MIN_LABEL_STEP / step))
    labels = {index: shorten(rows[index].name, MAX_AXIS_LABEL_CHARS) for index in range(0, len(rows), every)}
    label_top = top + plot_height + 8
    longest = max((text_width(label, AXIS_LABEL_FONT) for label in labels.values()), default=0.0)
    height = math.ceil(label_top + longest + (24 if every > 1 else 8))
    series = _series(rows)
    low, high = sqnr_axis([value for _, _, values in series for value in values], threshold)

    def x(index: int) -> float:
        return left + step * (index + 0.5)

    def y(value: float) -> float:
        return top + plot_height * (high - min(high, max(low, value))) / (high - low)

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" width="100%" '
        f'role="img" aria-label="per-layer SQNR">'
    ]
    tick_step = 10 if high - low <= 100 else 20
    for tick in range(int(low), int(high) + 1, tick_step):
        stroke = "#bbb" if tick == 0 else "#eee"
        parts.append(
            f'<line x1="{left}" x2="{width - right}" y1="{y(tick):.1f}" y2="{y(tick):.1f}" stroke="{stroke}"/>'
        )
        parts.append(f'<text x="{left - 6}" y="{y(tick) + 4:.1f}" font-size="10" text-anchor="end">{tick}</text>')
    if has_exact_values(rows):
        parts.append(f'<text x="{left - 6}" y="{band_y + 4:.1f}" font-size="10" text-anchor="end">{EXACT}</text>')
        parts.append(
            f'<line x1="{left}" x2="{width - right}" y1="{band_y}" y2="{band_y}" stroke="#ddd" stroke-dasharray="2 3"/>'
        )
    middle = top + plot_height / 2
    parts.append(
        f'<text x="14" y="{middle:.0f}" font-size="11" transform="rotate(-90 14 {middle:.0f})" '
        f'text-anchor="middle">SQNR (dB)</text>'
    )
    parts.append(
        f'<line x1="{left}" x2="{width - right}" y1="{y(threshold):.1f}" y2="{y(threshold):.1f}" '
        f'stroke="{THRESHOLD_COLOR}" stroke-dasharray="6 4" stroke-width="1.5"/>'
    )
    # Lines join neighbouring measured values only: a layer without this value (no shadow run
    # for a functional op) or without error (exact) breaks the line instead of being bridged.
    for _, color, values in series[:2]:
        for index in range(len(values) - 1):
            first, second = values[index], values[index + 1]
            if first is not None and second is not None and _measured(first) and _measured(second):
                parts.append(
                    f'<line x1="{x(index):.1f}" y1="{y(first):.1f}" x2="{x(index + 1):.1f}" '
                    f'y2="{y(second):.1f}" stroke="{color}" stroke-width="2.5"/>'
                )
    for index, row in enumerate(rows):
        cx = x(index)
        parts.append(f"<g><title>{escape(_tooltip(row))}</title>")
        parts.append(
            f'<rect x="{cx - step / 2:.1f}" y="{band_y - 8:.1f}" width="{step:.2f}" '
            f'height="{label_top - band_y + 8 + longest:.1f}" fill="transparent"/>'
        )
        weight = row.weight_sqnr
        if weight is not None and _measured(weight):
            parts.append(f'<rect x="{cx - 3:.1f}" y="{y(weight) - 3:.1f}" width="6" height="6" fill="{WEIGHT_COLOR}"/>')
        elif sqnr_word(weight) == EXACT:
            parts.append(
                f'<rect x="{cx - 4.5:.1f}" y="{band_y - 4.5:.1f}" width="9" height="9" fill="#fff" '
                f'stroke="{WEIGHT_COLOR}" stroke-width="1.5"/>'
            )
        both_exact = sqnr_word(row.sqnr_propagated) == sqnr_word(row.sqnr_shadow) == EXACT
        for (_, color, values), radius in zip(series[:2], (4.0, 2.0 if both_exact else 4.0)):
            value = values[index]
            if value is not None and _measured(value):
                parts.append(f'<circle cx="{cx:.1f}" cy="{y(value):.1f}" r="4" fill="{color}"/>')
            elif sqnr_word(value) == EXACT:
                parts.append(
                    f'<circle cx="{cx:.1f}" cy="{band_y}" r="{radius}" fill="#fff" stroke="{color}" stroke-width="2"/>'
                )
        if index in labels:
            parts.append(
                f'<text x="{cx + 3.5:.1f}" y="{label_top}" font-size="{AXIS_LABEL_FONT}" text-anchor="end" '
                f'transform="rotate(-90 {cx + 3.5:.1f} {label_top})">{escape(labels[index])}</text>'
            )
        parts.append("</g>")
    parts.append(f'<rect x="{left}" y="{top}" width="{plot_width}" height="{plot_height}" fill="none" stroke="#999"/>')
    if every > 1:
        parts.append(
            f'<text x="{width - right}" y="{height - 6}" font-size="11" text-anchor="end" fill="#666">'
            f"one layer in {every} labelled; hover a column for any layer's name and values</text>"
        )
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
        f'aria-label="histogram {escape(name)}">',
        f'<text x="{left}" y="13" font-size="11" font-weight="600">{escape(name)}</text>',
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


@dataclass(frozen=True)
class SensitivityBar:
    """One layer of the sensitivity chart and table: its label, its score (output noise power over
    output signal power with only this layer quantized) and the output SQNR that score means."""

    label: str
    score: float
    output_sqnr_db: float | None
    local_sqnr_db: float | None = None
    flops_share: float | None = None
    params_share: float | None = None


def sensitivity_svg(bars: Sequence[SensitivityBar], bar_area: int = 400, bar_height: int = 18) -> str:
    """Horizontal bars, most sensitive on top, each labelled with the output SQNR measured with only
    that layer quantized (the text's and the JSON's number, positive dB). A bar grows with the
    output noise that layer causes, so the longest bar has the lowest SQNR.

    The label column is as wide as the longest name shown (names past 64 characters are cut in
    the middle; hovering a bar shows the full name)."""
    right = 110  # room for the value after the longest bar
    shown = [bar for bar in bars if bar.score > 0][:20]
    labels = [shorten(bar.label, MAX_SENSITIVITY_LABEL_CHARS) for bar in shown]
    label_width = math.ceil(12 + max((text_width(label, SENSITIVITY_FONT) for label in labels), default=0.0))
    width = label_width + bar_area + right
    height = 16 + bar_height * max(1, len(shown))
    noise_db = [10.0 * math.log10(bar.score) for bar in shown]
    floor = min(noise_db, default=-60.0) - 5.0
    span = max(1e-9, max(noise_db, default=0.0) - floor)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" '
        f'aria-label="sensitivity ranking">'
    ]
    for index, (bar, label, noise) in enumerate(zip(shown, labels, noise_db)):
        y = 8 + index * bar_height
        length = bar_area * (noise - floor) / span
        value = "n/a" if bar.output_sqnr_db is None else describe_sqnr(bar.output_sqnr_db)
        parts.append(
            f"<g><title>{escape(bar.label)}: output SQNR {escape(value)} measured with only this layer "
            f"quantized (output noise/signal {bar.score:.3e})</title>"
        )
        parts.append(
            f'<text x="{label_width - 6}" y="{y + bar_height * 0.7:.1f}" font-size="{SENSITIVITY_FONT}" '
            f'text-anchor="end">{escape(label)}</text>'
        )
        parts.append(
            f'<rect x="{label_width}" y="{y + 2}" width="{max(length, 1.0):.1f}" height="{bar_height - 4}" '
            f'fill="{SENSITIVITY_COLOR}"/>'
        )
        parts.append(
            f'<text x="{label_width + length + 4:.1f}" y="{y + bar_height * 0.7:.1f}" '
            f'font-size="10">SQNR {escape(value)}</text></g>'
        )
    parts.append("</svg>")
    return "".join(parts)
