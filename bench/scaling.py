"""Scaling benchmark: qlint's cost against torch's own passes as the model grows.

    python bench/scaling.py [--sizes 200,2000,20000] [--trial-sizes 200,2000,20000]
                            [--static-rounds 5,3,1] [--trial-rounds 3,1,1] [--width 64] [--batch 32]

The model is an ``nn.Sequential`` of Linear(width, width) + ReLU pairs; "layers" counts
modules, so 2,000 layers are 1,000 Linear+ReLU pairs. Seeded weights and input. Two
comparisons, each measured side by side in this one process (the 2-core VM's speed drifts
by tens of percent over minutes, so only ratios taken round by round mean anything):

* static: ``qlint.lint(model, (x,), trial_options={"enabled": False})`` (trace, graph, every
  static rule; no trial; the data rules are skipped: no calibration data) against
  ``torch.export.export(model, (x,))``.
  Target: at most 10x at every size, and 20,000 layers within 5 minutes.
* trial: qlint's trial quantization as the engine runs it (its "trial" timing: private
  copies of the traced model, a float forward, prepare_fx, one calibration forward (the
  example input), convert_fx, the quantized forward, the per-layer paired run and the
  activation pass; ``--select QL105`` and no fix trials), against torch's own pass
  on a copy of the model: prepare_fx, one calibration forward, convert_fx and one forward,
  with the same qconfig mapping and BackendConfig (x86). Target: at most 1.5x.

Rounds alternate which side runs first. One untimed warm-up of every path on a 4-layer model
comes first (torch.export and prepare_fx import torch._dynamo, seconds of one-off cost).
torch runs on one thread, as in bench/advice.py, so the other tenants' load moves both sides
alike. A 20,000-layer trial takes tens of minutes: torch's prepare_fx rebuilds its module
dict for every observed node (quadratic in the model size) and the HistogramObserver's
qparam search is a Python loop per observer; `--trial-sizes 200,2000` skips it.
"""

from __future__ import annotations

import argparse
import copy
import gc
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn as nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from torch.ao.quantization import get_default_qconfig_mapping  # noqa: E402
from torch.ao.quantization.backend_config.x86 import get_x86_backend_config  # noqa: E402
from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx  # noqa: E402

import qlint  # noqa: E402


