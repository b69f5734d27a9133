"""Small example models and quantization recipes for demos, benchmarks and tests.

They exist so that the HTML demo, ``bench/sensitivity.py`` and the numeric
tests exercise the suite on the same, realistic shapes: conv-bn-relu stems,
residual adds, functional ReLUs, LSTMs, eager QuantStub models, and a
quantization config that is deliberately bad for exactly one layer.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import cast

import torch
from torch import nn
from torch.ao.quantization import (
    DeQuantStub,
    HistogramObserver,
    MinMaxObserver,
    QConfig,
    QConfigMapping,
    QuantStub,
    get_default_qconfig,
    get_default_qconfig_mapping,
)


class ConvBlock(nn.Module):
    def __init__(self, channels_in: int, channels_out: int, stride: int = 1):
        super().__init__()
        self.conv = nn.Conv2d(channels_in, channels_out, 3, stride=stride, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(channels_out)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.bn(self.conv(x)))


class ResidualBlock(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.conv1(x))
        return torch.relu(x + self.conv2(y))


class SmallConvNet(nn.Module):
    """Twelve weighted layers: stem, conv blocks, two residual blocks, a 1x1 conv and an MLP head."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.stem = ConvBlock(3, 16)
        self.block1 = ConvBlock(16, 24, stride=2)
        self.res1 = ResidualBlock(24)
        self.block2 = ConvBlock(24, 32, stride=2)
        self.res2 = ResidualBlock(32)
        self.block3 = ConvBlock(32, 48)
        self.pointwise = nn.Conv2d(48, 32, 1)
        self.fc1 = nn.Linear(32, 64)
        self.fc2 = nn.Linear(64, 32)
        self.head = nn.Linear(32, num_classes)
        signal_preserving_init(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.res1(self.block1(self.stem(x)))
        x = self.res2(self.block2(x))
        x = torch.relu(self.pointwise(self.block3(x)))
        x = torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1)
        x = torch.relu(self.fc1(x))
        x = torch.relu(self.fc2(x))
        return self.head(x)


class ResidualTower(nn.Module):
    """A deeper net for benchmarks: a stem, ``blocks`` residual blocks (2 convs each) and a head."""

    def __init__(self, blocks: int = 8, channels: int = 24, num_classes: int = 10):
        super().__init__()
        self.stem = ConvBlock(3, channels)
        self.blocks = nn.Sequential(*[ResidualBlock(channels) for _ in range(blocks)])
        self.head = nn.Linear(channels, num_classes)
        signal_preserving_init(self)
        for block in self.blocks:  # keep the residual sum from growing with depth
            with torch.no_grad():
                cast(ResidualBlock, block).conv2.weight.mul_(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.stem(x))
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


def signal_preserving_init(model: nn.Module) -> nn.Module:
    """He-initialized weights and small biases, so activations keep their scale with depth.

    PyTorch's default init shrinks activations layer after layer, which lets the
    output be dominated by the last biases; a trained network does not look like that.
    """
    generator = torch.Generator().manual_seed(0)
    for module in model.modules():
        if isinstance(module, (nn.Conv2d, nn.Linear)):
            fan_in = module.weight[0].numel()
            with torch.no_grad():
                module.weight.normal_(0.0, (2.0 / fan_in) ** 0.5, generator=generator)
                if module.bias is not None:
                    module.bias.normal_(0.0, 0.02, generator=generator)
    return model


class LstmTagger(nn.Module):
    """LSTM + linear head: the shape dynamic quantization is meant for."""

    def __init__(self, features: int = 16, hidden: int = 32, tags: int = 8):
        super().__init__()
        self.lstm = nn.LSTM(features, hidden, batch_first=True)
        self.proj = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, tags)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sequence, _ = self.lstm(x)
        return self.head(torch.relu(self.proj(sequence)))


