"""QL103's float islands sit between ops the backend really runs in int8, contain only ops a
qconfig can bring to int8, and suggest only fixes a QConfigMapping can express."""

import operator

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.ao.quantization import default_dynamic_qconfig, get_default_qconfig_mapping

import qlint
from qlint.linter.fixes import SetQConfig


def _seeded(cls):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return cls().eval()


def _islands(model, inputs, mapping, trial=False, calibration=None):
    report = qlint.lint(
        model,
        inputs,
        backend="x86",
        qconfig_mapping=mapping,
        calibration=calibration,
        select=["QL103"],
        trial_options={"enabled": trial},
    )
    return [f for f in report.by_rule("QL103") if f.data["kind"] == "float-island"]


class _Magnitude(nn.Module):
    """silero's front end: an STFT conv, |X| = sqrt(re² + im²), a conv."""

    def __init__(self):
        super().__init__()
        self.stft = nn.Conv1d(1, 16, 8, stride=4, bias=False)
        self.conv = nn.Conv1d(8, 8, 3, padding=1)

    def forward(self, x):
        spec = self.stft(x)
        magnitude = torch.sqrt(spec[:, :8] ** 2 + spec[:, 8:] ** 2)
        return self.conv(magnitude)


def _audio():
    return (torch.randn(2, 1, 64, generator=torch.Generator().manual_seed(0)),)


def test_an_add_between_ops_without_int8_kernels_is_no_island():
    # pow and sqrt carry the global qconfig but x86 has no int8 kernel for them: they run in float
    # whatever their qconfig, so the float add between them costs no dequantize/quantize.
    mapping = get_default_qconfig_mapping("x86").set_object_type(operator.add, None)
    assert _islands(_seeded(_Magnitude), _audio(), mapping) == []


class _Recurrent(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(8, 16, 1)
        self.cell = nn.LSTMCell(16, 16)
        self.head = nn.Conv1d(16, 1, 1)

    def forward(self, x, h, c):
        h, c = self.cell(F.relu(self.conv(x)).squeeze(-1), (h, c))
        return self.head(F.relu(h).unsqueeze(-1)), torch.stack([h, c])


def test_a_dynamic_recurrent_layer_is_no_island():
    # torch has no static int8 kernel for an LSTMCell: dynamic is the most a qconfig gives it.
    mapping = get_default_qconfig_mapping("x86").set_module_name("cell", default_dynamic_qconfig)
    g = torch.Generator().manual_seed(0)
    inputs = (torch.randn(2, 8, 1, generator=g), torch.randn(2, 16, generator=g), torch.randn(2, 16, generator=g))
    assert _islands(_seeded(_Recurrent), inputs, mapping) == []


class _Sum(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 8, 1)
        self.b = nn.Conv2d(3, 8, 1)
        self.out = nn.Conv2d(8, 4, 1)

    def forward(self, x):
        return self.out(self.a(x) + self.b(x))


def test_a_functional_island_gets_no_module_name_fix():
    # The add is a real island (int8 convs on both sides), but set_module_name('add') names no
    # module: torch ignores it, and a trial of it measures the model as it was.
    mapping = get_default_qconfig_mapping("x86").set_object_type(operator.add, None)
    image = (torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0)),)
    [island] = _islands(_seeded(_Sum), image, mapping, trial=True, calibration=[image] * 4)
    assert island.target == "add" and island.data["producers"] == ["a", "b"]
    assert not isinstance(island.suggestion, SetQConfig)
    assert "mapping.set_object_type(function, qconfig)" in island.message
    # no trial can express it: estimated from the add's error, never a fix trial of nothing
    assert island.impact is not None and island.impact.basis == "local-error"


class _DynamicLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 16)
        self.fc2 = nn.Linear(16, 16)
        self.fc3 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc3(self.fc2(self.fc1(x)))


def test_a_dynamic_linear_between_static_ones_is_still_an_island_with_its_fix():
    mapping = get_default_qconfig_mapping("x86").set_module_name("fc2", default_dynamic_qconfig)
    [island] = _islands(_seeded(_DynamicLinear), (torch.randn(4, 16),), mapping)
    assert isinstance(island.suggestion, SetQConfig) and island.suggestion.targets == ["fc2"]
