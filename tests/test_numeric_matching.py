"""Layer matching across the four kinds of quantized counterpart, and compare() on each."""

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.ao.quantization import get_default_qat_qconfig_mapping, quantize_dynamic
from torch.ao.quantization.quantize_fx import convert_fx, prepare_qat_fx

from qlint.measure.match_result import CounterpartKind
from qlint.measure.matching import match_layers
from qlint.numeric.compare import compare
from qlint.numeric.examples import (
    EagerConvNet,
    LstmTagger,
    SmallConvNet,
    image_batches,
    prepare_eager_ptq,
    quantize_eager_ptq,
    quantize_fx_ptq,
    randomize_batch_norm,
    sequence_batches,
)

warnings.filterwarnings("ignore")


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

CONV_NET_LAYERS = {  # every conv/linear of SmallConvNet, by float fqn
    "stem.conv",
    "block1.conv",
    "res1.conv1",
    "res1.conv2",
    "block2.conv",
    "res2.conv1",
    "res2.conv2",
    "block3.conv",
    "pointwise",
    "fc1",
    "fc2",
    "head",
}


@pytest.fixture(scope="module")
def conv_net():
    torch.manual_seed(0)
    model = randomize_batch_norm(SmallConvNet()).eval()
    data = image_batches(2, batch_size=2, size=8, seed=2)
    prepared, converted = quantize_fx_ptq(model, data)
    return model, data, prepared, converted


def _module_layers(result):
    return {layer.name for layer in result.layers if layer.is_module}


def _assert_compare_is_sane(report, expected_layers, minimum_weight_db=30.0):
    rows = {row.name: row for row in report.layers}
    assert expected_layers <= set(rows)
    for name in expected_layers:
        row = rows[name]
        # 8-bit weights of a healthy layer keep well above 30 dB; the activations were compared.
        assert row.weight_sqnr is not None and row.weight_sqnr > minimum_weight_db, (name, row.weight_sqnr)
        assert row.sqnr_propagated is not None and row.sqnr_shadow is not None
        assert 0.9 < row.cosine <= 1.0


def test_fx_converted_matches_by_fqn_and_absorbs_fusions(conv_net):
    model, data, _, converted = conv_net
    result = match_layers(model, converted)
    assert result.counterpart is CounterpartKind.CONVERTED_FX
    assert _module_layers(result) == CONV_NET_LAYERS
    assert all(layer.matched_by == "fqn" for layer in result.layers if layer.is_module)
    layers = result.by_name()
    # conv-bn-relu became one quantized ConvReLU2d at stem.conv: bn and relu are compared as part of it
    assert layers["stem.conv"].quant_class == "ConvReLU2d"
    assert layers["stem.conv"].absorbed == ["stem.bn", "stem.relu"]
    assert layers["stem.conv"].folded_batch_norm == "stem.bn"
    # functional ops: the residual add became quantized add_relu, which absorbs the float relu after it
    adds = [layer for layer in result.layers if layer.kind == "add"]
    assert len(adds) == 2 and all(layer.quant_class == "add_relu" for layer in adds)
    assert all(len(layer.absorbed) == 1 for layer in adds)
    assert set(layers["add"].predecessors) == {"block1.conv", "res1.conv2"}
    report = compare(model, converted, data)
    _assert_compare_is_sane(report, CONV_NET_LAYERS)


def test_prepared_ptq_model_is_simulated_with_its_observers(conv_net):
    model, data, prepared, converted = conv_net
    result = match_layers(model, prepared)
    assert result.counterpart is CounterpartKind.PREPARED
    assert _module_layers(result) == CONV_NET_LAYERS
    assert all(result.by_name()[name].quant_output_quantizer for name in CONV_NET_LAYERS)
    prepared_report = compare(model, prepared, data)
    converted_report = compare(model, converted, data)
    _assert_compare_is_sane(prepared_report, CONV_NET_LAYERS)
    # Observers frozen into fake-quant reproduce what convert produces, layer by layer.
    converted_rows = {row.name: row for row in converted_report.layers}
    for row in prepared_report.layers:
        if row.name in CONV_NET_LAYERS:
            assert abs(row.weight_sqnr - converted_rows[row.name].weight_sqnr) < 0.5
            assert abs(row.sqnr_shadow - converted_rows[row.name].sqnr_shadow) < 2.0