def stack(layers: int, width: int, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    modules: list[nn.Module] = []
    for _ in range(layers // 2):
        modules += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*modules).eval()


def example(width: int, batch: int) -> torch.Tensor:
    return torch.randn(batch, width, generator=torch.Generator().manual_seed(1))


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    gc.collect()
    began = time.perf_counter()
    result = fn()
    return time.perf_counter() - began, result


def torch_export(model: nn.Module, x: torch.Tensor) -> float:
    seconds, _ = timed(lambda: torch.export.export(model, (x,)))
    return seconds


def qlint_static(model: nn.Module, x: torch.Tensor) -> tuple[float, dict[str, float]]:
    seconds, report = timed(lambda: qlint.lint(model, (x,), trial_options={"enabled": False}))
    return seconds, {t.stage: t.seconds for t in report.timings}


def torch_trial(model: nn.Module, x: torch.Tensor) -> float:
    """What a user runs: prepare_fx, calibrate once, convert_fx, run once (the copy is untimed)."""
    working = copy.deepcopy(model)
    backend_config = get_x86_backend_config()

    def run():
        with torch.no_grad():
            prepared = prepare_fx(working, get_default_qconfig_mapping("x86"), (x,), backend_config=backend_config)
            prepared(x)
            converted = convert_fx(prepared, backend_config=backend_config)
            return converted(x)

    previous = torch.backends.quantized.engine
    torch.backends.quantized.engine = "x86"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            seconds, _ = timed(run)
    finally:
        torch.backends.quantized.engine = previous
    return seconds


def qlint_trial(model: nn.Module, x: torch.Tensor) -> tuple[float, float, str]:
    """(the trial's own time, the whole `lint --select QL105`, QL105's finding)."""
    seconds, report = timed(lambda: qlint.lint(model, (x,), select=["QL105"], trial_options={"max_fix_trials": 0}))
    rule = next(t.seconds for t in report.timings if t.stage == "trial")
    kinds = ", ".join(str(f.data.get("kind")) for f in report.findings if f.rule == "QL105") or "no finding"
    return rule, seconds, kinds


def alternate(rounds: int, first: Callable[[], object], second: Callable[[], object]) -> list[tuple]:
    """Run both sides ``rounds`` times, alternating which goes first; [(first, second), ...]."""
    results = []
    for index in range(rounds):
        if index % 2 == 0:
            a = first()
            b = second()
        else:
            b = second()
            a = first()
        results.append((a, b))
    return results


def ratio_text(ratios: list[float]) -> str:
    median = statistics.median(ratios)
    if len(ratios) == 1:
        return f"{median:.2f}"
    return f"{median:.2f} ({min(ratios):.2f}–{max(ratios):.2f})"


def per_size(values: str, sizes: list[int], name: str) -> dict[int, int]:
    counts = [int(v) for v in values.split(",")]
    if len(counts) < len(sizes):
        counts += [counts[-1]] * (len(sizes) - len(counts))
    if any(c < 1 for c in counts):
        raise SystemExit(f"--{name}: every count must be at least 1")
    return dict(zip(sizes, counts))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="200,2000,20000", help="layer counts for the static comparison")
    parser.add_argument("--trial-sizes", default="200,2000,20000", help="layer counts for the trial comparison")
    parser.add_argument("--static-rounds", default="5,3,1", help="rounds per static size")
    parser.add_argument("--trial-rounds", default="3,1,1", help="rounds per trial size")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",") if s]
    trial_sizes = [int(s) for s in args.trial_sizes.split(",") if s]
    static_rounds = per_size(args.static_rounds, sizes, "static-rounds")
    trial_rounds = per_size(args.trial_rounds, trial_sizes, "trial-rounds")
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")  # observer deprecation warnings, once per observer

    tiny, x = stack(4, args.width), example(args.width, args.batch)
    torch_export(tiny, x), qlint_static(tiny, x), torch_trial(tiny, x), qlint_trial(tiny, x)
    print(
        f"torch {torch.__version__}, qlint {qlint.__version__}, {args.threads} thread(s); "
        f"Sequential of Linear({args.width}, {args.width}) + ReLU, input {args.batch}x{args.width}\n"
    )

    print("static rules: qlint.lint(trial off) vs torch.export.export")
    print("| layers | rounds | torch.export s | qlint s (trace / rules) | qlint ÷ export, median (range) |")
    print("|---:|---:|---:|---:|---:|")
    for layers in sizes:
        model = stack(layers, args.width)
        rows = alternate(static_rounds[layers], lambda m=model: torch_export(m, x), lambda m=model: qlint_static(m, x))
        exports = [e for e, _ in rows]
        lints = [q[0] for _, q in rows]
        stages = rows[-1][1][1]
        ratios = [q[0] / e for e, q in rows]
        print(
            f"| {layers:,} | {len(rows)} | {statistics.median(exports):.2f} | {statistics.median(lints):.2f} "
            f"({stages['trace']:.2f} / {stages['rules']:.2f}) | {ratio_text(ratios)} |",
            flush=True,
        )
        del model, rows

    print("\ntrial quantization as lint runs it vs torch prepare_fx + calibrate + convert_fx + forward")
    print(
        "| layers | rounds | torch pass s | trial s | trial ÷ torch, median (range) | "
        "whole `lint --select QL105` s | QL105 result |"
    )
    print("|---:|---:|---:|---:|---:|---:|---|")
    for layers in trial_sizes:
        model = stack(layers, args.width)
        rows = alternate(trial_rounds[layers], lambda m=model: torch_trial(m, x), lambda m=model: qlint_trial(m, x))
        passes = [t for t, _ in rows]
        rules = [q[0] for _, q in rows]
        ratios = [q[0] / t for t, q in rows]
        print(
            f"| {layers:,} | {len(rows)} | {statistics.median(passes):.1f} | {statistics.median(rules):.1f} | "
            f"{ratio_text(ratios)} | {statistics.median(q[1] for _, q in rows):.1f} | {rows[-1][1][2]} |",
            flush=True,
        )
        del model, rows


if __name__ == "__main__":
    main()
