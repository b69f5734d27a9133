"""Calibration cost: plain forward vs qlint (QL201-203) vs torch ModelReport (4 detectors).

    python bench/calibration.py [--batches 8] [--batch-size 8] [--models resnet18,encoder,...]
                                [--modes plain,qlint,modelreport] [--repeats 3] [--loops 3]
                                [--real-models /work/shared/real_models]

``qlint-1in4`` is qlint with ``--percentile-every 4`` (points wider than 32 channels select
QL203's reference quantile on one batch in four). Three more modes split qlint's cost:
``qlint-minmax`` (every observer, computing only min, max and counts), ``qlint-calls``
(an identity module at every observed point) and ``floor-amax`` (one ``amax`` per observed
point, nothing kept: what any statistic computed in the model's stream costs at least).

Models: two built-in ones with random weights and data (a ResNet-18-shaped CNN
on 8x3x224x224 batches, a 4-block transformer encoder on 8x128x256 batches;
``--batches`` and ``--batch-size`` apply to them) and the four pretrained models
of the real-model kit (efficientnet_lite0, minilm_l6, silero_vad, digit_cnn,
each with its own 8 calibration batches; ``--batches`` caps them). Models whose
kit is missing are skipped with a message.

Times are wall-clock of the batch loop only (model build, tracing and observer
insertion are reported separately as setup). The development VM shares its
cores with other tenants, and its speed drifts by +-30 % over minutes, so the
ratios are measured side by side: one process holds every mode and runs one
pass of each in turn, ``repeats x loops`` rounds (ModelReport, ~20x slower,
every ``loops``-th round); the table shows the median and range of the
per-round ratios. Peak RSS needs a process per mode: each (model, mode) also
runs in its own subprocess on the same seeded batches, ``--repeats`` times,
modes alternating; those runs' times (fastest of ``--loops`` passes) are shown
too, as "separate".
"""

from __future__ import annotations

import argparse
import copy
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing qlint
BUILT_IN = ("resnet18", "encoder")
REAL = ("efficientnet_lite0", "minilm_l6", "silero_vad", "digit_cnn")
DEFAULT_REAL_MODELS = "/work/shared/real_models"


def _reset_peak_rss() -> bool:
    """Reset Linux's peak-RSS mark (VmHWM) of this process; False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


def _peak_rss_since_reset_mib():
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU()
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return self.relu(y + (x if self.down is None else self.down(x)))


class ResNet18(nn.Module):
    def __init__(self, classes=1000):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(3, 2, 1)
        )
        layers, cin = [], 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            layers += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
            cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(512, classes)

    def forward(self, x):
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(self.layers(self.stem(x)), 1), 1))


class EncoderStack(nn.Module):
    """Transformer encoder blocks written with Linear layers (symbolically traceable)."""

    def __init__(self, dim=256, heads=4, depth=4):
        super().__init__()
        self.heads = heads
        self.blocks = nn.ModuleList()
        for _ in range(depth):
            self.blocks.append(
                nn.ModuleDict(
                    dict(
                        norm1=nn.LayerNorm(dim),
                        qkv=nn.Linear(dim, 3 * dim),
                        proj=nn.Linear(dim, dim),
                        norm2=nn.LayerNorm(dim),
                        fc1=nn.Linear(dim, 4 * dim),
                        fc2=nn.Linear(4 * dim, dim),
                    )
                )
            )

    def forward(self, x):
        b, t, d = x.shape
        h = self.heads
        for blk in self.blocks:
            q, k, v = blk["qkv"](blk["norm1"](x)).chunk(3, dim=-1)
            q = q.reshape(b, t, h, d // h).transpose(1, 2)
            k = k.reshape(b, t, h, d // h).transpose(1, 2)
            v = v.reshape(b, t, h, d // h).transpose(1, 2)
            attn = torch.softmax(q @ k.transpose(-1, -2) / (d // h) ** 0.5, dim=-1)
            x = x + blk["proj"]((attn @ v).transpose(1, 2).reshape(b, t, d))
            x = x + blk["fc2"](torch.nn.functional.gelu(blk["fc1"](blk["norm2"](x))))
        return x


def load(name, count, size, real_models):
    """(model in eval mode, list of batches as tuples of positional inputs)."""
    if name in BUILT_IN:
        torch.manual_seed(0)
        model = (ResNet18() if name == "resnet18" else EncoderStack()).eval()
        generator = torch.Generator().manual_seed(0)
        shape = (size, 3, 224, 224) if name == "resnet18" else (size, 128, 256)
        return model, [(torch.randn(shape, generator=generator),) for _ in range(count)]
    if real_models not in sys.path:
        sys.path.insert(0, real_models)
    import models  # the real-model kit (see its README)

    model, _example, calibration = models.load(name)
    return model.eval(), [tuple(batch) for batch in calibration[:count]]


def real_kit_available(real_models):
    return (Path(real_models) / "models.py").is_file()


QLINT_MODES = ("qlint", "qlint-1in4", "qlint-minmax", "qlint-calls", "floor-amax")


class AmaxOnly(nn.Module):
    """The ``floor-amax`` control: one per-channel ``amax`` at an observed point, nothing kept.
    Any statistic computed in the model's stream costs at least this."""

    def __init__(self, channel_axis):
        super().__init__()
        self.channel_axis = channel_axis

    def forward(self, value):
        if not (isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel()):
            return value
        if self.channel_axis is None or value.dim() < 2:
            value.amax()
        else:
            axis = self.channel_axis % value.dim()
            value.amax(tuple(dim for dim in range(value.dim()) if dim != axis))
        return value


