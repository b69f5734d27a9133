"""How compare's HTML report and text table show what was measured: the chart's dB axis, values
at the SQNR cap (layers without error), long and many layer names, counts in the header.

Text is not measured without a browser: widths are bounded with EM, a lower bound of the average
advance of layer-name characters (DejaVu Sans, Chromium's default sans-serif on Linux, averages
0.51 to 0.58 em on names such as ``encoder.layer.2.output.LayerNorm``).
"""

import io
import math
import re
import warnings

import pytest
import torch
from rich.console import Console
from torch import nn
from torch.ao.quantization import get_default_qconfig_mapping

from qlint.cli.compare import layer_table
from qlint.core.sqnr import SQNR_CAP_DB
from qlint.numeric import html as report_html
from qlint.numeric.compare import compare
from qlint.numeric.examples import ResidualTower, image_batches, quantize_fx_ptq
from qlint.numeric.sensitivity import sensitivity_rows

warnings.filterwarnings("ignore")
pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

EM = 0.6
LONG_HEAD = "classifier.projection_with_an_unusually_long_descriptive_name_to_check_shortening"


class Cancellation(nn.Module):
    """``gelu(left(x) - right(x))`` with ``left`` and ``right`` almost equal, then a head.

    The difference of two large, separately quantized values is small next to their rounding
    noise (as centering is in a LayerNorm), so its propagated SQNR is negative. The GELU is kept
    float: its shadow run equals the quantized model's GELU exactly (the 200 dB cap)."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.ModuleDict(
            {
                "attention_output_projection_left": nn.Linear(16, 16),
                "attention_output_projection_right": nn.Linear(16, 16),
            }
        )
        self.intermediate_act_fn = nn.GELU()
        self.classifier = nn.ModuleDict({LONG_HEAD.split(".")[1]: nn.Linear(16, 4)})
        left, right = (
            self.encoder["attention_output_projection_left"],
            self.encoder["attention_output_projection_right"],
        )
        with torch.no_grad():
            right.weight.copy_(left.weight + 1e-3 * torch.randn_like(left.weight))
            right.bias.copy_(left.bias)

    def forward(self, x):
        encoded = self.encoder["attention_output_projection_left"](x) - self.encoder[
            "attention_output_projection_right"
        ](x)
        return self.classifier[LONG_HEAD.split(".")[1]](self.intermediate_act_fn(encoded))


@pytest.fixture(scope="module")
def cancellation():
    torch.manual_seed(0)
    model = Cancellation().eval()
    generator = torch.Generator().manual_seed(1)
    data = [torch.randn(8, 16, generator=generator) for _ in range(2)]
    mapping = get_default_qconfig_mapping("x86").set_module_name("intermediate_act_fn", None)
    quantized = quantize_fx_ptq(model, data, mapping)[1]
    report = compare(model, quantized, data)
    ranking = sensitivity_rows(model, data, quantized_model=quantized)
    return report, ranking, report_html.render_html(report, sensitivity=ranking)


@pytest.fixture(scope="module")
def tower():
    """A converted net of 162 compared layers (MiniLM-L6 has 97)."""
    model = ResidualTower(blocks=40, channels=8).eval()
    data = image_batches(1, batch_size=2, size=8, seed=0)
    return compare(model, quantize_fx_ptq(model, data)[1], data)


def _svg(page: str, label: str) -> str:
    return re.search(rf'<svg[^>]*aria-label="{label}".*?</svg>', page, re.DOTALL).group(0)


def _size(svg: str) -> tuple[float, float]:
    view_box = re.search(r'viewBox="0 0 ([\d.]+) ([\d.]+)"', svg)
    if view_box:
        return float(view_box.group(1)), float(view_box.group(2))
    size = re.search(r'<svg[^>]*width="([\d.]+)" height="([\d.]+)"', svg)
    return float(size.group(1)), float(size.group(2))


def _ticks(svg: str) -> list[tuple[float, float]]:
    """(dB, y) of the chart's y-axis ticks: each label and its grid line, in the same order."""
    values = re.findall(r'<text x="[\d.]+" y="[-\d.]+" font-size="10" text-anchor="end">(-?\d+)</text>', svg)
    lines = re.findall(r'<line x1="[\d.]+" x2="[\d.]+" y1="([-\d.]+)" y2="\1" stroke="#(?:eee|bbb)"/>', svg)
    assert len(values) == len(lines) >= 2
    return [(float(db), float(y)) for db, y in zip(values, lines)]


def _points(svg: str, color: str) -> list[tuple[float, float]]:
    """(x, y) of the filled markers of one series: the values drawn on the dB scale."""
    return [
        (float(x), float(y)) for x, y in re.findall(rf'<circle cx="([\d.]+)" cy="([-\d.]+)" r="4" fill="{color}"', svg)
    ]


def _axis_labels(svg: str) -> list[tuple[float, float, float, str]]:
    """(angle, x, y, text) of the rotated layer names under the chart."""
    found = re.findall(r'transform="rotate\((-?[\d.]+) ([\d.]+) ([\d.]+)\)">([^<]*)</text>', svg)
    return [(float(angle), float(x), float(y), text) for angle, x, y, text in found if "SQNR" not in text]


