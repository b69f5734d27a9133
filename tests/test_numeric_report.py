"""The HTML report, the per-op profile table and the `qlint compare` command."""

import argparse
import csv
import io
import json
import re
import warnings

import pytest
import torch
from rich.console import Console

from qlint.cli.compare import EXIT_FINDINGS, EXIT_USAGE, add_compare_arguments, load_data_arg, run_compare
from qlint.numeric import html as report_html
from qlint.numeric.compare import CompareReport, compare
from qlint.numeric.display import format_sqnr
from qlint.numeric.examples import (
    SmallConvNet,
    bad_layer_qconfig_mapping,
    image_batches,
    quantize_fx_ptq,
    randomize_batch_norm,
)
from qlint.numeric.histograms import activation_histograms, worst_layers
from qlint.numeric.profile import profile_model, profile_table, write_profile_csv
from qlint.numeric.sensitivity import sensitivity_rows

warnings.filterwarnings("ignore")
BAD_LAYER = "res1.conv1"


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


# Factories for the command, loaded as "<this module>:<name>".
def float_factory():
    torch.manual_seed(0)
    return randomize_batch_norm(SmallConvNet()).eval()


def quantized_factory():
    return quantize_fx_ptq(float_factory(), data_factory(), bad_layer_qconfig_mapping(BAD_LAYER))[1]


def data_factory():
    return image_batches(2, batch_size=3, size=8, seed=4)


@pytest.fixture(scope="module")
def compared():
    model, data, quantized = float_factory(), data_factory(), quantized_factory()
    report = compare(model, quantized, data)
    return model, data, quantized, report


def test_html_is_one_self_contained_file_with_every_section(compared, tmp_path):
    model, data, quantized, report = compared
    worst = worst_layers(report, 3)
    assert worst[0] == BAD_LAYER
    histograms = activation_histograms(model, quantized, data, report, worst)
    assert set(histograms) == set(worst)
    for histogram in histograms.values():  # every compared value landed in a bin
        assert sum(histogram.float_counts) == sum(histogram.quantized_counts) > 0
    ranking = sensitivity_rows(model, data, quantized_model=quantized)
    path = report_html.write_html(report, tmp_path / "report.html", sensitivity=ranking, histograms=histograms)
    page = path.read_text(encoding="utf-8")
    assert not re.search(r"<script|<link|<img|@import|url\(", page, re.IGNORECASE)
    assert set(re.findall(r"https?://[^\s\"'<>]+", page)) == {"http://www.w3.org/2000/svg"}
    svgs = re.findall(r"<svg.*?</svg>", page, re.DOTALL)
    assert len(svgs) == 1 + len(histograms) + 1  # SQNR chart, histograms, sensitivity bars
    sqnr_chart = svgs[0]
    points = re.findall(r'<circle cx="[\d.]+" cy="([\d.]+)" r="4" fill="(#[0-9a-f]+)"', sqnr_chart)
    propagated = [float(y) for y, color in points if color == report_html.PROPAGATED_COLOR]
    shadow = [float(y) for y, color in points if color == report_html.SHADOW_COLOR]
    assert len(propagated) == sum(row.sqnr_propagated is not None for row in report.layers)
    assert len(shadow) == sum(row.sqnr_shadow is not None for row in report.layers)
    # the broken layer's shadow point is the lowest (largest y) of the shadow series
    shadow_rows = [row.name for row in report.layers if row.sqnr_shadow is not None]
    assert shadow_rows[shadow.index(max(shadow))] == BAD_LAYER
    assert ranking[0].name == BAD_LAYER and page.index(BAD_LAYER) < page.index("Findings")
    # the labels say what each number is: the shadow series is the layer's own error, and the
    # ranking's "isolated SQNR" column holds each layer's SQNR quantized alone
    legend = dict(re.findall(r'<i class="swatch" style="background:(#[0-9a-f]+)"></i>([^<]+)</span>', page))
    assert legend[report_html.SHADOW_COLOR] == "shadow (the layer&#x27;s own error)"
    ranking_table = page[page.index("Sensitivity ranking") :]
    headers = re.findall(r"<th[^>]*>([^<]+)</th>", ranking_table[: ranking_table.index("</tr>")])
    column = headers.index("isolated SQNR")
    cells = [re.findall(r"<td[^>]*>([^<]*)</td>", tr) for tr in re.findall(r"<tr><td.*?</tr>", ranking_table)]
    assert [cell[1] for cell in cells[: len(ranking)]] == [row.name for row in ranking]
    assert [cell[column] for cell in cells[: len(ranking)]] == [format_sqnr(row.local_sqnr_db) for row in ranking]
    for finding in report.findings:
        assert finding.rule in page


