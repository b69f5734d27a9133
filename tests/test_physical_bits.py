"""No finding reports more bits lost than the dtype has (issue 15, Acceptance).

QL203 clamps its bit counts to [0, dtype bits]; QL104's ``bits_lost`` is log2 of the
resolution loss and is not clamped, so a per-tensor weight whose narrowest output channel
is ~1000x narrower than the widest reports about 10 of 8 bits lost. Found by
bench/findings.py's physical-bits check; QL104 now clamps it.
"""

import re

import pytest
import torch
import torch.nn as nn

import qlint


def _narrow_channel_linear() -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 8)).eval()
    with torch.no_grad():
        model[0].weight[3] *= 1e-3  # one output channel 1000x narrower than the widest
    return model


def test_ql104_reports_no_more_bits_lost_than_int8_has():
    example = (torch.randn(4, 16, generator=torch.Generator().manual_seed(1)),)
    # qnnpack's default weight observer is per-tensor, so QL104 judges this layer
    report = qlint.lint(_narrow_channel_linear(), example, backend="qnnpack", trial_options={"enabled": False})
    findings = report.by_rule("QL104")
    assert findings, "QL104 should report the per-tensor weight of a layer with a 1000x channel spread"
    for finding in findings:
        assert 0.0 <= finding.data["bits_lost"] <= 8.0
        for stated in re.findall(r"about ([0-9.]+) of its 8 bits lost", finding.message):
            assert float(stated) <= 8.0


def _dynamic_kernel_levels(backend: str) -> int:
    """How many levels torch's dynamic Linear gives its input on ``backend``'s engine: the distinct
    outputs of an identity layer over an evenly spread input (the reference)."""
    from torch.ao.quantization import quantize_dynamic

    previous = torch.backends.quantized.engine
    torch.backends.quantized.engine = backend
    try:
        layer = nn.Linear(4, 4, bias=False)
        with torch.no_grad():
            layer.weight.copy_(torch.eye(4))
        quantized = quantize_dynamic(nn.Sequential(layer), {nn.Linear}, dtype=torch.qint8)
        return int(quantized(torch.linspace(-1, 3, 4000).reshape(1000, 4))[:, 0].unique().numel())
    finally:
        torch.backends.quantized.engine = previous


@pytest.mark.parametrize("backend", ["x86", "qnnpack"])
def test_ql203_counts_the_bits_of_the_dynamic_kernel(backend):
    """torch's dynamic Linear quantizes its input with reduce_range on x86, fbgemm and onednn (7
    bits) though the dynamic qconfig's range is 0..255; QL203 said 8."""
    if backend not in torch.backends.quantized.supported_engines:
        pytest.skip(f"no {backend} engine in this torch build")
    from torch.ao.quantization import QConfigMapping, default_dynamic_qconfig

    generator = torch.Generator().manual_seed(0)
    batches = [torch.rand(64, 16, generator=generator) + 1.0 for _ in range(6)]
    for batch in batches:
        batch[0, 5] = 40.0  # a rare spike in channel 5
    model = _narrow_channel_linear()
    mapping = QConfigMapping().set_object_type(nn.Linear, default_dynamic_qconfig)
    report = qlint.lint(
        model, (batches[0],), calibration=batches, backend=backend, qconfig_mapping=mapping, select=["QL203"]
    )
    (finding,) = [f for f in report.findings if f.data.get("kind") == "outlier"]
    levels = _dynamic_kernel_levels(backend)
    assert 2 ** finding.data["dtype_bits"] == levels  # 128 on x86, 256 on qnnpack
    assert f"of {finding.data['dtype_bits']} bits lost" in finding.message
