"""No finding reports more bits lost than the dtype has (issue 15, Acceptance).

QL203 clamps its bit counts to [0, dtype bits]; QL104's ``bits_lost`` is log2 of the
resolution loss and is not clamped, so a per-tensor weight whose narrowest output channel
is ~1000x narrower than the widest reports about 10 of 8 bits lost. Found by
bench/findings.py's physical-bits check; QL104 now clamps it.
"""

import re

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
