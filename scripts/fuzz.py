#!/usr/bin/env python
"""Fuzz qlint.lint with random small models, hostile inputs and random options.

    python scripts/fuzz.py --runs 2000 --seed 0        # writes a summary table to stdout
    python scripts/fuzz.py --runs 2000 --max-seconds 600   # stops drawing cases after 10 minutes

Contract checked on every case: ``qlint.lint`` returns a Report or raises a
QlintError (the CLI turns that into exit 2) — never another exception — and the
model is left exactly as it was (state_dict bit-identical, training flags,
requires_grad, hooks). tests/test_fuzz.py drives the same generator with hypothesis.
"""

from __future__ import annotations

import argparse
import collections
import random
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

OPS = (
    "conv",
    "bn",
    "relu",
    "relu_f",
    "add",
    "cat",
    "sigmoid_f",
    "mul_const",
    "shared_conv",
    "hardtanh",
    "maxpool_f",
    "dropout",
)
INPUT_KINDS = (
    "normal",
    "nan",
    "inf",
    "-inf",
    "constant",
    "zeros",
    "huge_1e30",
    "tiny_1e-30",
    "batch1",
    "wrong_shape",
    "int_dtype",
    "double_dtype",
)
CALIBRATION_KINDS = ("none", "same", "normal", "nan", "inf", "constant", "huge_1e30", "empty_list", "wrong_shape")
WEIGHT_KINDS = ("normal", "nan_weight", "inf_weight", "zero_weight", "huge_weight")
MAPPINGS = ("none", "default", "badnet", "global_per_tensor", "empty")
MODES = ("eval", "train", "mixed")


class Draw:
    """The choices a case is made of; backed by hypothesis (tests) or random (script)."""

    def __init__(self, integer: Callable[[int, int], int]) -> None:
        self.integer = integer

    def choice(self, options):
        return options[self.integer(0, len(options) - 1)]

    def boolean(self) -> bool:
        return self.integer(0, 1) == 1