def make_runner(mode, model, example):
    """The module whose forward passes each mode times (plain: the model itself).

    Three controls split qlint's cost: ``qlint-minmax`` keeps every observer but computes
    only per-channel min, max and counts (no reference quantile); ``qlint-calls`` puts an
    identity module at every observed point (the observed graph and its module calls only);
    ``floor-amax`` one ``amax`` there (:class:`AmaxOnly`)."""
    if mode == "plain":
        return model
    if mode in QLINT_MODES:
        from qlint.linter.calibration import insert_observers, resolve_point_needs, resolve_points
        from qlint.linter.engine import analyse, instantiate_rules
        from qlint.linter.registry import Registry

        analysis = analyse(model, example, "x86")
        rules = instantiate_rules(Registry.default(include_plugins=False).select(["QL201", "QL202", "QL203"], None), {})
        runner, observers, _ = insert_observers(
            analysis.traced.graph_module,
            resolve_points(analysis.graph, rules),
            needs=resolve_point_needs(analysis.graph, rules),
        )
        for name, module in list(runner.named_children()):
            if module in observers.values():
                if mode == "qlint-calls":
                    setattr(runner, name, nn.Identity())
                elif mode == "floor-amax":
                    setattr(runner, name, AmaxOnly(module.channel_axis))
                elif mode == "qlint-minmax":
                    module.percentile = module.histogram = module.moments = False
                elif mode == "qlint-1in4":  # --percentile-every 4
                    module.percentile_every = 4
        return runner
    from torch.ao.quantization import get_default_qconfig_mapping
    from torch.ao.quantization.fx._model_report.detector import (
        DynamicStaticDetector,
        InputWeightEqualizationDetector,
        OutlierDetector,
        PerChannelDetector,
    )
    from torch.ao.quantization.fx._model_report.model_report import ModelReport
    from torch.ao.quantization.quantize_fx import prepare_fx

    prepared = prepare_fx(copy.deepcopy(model), get_default_qconfig_mapping("x86"), example)
    report = ModelReport(
        prepared,
        {PerChannelDetector(), DynamicStaticDetector(), InputWeightEqualizationDetector(0.5), OutlierDetector()},
    )
    return report.prepare_detailed_calibration()


def time_batches(runner, mode, data):
    """(wall seconds, CPU seconds of this process) for one pass over the batches, the way each mode runs them."""
    start, cpu_start = time.perf_counter(), time.process_time()
    if mode in QLINT_MODES:  # qlint's own batch loop, as `qlint --calibration` and qlint.lint run it
        from qlint.linter.calibration import run_calibration

        run_calibration(runner, data, quiet=True)
    else:
        for batch in data:
            runner(*batch)
    return time.perf_counter() - start, time.process_time() - cpu_start