class EagerConvNet(nn.Module):
    """Eager-mode quantizable: QuantStub/DeQuantStub and fusable conv-bn-relu."""

    def __init__(self):
        super().__init__()
        self.quant = QuantStub()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)
        self.bn = nn.BatchNorm2d(16)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(16, 16, 3, padding=1)
        self.relu2 = nn.ReLU()
        self.fc = nn.Linear(16, 10)
        self.dequant = DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.quant(x)
        x = self.relu(self.bn(self.conv(x)))
        x = self.relu2(self.conv2(x))
        x = x.mean((2, 3))
        return self.dequant(self.fc(x))

    FUSION = [["conv", "bn", "relu"], ["conv2", "relu2"]]


def randomize_batch_norm(model: nn.Module, seed: int = 0) -> nn.Module:
    """Give BN layers non-trivial statistics, as a trained model would have."""
    generator = torch.Generator().manual_seed(seed)
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            channels = module.num_features
            if module.running_mean is None or module.running_var is None:
                continue  # track_running_stats=False: no statistics to randomize
            with torch.no_grad():
                module.running_mean.copy_(torch.randn(channels, generator=generator) * 0.1)
                module.running_var.copy_(torch.rand(channels, generator=generator) * 0.5 + 0.75)
                module.weight.copy_(torch.rand(channels, generator=generator) * 0.5 + 0.75)
                module.bias.copy_(torch.randn(channels, generator=generator) * 0.1)
    return model


def image_batches(count: int, batch_size: int = 8, size: int = 16, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(batch_size, 3, size, size, generator=generator) for _ in range(count)]


def sequence_batches(
    count: int, batch_size: int = 4, steps: int = 12, features: int = 16, seed: int = 0
) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(batch_size, steps, features, generator=generator) for _ in range(count)]


def two_bit_weight_qconfig() -> QConfig:
    """A deliberately terrible qconfig: weights squeezed into 4 levels ([-2, 1]), per tensor."""
    return QConfig(
        activation=HistogramObserver.with_args(reduce_range=True),
        weight=MinMaxObserver.with_args(
            dtype=torch.qint8, qscheme=torch.per_tensor_symmetric, quant_min=-2, quant_max=1
        ),
    )


def bad_layer_qconfig_mapping(layer: str, backend: str = "x86") -> QConfigMapping:
    """The backend's default mapping, except ``layer`` gets ``two_bit_weight_qconfig``."""
    return get_default_qconfig_mapping(backend).set_module_name(layer, two_bit_weight_qconfig())


def quantize_fx_ptq(
    model: nn.Module, data: Iterable, mapping: QConfigMapping | None = None, backend: str = "x86"
) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    """(calibrated prepared model, converted int8 model), both built from copies of ``model``."""
    from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

    batches = list(data)
    prepared = prepare_fx(copy.deepcopy(model).eval(), mapping or get_default_qconfig_mapping(backend), (batches[0],))
    with torch.no_grad():
        for batch in batches:
            prepared(batch)
    return prepared, convert_fx(copy.deepcopy(prepared))


def prepare_eager_ptq(model: EagerConvNet, data: Iterable, backend: str = "x86") -> nn.Module:
    """Eager-mode PTQ up to conversion: a fused, prepared and calibrated copy of ``model``."""
    from torch.ao.quantization import fuse_modules, prepare

    prepared = copy.deepcopy(model).eval()
    prepared.qconfig = get_default_qconfig(backend)
    fuse_modules(prepared, EagerConvNet.FUSION, inplace=True)
    prepare(prepared, inplace=True)
    with torch.no_grad():
        for batch in data:
            prepared(batch)
    return prepared


def quantize_eager_ptq(model: EagerConvNet, data: Iterable, backend: str = "x86") -> nn.Module:
    from torch.ao.quantization import convert

    return convert(prepare_eager_ptq(model, data, backend), inplace=True)


def demo_factory_float() -> nn.Module:
    """`qlint compare` demo: ``qlint.numeric.examples:demo_factory_float``."""
    torch.manual_seed(0)
    return randomize_batch_norm(SmallConvNet()).eval()


def demo_factory_quantized() -> nn.Module:
    """The demo float model quantized with a bad config for ``res1.conv2``."""
    _, converted = quantize_fx_ptq(demo_factory_float(), image_batches(4), bad_layer_qconfig_mapping("res1.conv2"))
    return converted


def demo_calibration_data() -> list[torch.Tensor]:
    return image_batches(6, seed=1)
