"""What each number of `qlint compare`'s reports says it measures (QA pass, "Minor"):

* the cosine and error columns name the comparison they come from (propagated, or shadow under
  ``--modes shadow``), in the text table, the JSON and the HTML; a mode that was not run gets no
  column and no legend entry;
* the sensitivity bars are labelled with the measured output SQNR the text and JSON give, not a
  negative noise level;
* ``--badcases`` is in the HTML too, from the summary the text prints and the JSON holds;
* bad cases are scored on every floating-point output, and a case names the output that scored it.
"""

import argparse
import io
import math
import re
import warnings

import pytest
import torch
from rich.console import Console
from torch import nn

from qlint.cli.compare import add_compare_arguments, layer_table, run_compare
from qlint.numeric import html as report_html
from qlint.numeric.badcases import BadCaseSet, find_badcases
from qlint.numeric.compare import CompareReport, compare
from qlint.numeric.display import badcase_cells, describe_sqnr
from qlint.numeric.examples import (
    SmallConvNet,
    bad_layer_qconfig_mapping,
    image_batches,
    quantize_fx_ptq,
    randomize_batch_norm,
)
from qlint.numeric.sensitivity import sensitivity_rows

warnings.filterwarnings("ignore")
pytestmark = pytest.mark.usefixtures("one_intra_op_thread")
BAD_LAYER = "res1.conv1"


# Factories for the command, loaded as "<this module>:<name>".
def float_factory():
    torch.manual_seed(0)
    return randomize_batch_norm(SmallConvNet()).eval()


def data_factory():
    return image_batches(2, batch_size=3, size=8, seed=4)


def quantized_factory():
    return quantize_fx_ptq(float_factory(), data_factory(), bad_layer_qconfig_mapping(BAD_LAYER))[1]


@pytest.fixture(scope="module")
def models():
    return float_factory(), data_factory(), quantized_factory()


def _text_table(report) -> str:
    console = Console(file=io.StringIO(), width=200)
    console.print(layer_table(report))
    return console.file.getvalue()


def _html_headers(page: str, start: int = 0) -> list[str]:
    table = page[page.index("<table>", start) :]
    return re.findall(r"<th[^>]*>([^<]+)</th>", table[: table.index("</tr>")])


def _run(*argv):
    stdout = io.StringIO()
    code = run_compare(add_compare_arguments(argparse.ArgumentParser()).parse_args(list(argv)), stdout=stdout)
    return code, stdout.getvalue()


@pytest.mark.parametrize("modes", [("shadow",), ("propagated",), ("propagated", "shadow")])
def test_cosine_and_error_columns_name_the_comparison_they_measure(models, modes):
    """--modes shadow switched cosine, max |err| and RMSE/scale to shadow values under the same
    headers (digit_cnn conv_layers.0 cosine 0.99982 vs 0.99970), and the legend still listed
    propagated."""
    model, data, quantized = models
    report = compare(model, quantized, data, modes=modes)
    measured = "propagated" if "propagated" in modes else "shadow"
    rows = report.compare_rows()
    assert rows and {row.error_mode for row in rows} == {measured}
    for row in rows:  # the row's cosine is the cosine of the comparison it names
        assert row.cosine == pytest.approx(row.extra[measured]["cosine"], abs=1e-12)
    # JSON: the field says it
    assert CompareReport.model_validate_json(report.model_dump_json()).compare_rows()[0].error_mode == measured
    # text: the headers name it, and a mode that was not run has no column
    text = _text_table(report)
    assert text.count(f"({measured})") == 2  # cosine, RMSE/scale
    for mode in ("propagated", "shadow"):
        assert (f"{mode} dB" in text) == (mode in modes)
    # HTML: the layer table's headers and the chart's legend
    page = report_html.render_html(report)
    headers = _html_headers(page, page.index("<h2>Layers</h2>"))
    assert [h for h in headers if h.startswith(("cosine", "max |err|", "RMSE/scale"))] == [
        f"cosine ({measured})",
        f"max |err| ({measured})",
        f"RMSE/scale ({measured})",
    ]
    assert ("propagated" in headers) == ("propagated" in modes) and ("shadow" in headers) == ("shadow" in modes)
    legend = re.findall(r'<i class="swatch" style="background:(#[0-9a-f]+)"></i>', page)
    assert (report_html.PROPAGATED_COLOR in legend) == ("propagated" in modes)
    assert (report_html.SHADOW_COLOR in legend) == ("shadow" in modes)


