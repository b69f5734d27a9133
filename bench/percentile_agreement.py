"""QL203 with the sampled reference quantile vs the exact one, on the benchmark models.

    python bench/percentile_agreement.py [--models encoder,minilm_l6,...] [--real-models DIR]

Runs the calibration of QL203 three times over the same batches (the models and batches
of bench/calibration.py): exact on every batch (``percentile_sample=None``,
``percentile_every=1``: element for element what torch's OutlierDetector computes); the
sampled estimate (``percentile_sample=PERCENTILE_SAMPLE``) on every batch; and the default,
the sampled estimate with points of more than 32 channels selecting it on one batch in
``PERCENTILE_EVERY``. Prints per model the channels compared, the exact outlier count, and
for each estimate how many channel verdicts (metric > ratio_threshold) differ from the exact
ones and the relative error of the metric (median, 99th percentile) over channels where both
metrics are finite.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import calibration as bench  # noqa: E402  (bench/calibration.py: models and batches)

from qlint.linter.calibration import insert_observers, resolve_point_needs, resolve_points, run_calibration  # noqa: E402
from qlint.linter.engine import analyse, instantiate_rules  # noqa: E402
from qlint.linter.registry import Registry  # noqa: E402
from qlint.rules._ql203_measure import outlier_metric  # noqa: E402
from qlint.stats import PERCENTILE_SAMPLE  # noqa: E402
from qlint.stats.selection import PERCENTILE_EVERY  # noqa: E402


def metrics(analysis, rules, data, percentile_sample, percentile_every):
    """Per observed point, QL203's per-channel metric after calibrating with these settings."""
    points = resolve_points(analysis.graph, rules)
    observed, observers, _ = insert_observers(
        analysis.traced.graph_module, points, needs=resolve_point_needs(analysis.graph, rules)
    )
    for observer in observers.values():
        observer.percentile_sample = percentile_sample
        observer.percentile_every = percentile_every
    run_calibration(observed, data, quiet=True)
    return {point: outlier_metric(observer.stats.average_percentile_ratio()) for point, observer in observers.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(bench.BUILT_IN + bench.REAL))
    parser.add_argument("--real-models", default=bench.DEFAULT_REAL_MODELS)
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()
    print(f"percentile_sample={PERCENTILE_SAMPLE} on every batch, and on 1 in {PERCENTILE_EVERY} (default), vs exact")
    print(
        f"{'model':18} {'channels':>8} {'outliers':>8} | {'every batch: differ':>20} {'median':>7} {'p99':>7} "
        f"| {'default: differ':>20} {'median':>7} {'p99':>7}"
    )
    for name in args.models.split(","):
        if name in bench.REAL and not bench.real_kit_available(args.real_models):
            print(f"skipping {name}: no real-model kit at {args.real_models}", file=sys.stderr)
            continue
        model, data = bench.load(name, args.batches, args.batch_size, args.real_models)
        analysis = analyse(model, data[0], "x86")
        rules = instantiate_rules(Registry.default(include_plugins=False).select(["QL203"], None), {})
        threshold = rules[0].options.ratio_threshold
        exact = metrics(analysis, rules, data, None, 1)
        channels = sum(metric.numel() for metric in exact.values())
        outliers = sum(int((metric > threshold).sum()) for metric in exact.values())
        line = f"{name:18} {channels:8d} {outliers:8d}"
        for every in (1, PERCENTILE_EVERY):
            estimate = metrics(analysis, rules, data, PERCENTILE_SAMPLE, every)
            differ, median, p99 = _agreement(exact, estimate, threshold)
            line += f" | {differ:11d} ({differ / channels:5.1%}) {median:7.3f} {p99:7.2f}"
        print(line)


def _agreement(exact, estimate, threshold):
    """(verdicts that differ, median and 99th percentile of the metric's relative error)."""
    differ = 0
    errors = []
    for point, exact_metric in exact.items():
        metric = estimate[point]
        finite = torch.isfinite(exact_metric) & torch.isfinite(metric)
        errors.append((metric[finite] / exact_metric[finite] - 1).abs())
        differ += int(((exact_metric > threshold) != (metric > threshold)).sum())
    error = torch.cat(errors).double()
    median, p99 = torch.quantile(error, torch.tensor([0.5, 0.99], dtype=torch.float64)).tolist()
    return differ, median, p99


if __name__ == "__main__":
    main()