def test_chart_axis_follows_the_data_and_draws_negative_sqnr_where_it_is(cancellation):
    report, _, page = cancellation
    rows = report.compare_rows()
    propagated = [row.sqnr_propagated for row in rows if row.sqnr_propagated is not None]
    assert min(propagated) < -3.0  # the cancelled difference: the fixture's point
    svg = _svg(page, "per-layer SQNR")
    ticks = _ticks(svg)
    (db0, y0), (db1, y1) = min(ticks), max(ticks)
    assert db0 <= min(propagated) and db1 < SQNR_CAP_DB / 2  # the scale is the measured range, not the cap
    to_db = lambda y: db0 + (y - y0) * (db1 - db0) / (y1 - y0)  # noqa: E731
    drawn = [round(to_db(y), 1) for _, y in _points(svg, report_html.PROPAGATED_COLOR)]
    measured = [value for value in propagated if abs(value) < SQNR_CAP_DB]
    assert drawn == pytest.approx(measured, abs=0.2)


def test_values_at_the_cap_are_words_not_measurements(cancellation):
    report, ranking, page = cancellation
    gelu = next(row for row in report.compare_rows() if row.name == "intermediate_act_fn")
    assert gelu.sqnr_shadow == SQNR_CAP_DB  # kept float: no error, stored as the cap
    capped = f"{SQNR_CAP_DB:.1f}"
    # the text table
    console = Console(file=io.StringIO(), width=200)
    console.print(layer_table(report))
    text = console.file.getvalue()
    gelu_line = next(line for line in text.splitlines() if "intermediate_act_fn" in line)
    assert "exact" in gelu_line and capped not in text
    # the HTML tables: layers and sensitivity
    gelu_rows = re.findall(r"<tr><td[^>]*>[^<]*</td><td>intermediate_act_fn</td>.*?</tr>", page)
    assert gelu_rows and all("<td class=num>exact</td>" in row for row in gelu_rows)
    assert any(row.name == "intermediate_act_fn" and row.local_sqnr_db == SQNR_CAP_DB for row in ranking)
    assert f">{capped}<" not in page
    # the chart: capped values are not dB points (shadow points are the measured shadow values only)
    svg = _svg(page, "per-layer SQNR")
    shadow = [row.sqnr_shadow for row in report.compare_rows() if row.sqnr_shadow is not None]
    assert len(_points(svg, report_html.SHADOW_COLOR)) == sum(abs(value) < SQNR_CAP_DB for value in shadow)


def test_many_layer_names_do_not_overlap_and_every_layer_has_a_tooltip(tower):
    rows = tower.compare_rows()
    svg = report_html.sqnr_chart_svg(rows, 20.0)
    assert re.search(r'<svg[^>]*width="100%"', svg)  # the chart takes the page width
    width, height = _size(svg)
    labels = _axis_labels(svg)
    assert len(labels) >= len(rows) / 3  # a readable subset, not a handful
    for angle, x, y, text in labels:
        extent, slope = len(text) * EM * 10, math.radians(abs(angle))
        assert y + extent * math.sin(slope) <= height and x - extent * math.cos(slope) >= 0, text
    xs = sorted(x for _, x, _, _ in labels)
    slope = math.radians(abs(labels[0][0]))
    # parallel 10 px labels: the distance between neighbours, across the text, is at least a line
    assert min(b - a for a, b in zip(xs, xs[1:])) * math.sin(slope) >= 11
    titles = " ".join(re.findall(r"<title>([^<]*)</title>", svg))
    assert all(row.name in titles for row in rows)  # hovering any layer names it


def test_long_names_fit_their_label_area(cancellation):
    report, ranking, page = cancellation
    names = {row.name for row in report.compare_rows()} | {row.name for row in ranking}
    shortened = 0
    for label in ("per-layer SQNR", "sensitivity ranking"):
        svg = _svg(page, label)
        titles = " ".join(re.findall(r"<title>([^<]*)</title>", svg))
        texts = re.findall(
            r'<text x="([\d.]+)" y="[\d.]+" font-size="(\d+)" text-anchor="end"[^>]*>([^<]*)</text>', svg
        )
        shown = [(float(x), int(size), text) for x, size, text in texts if not re.fullmatch(r"-?\d+|exact", text)]
        assert shown
        for x, size, text in shown:
            if label == "sensitivity ranking":  # right-aligned at x: the text starts inside the chart
                assert x - len(text) * EM * size >= 0, text
            # a name cut in the middle keeps its start and end; the full name is one hover away
            head, cut, tail = text.partition("\u2026")
            full = [name for name in names if name == text or (cut and name.startswith(head) and name.endswith(tail))]
            assert len(full) == 1 and full[0] in titles, text
            shortened += bool(cut)
    assert shortened  # LONG_HEAD is too long to show whole


def test_header_counts_are_pluralized(cancellation):
    report, _, page = cancellation
    header = re.search(r'<div class="meta">counterpart:.*?</div>', page).group(0)
    counts = {"error": 0, "warning": 0}
    for finding in report.findings:
        counts[finding.severity.value] = counts.get(finding.severity.value, 0) + 1
    counts["layer"] = len(report.compare_rows())
    assert 1 in counts.values()  # the singular is what this checks
    for noun, count in counts.items():
        assert re.search(rf"\b{count} {noun}{'' if count == 1 else 's'}\b", header), (noun, header)
