"""Test models: the same network written in several styles."""

import operator

import torch
import torch.nn as nn
import torch.nn.functional as F

from qlint.core.sqnr import SqnrSums


def _init(module: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    for p in module.parameters():
        with torch.no_grad():
            p.copy_(torch.randn_like(p) * 0.2)
    return module.eval()


class SequentialNet(nn.Sequential):
    """conv-bn-relu, conv-bn-relu, pool, flatten, linear-relu, linear (no branches)."""

    def __init__(self):
        super().__init__(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.Conv2d(8, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(8, 16),
            nn.ReLU(),
            nn.Linear(16, 4),
        )


class Block(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=1)
        self.bn = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU()

    def forward(self, x):
        return self.relu(self.bn(self.conv(x)))


class NestedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(Block(3, 8), Block(8, 8))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.ModuleDict({"fc1": nn.Linear(8, 16), "act": nn.ReLU(), "fc2": nn.Linear(16, 4)})

    def forward(self, x):
        x = torch.flatten(self.pool(self.features(x)), 1)
        return self.head["fc2"](self.head["act"](self.head["fc1"](x)))


class FunctionalNet(nn.Module):
    """Weighted layers are modules; activations, pooling and flatten are functional."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(8)
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = torch.relu(self.bn2(self.conv2(x)))
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        return self.fc2(F.relu(self.fc1(x)))


class ResidualSequentialStyle(nn.Module):
    """Fan-out and a shared projection written with modules."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.relu = nn.ReLU()
        self.proj = nn.Linear(8, 8)
        self.unused = nn.Linear(8, 8)

    def forward(self, x):
        y = self.conv(x)
        y = self.relu(self.bn(y)) + y
        v = torch.flatten(nn.functional.adaptive_avg_pool2d(y, 1), 1)
        return self.proj(self.proj(v))


class ResidualFunctionalStyle(ResidualSequentialStyle):
    def forward(self, x):
        y = self.conv(x)
        y = operator.add(F.relu(self.bn(y)), y)
        v = F.adaptive_avg_pool2d(y, 1).flatten(1)
        return self.proj(self.proj(v))


def sequential_net():
    return _init(SequentialNet())


def nested_net():
    return _init(NestedNet())


def functional_net():
    return _init(FunctionalNet())


def residual_modules():
    return _init(ResidualSequentialStyle())


def residual_functional():
    return _init(ResidualFunctionalStyle())


def per_tensor_mapping(backend: str = "x86"):
    """A hand-written mapping: per-tensor weights everywhere, generic observer for sigmoid too."""
    from torch.ao.quantization import HistogramObserver, MinMaxObserver, QConfig, QConfigMapping

    qconfig = QConfig(
        activation=HistogramObserver.with_args(reduce_range=True),
        weight=MinMaxObserver.with_args(dtype=torch.qint8, qscheme=torch.per_tensor_symmetric),
    )
    return QConfigMapping().set_global(qconfig)


class GatedSequential(nn.Sequential):
    def __init__(self):
        super().__init__(SequentialNet(), nn.Sigmoid())


class GatedNested(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = NestedNet()
        self.gate = nn.Sigmoid()

    def forward(self, x):
        return self.gate(self.body(x))


class GatedFunctional(FunctionalNet):
    def forward(self, x):
        return torch.sigmoid(super().forward(x))


def gated_nested_train():
    """Factory used as 'tests.models:gated_nested_train' (BatchNorm left in training mode)."""
    return _init(GatedNested()).train()


class InvertedResidual(nn.Module):
    """MobileNetV2's block: expand 1x1, depthwise 3x3, project 1x1; a residual add when shapes allow."""

    def __init__(self, cin, cout, stride, expand, inplace):
        super().__init__()
        hidden = cin * expand
        self.use_residual = stride == 1 and cin == cout
        self.conv = nn.Sequential(
            nn.Conv2d(cin, hidden, 1, bias=False),
            nn.BatchNorm2d(hidden),
            nn.ReLU6(inplace=inplace),
            nn.Conv2d(hidden, hidden, 3, stride, 1, groups=hidden, bias=False),
            nn.BatchNorm2d(hidden),
            nn.ReLU6(inplace=inplace),
            nn.Conv2d(hidden, cout, 1, bias=False),
            nn.BatchNorm2d(cout),
        )

    def forward(self, x):
        return x + self.conv(x) if self.use_residual else self.conv(x)


class MobileNetStyle(nn.Module):
    """A small MobileNetV2: ReLU6 activations (in place, as torchvision writes them) and residual adds."""

    def __init__(self, inplace=True, num_classes=10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU6(inplace=inplace))
        self.blocks = nn.Sequential(
            InvertedResidual(8, 8, 1, 2, inplace),
            InvertedResidual(8, 12, 2, 3, inplace),
            InvertedResidual(12, 12, 1, 3, inplace),
        )
        self.head = nn.Sequential(nn.Conv2d(12, 24, 1, bias=False), nn.BatchNorm2d(24), nn.ReLU6(inplace=inplace))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(24, num_classes)

    def forward(self, x):
        x = self.head(self.blocks(self.stem(x)))
        return self.fc(torch.flatten(self.pool(x), 1))


def mobilenet_style(inplace=True):
    """Default init plus BN statistics away from identity; the same weights for either ``inplace``."""
    torch.manual_seed(0)
    model = MobileNetStyle(inplace)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d):
                channels = module.num_features
                module.running_mean.copy_(torch.rand(channels, generator=generator) * 0.4 - 0.2)
                module.running_var.copy_(torch.rand(channels, generator=generator) + 0.5)
                module.weight.copy_(torch.rand(channels, generator=generator) + 0.5)
                module.bias.copy_(torch.rand(channels, generator=generator) * 0.4 - 0.2)
    return model.eval()


def output_sqnr(model, quantized, batches) -> float:
    """Output SQNR (dB) of ``quantized`` against ``model`` over ``batches`` (tensors)."""
    sums = SqnrSums()
    with torch.no_grad():
        for batch in batches:
            sums.add(model(batch), quantized(batch))
    db = sums.sqnr_db()
    assert db is not None, "no floating-point outputs to compare"
    return db
