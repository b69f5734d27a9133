"""Models whose forward changes state: what qlint must leave as it was (tests/test_preserve.py).

Each is importable by the CLI as ``tests.stateful_models:<factory>``.
"""

import random

import torch
import torch.nn as nn
import torch.nn.functional as F


def _seeded(module: nn.Module) -> nn.Module:
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    return module.eval()


class ClampsWeight(nn.Module):
    """Clips its weights in place on every call, the way weight-clipping code does."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 8)

    def forward(self, x):
        with torch.no_grad():
            self.fc1.weight.clamp_(-0.05, 0.05)
            self.fc2.bias.data.mul_(2.0)
        return self.fc2(torch.relu(self.fc1(x)))


class ReassignsBuffer(nn.Module):
    """Counts its calls in a buffer that it replaces with a new tensor each time."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 8)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls = self.calls + 1
        return self.fc(x)


class ResizesObserver(nn.Module):
    """A per-channel observer on an activation: its min/max buffers grow from (0,) to (C,)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.observer = torch.ao.quantization.PerChannelMinMaxObserver(ch_axis=1)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        y = self.observer(torch.relu(self.conv(x)))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(y, 1), 1))


class WritesAttributes(nn.Module):
    """Keeps plain Python state: a call counter, a history list, a new attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 8)
        self.calls = 0
        self.history = []

    def forward(self, x):
        self.calls += 1
        self.history.append(self.calls)
        self.last_batch_size = 2
        return self.fc(x)


class WritesInput(nn.Module):
    """Scales its input in place before the first layer (``x = x.mul_(2)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 8)

    def forward(self, x):
        x = x.mul_(2.0)
        return self.fc2(torch.relu(self.fc1(x)))


class WritesInputUnused(WritesInput):
    """``x.mul_(2)`` as a statement: convert_fx drops the node (its value is unused), so the
    quantized model really computes something else."""

    def forward(self, x):
        x.mul_(2.0)
        return self.fc2(torch.relu(self.fc1(x)))


class ReadsInput(WritesInput):
    """WritesInput without the in-place write: the same function of a doubled input."""

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x * 2.0)))


class UsesRandomness(nn.Module):
    """Draws from torch's and Python's global RNGs (and numpy's when the test imported it)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 8)

    def forward(self, x):
        noise = torch.rand(1) * 0.0
        jitter = random.random() * 0.0
        return self.fc(x + noise + jitter)


class StoresProxyAttribute(nn.Module):
    """Keeps its last input as an attribute: under tracing that is a torch.fx Proxy."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 8)
        self.last_input = None

    def forward(self, x):
        self.last_input = x
        return self.fc(x)


class StoresProxyBuffer(nn.Module):
    """Puts a value computed in forward straight into its buffer table."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 8)
        self.register_buffer("running", torch.zeros(16))

    def forward(self, x):
        self._buffers["running"] = x.mean(0)
        return self.fc(x)


def clamps_weight() -> nn.Module:
    return _seeded(ClampsWeight())


def reassigns_buffer() -> nn.Module:
    return _seeded(ReassignsBuffer())


def resizes_observer() -> nn.Module:
    return _seeded(ResizesObserver())


def writes_attributes() -> nn.Module:
    return _seeded(WritesAttributes())


def writes_input() -> nn.Module:
    return _seeded(WritesInput())


def writes_input_unused() -> nn.Module:
    return _seeded(WritesInputUnused())


def reads_input() -> nn.Module:
    return _seeded(ReadsInput())


def uses_randomness() -> nn.Module:
    return _seeded(UsesRandomness())


def lazy() -> nn.Module:
    return nn.Sequential(nn.LazyLinear(32), nn.ReLU(), nn.Linear(32, 8)).eval()


def stores_proxy_attribute() -> nn.Module:
    return _seeded(StoresProxyAttribute())


def stores_proxy_buffer() -> nn.Module:
    return _seeded(StoresProxyBuffer())
