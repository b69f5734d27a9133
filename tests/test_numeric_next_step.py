"""`qlint compare` names the next step when the model output stays below its threshold.

compare runs QUANT as given and measures none of its fixes on the model output. On
EfficientNet-Lite0 (default x86, held-out) the output was at 0.2 dB, compare offered 8 onset
fixes and nothing told the user that `qlint MODEL --calibration DATA --emit-plan` then
`qlint verify` measure fixes (about 21 dB there). The tower below loses its output SQNR a
little at every layer: no layer is an onset, compare offers no fix, and the output ends
under 20 dB."""

import argparse
import io
import re
import warnings

import pytest
import torch
from torch import nn
from torch.ao.quantization import get_default_qconfig_mapping

from qlint.cli.compare import add_compare_arguments, run_compare
from qlint.numeric.compare import CompareReport, compare_report
from qlint.numeric.examples import bad_layer_qconfig_mapping, quantize_fx_ptq
from qlint.numeric.next_step import NextStep

warnings.filterwarnings("ignore")
pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


class Tower(nn.Module):
    """Residual Linear layers: each adds a little rounding error, none a jump."""

    def __init__(self, depth: int = 16, width: int = 16):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = x + 0.5 * layer(x)
        return x


# Factories for the command, loaded as "<this module>:<name>".
def float_model(seed: int = 0):
    torch.manual_seed(seed)
    return Tower().eval()


def batches():
    generator = torch.Generator().manual_seed(1)
    # channels from 1e-3 to 10: a per-tensor activation grid rounds the small ones away
    return [torch.randn(8, 16, generator=generator) * torch.logspace(-3, 1, 16) for _ in range(3)]


def quantized_model():
    return quantize_fx_ptq(float_model(), batches(), get_default_qconfig_mapping("x86"))[1]


def other_model_quantized():
    """Quantized from a tower with other weights: compare's finding is the mismatch."""
    return quantize_fx_ptq(float_model(seed=7), batches(), get_default_qconfig_mapping("x86"))[1]


SPECS = [f"{__name__}:float_model", f"{__name__}:quantized_model", "--calibration", f"{__name__}:batches"]


def _run(*argv):
    stdout = io.StringIO()
    code = run_compare(add_compare_arguments(argparse.ArgumentParser()).parse_args(list(argv)), stdout=stdout)
    return code, stdout.getvalue()


def _output_sqnr(text: str) -> float:
    return float(re.search(r"model output SQNR (-?[\d.]+) dB", text).group(1))


def test_a_model_below_the_threshold_gets_the_lint_and_verify_commands(tmp_path):
    html = tmp_path / "report.html"
    _, text = _run(*SPECS, "--html", str(html))
    output_db = _output_sqnr(text)
    assert output_db < 20.0  # the tower's output is below compare's threshold
    assert not any(line.startswith("QL30") for line in text.splitlines())  # no finding: compare offers no fix
    model, data = SPECS[0], SPECS[3]
    commands = [
        f"qlint {model} --calibration {data} --emit-plan plan.json",
        f"qlint verify {model} --plan plan.json --calibration {data} --eval-data HELD_OUT --emit-plan verified.json",
        f"qlint quantize {model} --plan verified.json --calibration {data} --output model_int8.pt",
    ]
    lines = text.splitlines()
    assert any(line.startswith("next step: ") and "below the 20 dB threshold" in line for line in lines)
    assert "compare offers no fix" in " ".join(text.split())
    for command in commands:  # each on a line of its own, unwrapped, to copy
        assert f"  {command}" in lines

    _, document = _run(*SPECS, "--format", "json")
    step = CompareReport.model_validate_json(document).next_step
    assert isinstance(step, NextStep)
    assert step.commands == commands
    assert step.fixes_offered == 0 and step.threshold_db == 20.0
    assert step.output_sqnr_db == pytest.approx(output_db, abs=0.051)

    page = html.read_text()
    assert '<h2 id="next-step">Next step</h2>' in page
    assert "\n".join(commands) in page


def test_no_next_step_when_the_output_meets_the_threshold(tmp_path):
    html = tmp_path / "report.html"
    _, text = _run(*SPECS, "--sqnr-threshold", "10", "--html", str(html))
    assert _output_sqnr(text) >= 10.0
    assert "next step" not in text and "qlint verify" not in text
    _, document = _run(*SPECS, "--sqnr-threshold", "10", "--format", "json")
    assert '"next_step"' not in document
    assert 'id="next-step"' not in html.read_text()


def test_no_next_step_when_quant_comes_from_another_float_model():
    """A low output there measures two float models, not quantization: the step would mislead."""
    report = compare_report(float_model(), other_model_quantized(), batches())
    assert any(finding.data.get("kind") == "other-weights" for finding in report.findings)
    assert _output_sqnr(" ".join(notice.message for notice in report.notices)) < 20.0
    assert report.next_step is None


def test_the_step_counts_the_unmeasured_fixes_compare_offers():
    """A layer with 2-bit weights: compare's QL301/QL302 offer fixes; none is measured."""
    model, data = float_model(), batches()
    quantized = quantize_fx_ptq(model, data, bad_layer_qconfig_mapping("layers.3"))[1]
    report = compare_report(model, quantized, data, model_name="pkg:float_model")
    offered = sum(1 for finding in report.findings if finding.suggestion is not None)
    assert offered > 0
    assert report.next_step is not None and report.next_step.fixes_offered == offered
    assert f"its {offered} fix" in report.next_step.reason and "not measured" in report.next_step.reason
    assert report.next_step.commands[0] == "qlint pkg:float_model --calibration DATA --emit-plan plan.json"


def test_the_commands_trust_the_model_file_when_compare_did():
    """QA: with --trust-pickle, compare loaded the file; its first command, without it, refused it."""
    _, trusted = _run(*SPECS, "--trust-pickle", "--format", "json")
    commands = CompareReport.model_validate_json(trusted).next_step.commands
    assert all(f"{SPECS[0]} --trust-pickle" in command for command in commands)
    _, plain = _run(*SPECS, "--format", "json")
    assert not any("--trust-pickle" in c for c in CompareReport.model_validate_json(plain).next_step.commands)
