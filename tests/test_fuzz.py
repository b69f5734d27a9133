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
