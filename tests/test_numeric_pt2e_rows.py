"""compare reads a pt2e row at the value the int8 model passes on: after the op's own output
quantize/dequantize pair. It read the raw aten output, so a layer's output rounding was charged
to the next layer (QA, digit_cnn: relu_1 41.5 dB raw, 33.8 dB after its pair; QL301/QL302 then
blamed relu_2)."""

import copy

import torch
import torch.fx
import torch.nn as nn
from torch.ao.quantization import HistogramObserver, QConfig, QConfigMapping, default_per_channel_weight_observer
from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (
    X86InductorQuantizer,
    get_default_x86_inductor_quantization_config,
)

from qlint.core.sqnr import SqnrSums
from qlint.measure.pt2e_outputs import quantized_outputs
from qlint.numeric.compare import compare


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.relu = nn.ReLU()
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(8 * 4 * 4, 4)

    def forward(self, x):
        # X86InductorQuantizer quantizes the ReLU's output for the pooling (int8 in, int8 out)
        return self.fc(self.pool(self.relu(self.conv(x))).reshape(x.shape[0], -1))


def _net() -> nn.Module:
    torch.manual_seed(0)
    net = _Net().eval()
    with torch.no_grad():  # a few large outputs set the range: the output rounding is coarse
        net.conv.weight[0].mul_(6.0)
    return net


def _batches():
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(4, 3, 8, 8, generator=generator) for _ in range(4)]


def _pt2e(net: nn.Module):
    exported = torch.export.export(copy.deepcopy(net), (_batches()[0],)).module()
    quantizer = X86InductorQuantizer().set_global(get_default_x86_inductor_quantization_config())
    prepared = prepare_pt2e(exported, quantizer)
    with torch.no_grad():
        for batch in _batches():
            prepared(batch)
    return convert_pt2e(prepared)


def _node_outputs(graph_module: torch.fx.GraphModule, batch: torch.Tensor) -> dict[str, torch.Tensor]:
    outputs: dict[str, torch.Tensor] = {}

    class Recorder(torch.fx.Interpreter):
        def run_node(self, node):
            value = super().run_node(node)
            if isinstance(value, torch.Tensor):
                outputs[node.name] = value.detach().clone()
            return value

    with torch.no_grad():
        Recorder(graph_module).run(batch)
    return outputs


def _quantize_node(converted: torch.fx.GraphModule, source: str) -> torch.fx.Node:
    return next(
        node
        for node in converted.graph.nodes
        if node.target is torch.ops.quantized_decomposed.quantize_per_tensor.default and node.args[0].name == source
    )


def test_a_pt2e_row_is_read_after_the_ops_own_output_quantize_dequantize():
    net = _net()
    exported = torch.export.export(copy.deepcopy(net), (_batches()[0],)).module()
    converted = _pt2e(net)
    rows = {row.name: row for row in compare(exported, converted, _batches()).compare_rows()}

    # by hand: the converted graph's raw relu output, rounded by its own pair with torch's ops
    quantize = _quantize_node(converted, "relu")
    scale, zero_point, low, high, dtype = quantize.args[1:6]
    after_pair, raw, conv_raw = SqnrSums(), SqnrSums(), SqnrSums()
    for batch in _batches():
        floats, quants = _node_outputs(exported, batch), _node_outputs(converted, batch)
        integers = torch.ops.quantized_decomposed.quantize_per_tensor(
            quants["relu"], scale, zero_point, low, high, dtype
        )
        rounded = torch.ops.quantized_decomposed.dequantize_per_tensor(integers, scale, zero_point, low, high, dtype)
        after_pair.add(floats["relu"], rounded)
        raw.add(floats["relu"], quants["relu"])
        conv_raw.add(floats["conv2d"], quants["conv2d"])

    assert raw.sqnr_db() - after_pair.sqnr_db() > 3.0  # the row's own rounding matters here
    assert abs(rows["relu"].sqnr_propagated - after_pair.sqnr_db()) < 0.01, (rows["relu"], after_pair.sqnr_db())
    # the conv's output has no pair (its ReLU follows): the relu reads it raw, and so does its row
    assert abs(rows["conv2d"].sqnr_propagated - conv_raw.sqnr_db()) < 0.01
    # the error columns are in units of the pair's step
    assert rows["relu"].extra["quantized_exit"] == quantized_outputs(converted)["relu"].node
    assert abs(rows["relu"].extra["propagated"]["scale"] - scale) < 1e-9 * scale


def test_pt2e_and_fx_rows_of_one_network_agree():
    """The same network through pt2e and FX with the same choices (uint8 histogram activations,
    per-channel symmetric int8 weights): the pt2e relu row is the FX ConvReLU row's value."""
    net = _net()
    exported = torch.export.export(copy.deepcopy(net), (_batches()[0],)).module()
    pt2e_rows = {row.name: row for row in compare(exported, _pt2e(net), _batches()).compare_rows()}

    qconfig = QConfig(
        activation=HistogramObserver.with_args(dtype=torch.quint8, reduce_range=False),
        weight=default_per_channel_weight_observer,
    )
    prepared = prepare_fx(copy.deepcopy(net), QConfigMapping().set_global(qconfig), (_batches()[0],))
    with torch.no_grad():
        for batch in _batches():
            prepared(batch)
    fx_rows = {row.name: row for row in compare(net, convert_fx(prepared), _batches()).compare_rows()}

    assert abs(pt2e_rows["relu"].sqnr_propagated - fx_rows["conv"].sqnr_propagated) < 0.1, (
        pt2e_rows["relu"].sqnr_propagated,
        fx_rows["conv"].sqnr_propagated,
    )


def test_an_output_with_several_pairs_is_read_after_the_first_in_graph_order():
    """The documented rule: the first dequantize in graph order whose quantize reads the output;
    a raw consumer beside a pair does not make the op read raw; an op with no pair is left out."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    relu = graph.call_function(torch.ops.aten.relu.default, (x,))
    q, dq = (
        torch.ops.quantized_decomposed.quantize_per_tensor.default,
        torch.ops.quantized_decomposed.dequantize_per_tensor.default,
    )
    pairs = []
    for scale in (0.5, 0.25):  # two consumers that asked for their own grids
        quantized = graph.call_function(q, (relu, scale, 0, 0, 255, torch.uint8))
        pairs.append(graph.call_function(dq, (quantized, scale, 0, 0, 255, torch.uint8)))
    raw_consumer = graph.call_function(torch.ops.aten.neg.default, (relu,))
    graph.output((pairs[0], pairs[1], raw_consumer))
    found = quantized_outputs(torch.fx.GraphModule(nn.Module(), graph))

    assert found[relu.name].node == pairs[0].name and found[relu.name].scale == 0.5
    assert set(found) == {relu.name}
    x_value = torch.linspace(-2.0, 2.0, 9)
    # what the row then reads: the first pair's value
    assert torch.equal(torch.fx.GraphModule(nn.Module(), graph)(x_value)[0], torch.round(x_value.relu() / 0.5) * 0.5)