def test_profile_rows_table_and_csv(compared, tmp_path):
    model, data, quantized, _ = compared
    rows = profile_model(quantized, data)
    by_key = {(row.layer, row.role): row for row in rows}
    stem_output = by_key[("stem.conv", "output")]
    assert stem_output.dtype == "quint8"
    assert stem_output.scale == pytest.approx(quantized.stem.conv.scale)
    assert stem_output.count == sum(batch.shape[0] for batch in data) * 16 * 8 * 8
    assert by_key[("stem.conv", "weight")].dtype == "qint8"
    # float statistics against a direct computation
    float_rows = {(row.layer, row.role): row for row in profile_model(model, data[:1])}
    with torch.no_grad():
        direct = model.stem.conv(data[0])
    row = float_rows[("stem.conv", "output")]
    assert row.min == pytest.approx(float(direct.min()), rel=1e-5)
    assert row.max == pytest.approx(float(direct.max()), rel=1e-5)
    assert row.mean == pytest.approx(float(direct.double().mean()), rel=1e-4, abs=1e-6)
    assert row.var == pytest.approx(float(direct.double().var(unbiased=False)), rel=1e-4)
    assert row.shape == list(direct.shape)
    path = write_profile_csv(rows, tmp_path / "profile.csv")
    with path.open() as handle:
        records = list(csv.DictReader(handle))
    assert len(records) == len(rows) and records[0]["layer"] == rows[0].layer
    console = Console(file=io.StringIO(), width=200)
    console.print(profile_table(rows))
    assert "stem.conv" in console.file.getvalue()


def _parse(argv):
    return add_compare_arguments(argparse.ArgumentParser()).parse_args(argv)


def test_command_json_html_and_badcases(tmp_path):
    factories = [f"{__name__}:{name}" for name in ("float_factory", "quantized_factory", "data_factory")]
    stdout = io.StringIO()
    html_path, badcases_path = tmp_path / "report.html", tmp_path / "badcases.pt"
    code = run_compare(
        _parse(
            [
                factories[0],
                factories[1],
                "--calibration",
                factories[2],
                "--format",
                "json",
                "--html",
                str(html_path),
                "--badcases",
                "2",
                "--badcases-path",
                str(badcases_path),
            ]
        ),
        stdout=stdout,
    )
    assert code == EXIT_FINDINGS
    report = CompareReport.model_validate_json(stdout.getvalue())
    assert [finding.target for finding in report.by_rule("QL301")] == [BAD_LAYER]
    assert html_path.read_text().startswith("<!DOCTYPE html>")
    saved = torch.load(badcases_path, weights_only=True)
    assert set(saved["cases"]) == {"sqnr", "cosine", "l1", "max_abs"} and len(saved["cases"]["l1"]) == 2
    badcase_report = json.loads(badcases_path.with_suffix(".report.json").read_text())
    assert badcase_report["model"] == "badcases" and badcase_report["layers"]


def test_command_text_output_and_usage_errors(tmp_path):
    data_path = tmp_path / "data.pt"
    torch.save(data_factory(), data_path)
    stdout = io.StringIO()
    float_spec, quantized_spec = f"{__name__}:float_factory", f"{__name__}:quantized_factory"
    code = run_compare(
        _parse([float_spec, quantized_spec, "--calibration", str(data_path), "--modes", "propagated"]), stdout=stdout
    )
    text = stdout.getvalue()
    assert code == EXIT_FINDINGS and "QL301" in text and BAD_LAYER in text and "propagated dB" in text
    assert (
        run_compare(
            _parse(["no_such_module:factory", quantized_spec, "--calibration", str(data_path)]), stdout=io.StringIO()
        )
        == EXIT_USAGE
    )
    assert (
        run_compare(
            _parse([float_spec, quantized_spec, "--calibration", str(data_path), "--modes", "bogus"]),
            stdout=io.StringIO(),
        )
        == EXIT_USAGE
    )
    with pytest.raises(Exception, match="not-a-spec"):
        load_data_arg("not-a-spec")
