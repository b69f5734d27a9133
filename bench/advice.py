"""Advice benchmark: default mapping vs torch ModelReport's mapping vs qlint's verified plan.

    python bench/advice.py [--models a_outlier_mlp,...] [--target-sqnr 35] [--json out.json]

For each model of bench/advice_models.py: output SQNR (dB, on held-out batches) and int8
coverage of conv+linear under (1) get_default_qconfig_mapping('x86'), (2) ModelReport's
generate_qconfig_mapping() (PerChannel, DynamicStatic, InputWeightEqualization and
Outlier detectors; private torch API, allowed in bench/ only), (3) qlint: lint with
calibration → plan_from_report → verify (rewrites, greedy pruning, static/dynamic scheme
search, target-SQNR fallback with at most 10% of conv+linear layers float), and (4)
ModelReport at equal coverage: its module-level qconfigs over
get_default_qconfig_mapping('x86') (names of fused modules mapped back to the user's
modules), with exactly as many conv+linear layers float as qlint's plan keeps (see
:func:`equal_coverage`). All quantization uses the x86 backend config, as qlint verify does.
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
from qlint.advice.plan import plan_from_report  # noqa: E402
from qlint.advice.verify import verify  # noqa: E402
from qlint.advice.verify_session import conv_linear_modules, functional_owners  # noqa: E402
from qlint.core.backends import backend_config  # noqa: E402
from qlint.core.sqnr import SqnrSums  # noqa: E402
from qlint.measure.fallback import weighted_coverage  # noqa: E402


def sqnr_db(model, float_model, eval_data) -> float:
    sums = SqnrSums()
    with torch.no_grad():
        for batch in eval_data:
            sums.add(float_model(batch), model(batch))
    return sums.sqnr_db()


def model_report_mapping(model, calibration):
    from torch.ao.quantization import get_default_qconfig_mapping
    from torch.ao.quantization.fx._model_report.detector import (
        DynamicStaticDetector,
        InputWeightEqualizationDetector,
        OutlierDetector,
        PerChannelDetector,
    )
    from torch.ao.quantization.fx._model_report.model_report import ModelReport
    from torch.ao.quantization.quantize_fx import prepare_fx

    full = [PerChannelDetector("x86"), DynamicStaticDetector(), InputWeightEqualizationDetector(0.5), OutlierDetector()]
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

    prepared = prepare_fx(copy.deepcopy(model).eval(), mapping, (calibration[0],), backend_config=backend_config("x86"))
    with torch.no_grad():
        for batch in calibration:
            prepared(batch)
    return convert_fx(prepared, backend_config=backend_config("x86"))


def _measure(model, mapping, calibration, eval_data) -> tuple[float, int, int, list[str]]:
    q = quantize(model, mapping, calibration)
    int8, total, floats = weighted_coverage(q)
    return sqnr_db(q, model, eval_data), int8, total, floats


def _original_name(fqn: str, names: set[str]) -> str | None:
    """ModelReport names modules of the *prepared* (fused) model: 'layers.0.0' is the Linear inside the
    fused LinearReLU that replaced 'layers.0'. Map such a name to the module of the user's model."""
    while fqn:
        if fqn in names:
            return fqn
        fqn = fqn.rpartition(".")[0]
    return None


def model_report_over_default(model, mr_mapping):
    """ModelReport's module-level qconfigs on top of get_default_qconfig_mapping('x86'): every layer
    it says nothing about is quantized with the default (equal-coverage comparison)."""
    from torch.ao.quantization import get_default_qconfig_mapping

    names = {n for n, _ in model.named_modules() if n}
    mapping = get_default_qconfig_mapping("x86")
    applied: dict[str, str] = {}
    for fqn, qconfig in mr_mapping.module_name_qconfigs.items():
        target = _original_name(fqn, names)
        if target is not None:
            mapping.set_module_name(target, qconfig)
            applied[fqn] = target
    return mapping, applied


def _with_float(mapping, layers):
    mapping = copy.deepcopy(mapping)
    for fqn in layers:
        mapping.set_module_name(fqn, None)
    return mapping


