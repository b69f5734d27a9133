"""A module the model calls more than once is measured call by call.

QA (EfficientNet-Lite0, whose model-level ``_swish`` ReLU6 runs after the stem and after the
head): compare pooled both calls into one row at the first call's place (14.7 dB after the
stem, where the calls measure 17.1 dB and -1.4 dB), and QL302 reported a 14.6 dB drop at
``_fc``, whose real input is at -1.4 dB. On the toy below, one ``act`` row (0.7 dB) right after
conv1 was blamed ("fix act first"), where the first call measures 31.9 dB and conv2 (5.9 dB)
is where the error starts.

The references are the FX node outputs of each call site, float graph against the converted
graph, pooled over the batches.
"""

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.ao.quantization import get_default_qconfig_mapping
from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

from qlint.core.sqnr import SqnrSums
from qlint.numeric.compare import compare
from qlint.numeric.sensitivity import sensitivity_rows

warnings.filterwarnings("ignore")
pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


class SharedActivation(nn.Module):
    """One ReLU6 called twice: after conv1, and after conv2 scaled up (a much larger signal)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.act = nn.ReLU6()
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        x = self.act(self.conv1(x))
        x = self.act(self.conv2(x) * 30.0)
        return self.fc(x.mean((2, 3)))


class SharedFusedRelu(nn.Module):
    """One ReLU after two convs of the same output shape: prepare_fx fuses it into both."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.relu = nn.ReLU()

    def forward(self, x):
        return self.relu(self.conv2(self.relu(self.conv1(x)) * 4.0))


class SharedReluLastCallFused(nn.Module):
    """One ReLU called three times: after two pools (quantized ReLU calls) and after fc, where
    prepare_fx fuses it (LinearReLU): the quantized model calls it twice."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8, 4)
        self.act = nn.ReLU()

    def forward(self, x):
        x = self.act(nn.functional.max_pool2d(self.conv1(x), 2))
        x = self.act(nn.functional.max_pool2d(self.conv2(x), 2))
        return self.act(self.fc(x.mean((2, 3))))


def _batches():
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(4, 3, 8, 8, generator=generator) for _ in range(3)]


def _float_and_converted(model_class):
    torch.manual_seed(0)
    model = model_class().eval()
    batches = _batches()
    prepared = prepare_fx(copy.deepcopy(model), get_default_qconfig_mapping("x86"), (batches[0],))
    with torch.no_grad():
        for batch in batches:
            prepared(batch)
    return model, convert_fx(prepared), batches


class _NodeOutputs(torch.fx.Interpreter):
    """Every node's output of one run, dequantized, and the grid of each quantized one."""

    def __init__(self, module):
        super().__init__(module)
        self.outputs = {}
        self.grids = {}

    def run_node(self, node):
        result = super().run_node(node)
        if isinstance(result, torch.Tensor):
            self.outputs[node.name] = result.dequantize() if result.is_quantized else result.detach()
            if result.is_quantized:
                self.grids[node.name] = (result.q_scale(), result.q_zero_point())
        return result


def _node_sqnr(model, converted, batches, pairs) -> dict[str, float]:
    """Propagated SQNR of each (float node, quantized node) pair, keyed by the float node."""
    float_graph = torch.fx.symbolic_trace(model)
    sums = {float_name: SqnrSums() for float_name, _ in pairs}
    with torch.no_grad():
        for batch in batches:
            reference, quantized = _NodeOutputs(float_graph), _NodeOutputs(converted)
            reference.run(batch.clone())
            quantized.run(batch.clone())
            for float_name, quant_name in pairs:
                sums[float_name].add(reference.outputs[float_name], quantized.outputs[quant_name])
    return {name: value.sqnr_db() for name, value in sums.items()}


