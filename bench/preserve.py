"""What leaving the model as it was costs: parameters copied on first write vs up front.

    python bench/preserve.py [--models efficientnet_lite0,minilm_l6,silero_vad,digit_cnn] [--repeats 5]
                             [--peak-repeats 3]   (0: times only)

``qlint.core.preserve.preserved_state`` copies buffers on entry and watches parameters,
copying one only before the first call that can write it. This bench compares three
ways of running ``qlint.lint`` (calibration on the model's 8 batches, every rule but
QL105, whose trial quantization makes private copies of its own and would hide the
difference; then once more with every rule):

* ``watch``: as shipped;
* ``eager``: every parameter copied on entry as well (the alternative that was not taken);
* ``off``: parameters neither copied nor watched, no TorchFunctionMode (what lint cost
  before parameters were guarded; buffers are still copied).

Peak RSS is measured in a fresh process per (model, mode), the median of
``--peak-repeats`` processes: the kernel's peak mark is reset after the model is loaded
(and linted once, so imports are out of the way), so the number is what lint adds on
top of the loaded model. Times alternate the modes in one process, ``--repeats`` rounds, and show the
median ratio to ``off``. Needs the real models: ``bash /work/shared/real_models/install.sh``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
REAL_MODELS = Path("/work/shared/real_models")
MODES = ("watch", "eager", "off")


def _set_mode(mode: str) -> None:
    from qlint.core import preserve

    originals = getattr(preserve, "_bench_originals", None)
    if originals is None:
        originals = preserve._bench_originals = (
            preserve._KeptTensor.__init__,
            preserve._open_watch,
            preserve._close_watch,
        )
    init, open_watch, close_watch = originals

    def eager_init(self, name, tensor, copy_now):
        init(self, name, tensor, True)

    class NoWatch:
        pass

    preserve._KeptTensor.__init__ = eager_init if mode == "eager" else init
    preserve._open_watch = open_watch if mode != "off" else (lambda *args: NoWatch())
    preserve._close_watch = close_watch if mode != "off" else (lambda *args: None)


def _load(name: str):
    sys.path.insert(0, str(REAL_MODELS))
    import models

    return models.load(name)


def _lint(model, example, calibration, all_rules: bool):
    import qlint

    return qlint.lint(model, example, calibration=calibration, ignore=None if all_rules else ["QL105"])


def _peak_child(name: str, mode: str, all_rules: bool) -> None:
    """One lint run in this process; prints JSON with the peak RSS lint added (MiB)."""
    import torch

    torch.set_num_threads(1)
    model, example, calibration = _load(name)
    _set_mode(mode)
    _lint(model, example, calibration[:1], all_rules)  # imports and lazy initialization out of the way
    with open("/proc/self/status") as handle:
        rss = next(int(line.split()[1]) for line in handle if line.startswith("VmRSS:")) / 1024
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")
    _lint(model, example, calibration, all_rules)
    with open("/proc/self/status") as handle:
        peak = next(int(line.split()[1]) for line in handle if line.startswith("VmHWM:")) / 1024
    params = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    buffers = sum(b.numel() * b.element_size() for b in model.buffers()) / 2**20
    print(json.dumps({"peak_added": peak - rss, "params": params, "buffers": buffers}))


def _peak(name: str, mode: str, all_rules: bool) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--child", name, mode, str(int(all_rules))],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def _peaks(name: str, all_rules: bool, repeats: int) -> dict[str, dict]:
    """Median over ``repeats`` processes per mode, modes alternating."""
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for _ in range(repeats):
        for mode in MODES:
            runs[mode].append(_peak(name, mode, all_rules))
    return {
        mode: dict(found[0], peak_added=statistics.median(run["peak_added"] for run in found))
        for mode, found in runs.items()
    }


def _times(name: str, repeats: int) -> dict[str, float]:
    import torch

    torch.set_num_threads(1)
    model, example, calibration = _load(name)
    seconds: dict[str, list[float]] = {mode: [] for mode in MODES}
    _lint(model, example, calibration[:1], False)
    for _ in range(repeats):
        for mode in MODES:
            _set_mode(mode)
            start = time.perf_counter()
            _lint(model, example, calibration, False)
            seconds[mode].append(time.perf_counter() - start)
    return {mode: statistics.median(a / b for a, b in zip(seconds[mode], seconds["off"])) for mode in MODES} | {
        "off_seconds": statistics.median(seconds["off"])
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="efficientnet_lite0,minilm_l6,silero_vad,digit_cnn")
    parser.add_argument("--repeats", type=int, default=5, help="timing rounds")
    parser.add_argument("--peak-repeats", type=int, default=3, help="processes per mode for peak RSS (0: none)")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _peak_child(args.child[0], args.child[1], bool(int(args.child[2])))
        return
    print("peak RSS lint adds over the loaded model (MiB), and lint time relative to 'off'")
    print(
        f"{'model':<20}{'params':>8}{'buffers':>9} | {'rules':<9}"
        + "".join(f"{m:>8}" for m in MODES)
        + f" | {'time watch':>10}{'eager':>7}{'off s':>7}"
    )
    for name in args.models.split(","):
        times = _times(name, args.repeats)
        for all_rules in (False, True):
            if not args.peak_repeats:
                print(
                    f"{name:<20}{'':>17} | {'no QL105':<9}{'':>24} | {times['watch']:>10.3f}"
                    f"{times['eager']:>7.3f}{times['off_seconds']:>7.2f}"
                )
                break
            peaks = _peaks(name, all_rules, args.peak_repeats)
            first = peaks["watch"]
            timing = (
                f" | {times['watch']:>10.3f}{times['eager']:>7.3f}{times['off_seconds']:>7.2f}"
                if not all_rules
                else " |"
            )
            print(
                f"{name:<20}{first['params']:>8.1f}{first['buffers']:>9.2f} | "
                f"{'all' if all_rules else 'no QL105':<9}"
                + "".join(f"{peaks[m]['peak_added']:>8.1f}" for m in MODES)
                + timing
            )


if __name__ == "__main__":
    main()
