"""Advice benchmark: default mapping vs torch ModelReport's mapping vs qlint's verified plan.

    python bench/advice.py [--models a_outlier_mlp,...] [--target-sqnr 35] [--json out.json]

For each model of bench/advice_models.py: output SQNR (dB, on held-out batches) and int8
coverage of conv+linear under (1) get_default_qconfig_mapping('x86'), (2) ModelReport's
generate_qconfig_mapping() (PerChannel, DynamicStatic, InputWeightEqualization and
Outlier detectors; private torch API, allowed in bench/ only), (3) qlint: lint with
calibration → plan_from_report → verify (rewrites, greedy pruning, target-SQNR fallback
with at most 10% of conv+linear layers float).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from advice_models import MODELS  # noqa: E402

import qlint  # noqa: E402
from qlint.plan import plan_from_report  # noqa: E402
from qlint.verify import conv_linear_coverage, verify  # noqa: E402


def sqnr_db(model, float_model, eval_data) -> float:
    signal = noise = 0.0
    with torch.no_grad():
        for batch in eval_data:
            a = float_model(batch).double()
            b = model(batch)
            b = (b.dequantize() if b.is_quantized else b).double()
            signal += float((a * a).sum())
            noise += float(((a - b) ** 2).sum())
    import math

    return 10 * math.log10(signal / noise) if noise > 0 else 200.0


def model_report_mapping(model, calibration):
    from torch.ao.quantization import get_default_qconfig_mapping
    from torch.ao.quantization.fx._model_report.detector import (DynamicStaticDetector,
                                                                  InputWeightEqualizationDetector,
                                                                  OutlierDetector, PerChannelDetector)
    from torch.ao.quantization.fx._model_report.model_report import ModelReport
    from torch.ao.quantization.quantize_fx import prepare_fx

    full = [PerChannelDetector("x86"), DynamicStaticDetector(), InputWeightEqualizationDetector(0.5),
            OutlierDetector()]
    for detectors in (full, full[:3], full[:2]):  # some detectors crash on traced-through conv subclasses
        prepared = prepare_fx(copy.deepcopy(model).eval(), get_default_qconfig_mapping("x86"), (calibration[0],))
        report = ModelReport(prepared, set(detectors))
        try:
            ready = report.prepare_detailed_calibration()
            break
        except ValueError:
            continue
    with torch.no_grad():
        for batch in calibration:
            ready(batch)
    report.generate_model_report(remove_inserted_observers=False)
    return report.generate_qconfig_mapping()


def quantize(model, mapping, calibration):
    from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

    prepared = prepare_fx(copy.deepcopy(model).eval(), mapping, (calibration[0],))
    with torch.no_grad():
        for batch in calibration:
            prepared(batch)
    return convert_fx(prepared)


def run_one(name: str, target_sqnr: float, max_float_fraction: float) -> dict:
    torch.manual_seed(0)
    start = time.perf_counter()
    model, calibration, eval_data = MODELS[name]()
    trained = time.perf_counter() - start

    mr_mapping = model_report_mapping(model, calibration)
    mr_model = quantize(model, mr_mapping, calibration)
    mr_int8, mr_total, _ = conv_linear_coverage(mr_model)
    mr_sqnr = sqnr_db(mr_model, model, eval_data)

    stage = time.perf_counter()
    report = qlint.lint(model, (calibration[0],), calibration=calibration)
    plan = plan_from_report(report)
    result = verify(model, plan, calibration, eval_data, target_sqnr=target_sqnr,
                    max_float_fraction=max_float_fraction,
                    model_name=name)
    advised = time.perf_counter() - stage
    return {
        "model": name, "train_s": round(trained, 1), "qlint_s": round(advised, 1),
        "findings": sorted({f.rule for f in report.findings}),
        "plan_decisions": len(plan.modules) + len(plan.equalization) + len(plan.rewrites),
        "default_sqnr": result.default.sqnr_db, "default_cov": result.default.int8_fraction,
        "mr_sqnr": round(mr_sqnr, 2), "mr_cov": round(mr_int8 / mr_total, 4) if mr_total else 1.0,
        "plan_given_sqnr": result.requested.sqnr_db,
        "qlint_sqnr": result.plan.sqnr_db, "qlint_cov": result.plan.int8_fraction,
        "qlint_float_layers": result.kept_float,
        "kept_decisions": [f"{d.kind}:{d.target}" for d in result.decisions if d.kept],
        "dropped_decisions": [f"{d.kind}:{d.target}" for d in result.decisions if not d.kept],
        "rewrites": [f"{r.kind}:{'+'.join(r.modules)}" for r in result.rewrites if r.applied],
        "notes": result.notes,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--target-sqnr", type=float, default=35.0)
    parser.add_argument("--max-float-fraction", type=float, default=0.1)
    parser.add_argument("--json")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    rows = []
    for name in args.models.split(","):
        row = run_one(name, args.target_sqnr, args.max_float_fraction)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print()
    header = ("| model | default SQNR (cov) | ModelReport SQNR (cov) | qlint plan SQNR (cov) | vs default | "
              "vs ModelReport | layers float |")
    print(header)
    print("|" + "---|" * 7)
    for r in rows:
        print(f"| {r['model']} | {r['default_sqnr']:.2f} dB ({r['default_cov']:.0%}) | "
              f"{r['mr_sqnr']:.2f} dB ({r['mr_cov']:.0%}) | {r['qlint_sqnr']:.2f} dB ({r['qlint_cov']:.0%}) | "
              f"{r['qlint_sqnr'] - r['default_sqnr']:+.2f} dB | {r['qlint_sqnr'] - r['mr_sqnr']:+.2f} dB | "
              f"{1 - r['qlint_cov']:.0%} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
