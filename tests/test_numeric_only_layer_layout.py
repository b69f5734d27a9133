"""The sensitivity pass hands the float model each quantized layer's output laid out as the float
layer's own, and a layer whose substitution still makes the float model raise is reported for
that layer, not the whole compare lost.

QA 31 (digit_cnn): x86's quantized conv returns channels_last; the float model's ``.view`` after
its convs raised on it, and ``qlint compare --sensitivity`` exited 2 blaming "the float model",
which runs on the data by itself (the quantized model had the plan's ``.reshape``)."""

import argparse
import copy
import io
import warnings

import pytest
import torch
from torch import nn
from torch.ao.quantization import get_default_qconfig_mapping
from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

from qlint.cli.compare import add_compare_arguments, run_compare
from qlint.numeric.sensitivity import sensitivity_rows

warnings.filterwarnings("ignore")
pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


class ConvView(nn.Module):
    """A conv flattened with ``.view``, as digit_cnn flattens its last conv."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.fc = nn.Linear(8 * 6 * 6, 4)

    def forward(self, x):
        y = self.conv(x)
        return self.fc(y.view(y.size(0), -1))


class ConvReshape(ConvView):
    """The same model with ``.reshape``: what qlint's view_to_reshape rewrite quantizes."""

    def forward(self, x):
        y = self.conv(x)
        return self.fc(y.reshape(y.size(0), -1))


class Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(self.fc1(x))


class Checked(Plain):
    """Refuses an exact zero after fc1: its float output has none, its int8 output does (the
    values within half a step of 0 round to it), so only fc1's substitution makes it raise."""

    def forward(self, x):
        hidden = self.fc1(x)
        if bool((hidden == 0).any()):
            raise ValueError("fc1 output has an exact zero")
        return self.fc2(hidden)


def _quantize(model: nn.Module, batches: list) -> torch.fx.GraphModule:
    prepared = prepare_fx(copy.deepcopy(model), get_default_qconfig_mapping("x86"), (batches[0],))
    with torch.no_grad():
        for batch in batches:
            prepared(batch)
    return convert_fx(prepared)


def _twins(float_class: type, quant_class: type) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    model = float_class().eval()
    twin = quant_class().eval()
    twin.load_state_dict(model.state_dict())
    return model, twin


def conv_batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(4, 3, 6, 6, generator=generator) for _ in range(3)]


def linear_batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(16, 8, generator=generator) for _ in range(3)]


# Factories for the command, loaded as "<this module>:<name>".
def checked_model() -> nn.Module:
    return _twins(Checked, Plain)[0]


def checked_quantized() -> nn.Module:
    return _quantize(_twins(Checked, Plain)[1], linear_batches())


def test_a_channels_last_quantized_conv_is_handed_over_in_the_float_layout():
    model, twin = _twins(ConvView, ConvReshape)
    data = conv_batches()
    quantized = _quantize(twin, data)
    with torch.no_grad():  # the premise: x86's quantized conv emits channels_last
        conv_output = quantized.conv(torch.quantize_per_tensor(data[0], 0.05, 64, torch.quint8))
    assert not conv_output.is_contiguous() and conv_output.is_contiguous(memory_format=torch.channels_last)
    rows = {row.name: row for row in sensitivity_rows(model, data, quantized_model=quantized)}
    # the reshape twin takes any layout: the view model must get the same numbers, values unchanged
    truth = {row.name: row for row in sensitivity_rows(twin, data, quantized_model=quantized)}
    assert set(rows) == set(truth) == {"conv", "fc"}
    for name, row in rows.items():
        assert row.not_measured is None, row.not_measured
        assert row.output_sqnr_db is not None and truth[name].output_sqnr_db is not None
        assert row.output_sqnr_db == pytest.approx(truth[name].output_sqnr_db, abs=1e-6), name
        assert row.score == pytest.approx(truth[name].score, rel=1e-6), name
        assert row.score > 0, name


def test_a_layer_whose_substitution_raises_is_reported_and_the_others_ranked():
    model, twin = _twins(Checked, Plain)
    data = linear_batches()
    quantized = _quantize(twin, data)
    with torch.no_grad():  # the premise: the float model runs on the data by itself
        for batch in data:
            model(batch)
    rows = sensitivity_rows(model, data, quantized_model=quantized)
    by_name = {row.name: row for row in rows}
    failed = by_name["fc1"]
    assert failed.not_measured is not None and failed.output_sqnr_db is None and failed.score == 0.0
    assert "ValueError" in failed.not_measured and "fc1 output has an exact zero" in failed.not_measured
    assert "fc1's quantized output in place of its own" in failed.not_measured  # not "the float model raised"
    assert rows[-1].name == "fc1"  # ranked last: not measured is not "adds no error"
    truth = {row.name: row for row in sensitivity_rows(twin, data, quantized_model=quantized)}
    assert by_name["fc2"].not_measured is None
    assert by_name["fc2"].output_sqnr_db == pytest.approx(truth["fc2"].output_sqnr_db, abs=1e-6)


def _run(*argv: str) -> tuple[int, str]:
    stdout = io.StringIO()
    code = run_compare(add_compare_arguments(argparse.ArgumentParser()).parse_args(list(argv)), stdout=stdout)
    return code, stdout.getvalue()


def test_compare_keeps_its_report_when_one_layer_cannot_be_ranked():
    code, text = _run(
        f"{__name__}:checked_model",
        f"{__name__}:checked_quantized",
        "--calibration",
        f"{__name__}:linear_batches",
        "--sensitivity",
    )
    assert code != 2, text
    assert "fc1 not measured" in text  # the ranking line
    assert "sensitivity of fc1 not measured: the float model with fc1's quantized output" in text  # the notice
    assert "fc2 " in text.split("sensitivity (most sensitive first", 1)[1]


def test_compare_debug_shows_the_traceback(run_main):
    args = ("compare", "missing.pt", "missing2.pt", "--calibration", "missing.pt")
    plain = run_main(*args)
    assert plain.returncode == 2 and "Traceback" not in plain.stderr
    debug = run_main(*args, "--debug")
    assert debug.returncode == 2 and "Traceback" in debug.stderr, debug.stderr
