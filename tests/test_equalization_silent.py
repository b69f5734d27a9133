"""Equalization leaves a channel that was silent in calibration alone.

On silero_vad qlint's equalization rescale (the plan's QL202 pair conv3 -> conv4) gave conv4's
input channels that were all zeros in calibration (after a ReLU) a scale of ~1e4 from the
1e-8 floor of their range (up to 4e4; now at most 5). Held-out batches that woke such a channel pushed conv3's output
to 1490 where calibration had set its int8 range near 4: verify showed conv3 at 0.01 dB.
torch's own equalization refuses to scale when a channel has no range.
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn as nn

from qlint.measure.equalization import apply_equalization

SILENT = 5  # conv1's output channel that calibration never wakes


class _Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(4, 8, 1)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv1d(8, 4, 1)

    def forward(self, x):
        return self.conv2(self.relu(self.conv1(x)))


def _model() -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = _Pair().eval()
    with torch.no_grad():
        model.conv1.weight[SILENT] = torch.tensor([[1.0], [0.0], [0.0], [0.0]])
        model.conv1.bias[SILENT] = -10.0  # input channel 0 stays in [0, 1] in calibration: relu gives 0
    return model


def _batches(seed: int, wake: bool) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    batches = [torch.rand(16, 4, 32, generator=generator) for _ in range(4)]
    if wake:
        for batch in batches:
            batch[:, 0, :4] = 14.0  # the silent channel now reaches 4
    return batches


def test_a_channel_silent_in_calibration_keeps_scale_one():
    model = _model()
    gm = fx.symbolic_trace(model)
    equalized, applied = apply_equalization(gm, ["conv2"], _batches(0, wake=False))
    assert applied[0].applied
    conv1, conv2 = equalized.get_submodule("conv1"), equalized.get_submodule("conv2")
    assert torch.equal(conv1.weight[SILENT], model.conv1.weight[SILENT])
    assert torch.equal(conv1.bias[SILENT], model.conv1.bias[SILENT])
    assert torch.equal(conv2.weight[:, SILENT], model.conv2.weight[:, SILENT])
    others = [c for c in range(8) if c != SILENT]
    assert not torch.equal(conv2.weight[:, others], model.conv2.weight[:, others])  # the rest is balanced
