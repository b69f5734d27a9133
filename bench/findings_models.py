"""Models written for bench/findings.py: structures a new user brings, seeded, random weights.

- ``mobilenet_v2``: MobileNet-v2 inverted-residual blocks (1x1 expand, 3x3 depthwise, 1x1
  project), conv-bn-ReLU6(inplace=True), residual adds; BatchNorm carries realistic running
  statistics (non-zero means, variances 0.3-3), so BN folding changes the weights.
- ``transformer``: a linear embedding, an ``nn.TransformerEncoder`` (a tracer leaf), a linear head.
- ``lstm`` / ``gru``: a recurrent layer and a linear head on the last step.

Each builder returns ``(model, example_inputs, calibration, held_out)``: 8 calibration and 4
held-out batches, disjoint, from a seeded generator; the caller's RNG is left as it was.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn


class InvertedResidual(nn.Module):
    def __init__(self, channels: int, expansion: int = 4) -> None:
        super().__init__()
        hidden = channels * expansion
        self.expand = nn.Conv2d(channels, hidden, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(hidden)
        self.act1 = nn.ReLU6(inplace=True)
        self.dw = nn.Conv2d(hidden, hidden, 3, padding=1, groups=hidden, bias=False)
        self.bn2 = nn.BatchNorm2d(hidden)
        self.act2 = nn.ReLU6(inplace=True)
        self.project = nn.Conv2d(hidden, channels, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(channels)

    def forward(self, x):
        return x + self.bn3(self.project(self.act2(self.bn2(self.dw(self.act1(self.bn1(self.expand(x))))))))


class MobileNetV2ish(nn.Module):
    def __init__(self, width: int = 24, blocks: int = 3, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, stride=2, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(width)
        self.act = nn.ReLU6(inplace=True)
        self.blocks = nn.Sequential(*[InvertedResidual(width) for _ in range(blocks)])
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(width, classes)

    def forward(self, x):
        return self.fc(torch.flatten(self.pool(self.blocks(self.act(self.bn(self.stem(x))))), 1))


class TransformerClassifier(nn.Module):
    def __init__(self, features: int = 16, dim: int = 64, heads: int = 4, layers: int = 2, classes: int = 5) -> None:
        super().__init__()
        self.embed = nn.Linear(features, dim)
        layer = nn.TransformerEncoderLayer(dim, heads, dim * 2, batch_first=True, dropout=0.0)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        return self.head(self.encoder(self.embed(x)).mean(1))


class LSTMClassifier(nn.Module):
    def __init__(self, features: int = 16, hidden: int = 64, classes: int = 5) -> None:
        super().__init__()
        self.lstm = nn.LSTM(features, hidden, batch_first=True)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x):
        y, _ = self.lstm(x)
        return self.head(y[:, -1])


class GRUClassifier(nn.Module):
    def __init__(self, features: int = 16, hidden: int = 64, classes: int = 5) -> None:
        super().__init__()
        self.gru = nn.GRU(features, hidden, batch_first=True)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x):
        y, _ = self.gru(x)
        return self.head(y[:, -1])


def _realistic_batchnorm(model: nn.Module, generator: torch.Generator) -> None:
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            with torch.no_grad():
                module.running_mean.uniform_(-0.5, 0.5, generator=generator)
                module.running_var.uniform_(0.3, 3.0, generator=generator)
                module.weight.uniform_(0.5, 1.5, generator=generator)
                module.bias.uniform_(-0.2, 0.2, generator=generator)


def _build(make: Callable[[], nn.Module], shape: tuple[int, ...], batchnorm: bool = False):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = make().eval()
    generator = torch.Generator().manual_seed(1)
    if batchnorm:
        _realistic_batchnorm(model, generator)
    batches = [torch.randn(*shape, generator=generator) for _ in range(13)]
    return model, (batches[0],), batches[1:9], batches[9:13]


MODELS: dict[str, Callable[[], tuple]] = {
    "mobilenet_v2": lambda: _build(MobileNetV2ish, (8, 3, 64, 64), batchnorm=True),
    "transformer": lambda: _build(TransformerClassifier, (8, 16, 16)),
    "lstm": lambda: _build(LSTMClassifier, (8, 20, 16)),
    "gru": lambda: _build(GRUClassifier, (8, 20, 16)),
}
