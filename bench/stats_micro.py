"""Micro-benchmark: calibration cost of StatsObserver on a ResNet-18-shaped CNN.

Times a plain forward against a forward with a StatsObserver on the input of
every conv/linear and on the output of every linear, over the same batches,
and prints the ratio (target: <= 1.3). Plain and observed passes alternate so
that background load hits both alike; the median over repeats is reported.
On a shared machine use ``--threads 1`` and read the CPU-time ratio too: with
several OpenMP threads, every parallel region waits for its slowest thread,
so wall times then measure the other tenants more than the code.

    python bench/stats_micro.py [--batches 8] [--batch-size 8] [--repeats 3] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from qlint.stats import StatsObserver


class BasicBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.downsample = None
        if stride != 1 or in_channels != out_channels:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=False), nn.BatchNorm2d(out_channels)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        shortcut = x if self.downsample is None else self.downsample(x)
        return torch.relu(out + shortcut)


def resnet18_shaped(num_classes: int = 1000) -> nn.Module:
    widths = [64, 128, 256, 512]
    layers: list[nn.Module] = [
        nn.Conv2d(3, 64, 7, 2, 3, bias=False),
        nn.BatchNorm2d(64),
        nn.ReLU(),
        nn.MaxPool2d(3, 2, 1),
    ]
    in_channels = 64
    for stage, width in enumerate(widths):
        layers.append(BasicBlock(in_channels, width, 1 if stage == 0 else 2))
        layers.append(BasicBlock(width, width, 1))
        in_channels = width
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, num_classes)]
    return nn.Sequential(*layers).eval()


def attach_observers(model: nn.Module) -> tuple[list[StatsObserver], list]:
    """Observer on every conv/linear input and every linear output, via hooks."""
    observers: list[StatsObserver] = []
    handles = []
    for module in list(model.modules()):
        if isinstance(module, (nn.Conv2d, nn.Linear)):
            before = StatsObserver(channel_axis=1)
            observers.append(before)
            handles.append(module.register_forward_pre_hook(lambda _m, args, obs=before: (obs(args[0]),) + args[1:]))
        if isinstance(module, nn.Linear):
            after = StatsObserver(channel_axis=1)
            observers.append(after)
            handles.append(module.register_forward_hook(lambda _m, _args, out, obs=after: obs(out)))
    return observers, handles


def time_pass(model: nn.Module, batches: list[torch.Tensor]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) for one pass over ``batches``."""
    wall, cpu = time.perf_counter(), time.process_time()
    with torch.no_grad():
        for batch in batches:
            model(batch)
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch default)")
    args = parser.parse_args()
    if args.threads:
        # One thread is the robust setting on a shared machine: OpenMP barriers
        # degrade badly when other processes compete for the cores.
        torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    plain = resnet18_shaped()
    observed = resnet18_shaped()
    observed.load_state_dict(plain.state_dict())
    observers, _handles = attach_observers(observed)
    batches = [torch.randn(args.batch_size, 3, 224, 224) for _ in range(args.batches)]

    time_pass(plain, batches[:1])  # warm-up: allocator, oneDNN primitives, scratch buffers
    time_pass(observed, batches[:1])
    plain_times, observed_times = [], []
    for _ in range(args.repeats):
        plain_times.append(time_pass(plain, batches))
        observed_times.append(time_pass(observed, batches))
    print(f"threads={torch.get_num_threads()} observers={len(observers)} batches={args.batches}x{args.batch_size}")
    for index, clock in enumerate(("wall", "cpu")):
        plain_s = [times[index] for times in plain_times]
        observed_s = [times[index] for times in observed_times]
        ratios = [o / p for o, p in zip(observed_s, plain_s)]
        print(
            f"{clock:4s}: plain median {statistics.median(plain_s) * 1e3:8.1f} ms, "
            f"observed median {statistics.median(observed_s) * 1e3:8.1f} ms, "
            f"ratio median {statistics.median(ratios):.3f} (min {min(ratios):.3f})"
        )


if __name__ == "__main__":
    main()
