"""A small CNN with the quantization mistakes qlint is built to find.

    qlint examples.badnet:build --input-shape 1,3,32,32 --qconfig-mapping examples.badnet:qconfig_mapping

- the stem conv's output feeds both its BatchNorm and a skip branch (QL101: stays unfused);
- one ReLU module is called twice, and an old head is never called (QL102);
- the mapping gives sigmoid a calibrated observer instead of fixed qparams (QL103: prepare_fx
  ignores it, so the int8 model does not change: info);
- the mapping quantizes the classifier's weights per tensor, and one of its rows is 10x the
  others (QL104);
- ``calibration_batches`` drifts in scale, has one very wide and one spiky channel (QL201-QL203).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.ao.quantization import (
    HistogramObserver,
    MinMaxObserver,
    QConfig,
    QConfigMapping,
    get_default_qconfig,
    get_default_qconfig_mapping,
)


class BadNet(nn.Module):
    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.stem_bn = nn.BatchNorm2d(16)
        self.act = nn.ReLU()
        self.block = nn.Sequential(
            nn.Conv2d(16, 32, 3, stride=2, padding=1),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.Conv2d(32, 32, 3, padding=1),
            nn.BatchNorm2d(32),
            nn.ReLU(),
        )
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(32, num_classes)
        self.gate = nn.Linear(32, num_classes)
        self.old_head = nn.Linear(32, num_classes)  # left over from an earlier version

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.stem(x)
        y = self.act(self.stem_bn(y)) + y  # the conv output also feeds the skip branch
        y = self.block(self.act(y))  # self.act is called a second time
        features = torch.flatten(self.pool(y), 1)
        return self.classifier(features) * torch.sigmoid(self.gate(features))


def build() -> nn.Module:
    torch.manual_seed(0)
    model = BadNet().eval()
    with torch.no_grad():
        # one class's weights 10x the others' (a class reweighted after training): one
        # per-tensor weight scale covers that row, and the other rows keep a tenth of the codes
        model.classifier.weight[3] *= 10.0
    return model


def qconfig_mapping(backend: str = "x86") -> QConfigMapping:
    """The mapping a user might write by hand, with two mistakes in it."""
    mapping = get_default_qconfig_mapping(backend)
    generic = get_default_qconfig(backend)
    mapping.set_object_type(torch.sigmoid, generic)  # sigmoid should keep fixed qparams
    per_tensor = QConfig(
        activation=HistogramObserver.with_args(reduce_range=True),
        weight=MinMaxObserver.with_args(dtype=torch.qint8, qscheme=torch.per_tensor_symmetric),
    )
    mapping.set_module_name("classifier", per_tensor)
    return mapping


def calibration_batches(count: int = 8, batch_size: int = 4) -> list[torch.Tensor]:
    """Calibration data with the problems the data rules look for.

    The input scale drifts from batch to batch (QL201: non-stationary, dynamic quantization
    fits better), channel 1 is 100x wider than the others (QL202: input-weight equalization
    helps) and channel 2 has rare spikes (QL203: activation outliers).

        qlint examples.badnet:build --input-shape 1,3,32,32 --calibration examples.badnet:calibration_batches
    """
    generator = torch.Generator().manual_seed(3)
    drift = [1.0, 8.0, 0.25, 3.0, 20.0, 0.5, 2.0, 40.0]
    batches = []
    for k in range(count):
        x = torch.randn(batch_size, 3, 32, 32, generator=generator)
        x[:, 1] *= 100.0
        spikes = torch.rand(batch_size, 32, 32, generator=generator) < 0.002
        spikes[0, 0, 0] = True
        x[:, 2][spikes] = 60.0
        batches.append(x * drift[k % len(drift)])
    return batches
