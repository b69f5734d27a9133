#!/usr/bin/env python3
"""Time qlint's sensitivity() against the exhaustive one-layer-at-a-time method.

    python bench/sensitivity.py [--model small|tower] [--batches 4] [--threads 1] [--bad LAYER]

Prints both rankings, the wall time of each, the speedup (also for the analysis
alone, when the quantized model already exists as in `qlint compare --sensitivity`),
and the Spearman rank correlation over the exhaustive method's top 10 layers (and
over all layers).
Both methods see the same calibration data and the same qconfig mapping.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qlint.numeric.examples import (  # noqa: E402
    ResidualTower,
    SmallConvNet,
    bad_layer_qconfig_mapping,
    image_batches,
    randomize_batch_norm,
)
from qlint.numeric.sensitivity import (  # noqa: E402
    exhaustive_sensitivity,
    quantize_with_fx,
    sensitivity_rows,
    spearman,
    top_k_spearman,
)

MODELS = {"small": lambda: SmallConvNet(), "tower": lambda: ResidualTower(blocks=10)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="tower")
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--size", type=int, default=16, help="input height and width")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1 suits shared machines)")
    parser.add_argument("--bad", default=None, help="give this layer 4-level weights (a broken config)")
    parser.add_argument("--backend", default="x86")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = randomize_batch_norm(MODELS[args.model]()).eval()
    data = image_batches(args.batches, batch_size=args.batch_size, size=args.size, seed=1)
    mapping = bad_layer_qconfig_mapping(args.bad, args.backend) if args.bad else None

    sensitivity_rows(model, data[:1], args.backend, mapping)  # warm-up: lazy imports, first-call costs
    started = time.perf_counter()
    rows = sensitivity_rows(model, data, args.backend, mapping)
    fast = time.perf_counter() - started
    quantized = quantize_with_fx(model, data, args.backend, mapping)
    started = time.perf_counter()
    sensitivity_rows(model, data, args.backend, quantized_model=quantized)
    analysis_only = time.perf_counter() - started
    started = time.perf_counter()
    reference = exhaustive_sensitivity(model, data, args.backend, mapping)
    slow = time.perf_counter() - started

    estimate = [(row.name, row.score) for row in rows]
    estimated = dict(estimate)
    exhaustive_rank = {name: rank for rank, (name, _) in enumerate(reference, 1)}
    print(
        f"model {args.model}: {len(rows)} quantized layers, {args.batches} batches of "
        f"{args.batch_size}x3x{args.size}x{args.size}, {args.threads} thread(s), torch {torch.__version__}"
    )
    print(f"{'rank':>4} {'layer':<22} {'estimate':>10} {'exhaustive':>10} {'ex. rank':>8} {'FLOPs':>6} {'params':>6}")
    for rank, row in enumerate(rows, 1):
        print(
            f"{rank:>4} {row.name:<22} {row.score:>10.3e} {dict(reference)[row.name]:>10.3e} "
            f"{exhaustive_rank[row.name]:>8} {100 * row.flops_share:>5.1f}% {100 * row.params_share:>5.1f}%"
        )
    top10 = top_k_spearman(reference, estimate, 10)
    overall = spearman([value for _, value in reference], [estimated[name] for name, _ in reference])
    print(f"sensitivity(): {fast:.2f} s   exhaustive: {slow:.2f} s   speedup: {slow / fast:.1f}x")
    print(
        f"  of which analysis, given the quantized model: {analysis_only:.2f} s "
        f"({slow / analysis_only:.1f}x faster than exhaustive)"
    )
    print(f"Spearman, exhaustive top 10: {top10:.3f}   all {len(reference)} layers: {overall:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
