"""Property: qlint.lint returns a Report or raises QlintError, and never touches the model.

Random small models (DAGs of conv, bn, relu, add, cat, functional ops, shared modules,
random shapes, data-dependent control flow), hostile inputs and weights (NaN, Inf,
constant, 1e30, batch size 1, wrong shape/dtype), hostile calibration data and random
options (backend, mapping, select/ignore). The generator lives in scripts/fuzz.py, which
runs the long version (2000+ cases) recorded in docs/reliability.md.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

_SPEC = importlib.util.spec_from_file_location(
    "qlint_fuzz", Path(__file__).resolve().parent.parent / "scripts" / "fuzz.py"
)
fuzz = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(fuzz)


@pytest.fixture(scope="module")
def registry():
    from qlint.linter.registry import Registry

    return Registry.default()


@pytest.fixture(autouse=True)
def _quiet_torch_logs():
    logging.disable(logging.CRITICAL)  # torch.export dumps graphs on data-dependent failures
    yield
    logging.disable(logging.NOTSET)


@settings(
    max_examples=200,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
)
@given(st.data())
def test_lint_never_crashes_and_never_modifies(registry, data):
    case = fuzz.build_case(fuzz.Draw(lambda lo, hi: data.draw(st.integers(lo, hi))))
    outcome, detail = fuzz.run_case(case, registry)
    assert outcome in ("report", "qlint-error", "rule-crash-contained"), f"{outcome}: {detail}\ncase={case}"


def test_checker_detects_a_modified_model():
    import torch

    model = torch.nn.Linear(2, 2)
    before = fuzz._snapshot(model)
    with torch.no_grad():
        model.weight[0, 0] += 1
    assert fuzz._same(before, fuzz._snapshot(model)) == "state_dict entry weight changed"
    model.train(False)
    assert fuzz._same(fuzz._snapshot(torch.nn.Linear(2, 2)), fuzz._snapshot(model)) is not None


def test_hostile_cases_give_report_or_qlint_error(registry):
    """Fixed cases for each hostile input class, so a regression names the class."""
    base = {
        "in_channels": 3,
        "spec": [("conv", 0, 3, 4, 3), ("bn", 1, 4), ("relu", 2)],
        "channels": [3, 4, 4, 4],
        "classes": 2,
        "size": 5,
        "batch": 2,
        "data_dependent": False,
        "calibration": "none",
        "weights": "normal",
        "mapping": "none",
        "mode": "eval",
        "backend": "x86",
        "select": None,
        "ignore": None,
        "seed": 0,
    }
    for kind in fuzz.INPUT_KINDS:
        outcome, detail = fuzz.run_case({**base, "input": kind}, registry)
        assert outcome in ("report", "qlint-error"), (kind, detail)
        if kind == "wrong_shape":
            assert outcome == "qlint-error" and "TraceError" in detail
    outcome, _ = fuzz.run_case({**base, "input": "normal", "data_dependent": True}, registry)
    assert outcome in ("report", "qlint-error")


class _RaisesOnCall(Exception):
    pass


def _conv_net_raising_on_call(n):
    """A small conv net whose classifier raises on its n-th forward call (0: never), counting
    every call, in copies of the model too (the hook is copied with it)."""
    import torch
    import torch.nn as nn

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 4)
    ).eval()
    calls = [0]

    def count(module, args):
        calls[0] += 1
        if calls[0] == n:
            raise _RaisesOnCall(f"call {n}")

    model[4].register_forward_pre_hook(count)
    return model, calls


def test_a_model_raising_on_any_one_call_gives_a_report_or_a_qlint_error():
    """Wherever the user's code fails (tracing, calibration, the trial's float reference, the
    per-layer comparison), lint answers with a Report or a QlintError, never the user's exception."""
    import torch

    import qlint
    from qlint.errors import QlintError

    generator = torch.Generator().manual_seed(1)
    example = torch.randn(2, 3, 8, 8, generator=generator)
    calibration = [torch.randn(2, 3, 8, 8, generator=generator) for _ in range(2)]
    model, calls = _conv_net_raising_on_call(0)
    qlint.lint(model, (example,), calibration=calibration)
    total = calls[0]
    assert total > 10  # tracing, calibration, the trial and its comparisons all ran the model
    outcomes = set()
    for n in range(1, total + 1):
        model, _ = _conv_net_raising_on_call(n)
        try:
            report = qlint.lint(model, (example,), calibration=calibration)
        except QlintError:
            outcomes.add("qlint-error")
        else:
            told = any("_RaisesOnCall" in notice.message for notice in report.notices)
            outcomes.add("report saying what is missing" if told else "report")
    assert outcomes == {"qlint-error", "report", "report saying what is missing"}
