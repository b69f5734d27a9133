"""A conv whose int8 output grid ends where its only consumer (a ReLU6) clamps is read after
the clamp: values beyond it never reach the model, so they are not the conv's error.

QL101's fix gives such a conv the fixed range [0, 6]. compare read the conv raw and called the
ReLU6's own work "clipping" (efficientnet_lite0: 33 QL301 errors telling the user to undo
qlint's largest gain). A grid narrower than the clamp still clips for real and is still named.
"""

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.ao.quantization import QConfig, default_per_channel_weight_observer, get_default_qconfig_mapping
from torch.ao.quantization.observer import FixedQParamsObserver
from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

from qlint.core.sqnr import SqnrSums
from qlint.numeric.compare import compare
from qlint.numeric.sensitivity import sensitivity_rows

warnings.filterwarnings("ignore")
pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


class ConvReLU6(nn.Module):
    """stem -> conv -> ReLU6 -> head; the stem gives the conv an input grid of its own, so a
    fixed range set on the conv is its output's alone (as QL101's observe_input rewrite does)."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 3, 1)
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.act = nn.ReLU6()
        self.head = nn.Conv2d(8, 4, 1)

    def forward(self, x):
        return self.head(self.act(self.conv(self.stem(x))))


def _model_and_data() -> tuple[nn.Module, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = ConvReLU6().eval()
    with torch.no_grad():
        model.conv.weight.mul_(8.0)  # most conv outputs lie far outside [0, 6]
    generator = torch.Generator().manual_seed(1)
    return model, [torch.randn(4, 3, 12, 12, generator=generator) for _ in range(3)]


def _quantized(model: nn.Module, data: list[torch.Tensor], high: float, *, convert: bool = True) -> nn.Module:
    """x86 int8, with the conv's output on the fixed grid [0, high] (255 steps)."""
    fixed = FixedQParamsObserver.with_args(
        scale=high / 255, zero_point=0, dtype=torch.quint8, quant_min=0, quant_max=255
    )
    mapping = get_default_qconfig_mapping("x86").set_module_name(
        "conv", QConfig(activation=fixed, weight=default_per_channel_weight_observer)
    )
    prepared = prepare_fx(copy.deepcopy(model), mapping, (data[0],))
    with torch.no_grad():
        for batch in data:
            prepared(batch)
    return convert_fx(prepared) if convert else prepared


def _what_the_relu6_passes_on(model: nn.Module, quantized: nn.Module, data: list[torch.Tensor]) -> float:
    """By hand: the SQNR of the conv's output after the ReLU6, int8 model against float model."""
    kept: list[torch.Tensor] = []
    handle = quantized.conv.register_forward_hook(lambda module, args, output: kept.append(output.dequantize()))
    sums = SqnrSums()
    try:
        with torch.no_grad():
            for batch in data:
                kept.clear()
                quantized(batch)
                sums.add(model.act(model.conv(model.stem(batch))), kept[0])
    finally:
        handle.remove()
    db = sums.sqnr_db()
    assert db is not None
    return db


def test_a_fixed_range_ending_at_the_relu6_is_read_after_it_and_not_blamed():
    model, data = _model_and_data()
    quantized = _quantized(model, data, 6.0)
    report = compare(model, quantized, data)
    rows = {row.name: row for row in report.layers}
    truth = _what_the_relu6_passes_on(model, quantized, data)
    assert truth > 25.0  # the fixed range works: the int8 model passes on what the float one does
    assert abs(rows["conv"].sqnr_propagated - truth) < 0.01
    assert abs(rows["conv"].sqnr_propagated - rows["act"].sqnr_propagated) < 0.01
    assert rows["conv"].sqnr_shadow > 25.0
    assert rows["conv"].extra["propagated"]["float_min"] >= 0.0
    assert rows["conv"].extra["propagated"]["float_max"] <= 6.0
    assert not [f for f in report.findings if f.target == "conv"], [f.message for f in report.findings]
    assert any("after the clamp" in notice.message and "conv" in notice.message for notice in report.notices)
    # sensitivity's isolated SQNR is the same measurement of the same layer
    isolated = {row.name: row for row in sensitivity_rows(model, data, quantized_model=quantized)}
    assert isolated["conv"].local_sqnr_db is not None and isolated["conv"].local_sqnr_db > 25.0


def test_a_prepared_model_reads_the_conv_after_the_relu6_too():
    model, data = _model_and_data()
    report = compare(model, _quantized(model, data, 6.0, convert=False), data)
    rows = {row.name: row for row in report.layers}
    assert rows["conv"].sqnr_propagated > 25.0
    assert not [f for f in report.findings if f.target == "conv"], [f.message for f in report.findings]


def test_a_grid_narrower_than_the_clamp_still_clips_and_is_named():
    """[0, 1] before a ReLU6: the int8 conv cuts values between 1 and 6 that the float model
    passes on. That is real clipping, and QL301 still says so."""
    model, data = _model_and_data()
    quantized = _quantized(model, data, 1.0)
    report = compare(model, quantized, data)
    rows = {row.name: row for row in report.layers}
    assert abs(rows["conv"].sqnr_propagated - _what_the_relu6_passes_on(model, quantized, data)) < 0.01
    blamed = [f for f in report.findings if f.rule == "QL301" and f.target == "conv"]
    assert blamed and blamed[0].data["kind"] == "clipping", [f.message for f in report.findings]