def run_one(name, mode, count, size, real_models, loops=1):
    model, data = load(name, count, size, real_models)
    example = data[0]
    setup = time.perf_counter()
    runner = make_runner(mode, model, example)
    setup = time.perf_counter() - setup
    runner.eval()
    with torch.no_grad():
        runner(*data[0])  # warm-up (not timed; also counts in the process peak RSS as for every mode)
        peak_resettable = _reset_peak_rss()
        loop_seconds = []
        for _ in range(loops):  # the fastest loop: the one least disturbed by other tenants of the VM
            loop_seconds.append(time_batches(runner, mode, data)[0])
        seconds = min(loop_seconds)
    loop_peak_mib = _peak_rss_since_reset_mib() if peak_resettable else None
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if mode == "qlint":
        # the full engine path too: rules + report (timed separately, includes tracing)
        import qlint

        start = time.perf_counter()
        qlint.lint(
            load(name, count, size, real_models)[0],
            example,
            calibration=data,
            select=["QL201", "QL202", "QL203"],
            calibration_options={"quiet": True},
        )
        lint_seconds = time.perf_counter() - start
    else:
        lint_seconds = None
    print(
        json.dumps(
            dict(
                model=name,
                mode=mode,
                seconds=seconds,
                setup=setup,
                lint_seconds=lint_seconds,
                peak_rss_mib=peak_mib,
                loop_peak_rss_mib=loop_peak_mib,
                threads=torch.get_num_threads(),
            )
        )
    )


