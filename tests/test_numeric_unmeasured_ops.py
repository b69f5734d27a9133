"""QL302 with ops no row measures between a layer and its inputs' layers.

QA (silero_vad): QL302 said conv1 "amplifies noise it receives" (28.3 dB at its input layer
``add``, 10.6 dB at conv1) and offered keeping conv1 float, which changes nothing (3.97 ->
3.94 dB held-out). The drop is made by ``sqrt`` between them, which the quantized model runs
in float on add's int8 output and which no row measures (add 28.3, sqrt 13.7, conv1 10.6 dB
at the FX nodes); keeping add float gains 2.5 dB."""

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.ao.quantization import get_default_qconfig_mapping
from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

from qlint.numeric.compare import compare

warnings.filterwarnings("ignore")
pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


class MagnitudeThenConv(nn.Module):
    """Squared magnitude (an int8 add), its square root (float in the quantized model), a conv."""

    def __init__(self) -> None:
        super().__init__()
        self.real = nn.Conv1d(1, 16, 9, padding=4)
        self.imag = nn.Conv1d(1, 16, 9, padding=4)
        self.conv1 = nn.Conv1d(16, 8, 3, padding=1)

    def forward(self, x):
        real, imag = self.real(x), self.imag(x)
        return self.conv1(torch.sqrt(real * real + imag * imag))


def test_a_drop_across_an_op_no_row_measures_names_it_and_offers_no_keep_float():
    torch.manual_seed(0)
    model = MagnitudeThenConv().eval()
    generator = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(4):
        # one large value per row: the add's int8 step is coarse for the many small magnitudes,
        # whose square roots then carry a large relative error
        batch = torch.randn(8, 1, 64, generator=generator) * 0.1
        batch[:, :, 5] = 10.0
        batches.append(batch)
    prepared = prepare_fx(copy.deepcopy(model), get_default_qconfig_mapping("x86"), (batches[0],))
    with torch.no_grad():
        for batch in batches:
            prepared(batch)
    report = compare(model, convert_fx(prepared), batches)
    rows = {row.name: row for row in report.compare_rows()}
    assert "sqrt" not in rows and rows["conv1"].extra["between"] == ["sqrt"]
    assert rows["conv1"].extra["predecessors"] == ["add"]
    [onset] = [finding for finding in report.findings if finding.rule == "QL302"]
    assert onset.target == "conv1" and onset.data["kind"] == "amplified"
    assert "by sqrt (no row measures it) or by this layer" in onset.message
    assert "keep conv1 in float" not in onset.message and onset.suggestion is None
