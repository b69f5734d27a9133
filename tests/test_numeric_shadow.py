"""Shadow SQNR follows torch NS's definition: parity with ``add_shadow_loggers``.

torch's shadow model runs each float layer on the *quantized model's* dequantized
input to that layer and compares it with the quantized layer's output.  qlint's
shadow column must give the same number, layer by layer, over a stream of batches.
"""

import copy
import warnings

import pytest
import torch

# torch's FX numeric suite is private API: the reference in tests only.
import torch.ao.ns._numeric_suite_fx as torch_ns
from torch import nn
from torch.ao.quantization import get_default_qconfig_mapping
from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

from qlint.measure.metrics import PairwiseErrorStats
from qlint.numeric.compare import compare
from tests.models import mobilenet_style

warnings.filterwarnings("ignore")
pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


class ConvModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x):
        return self.conv2(self.conv1(x))


class ConvBnReLU(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(8)
        self.relu2 = nn.ReLU()

    def forward(self, x):
        return self.relu2(self.bn2(self.conv2(self.relu1(self.bn1(self.conv1(x))))))


class LinearModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 32)
        self.fc3 = nn.Linear(32, 8)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def _with_batch_norm_statistics(model: nn.Module) -> nn.Module:
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d):
                channels = module.num_features
                module.running_mean.copy_(torch.rand(channels, generator=generator) - 0.5)
                module.running_var.copy_(torch.rand(channels, generator=generator) * 1.5 + 0.5)
                module.weight.copy_(torch.rand(channels, generator=generator) + 0.5)
                module.bias.copy_(torch.rand(channels, generator=generator) * 0.4 - 0.2)
    return model.eval()


def _case(name: str):
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(3)
    if name == "linear":
        model, shape = LinearModel().eval(), (8, 16)
    elif name == "conv":
        model, shape = ConvModel().eval(), (4, 3, 12, 12)
    elif name == "conv-bn-relu":
        model, shape = _with_batch_norm_statistics(ConvBnReLU()), (4, 3, 12, 12)
    else:
        model, shape = mobilenet_style(inplace=False), (4, 3, 16, 16)
    batches = [torch.randn(*shape, generator=generator) for _ in range(3)]
    prepared = prepare_fx(copy.deepcopy(model), get_default_qconfig_mapping("x86"), (batches[0],))
    with torch.no_grad():
        for batch in batches:
            prepared(batch)
    return model, convert_fx(prepared), batches


def torch_shadow_sqnr(float_model: nn.Module, converted: torch.fx.GraphModule, batches) -> dict[str, float]:
    """SQNR per quantized module fqn from torch's shadow loggers, pooled over the batches."""
    shadow = torch_ns.add_shadow_loggers(
        "fp32", copy.deepcopy(float_model), "int8", copy.deepcopy(converted), torch_ns.OutputLogger
    )
    with torch.no_grad():
        for batch in batches:
            shadow(batch)
    results = torch_ns.extract_shadow_logger_info(shadow, torch_ns.OutputLogger, "int8")
    module_of_node = {node.name: str(node.target) for node in converted.graph.nodes if node.op == "call_module"}
    sqnr = {}
    for layer in results.values():
        float_entries, quant_entries = layer["node_output"]["fp32"], layer["node_output"]["int8"]
        for float_entry, quant_entry in zip(float_entries, quant_entries):
            stats = PairwiseErrorStats()
            for reference, quantized in zip(float_entry["values"], quant_entry["values"]):
                stats.update(reference, quantized)
            fqn = quant_entry["fqn"] or module_of_node.get(quant_entry["ref_node_name"], quant_entry["ref_node_name"])
            sqnr[fqn] = stats.sqnr_db()
    return sqnr


@pytest.mark.parametrize("name", ["conv", "conv-bn-relu", "linear", "mobilenet-style"])
def test_shadow_sqnr_equals_torch_add_shadow_loggers(name):
    model, converted, batches = _case(name)
    reference = torch_shadow_sqnr(model, converted, batches)
    rows = {row.name: row for row in compare(model, converted, batches).layers}
    shadowed = [name for name, row in rows.items() if row.sqnr_shadow is not None]
    assert shadowed and set(shadowed) <= set(reference)  # every layer qlint shadows, torch shadows too
    assert sum(rows[name].weight_sqnr is not None for name in shadowed) >= 2
    for name in shadowed:
        assert abs(rows[name].sqnr_shadow - reference[name]) < 0.01, (name, rows[name].sqnr_shadow, reference[name])


def test_first_layer_shadow_leaves_out_the_input_quantization():
    """Propagated includes the model input's quantization error; shadow starts from the quantized input."""
    model, converted, batches = _case("conv")
    captured = []
    hooked = copy.deepcopy(converted)
    hooked.conv1.register_forward_pre_hook(lambda module, args: captured.append(args[0].dequantize()))
    hooked.conv1.register_forward_hook(lambda module, args, output: captured.append(output.dequantize()))
    by_hand, propagated = PairwiseErrorStats(), PairwiseErrorStats()
    with torch.no_grad():
        for batch in batches:
            captured.clear()
            hooked(batch)
            quantized_input, quantized_output = captured
            by_hand.update(model.conv1(quantized_input), quantized_output)
            propagated.update(model.conv1(batch), quantized_output)
    row = next(row for row in compare(model, converted, batches).layers if row.name == "conv1")
    assert abs(row.sqnr_shadow - by_hand.sqnr_db()) < 1e-6
    assert abs(row.sqnr_propagated - propagated.sqnr_db()) < 1e-6
    assert row.sqnr_shadow > row.sqnr_propagated + 1.0