class SpecNet(nn.Module):
    """A DAG of ops over 4-D feature maps, then pool → flatten → linear."""

    def __init__(
        self, spec: list[tuple], in_channels: int, channels: list[int], classes: int, data_dependent: bool
    ) -> None:
        super().__init__()
        self.spec = spec
        self.layers = nn.ModuleDict()
        for index, step in enumerate(spec):
            op = step[0]
            if op == "conv":
                _, src, cin, cout, k = step
                self.layers[f"m{index}"] = nn.Conv2d(cin, cout, k, padding=k // 2)
            elif op == "bn":
                self.layers[f"m{index}"] = nn.BatchNorm2d(step[2])
            elif op == "relu":
                self.layers[f"m{index}"] = nn.ReLU()
            elif op == "hardtanh":
                self.layers[f"m{index}"] = nn.Hardtanh()
            elif op == "dropout":
                self.layers[f"m{index}"] = nn.Dropout(0.5)
        self.head = nn.Linear(channels[-1], classes)
        self.unused = nn.Linear(2, 2) if len(spec) % 3 == 0 else None
        self.data_dependent = data_dependent

    def forward(self, x):
        values = [x]
        for index, step in enumerate(self.spec):
            op, src = step[0], step[1]
            a = values[src]
            if op in ("conv", "bn", "relu", "hardtanh", "dropout"):
                out = self.layers[f"m{index}"](a)
            elif op == "shared_conv":
                out = self.layers[f"m{step[2]}"](a)
            elif op == "relu_f":
                out = F.relu(a)
            elif op == "sigmoid_f":
                out = torch.sigmoid(a)
            elif op == "mul_const":
                out = a * 2.0
            elif op == "maxpool_f":
                out = F.max_pool2d(a, 3, stride=1, padding=1)
            elif op == "add":
                out = a + values[step[2]]
            else:  # cat
                out = torch.cat([a, values[step[2]]], dim=1)
            values.append(out)
        y = values[-1]
        if self.data_dependent and y.sum() > 0:
            y = y * 0.5
        return self.head(torch.flatten(F.adaptive_avg_pool2d(y, 1), 1))


def build_case(draw: Draw) -> dict[str, Any]:
    in_channels = draw.integer(1, 4)
    channels = [in_channels]
    spec: list[tuple] = []
    convs: list[tuple[int, int, int]] = []  # (index, cin, cout)
    for _ in range(draw.integer(1, 7)):
        index = len(spec)
        src = draw.integer(0, len(channels) - 1)
        c = channels[src]
        op = draw.choice(OPS)
        if op == "conv":
            cout = draw.integer(1, 8)
            spec.append(("conv", src, c, cout, draw.choice((1, 3))))
            convs.append((index, c, cout))
            channels.append(cout)
        elif op == "shared_conv":
            usable = [i for i, cin, _ in convs if cin == c]
            if not usable:
                spec.append(("relu", src))
                channels.append(c)
                continue
            target = draw.choice(usable)
            spec.append(("shared_conv", src, target))
            channels.append(next(cout for i, _, cout in convs if i == target))
        elif op == "bn":
            spec.append(("bn", src, c))
            channels.append(c)
        elif op in ("add", "cat"):
            partners = [i for i, ch in enumerate(channels) if ch == c] if op == "add" else list(range(len(channels)))
            other = draw.choice(partners)
            spec.append((op, src, other))
            channels.append(c + channels[other] if op == "cat" else c)
        else:
            spec.append((op, src))
            channels.append(c)
    from qlint.linter.registry import Registry

    codes = [cls.code for cls in Registry.default().all()]
    selectors = codes + ["QL1", "QL2", "ALL", "unfused-pattern"]
    case = {
        "in_channels": in_channels,
        "spec": spec,
        "channels": channels,
        "classes": draw.integer(1, 5),
        "size": draw.integer(1, 9),
        "batch": draw.integer(1, 3),
        "data_dependent": draw.integer(0, 9) == 0,
        "input": draw.choice(INPUT_KINDS),
        "calibration": draw.choice(CALIBRATION_KINDS),
        "weights": draw.choice(WEIGHT_KINDS),
        "mapping": draw.choice(MAPPINGS),
        "mode": draw.choice(MODES),
        "backend": draw.choice(("x86", "fbgemm", "qnnpack", "onednn")),
        "select": [draw.choice(selectors) for _ in range(draw.integer(0, 2))] or None,
        "ignore": [draw.choice(selectors) for _ in range(draw.integer(0, 2))] or None,
        "seed": draw.integer(0, 2**16),
        # One case in sixteen runs lint's trial quantization (with one fix trial): it runs
        # torch's prepare/convert several times, the bulk of a case's cost.
        "trial": draw.integer(0, 15) == 0,
    }
    return case


def _tensor(kind: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    if kind == "nan":
        t = torch.randn(shape, generator=generator)
        t.view(-1)[0] = float("nan")
        return t
    if kind in ("inf", "-inf"):
        t = torch.randn(shape, generator=generator)
        t.view(-1)[::2] = float(kind)
        return t
    if kind == "constant":
        return torch.full(shape, 3.0)
    if kind == "zeros":
        return torch.zeros(shape)
    if kind == "huge_1e30":
        return torch.randn(shape, generator=generator) * 1e30
    if kind == "tiny_1e-30":
        return torch.randn(shape, generator=generator) * 1e-30
    if kind == "int_dtype":
        return torch.randint(0, 5, shape, generator=generator)
    if kind == "double_dtype":
        return torch.randn(shape, generator=generator, dtype=torch.float64)
    return torch.randn(shape, generator=generator)


def materialize(case: dict[str, Any]):
    torch.manual_seed(case["seed"])
    generator = torch.Generator().manual_seed(case["seed"])
    model = SpecNet(case["spec"], case["in_channels"], case["channels"], case["classes"], case["data_dependent"])
    if case["mode"] == "eval":
        model.eval()
    elif case["mode"] == "mixed":
        model.eval()
        for i, module in enumerate(model.modules()):
            module.training = i % 2 == 0
    with torch.no_grad():
        weight = case["weights"]
        params = list(model.parameters())
        if weight != "normal" and params:
            p = params[case["seed"] % len(params)]
            value = {"nan_weight": float("nan"), "inf_weight": float("inf"), "zero_weight": 0.0, "huge_weight": 1e30}[
                weight
            ]
            if weight == "zero_weight":
                p.zero_()
            else:
                p.view(-1)[0] = value
    batch = 1 if case["input"] == "batch1" else case["batch"]
    shape = (batch, case["in_channels"], case["size"], case["size"])
    if case["input"] == "wrong_shape":
        shape = (batch, case["in_channels"] + 1, case["size"], case["size"])
    example = (_tensor(case["input"], shape, generator),)
    calib_kind = case["calibration"]
    calibration: Any | None
    good_shape = (case["batch"], case["in_channels"], case["size"], case["size"])
    if calib_kind == "none":
        calibration = None
    elif calib_kind == "same":
        calibration = [example[0]]
    elif calib_kind == "empty_list":
        calibration = []
    elif calib_kind == "wrong_shape":
        calibration = [torch.randn(2, case["in_channels"] + 2, 3, 3, generator=generator)]
    else:
        calibration = [_tensor(calib_kind, good_shape, generator) for _ in range(2)]
    return model, example, calibration


def mapping_object(name: str, backend: str):
    from torch.ao.quantization import (
        MinMaxObserver,
        QConfig,
        QConfigMapping,
        get_default_qconfig,
        get_default_qconfig_mapping,
    )

    if name == "none":
        return None
    if name == "default":
        return get_default_qconfig_mapping(backend)
    if name == "badnet":
        from examples.badnet import qconfig_mapping

        return qconfig_mapping(backend)
    if name == "empty":
        return QConfigMapping()
    per_tensor = QConfig(
        activation=get_default_qconfig(backend).activation,
        weight=MinMaxObserver.with_args(dtype=torch.qint8, qscheme=torch.per_tensor_symmetric),
    )
    return QConfigMapping().set_global(per_tensor)


def _snapshot(model: nn.Module):
    state = {k: v.detach().clone() for k, v in model.state_dict(keep_vars=False).items()}
    flags = [(n, m.training) for n, m in model.named_modules()]
    grads = [(n, p.requires_grad) for n, p in model.named_parameters()]
    hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    return state, flags, grads, hooks


def _bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _same(before, after) -> str | None:
    state_a, flags_a, grads_a, hooks_a = before
    state_b, flags_b, grads_b, hooks_b = after
    if state_a.keys() != state_b.keys():
        return "state_dict keys changed"
    for key in state_a:
        a, b = state_a[key], state_b[key]
        if a.dtype != b.dtype or a.shape != b.shape or _bits(a) != _bits(b):
            return f"state_dict entry {key} changed"
    if flags_a != flags_b:
        return "training flags changed"
    if grads_a != grads_b:
        return "requires_grad changed"
    if hooks_a != hooks_b:
        return "hooks changed"
    return None


def run_case(case: dict[str, Any], registry=None) -> tuple[str, str]:
    """(outcome, detail): outcome is "report", "qlint-error", "crash" or "modified"."""
    import qlint
    from qlint.errors import QlintError

    model, example, calibration = materialize(case)
    before = _snapshot(model)
    try:
        mapping = mapping_object(case["mapping"], case["backend"])
        report = qlint.lint(
            model,
            example,
            calibration=calibration,
            backend=case["backend"],
            qconfig_mapping=mapping,
            select=case["select"],
            ignore=case["ignore"],
            registry=registry,
            calibration_options={"quiet": True},
            trial_options={"enabled": case.get("trial", True), "max_fix_trials": 1},
        )
        outcome, detail = "report", f"{len(report.findings)} findings, {len(report.skipped)} skipped"
        crashed = [n.message for n in report.notices if "rule crashed" in n.message]
        if crashed:
            outcome, detail = "rule-crash-contained", crashed[0]
        report.model_validate_json(report.model_dump_json())  # the report must survive JSON
    except QlintError as error:
        outcome, detail = "qlint-error", f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    except Exception as error:  # the contract is broken
        tb = traceback.extract_tb(error.__traceback__)
        where = next(
            (
                f"{Path(f.filename).name}:{f.lineno} in {f.name}"
                for f in reversed(tb)
                if "/qlint/" in f.filename or "/rules/" in f.filename
            ),
            "?",
        )
        return "crash", f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''} @ {where}"
    changed = _same(before, _snapshot(model))
    if changed:
        return "modified", changed
    return outcome, detail


def _classes(case: dict[str, Any]) -> list[str]:
    return [
        f"input={case['input']}",
        f"calibration={case['calibration']}",
        f"weights={case['weights']}",
        f"mapping={case['mapping']}",
        f"mode={case['mode']}",
        f"data_dependent={case['data_dependent']}",
        f"backend={case['backend']}",
    ]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--show", type=int, default=20, help="distinct failures to print")
    parser.add_argument(
        "--max-seconds",
        type=float,
        default=None,
        help="draw no new case after this many seconds (the table counts the cases run)",
    )
    args = parser.parse_args(argv)
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    from qlint.linter.registry import Registry

    registry = Registry.default()
    rng = random.Random(args.seed)
    table: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    failures: dict[str, tuple[dict, str]] = {}
    totals: collections.Counter = collections.Counter()
    start = time.time()
    runs = 0
    for _run in range(args.runs):
        if args.max_seconds is not None and time.time() - start > args.max_seconds:
            break
        runs += 1
        case = build_case(Draw(rng.randint))
        outcome, detail = run_case(case, registry)
        totals[outcome] += 1
        for cls in _classes(case):
            table[cls][outcome] += 1
        if outcome in ("crash", "modified", "rule-crash-contained"):  # a contained rule crash is a rule bug
            failures.setdefault(detail, (case, outcome))
        if outcome == "qlint-error":
            table["qlint-error messages"][detail.split(":")[0]] += 1
    elapsed = time.time() - start
    outcomes = ["report", "rule-crash-contained", "qlint-error", "crash", "modified"]
    print(f"# qlint fuzz: {runs} cases, seed {args.seed}, {elapsed:.0f}s, torch {torch.__version__}\n")
    print("| outcome | cases |\n| --- | --- |")
    for outcome in outcomes:
        print(f"| {outcome} | {totals[outcome]} |")
    print("\n| input class | " + " | ".join(outcomes) + " |")
    print("| --- |" + " --- |" * len(outcomes))
    for cls in sorted(k for k in table if k != "qlint-error messages"):
        print(f"| {cls} | " + " | ".join(str(table[cls][o]) for o in outcomes) + " |")
    print("\nQlintError classes:", dict(table["qlint-error messages"]))
    for detail, (case, outcome) in list(failures.items())[: args.show]:
        print(f"\nFAILURE ({outcome}): {detail}\n  case: {case}")
    return 1 if any(outcome != "rule-crash-contained" for _, outcome in failures.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
