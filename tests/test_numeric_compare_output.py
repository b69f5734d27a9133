"""`qlint compare`'s model-level numbers: the output SQNR over every output tensor, shown as
the tables show it ("exact", not the 200 dB cap), and the sensitivity ranking in its JSON."""

import argparse
import copy
import io
import json
import math
import re
import warnings

import pytest
import torch
from torch import nn

from qlint.cli.compare import add_compare_arguments, run_compare
from qlint.linter.findings import Report
from qlint.numeric.compare import CompareReport, compare
from qlint.numeric.display import EXACT_NOTE
from qlint.numeric.examples import bad_layer_qconfig_mapping, quantize_fx_ptq
from qlint.numeric.sensitivity import SensitivityRow, sensitivity_rows

warnings.filterwarnings("ignore")
pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


class TwoHeads(nn.Module):
    """Two outputs, as silero_vad's (probability, state)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.first = nn.Linear(16, 4)
        self.second = nn.Linear(16, 6)

    def forward(self, x):
        hidden = torch.relu(self.body(x))
        return self.first(hidden), self.second(hidden)


# Factories for the command, loaded as "<this module>:<name>".
def float_model():
    torch.manual_seed(0)
    return TwoHeads().eval()


def batches():
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(5, 8, generator=generator) for _ in range(3)]


def quantized_model():
    """The second head gets 2-bit weights: its output carries far more error than the first's."""
    return quantize_fx_ptq(float_model(), batches(), bad_layer_qconfig_mapping("second"))[1]


def float_copy():
    return copy.deepcopy(float_model())


def _run(*argv):
    stdout = io.StringIO()
    code = run_compare(add_compare_arguments(argparse.ArgumentParser()).parse_args(list(argv)), stdout=stdout)
    return code, stdout.getvalue()


def _info_line(report):
    return next(notice.message for notice in report.notices if "model output SQNR" in notice.message)


def _sqnr_db(pairs):
    """10 log10(signal / noise) summed over the given (float, quantized) tensors, by hand."""
    signal = sum(float(x.double().pow(2).sum()) for x, _ in pairs)
    noise = sum(float((x.double() - y.double()).pow(2).sum()) for x, y in pairs)
    return 10 * math.log10(signal / noise)


def test_model_output_sqnr_covers_every_output_tensor():
    """silero_vad returns (prob, state): compare said 19.1 dB (prob alone) where verify says 18.18 dB
    over both. The line now pools every floating-point output tensor, as verify does."""
    model, quantized, data = float_model(), quantized_model(), batches()
    pairs = []
    with torch.no_grad():
        for batch in data:
            pairs += list(zip(model(batch), quantized(batch)))
    every_output = _sqnr_db(pairs)
    first_output = _sqnr_db(pairs[::2])
    assert first_output - every_output > 3  # the two definitions differ here

    line = _info_line(compare(model, quantized, data))
    shown = float(re.search(r"model output SQNR (-?[\d.]+) dB", line).group(1))
    assert shown == pytest.approx(every_output, abs=0.051)
    assert "over all 2 floating-point tensors of the output" in line


def test_an_error_free_output_is_exact_not_the_cap():
    """An identical pair printed 'model output SQNR 200.0 dB' (the cap for no error) while the
    table said 'exact'; the exact note stopped mid-phrase ("... still carries its input's")."""
    spec = f"{__name__}:float_model"
    code, text = _run(spec, f"{__name__}:float_copy", "--calibration", f"{__name__}:batches")
    assert code == 0
    line = next(line for line in text.splitlines() if "model output SQNR" in line)
    assert "model output SQNR exact, cosine 1.0000" in line and "200" not in line
    assert EXACT_NOTE.endswith("still carries the error of its input")
    assert "still carries the error of its input" in " ".join(text.split())


def test_json_carries_the_sensitivity_ranking():
    """--sensitivity with --format json computed the ranking and dropped it (stdout held the
    report alone); it is now the report's typed "sensitivity" list, null when not asked for."""
    specs = [f"{__name__}:float_model", f"{__name__}:quantized_model", "--calibration", f"{__name__}:batches"]
    _, ranked = _run(*specs, "--sensitivity", "--format", "json")
    report = CompareReport.model_validate_json(ranked)
    expected = sensitivity_rows(float_model(), batches(), quantized_model=quantized_model())
    assert report.sensitivity is not None and all(isinstance(row, SensitivityRow) for row in report.sensitivity)
    assert [row.name for row in report.sensitivity] == [row.name for row in expected]
    assert report.sensitivity[0].name == "second"
    assert [row.score for row in report.sensitivity] == pytest.approx([row.score for row in expected], rel=1e-9)

    # a threshold under the output's SQNR: no next step either (that key is CompareReport's too)
    _, plain = _run(*specs, "--format", "json", "--sqnr-threshold", "5")
    assert CompareReport.model_validate_json(plain).sensitivity is None
    # without a ranking it is a plain Report, as before CompareReport (Report refuses unknown keys)
    assert "sensitivity" not in json.loads(plain) and "next_step" not in json.loads(plain)
    assert Report.model_validate_json(plain).model == CompareReport.model_validate_json(plain).model


def test_help_says_what_sensitivity_and_backend_do():
    """The help said --sensitivity re-quantizes FLOAT for --backend; it ranks QUANT as given,
    and --backend is a label of the report."""
    actions = {action.dest: action.help for action in add_compare_arguments(argparse.ArgumentParser())._actions}
    assert "re-quantizes FLOAT" not in actions["sensitivity"] and "nothing is re-quantized" in actions["sensitivity"]
    assert all(field in actions["sensitivity"] for field in SensitivityRow.model_fields)
    assert "a label" in actions["backend"]


class FirstHeadOnly(TwoHeads):
    def forward(self, x):
        return super().forward(x)[0]


def test_outputs_that_do_not_pair_up_are_named_not_scored_on_the_first_tensor():
    """A QUANT returning fewer output tensors than FLOAT was scored on the first tensor of each
    (an 'exact' output here); the outputs do not pair up, and compare now says so."""
    model = float_model()
    other = FirstHeadOnly().eval()
    other.load_state_dict(model.state_dict())
    report = compare(model, other, batches())
    assert "model output SQNR n/a" in _info_line(report)
    warning = next(notice.message for notice in report.notices if "do not pair up" in notice.message)
    assert "2 and 1 floating-point tensors" in warning