def test_prepared_qat_model_matches_fused_qat_modules(conv_net):
    model, data, _, _ = conv_net
    qat = prepare_qat_fx(copy.deepcopy(model).train(), get_default_qat_qconfig_mapping("x86"), (data[0],))
    qat.eval()  # observers still record in eval; BN statistics stay as in the float model
    with torch.no_grad():
        for batch in data:
            qat(batch)
    result = match_layers(model, qat)
    assert result.counterpart is CounterpartKind.PREPARED
    assert _module_layers(result) == CONV_NET_LAYERS
    assert result.by_name()["stem.conv"].quant_class == "ConvBnReLU2d"
    _assert_compare_is_sane(compare(model, qat, data), CONV_NET_LAYERS)
    # and its convert_fx result is matched the same way
    converted = convert_fx(copy.deepcopy(qat))
    assert _module_layers(match_layers(model, converted)) == CONV_NET_LAYERS


def test_dynamic_lstm_and_linear():
    torch.manual_seed(0)
    model = LstmTagger().eval()
    dynamic = quantize_dynamic(copy.deepcopy(model), {nn.LSTM, nn.Linear}, dtype=torch.qint8)
    result = match_layers(model, dynamic)
    assert result.counterpart is CounterpartKind.DYNAMIC
    assert _module_layers(result) == {"lstm", "proj", "head"}
    assert result.by_name()["head"].predecessors == ["proj"]
    report = compare(model, dynamic, sequence_batches(2))
    _assert_compare_is_sane(report, {"lstm", "proj", "head"})
    # the LSTM's row pools all four gate matrices of the layer, not only one
    assert report.layers[0].extra["weight"]["elements"] == sum(
        parameter.numel() for name, parameter in model.lstm.named_parameters() if name.startswith("weight")
    )


def test_eager_converted_model():
    torch.manual_seed(0)
    model = randomize_batch_norm(EagerConvNet()).eval()
    data = image_batches(2, batch_size=2, size=8)
    eager = quantize_eager_ptq(model, data)
    result = match_layers(model, eager)
    assert result.counterpart is CounterpartKind.EAGER_CONVERTED
    assert _module_layers(result) == {"conv", "conv2", "fc"}
    # eager fusion leaves Identity at bn/relu/relu2; those float modules are absorbed
    assert result.by_name()["conv"].absorbed == ["bn", "relu"]
    assert result.by_name()["conv2"].absorbed == ["relu2"]
    _assert_compare_is_sane(compare(model, eager, data), {"conv", "conv2", "fc"})


class _Renamed(nn.Module):
    """The same network as _Original, with different attribute names."""

    def __init__(self):
        super().__init__()
        self.first = nn.Conv2d(3, 8, 3, padding=1)
        self.second = nn.Conv2d(8, 8, 3, padding=1)
        self.classifier = nn.Linear(8, 4)

    def forward(self, x):
        x = self.second(torch.relu(self.first(x)))
        return self.classifier(x.mean((2, 3)))


class _Original(_Renamed):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = self.first, self.second, self.classifier
        del self.first, self.second, self.classifier

    def forward(self, x):
        x = self.b(torch.relu(self.a(x)))
        return self.c(x.mean((2, 3)))


def test_graph_order_fallback_when_names_differ():
    torch.manual_seed(0)
    original = _Original().eval()
    renamed = _Renamed().eval()
    renamed.load_state_dict(
        {
            "first.weight": original.a.weight,
            "first.bias": original.a.bias,
            "second.weight": original.b.weight,
            "second.bias": original.b.bias,
            "classifier.weight": original.c.weight,
            "classifier.bias": original.c.bias,
        }
    )
    data = image_batches(2, batch_size=2, size=8)
    _, quantized = quantize_fx_ptq(renamed, data)
    result = match_layers(original, quantized)
    pairs = {layer.name: layer.quant_site.name for layer in result.layers if layer.is_module}
    assert pairs == {"a": "first", "b": "second", "c": "classifier"}
    assert all(layer.matched_by == "graph-order" for layer in result.layers if layer.is_module)
    report = compare(original, quantized, data)
    # the pairing is right only if the weights line up: int8 weight SQNR, not noise
    assert all(row.weight_sqnr > 30 for row in report.layers if row.name in pairs)


def test_eager_prepared_model_is_simulated_like_its_conversion():
    torch.manual_seed(0)
    model = randomize_batch_norm(EagerConvNet()).eval()
    data = image_batches(2, batch_size=2, size=8)
    prepared = prepare_eager_ptq(model, data)
    assert match_layers(model, prepared).counterpart is CounterpartKind.PREPARED
    simulated = {row.name: row for row in compare(model, prepared, data).layers}
    converted = {row.name: row for row in compare(model, quantize_eager_ptq(model, data), data).layers}
    for name in ("conv", "conv2", "fc"):
        # frozen observers + simulated weights reproduce the converted model's error
        assert abs(simulated[name].sqnr_propagated - converted[name].sqnr_propagated) < 2.0, name
        assert abs(simulated[name].weight_sqnr - converted[name].weight_sqnr) < 0.5, name
        assert simulated[name].sqnr_propagated < 60.0  # quantization noise is really there