def test_a_shared_module_has_a_row_per_call_measured_at_that_call():
    model, converted, batches = _float_and_converted(SharedActivation)
    # the converted graph keeps the float graph's call sites: act and act_1 call the one module
    calls = [node.name for node in converted.graph.nodes if node.op == "call_module" and node.target == "act"]
    assert calls == ["act", "act_1"]
    truth = _node_sqnr(
        model, converted, batches, [("conv1", "conv1"), ("act", "act"), ("conv2", "conv2"), ("act_1", "act_1")]
    )
    report = compare(model, converted, batches)
    rows = {row.name: row for row in report.compare_rows()}
    order = [row.name for row in report.compare_rows()]
    assert order.index("act") < order.index("conv2") < order.index("act_1") < order.index("fc")
    for name, expected in truth.items():
        assert rows[name].sqnr_propagated == pytest.approx(expected, abs=0.01), (name, expected)
    assert (rows["act"].module, rows["act"].call, rows["act"].calls) == ("act", 0, 2)
    assert (rows["act_1"].module, rows["act_1"].call, rows["act_1"].calls) == ("act", 1, 2)
    assert rows["conv2"].extra["predecessors"] == ["act"]
    assert rows["fc"].extra["predecessors"] == ["act_1"]
    # The error starts at conv2, not at the first call of act, which passes conv1's error on.
    onsets = [finding for finding in report.findings if finding.rule == "QL302"]
    assert [finding.target for finding in onsets] == ["conv2"]
    assert not [f for f in report.findings if f.target == "act"]
    # A fix for one call names the module, and says that it changes every call.
    (act_1,) = [f for f in report.findings if f.target == "act_1"]
    assert act_1.suggestion is not None and act_1.suggestion.module == "act"
    assert act_1.data["module"] == "act"  # what a tool reading the JSON keeps float: act_1 is a call, not a module
    assert "calls 2 times" in act_1.message


def test_a_relu_fused_into_two_convs_is_read_after_each():
    """Each conv's fused ReLU is the call that follows it: conv2 was compared with the ReLU's
    first call (conv1's output, of the same shape)."""
    model, converted, batches = _float_and_converted(SharedFusedRelu)
    assert type(converted.conv1).__name__ == type(converted.conv2).__name__ == "ConvReLU2d"
    truth = _node_sqnr(model, converted, batches, [("relu", "conv1"), ("relu_1", "conv2")])
    rows = {row.name: row for row in compare(model, converted, batches).compare_rows()}
    assert rows["conv1"].sqnr_propagated == pytest.approx(truth["relu"], abs=0.01)
    assert rows["conv2"].sqnr_propagated == pytest.approx(truth["relu_1"], abs=0.01)
    assert rows["conv2"].extra["predecessors"] == ["mul"]


def test_a_call_fused_into_another_layer_leaves_a_row_per_other_call():
    """QA (digit_cnn with one shared ReLU, its last call fused into fc0): the quantized model
    calls the module fewer times, so its calls were pooled into one row at the first call's
    place, labelled with every call though the fused one is read as the Linear's output."""
    model, converted, batches = _float_and_converted(SharedReluLastCallFused)
    calls = [node.name for node in converted.graph.nodes if node.op == "call_module" and node.target == "act"]
    assert calls == ["act", "act_1"] and type(converted.fc).__name__ == "LinearReLU"
    truth = _node_sqnr(model, converted, batches, [("act", "act"), ("act_1", "act_1"), ("act_2", "fc")])
    report = compare(model, converted, batches)
    rows = {row.name: row for row in report.compare_rows()}
    assert [row.name for row in report.compare_rows()] == ["conv1", "act", "conv2", "act_1", "fc"]
    assert rows["act"].sqnr_propagated == pytest.approx(truth["act"], abs=0.01)
    assert rows["act_1"].sqnr_propagated == pytest.approx(truth["act_1"], abs=0.01)
    assert rows["fc"].sqnr_propagated == pytest.approx(truth["act_2"], abs=0.01)  # the fused call
    assert (rows["act_1"].module, rows["act_1"].call) == ("act", 1)
    assert rows["fc"].extra["predecessors"] == ["act_1"]
    assert not [notice for notice in report.notices if "pools every call" in notice.message]


def test_sensitivity_ranks_a_shared_module_once_each_call_on_its_own_input_grid():
    """The isolated run put every call's input on the last call's input grid: act's first
    input (conv1's output, step 0.04) was rounded to mul's step (11.4)."""
    model, converted, batches = _float_and_converted(SharedActivation)
    float_graph = torch.fx.symbolic_trace(model)
    isolated = SqnrSums()
    with torch.no_grad():
        for batch in batches:
            reference, quantized = _NodeOutputs(float_graph), _NodeOutputs(converted)
            reference.run(batch.clone())
            quantized.run(batch.clone())
            for float_input, quant_input, output in (("conv1", "conv1", "act"), ("mul", "mul_1", "act_1")):
                scale, zero_point = quantized.grids[quant_input]
                on_grid = torch.quantize_per_tensor(reference.outputs[float_input], scale, zero_point, torch.quint8)
                isolated.add(reference.outputs[output], converted.act(on_grid).dequantize())
    rows = {row.name: row for row in sensitivity_rows(model, batches, quantized_model=converted)}
    assert rows["act"].local_sqnr_db == pytest.approx(isolated.sqnr_db(), abs=0.01)
    assert rows["act"].calls == 2 and rows["conv1"].calls == 1  # ranked once, both calls
