"""Models with structures known to quantize badly, briefly trained on synthetic tasks.

Each builder returns ``(model, calibration, eval_data)`` after a short seeded training run
(a few seconds on 2 CPU cores) so the weights are realistic rather than random init.
Some structures are then made worse by a *function-preserving* reparametrization (the
float outputs do not change, within float rounding), which is how the problem arises in
trained networks: a few LayerNorm gains grow large while the next layer's weights for
those dims shrink (BERT-style outlier dims); some input columns of a linear carry tiny
activations with compensatingly large weights; a few conv filters are near-dead and their
BatchNorm re-amplifies them (small running_var).

(a) ``outlier_mlp``      transformer-style MLP blocks with LayerNorm outlier dims
(b) ``imbalanced_mlp``   linear layers whose input channels are imbalanced (equalization helps)
(c) ``drifting_linear``  a linear fed a non-stationary input (scale drifts batch to batch)
(d) ``gated_cnn``        sigmoid gate + softmax head + an unfused (fan-out) conv-bn
(e) ``same_conv_cnn``    a CNN of conv subclasses whose forward traces to F.conv2d, then BN modules
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

STEPS = 150


def _train(
    model: nn.Module,
    make_batch: Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]],
    loss_fn: Callable,
    steps: int = STEPS,
    lr: float = 3e-3,
    seed: int = 0,
) -> nn.Module:
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        x, y = make_batch(generator)
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
    return model.eval()


# ------------------------------------------------------------------------- (a) outliers
class MLPBlock(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.fc2(F.relu(self.fc1(self.ln(x))))


class OutlierMLP(nn.Module):
    def __init__(self, din: int = 32, dim: int = 64, hidden: int = 128, blocks: int = 5, dout: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(din, dim)
        self.blocks = nn.Sequential(*[MLPBlock(dim, hidden) for _ in range(blocks)])
        self.out = nn.Linear(dim, dout)

    def forward(self, x):
        return self.out(self.blocks(self.inp(x)))


def _teacher(din: int, dout: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    teacher = nn.Sequential(nn.Linear(din, 64), nn.Tanh(), nn.Linear(64, dout))
    return teacher.eval()


def _regression_data(din: int, dout: int, seed: int, scale_fn=None):
    teacher = _teacher(din, dout, seed + 100)

    def batch(generator):
        x = torch.randn(64, din, generator=generator)
        if scale_fn is not None:
            x = x * scale_fn(generator)
        with torch.no_grad():
            return x, teacher(x)

    return batch


def _split(make_input: Callable[[torch.Generator], torch.Tensor], seed: int, n_cal: int = 8, n_eval: int = 8):
    generator = torch.Generator().manual_seed(seed + 1)
    calibration = [make_input(generator) for _ in range(n_cal)]
    eval_data = [make_input(generator) for _ in range(n_eval)]
    return calibration, eval_data


def outlier_mlp(seed: int = 0):
    torch.manual_seed(seed)
    model = OutlierMLP()
    batch = _regression_data(32, 16, seed)
    _train(model, batch, F.mse_loss, seed=seed)
    with torch.no_grad():  # BERT-style outlier dims: big LN gain, next layer compensates
        for block in model.blocks:
            for dim in (3, 17):
                block.ln.weight[dim] *= 60.0
                block.ln.bias[dim] *= 60.0
                block.fc1.weight[:, dim] /= 60.0
    return (model,) + _split(lambda g: torch.randn(64, 32, generator=g), seed)


# ---------------------------------------------------------------------- (b) imbalance
class ImbalancedMLP(nn.Module):
    def __init__(self, din: int = 32, dim: int = 64, layers: int = 10, dout: int = 16) -> None:
        super().__init__()
        sizes = [din] + [dim] * (layers - 1) + [dout]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes, sizes[1:]))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.relu(x)
        return x


def imbalanced_mlp(seed: int = 0):
    torch.manual_seed(seed)
    model = ImbalancedMLP()
    _train(model, _regression_data(32, 16, seed), F.mse_loss, seed=seed)
    generator = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():  # scale output rows of layer i by s, input columns of layer i+1 by 1/s
        for i in (2, 5):
            s = torch.exp(torch.empty(model.layers[i].out_features).uniform_(-4.0, 1.0, generator=generator))
            model.layers[i].weight.mul_(s[:, None])
            model.layers[i].bias.mul_(s)
            model.layers[i + 1].weight.div_(s[None, :])
    return (model,) + _split(lambda g: torch.randn(64, 32, generator=g), seed)


# -------------------------------------------------------------------- (c) non-stationary
class DriftingNet(nn.Module):
    """The first linear sees an input whose scale drifts; LayerNorm makes the rest stationary."""

    def __init__(self, din: int = 32, dim: int = 64, dout: int = 16, depth: int = 8) -> None:
        super().__init__()
        self.fc_in = nn.Linear(din, dim)
        self.norm = nn.LayerNorm(dim)
        self.body = nn.Sequential(*[nn.Sequential(nn.Linear(dim, dim), nn.ReLU()) for _ in range(depth)])
        self.fc_out = nn.Linear(dim, dout)

    def forward(self, x):
        return self.fc_out(self.body(self.norm(self.fc_in(x))))


def _drift(generator: torch.Generator) -> float:
    return float(10 ** torch.empty(1).uniform_(-2.0, 1.0, generator=generator))


def drifting_linear(seed: int = 0):
    torch.manual_seed(seed)
    model = DriftingNet()
    teacher_batch = _regression_data(32, 16, seed)

    def batch(generator):  # scale-invariant target: teacher on the normalized input
        x, _ = teacher_batch(generator)
        scale = _drift(generator)
        with torch.no_grad():
            return x * scale, _teacher(32, 16, seed + 100)(x)

    _train(model, batch, F.mse_loss, seed=seed)
    return (model,) + _split(lambda g: torch.randn(64, 32, generator=g) * _drift(g), seed)


# ----------------------------------------------------- (d) sigmoid/softmax + unfused conv-bn
class GatedCNN(nn.Module):
    def __init__(self, width: int = 16, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1)
        self.convs = nn.ModuleList(nn.Conv2d(width, width, 3, padding=1) for _ in range(6))
        self.bns = nn.ModuleList(nn.BatchNorm2d(width) for _ in range(6))
        self.gate = nn.Conv2d(width, width, 1)
        self.branch = nn.Conv2d(width, width, 3, padding=1)  # output also feeds the skip: unfused with bn
        self.branch_bn = nn.BatchNorm2d(width)
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        x = F.relu(self.stem(x))
        for conv, bn in zip(self.convs, self.bns):
            x = F.relu(bn(conv(x)))
        x = x * torch.sigmoid(self.gate(x))
        y = self.branch(x)
        x = F.relu(self.branch_bn(y)) + y
        return torch.softmax(self.head(x.mean((2, 3))), dim=-1)


def _images(generator, n=32, size=16, classes=10):
    labels = torch.randint(0, classes, (n,), generator=generator)
    freq = (labels.float() + 1.0)[:, None, None, None] / classes
    grid = torch.linspace(0, 6.28, size)
    pattern = torch.sin(freq * grid[None, None, :, None] * 3 + grid[None, None, None, :])
    x = pattern.expand(n, 3, size, size) + 0.5 * torch.randn(n, 3, size, size, generator=generator)
    return x, labels


def _near_dead_filters(conv_weight, conv_bias, bn, channels, factor=1e-3):
    """Shrink filters by ``factor``; BN re-amplifies them (running stats scaled to match)."""
    with torch.no_grad():
        for c in channels:
            conv_weight[c] *= factor
            if conv_bias is not None:
                conv_bias[c] *= factor
            bn.running_mean[c] *= factor
            bn.running_var[c] = bn.running_var[c] * factor * factor
            bn.eps = bn.eps  # eps stays; var*factor^2 >> eps is checked by the float test
    return bn


def gated_cnn(seed: int = 0):
    torch.manual_seed(seed)
    model = GatedCNN()
    _train(model, _images, lambda out, y: F.nll_loss(torch.log(out + 1e-6), y), seed=seed)
    with torch.no_grad():
        bn = model.branch_bn
        channels = [1, 5, 9]
        for c in channels:
            bn.running_var[c] = bn.running_var[c].clamp_min(1e-2)
        bn.eps = 1e-9
        _near_dead_filters(model.branch.weight, model.branch.bias, bn, channels, factor=3e-3)
    return (model,) + _split(lambda g: _images(g)[0], seed)


# ---------------------------------------------------- (e) conv subclass → F.conv2d + BN
class SameConv2d(nn.Conv2d):
    """TF-style 'same' padding in a custom forward: traces to F.pad + F.conv2d, not a module call."""

    def forward(self, x):
        k = self.kernel_size[0]
        pad = (k - 1) // 2
        x = F.pad(x, (pad, k - 1 - pad, pad, k - 1 - pad))
        return F.conv2d(x, self.weight, self.bias, self.stride, (0, 0), self.dilation, self.groups)


class SameConvCNN(nn.Module):
    def __init__(self, width: int = 16, classes: int = 10, depth: int = 6) -> None:
        super().__init__()
        self.convs = nn.ModuleList(
            [SameConv2d(3, width, 3, bias=False)] + [SameConv2d(width, width, 3, bias=False) for _ in range(depth - 1)]
        )
        self.bns = nn.ModuleList(nn.BatchNorm2d(width) for _ in range(depth))
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        for conv, bn in zip(self.convs, self.bns):
            x = F.relu(bn(conv(x)))
        return self.head(x.mean((2, 3)))


def same_conv_cnn(seed: int = 0):
    torch.manual_seed(seed)
    model = SameConvCNN()
    _train(model, _images, F.cross_entropy, seed=seed)
    generator = torch.Generator().manual_seed(seed + 3)
    with torch.no_grad():
        for conv, bn in zip(model.convs, model.bns):
            bn.eps = 1e-9
            channels = torch.randperm(conv.out_channels, generator=generator)[:3].tolist()
            for c in channels:
                bn.running_var[c] = bn.running_var[c].clamp_min(1e-2)
            _near_dead_filters(conv.weight, None, bn, channels, factor=3e-3)
    return (model,) + _split(lambda g: _images(g)[0], seed)


MODELS = {
    "a_outlier_mlp": outlier_mlp,
    "b_imbalanced_mlp": imbalanced_mlp,
    "c_drifting_linear": drifting_linear,
    "d_gated_cnn": gated_cnn,
    "e_same_conv_cnn": same_conv_cnn,
}