def test_sensitivity_bars_are_labelled_with_the_estimated_output_sqnr(models, tmp_path):
    """The bars read "-36.7 dB" (noise over signal) beside a positive "isolated SQNR" column,
    while the JSON said output_sqnr_db 36.7 and the text printed the raw ratio."""
    model, data, quantized = models
    ranking = sensitivity_rows(model, data, quantized_model=quantized)
    report = compare(model, quantized, data)
    page = report_html.render_html(report, sensitivity=ranking)
    chart = page[page.index('<div id="sensitivity">') :]
    chart = chart[: chart.index("</svg>")]
    labels = re.findall(r'font-size="10">([^<]+)</text>', chart)
    shown = [row for row in ranking if row.score > 0][:20]
    assert labels == [f"SQNR {describe_sqnr(row.output_sqnr_db)}" for row in shown]
    assert all(row.output_sqnr_db > 0 for row in shown) and not re.search(r">-[\d.]+ dB<", chart)
    # the table has the same number, named
    headers = _html_headers(page, page.index("Sensitivity ranking"))
    assert "output SQNR, only it int8" in headers
    # the text line gives each layer the same value
    code, text = _run(
        f"{__name__}:float_factory",
        f"{__name__}:quantized_factory",
        "--calibration",
        f"{__name__}:data_factory",
        "--sensitivity",
    )
    line = " ".join(text[text.index("sensitivity (most sensitive first") :].split())
    assert "output SQNR measured with only that layer quantized" in line
    for row in ranking[:3]:
        assert f"{row.name} {describe_sqnr(row.output_sqnr_db)}" in line


def test_badcases_are_in_the_html_from_the_summary_the_text_and_json_show(tmp_path):
    """--html carried only the one-line 'saved the 3 worst inputs' note: the worst inputs and the
    comparison on them were printed in the terminal alone."""
    specs = [f"{__name__}:{name}" for name in ("float_factory", "quantized_factory", "data_factory")]
    html_path = tmp_path / "report.html"
    common = [specs[0], specs[1], "--calibration", specs[2], "--badcases", "2"]
    common += ["--badcases-path", str(tmp_path / "bc.pt")]
    _, json_text = _run(*common, "--format", "json", "--html", str(html_path))
    summary = CompareReport.model_validate_json(json_text).badcases
    assert summary is not None and summary.samples_seen == 6 and summary.report.compare_rows()
    assert [metric.metric for metric in summary.worst] == ["sqnr", "cosine", "l1", "max_abs"]
    assert all(len(metric.cases) == 2 for metric in summary.worst)
    page = html_path.read_text(encoding="utf-8")
    section = page[page.index('id="badcases"') :]
    table = section[section.index('<table id="badcase-table">') :]
    table = table[: table.index("</table>")]
    cells = re.findall(r"<tr><td>([^<]*)</td><td>([^<]*)</td></tr>", table)
    assert cells == [(metric.description, badcase_cells(metric, summary)) for metric in summary.worst]
    # the comparison on the worst inputs follows, row for row
    layers = section[section.index("On the worst inputs only") :]
    names = re.findall(r"<tr><td class=num>\d+</td><td>([^<]+)</td>", layers)
    assert names == [row.name for row in summary.report.compare_rows()]
    # the text prints the same cells
    _, text = _run(*common)
    flat = " ".join(text.split())
    for metric in summary.worst:
        assert metric.description in flat and " ".join(badcase_cells(metric, summary).split()) in flat


class SplitHeads(nn.Module):
    """Two outputs from two halves of the input, as silero_vad's (probability, state): an input
    whose second half is out of range breaks the second output and leaves the first as it is."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(4, 3)
        self.second = nn.Linear(4, 5)

    def forward(self, x):
        return self.first(x[:, :4]), self.second(x[:, 4:])


def _per_sample_sqnr(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double().reshape(-1), y.double().reshape(-1)
    return 10 * math.log10(float((x * x).sum()) / float(((x - y) ** 2).sum()))


def test_badcases_score_every_output_and_name_the_worst(tmp_path):
    """find_badcases scored the first output alone: on silero_vad the state, and on this model
    the sample that breaks the second output, were never among the worst inputs."""
    torch.manual_seed(0)
    model = SplitHeads().eval()
    generator = torch.Generator().manual_seed(3)
    calibration = [torch.randn(6, 8, generator=generator) for _ in range(4)]
    _, quantized = quantize_fx_ptq(model, calibration)
    data = [torch.randn(6, 8, generator=generator) for _ in range(3)]
    broken = 8  # batch 1, row 2: its second half far past the calibrated range
    data[1][2, 4:] *= 12.0
    found = find_badcases(model, quantized, data, top=2)
    assert found.outputs == ["output[0]", "output[1]"]
    for metric in ("sqnr", "l1", "max_abs"):
        worst = found.worst(metric)[0]
        assert (worst.index, worst.output) == (broken, "output[1]"), metric
    # the value is that output's own per-sample SQNR, measured here by hand
    case = found.worst("sqnr")[0]
    with torch.no_grad():
        expected = _per_sample_sqnr(model(case.sample)[1], quantized(case.sample)[1])
    assert case.value == pytest.approx(expected, abs=1e-6)
    # the output that scored a case survives the file
    loaded = BadCaseSet.load(found.save(tmp_path / "bc.pt"))
    assert loaded.outputs == found.outputs
    assert [(c.index, c.output) for c in loaded.worst("sqnr")] == [(c.index, c.output) for c in found.worst("sqnr")]