def run_interleaved(name, modes, count, size, real_models, rounds, loops):
    """Every mode in one process, one pass each in turn, ``rounds`` times (ModelReport, ~20x
    slower, every ``loops``-th round): the VM's slow and fast phases then hit all modes alike,
    which separate processes minutes apart do not guarantee."""
    model, data = load(name, count, size, real_models)
    runners = {}
    with torch.no_grad():
        for mode in modes:
            try:
                runner = make_runner(mode, model, data[0])
                runner.eval()
                runner(*data[0])  # warm-up
            except Exception as error:  # ModelReport cannot prepare or run every model; the others still run
                if mode == "plain":
                    raise
                print(f"{name}: {mode} skipped: {type(error).__name__}: {str(error)[:200]}", file=sys.stderr)
                continue
            runners[mode] = runner
    seconds: dict[str, list] = {mode: [] for mode in runners}
    cpu: dict[str, list] = {mode: [] for mode in runners}
    with torch.no_grad():
        for number in range(rounds):
            for mode, runner in runners.items():
                slow = mode == "modelreport" and number % loops
                wall, cpu_seconds = (None, None) if slow else time_batches(runner, mode, data)
                seconds[mode].append(wall)
                cpu[mode].append(cpu_seconds)
    print(json.dumps(dict(model=name, seconds=seconds, cpu=cpu)))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--models", default=",".join(BUILT_IN + REAL))
    parser.add_argument(
        "--real-models",
        default=DEFAULT_REAL_MODELS,
        help="folder of the real-model kit (models.py); its models are skipped when it is missing",
    )
    parser.add_argument("--modes", default="plain,qlint,modelreport")
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="subprocess runs per (model, mode), interleaved across modes; medians are reported",
    )
    parser.add_argument(
        "--loops",
        type=int,
        default=3,
        help="timed passes over the batches per run (the fastest counts); ModelReport gets 1",
    )
    parser.add_argument("--one", nargs=2, metavar=("MODEL", "MODE"), help=argparse.SUPPRESS)
    parser.add_argument("--interleaved", metavar="MODEL", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        run_one(args.one[0], args.one[1], args.batches, args.batch_size, args.real_models, args.loops)
        return
    if args.interleaved:
        run_interleaved(
            args.interleaved,
            args.modes.split(","),
            args.batches,
            args.batch_size,
            args.real_models,
            args.repeats * args.loops,
            args.loops,
        )
        return
    modes = args.modes.split(",")
    results: dict[tuple[str, str], list[dict]] = {}
    side_by_side: dict[str, dict[str, list]] = {}
    side_by_side_cpu: dict[str, dict[str, list]] = {}
    common = ["--batches", str(args.batches), "--batch-size", str(args.batch_size), "--real-models", args.real_models]
    for name in args.models.split(","):
        if name not in BUILT_IN + REAL:
            parser.error(f"unknown model {name!r}; choose from {', '.join(BUILT_IN + REAL)}")
        if name in REAL and not real_kit_available(args.real_models):
            print(f"skipping {name}: no real-model kit at {args.real_models}", file=sys.stderr)
            continue
        out = subprocess.run(
            [
                sys.executable,
                __file__,
                "--interleaved",
                name,
                "--modes",
                ",".join(modes),
                "--repeats",
                str(args.repeats),
                "--loops",
                str(args.loops),
            ]
            + common,
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
        if out.stderr.strip():  # a mode skipped, or the traceback of a failed run
            print(out.stderr.strip()[-600:], file=sys.stderr)
        if not out.returncode:
            measured = json.loads(out.stdout.strip().splitlines()[-1])
            side_by_side[name], side_by_side_cpu[name] = measured["seconds"], measured["cpu"]
        # Memory needs a process per mode; modes alternate within each repeat.
        for _ in range(args.repeats):
            for mode in modes:
                loops = 1 if mode == "modelreport" else args.loops
                out = subprocess.run(
                    [sys.executable, __file__, "--one", name, mode, "--loops", str(loops)] + common,
                    capture_output=True,
                    text=True,
                    cwd=ROOT,
                )
                if out.returncode:  # e.g. ModelReport on a model its observers cannot run: the last line says why
                    print(
                        f"{name} {mode}: {(out.stderr.strip().splitlines() or ['failed'])[-1][:300]}", file=sys.stderr
                    )
                    continue
                results.setdefault((name, mode), []).append(json.loads(out.stdout.strip().splitlines()[-1]))
    # "side by side": every mode in one process, one pass each in turn; the median and range of
    # the per-round ratios of wall time, and the median ratio of the process's CPU time (less
    # sensitive to other tenants of a shared machine). "separate": the medians of the per-mode
    # processes (fastest of --loops passes each), which also measure memory. "loop peak": Linux's
    # peak-RSS mark reset just before the timed batches, i.e. peak RSS during calibration itself;
    # "process peak" also covers imports, tracing and observer insertion.
    print(
        f"{'model':18} {'mode':12} {'x plain side by side':>21} {'(range)':>13} {'CPU x':>6} {'separate s':>10} "
        f"{'x plain':>8} {'loop peak MiB':>14} {'x plain':>8} {'process peak MiB':>17} {'x plain':>8} "
        f"{'setup s':>8}"
    )
    for (name, mode), runs in results.items():
        plain_runs = results.get((name, "plain"))
        if not plain_runs:
            continue
        rounds = side_by_side.get(name, {})
        ratios = [t / p for t, p in zip(rounds.get(mode, []), rounds.get("plain", [])) if t is not None]
        together = (
            f"{_median(ratios):21.2f} {f'{min(ratios):.2f}-{max(ratios):.2f}':>13}"
            if ratios
            else f"{'n/a':>21} {'':>13}"
        )
        cpu_rounds = side_by_side_cpu.get(name, {})
        cpu_ratios = [t / p for t, p in zip(cpu_rounds.get(mode, []), cpu_rounds.get("plain", [])) if t is not None]
        together += f" {_median(cpu_ratios):6.2f}" if cpu_ratios else f" {'n/a':>6}"
        seconds, plain_seconds = _median([r["seconds"] for r in runs]), _median([r["seconds"] for r in plain_runs])
        loop = _median([r["loop_peak_rss_mib"] for r in runs if r["loop_peak_rss_mib"]] or [0])
        plain_loop = _median([r["loop_peak_rss_mib"] for r in plain_runs if r["loop_peak_rss_mib"]] or [0])
        peak, plain_peak = _median([r["peak_rss_mib"] for r in runs]), _median([r["peak_rss_mib"] for r in plain_runs])
        loop_text = f"{loop:14.0f} {loop / plain_loop:8.2f}" if loop and plain_loop else f"{'n/a':>14} {'':8}"
        print(
            f"{name:18} {mode:12} {together} {seconds:10.2f} {seconds / plain_seconds:8.2f} {loop_text} "
            f"{peak:17.0f} {peak / plain_peak:8.2f} {_median([r['setup'] for r in runs]):8.2f}"
        )


def _median(values):
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


if __name__ == "__main__":
    main()
