"""pt2e export of a plan (runs only where torchao, the extra qlint[pt2e], is installed)."""

import copy

import pytest
import torch
import torch.nn as nn

from qlint.measure.metrics import sqnr_db

pt2e = pytest.importorskip("torchao.quantization.pt2e.quantize_pt2e")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 4)
        self.head = nn.Linear(4, 4)

    def forward(self, x):
        y = torch.relu(self.bn(self.conv(x))).mean((2, 3))
        return self.head(torch.relu(self.fc(y)))


def _quantize(model, quantizer, batches):
    exported = torch.export.export(copy.deepcopy(model), (batches[0],)).module()
    prepared = pt2e.prepare_pt2e(exported, quantizer)
    for batch in batches:
        prepared(batch)
    return pt2e.convert_pt2e(prepared)


def test_plan_exports_to_a_working_pt2e_quantizer():
    from qlint.advice.plan import ModuleDecision, Provenance, default_plan

    torch.manual_seed(0)
    model = Net().eval()
    batches = [torch.randn(4, 3, 16, 16) for _ in range(4)]
    base = default_plan("x86")
    keep_head = base.model_copy(
        update={
            "modules": [
                ModuleDecision(fqn="head", quantize=False, provenance=[Provenance(source="user", detail="test")])
            ]
        }
    )

    converted = _quantize(model, keep_head.to_pt2e_quantizer(), batches)
    with torch.no_grad():
        reference, output = model(batches[0]), converted(batches[0])
    assert sqnr_db(reference, output) > 20
    # the keep-float decision reached the quantizer: head's linear runs on float weights
    code = converted.code
    assert code.count("quantize_per_tensor") > 0
    everything = _quantize(model, base.to_pt2e_quantizer(), batches)
    assert everything.code.count("dequantize") > code.count("dequantize")


def test_non_x86_backend_is_refused_with_a_clear_error():
    from qlint.advice.plan import default_plan
    from qlint.errors import ConfigError

    with pytest.raises(ConfigError, match="XNNPACK"):
        default_plan("qnnpack").to_pt2e_quantizer()
