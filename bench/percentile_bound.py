"""The error bound of the sampled reference quantile, by simulation.

    python bench/percentile_bound.py [--channels 20000] [--q 0.975,0.9]

For a batch of ``n`` values per channel above the exact-selection size, qlint
estimates each channel's reference quantile from a fixed random sample of
positions (qlint/stats/selection.py). The positions are uniform, so the batch
ranks of the sampled values are uniform whatever the data: the *level* of the
estimate (the fraction of the channel's values below it) has a distribution
that depends on n, q and the sample plan only. This script measures it with
the real code on channels whose values are random permutations (no ties) and
prints, per (q, n), the 1 % / 99 % quantiles of that level next to torch's exact
level, and the same for the mean over 8 batches (the metric averages batches).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from qlint.stats.batch import summarize_values  # noqa: E402
from qlint.stats.selection import PERCENTILE_SAMPLE, host_reference_rank, sample_plan  # noqa: E402


def levels(n: int, q: float, channels: int, generator: torch.Generator) -> torch.Tensor:
    """Per channel, the fraction of its n values below the sampled reference (channel-last batch)."""
    ranks = torch.rand(n, channels, generator=generator).argsort(dim=0).float()  # a permutation per channel
    summary = summarize_values(ranks, -1, q, histogram=False)
    return summary.reference.double() / n  # value r has r values below it


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--channels", type=int, default=20000)
    parser.add_argument("--q", default="0.975,0.9")
    parser.add_argument("--sizes", default="128,256,300,512,1024,3072,25088")
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    print(f"percentile_sample={PERCENTILE_SAMPLE}; level of the estimate (fraction of the batch below it)")
    print(
        f"{'q':>6} {'n':>6} {'exact':>7} {'groups x size':>13} {'1 %':>7} {'median':>7} {'99 %':>7} "
        f"{'8-batch mean 1 %':>17} {'99 %':>7}"
    )
    for q in (float(value) for value in args.q.split(",")):
        for n in (int(value) for value in args.sizes.split(",")):
            # above the exact size (the sampled path), and at most ~2e7 values in memory at once
            channels = max(min(args.channels, 20_000_000 // n), 32768 // n + 1)
            level = levels(n, q, channels, generator)
            plan = sample_plan(n, q, PERCENTILE_SAMPLE, torch.device("cpu"))
            mean8 = level[: channels // 8 * 8].view(-1, 8).mean(1)
            low, middle, high = torch.quantile(level, torch.tensor([0.01, 0.5, 0.99], dtype=torch.float64)).tolist()
            low8, high8 = torch.quantile(mean8, torch.tensor([0.01, 0.99], dtype=torch.float64)).tolist()
            exact = host_reference_rank(n, q) / n
            print(
                f"{q:6.3f} {n:6d} {exact:7.4f} {f'{plan.groups} x {plan.group_size}':>13} {low:7.4f} "
                f"{middle:7.4f} {high:7.4f} {low8:17.4f} {high8:7.4f}"
            )


if __name__ == "__main__":
    main()