def equal_coverage(model, mapping, calibration, eval_data, float_count: int, qlint_float: list[str]) -> dict:
    """ModelReport-over-default with exactly ``float_count`` conv/linear layers float.

    Two choices of which layers stay float, the better one reported: (1) the layers whose
    float fallback gains most SQNR alone under this mapping (measured on the eval batches,
    as qlint's own fallback selects; if the mapping already leaves more layers float, the
    float layers costing least SQNR are quantized back); (2) the very layers qlint keeps float.
    """
    traced = torch.fx.symbolic_trace(copy.deepcopy(model))
    layers = conv_linear_modules(traced) + [
        o for o in functional_owners(traced) if o not in conv_linear_modules(traced)
    ]
    base, int8, total, floats = _measure(model, mapping, calibration, eval_data)
    already = [f for f in layers if f in floats]
    choices: dict[str, list[str]] = {}
    if len(floats) <= float_count:
        gains = {
            f: _measure(model, _with_float(mapping, [f]), calibration, eval_data)[0] - base
            for f in layers
            if f not in floats
        }
        extra = sorted(gains, key=lambda f: -gains[f])[: float_count - len(floats)]
        choices["most sensitive (measured)"] = already + extra
    else:  # quantize float layers back, least sensitive first
        from torch.ao.quantization import get_default_qconfig

        costs = {}
        for f in already:
            trial = copy.deepcopy(mapping).set_module_name(f, get_default_qconfig("x86"))
            costs[f] = base - _measure(model, trial, calibration, eval_data)[0]
        back = sorted(costs, key=lambda f: costs[f])[: len(floats) - float_count]
        for f in back:
            mapping = copy.deepcopy(mapping).set_module_name(f, get_default_qconfig("x86"))
        choices["least sensitive quantized back"] = [f for f in already if f not in back]
    same = [f for f in qlint_float if f in layers]
    if len(same) == float_count:
        choices["qlint's float layers"] = same
    rows = []
    for how, keep in choices.items():
        trial = mapping if how == "least sensitive quantized back" else _with_float(mapping, keep)
        value, i8, tot, fl = _measure(model, trial, calibration, eval_data)
        rows.append({"sqnr": round(value, 2), "cov": round(i8 / tot, 4) if tot else 1.0, "float": fl, "how": how})
    best = max(rows, key=lambda r: r["sqnr"])
    return {**best, "tried": {r["how"]: [r["sqnr"], r["float"]] for r in rows}}


def run_one(name: str, target_sqnr: float, max_float_fraction: float) -> dict:
    torch.manual_seed(0)
    start = time.perf_counter()
    model, calibration, eval_data = MODELS[name]()
    trained = time.perf_counter() - start

    mr_mapping = model_report_mapping(model, calibration)
    mr_sqnr, mr_int8, mr_total, _ = _measure(model, mr_mapping, calibration, eval_data)

    stage = time.perf_counter()
    report = qlint.lint(model, (calibration[0],), calibration=calibration)
    plan = plan_from_report(report)
    result = verify(
        model,
        plan,
        calibration,
        eval_data,
        target_sqnr=target_sqnr,
        max_float_fraction=max_float_fraction,
        model_name=name,
    )
    advised = time.perf_counter() - stage

    over_default, renamed = model_report_over_default(model, mr_mapping)
    qlint_float = [f for f in result.plan.float_modules]
    float_count = round((1 - result.plan.int8_fraction) * mr_total)
    eq = equal_coverage(model, over_default, calibration, eval_data, float_count, qlint_float)
    return {
        "model": name,
        "train_s": round(trained, 1),
        "qlint_s": round(advised, 1),
        "findings": sorted({f.rule for f in report.findings}),
        "plan_decisions": len(plan.modules) + len(plan.equalization) + len(plan.rewrites),
        "default_sqnr": result.default.sqnr_db,
        "default_cov": result.default.int8_fraction,
        "mr_sqnr": round(mr_sqnr, 2),
        "mr_cov": round(mr_int8 / mr_total, 4) if mr_total else 1.0,
        "mr_entries": len(mr_mapping.module_name_qconfigs),
        "mr_renamed": {k: v for k, v in renamed.items() if k != v},
        "mr_eq_sqnr": eq["sqnr"],
        "mr_eq_cov": eq["cov"],
        "mr_eq_float": eq["float"],
        "mr_eq_how": eq["how"],
        "mr_eq_tried": eq["tried"],
        "plan_given_sqnr": result.requested.sqnr_db,
        "qlint_sqnr": result.plan.sqnr_db,
        "qlint_cov": result.plan.int8_fraction,
        "qlint_int8": result.plan.int8_layers,
        "qlint_total": result.plan.total_layers,
        "qlint_float_layers": qlint_float,
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
    header = (
        "| model | default SQNR (cov) | ModelReport raw SQNR (cov) | ModelReport equal-cov SQNR (cov) | "
        "qlint plan SQNR (cov) | vs default | vs ModelReport equal-cov | vs ModelReport raw | "
        "qlint layers float |"
    )
    print(header)
    print("|" + "---|" * 9)
    for r in rows:
        floats = ", ".join(f"`{f}`" for f in r["qlint_float_layers"]) or "none"
        print(
            f"| {r['model']} | {r['default_sqnr']:.2f} dB ({r['default_cov']:.0%}) | "
            f"{r['mr_sqnr']:.2f} dB ({r['mr_cov']:.0%}) | {r['mr_eq_sqnr']:.2f} dB ({r['mr_eq_cov']:.0%}) | "
            f"{r['qlint_sqnr']:.2f} dB ({r['qlint_cov']:.0%}) | "
            f"{r['qlint_sqnr'] - r['default_sqnr']:+.2f} dB | {r['qlint_sqnr'] - r['mr_eq_sqnr']:+.2f} dB | "
            f"{r['qlint_sqnr'] - r['mr_sqnr']:+.2f} dB | {1 - r['qlint_cov']:.0%} ({floats}) |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
