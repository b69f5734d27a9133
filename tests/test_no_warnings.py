"""qlint's own quantizations warn the user of nothing.

torch's observers warn when made with reduce_range ("will be deprecated"): qlint chose that
setting, not the user, yet ``qlint.lint`` printed the warning into their process, and under
``-W error`` (pytest's ``filterwarnings = error``, common in CI) ``QuantPlan.quantize``,
``verify``, ``compare`` and ``sensitivity`` failed ("prepare_fx failed: UserWarning: ...").
"""

from __future__ import annotations

import warnings

import torch
import torch.nn as nn

import qlint
from qlint.advice.plan import plan_from_report


def _model() -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 14 * 14, 4)
        ).eval()


def _batches(seed: int, count: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 3, 16, 16, generator=generator) for _ in range(count)]


def test_every_entry_point_runs_under_warnings_as_errors():
    model, calibration, held_out = _model(), _batches(0, 4), _batches(1, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = qlint.lint(model, (calibration[0],), calibration=calibration)
        report.qconfig_mapping()
        plan = plan_from_report(report)
        quantized = plan.quantize(model, calibration)
        verified = qlint.verify(model, plan, calibration, held_out, max_trials=2)
        compared = qlint.compare(model, quantized, held_out)
        rows = qlint.sensitivity(model, held_out)
    assert report.trial is not None and report.trial.output_sqnr_db is not None
    assert verified.plan.sqnr_db is not None and compared.compare_rows() and rows
