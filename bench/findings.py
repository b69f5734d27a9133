"""Findings benchmark: every warning and error of ``qlint.lint`` with its measured impact.

    python bench/findings.py [--models a,b] [--real-models DIR] [--batches N] [--max-fix-trials K]
                             [--backend x86] [--pt2e]

Models: the four real pretrained models of ``--real-models`` (efficientnet_lite0, minilm_l6,
silero_vad, digit_cnn; skipped when the kit is absent) and the models of
bench/findings_models.py (mobilenet_v2, transformer, lstm, gru).

Each model is linted once with its calibration batches (``--batches``, 8 by default) and example
inputs; the held-out batches are never shown to lint. The lint's trial reads them all, calibrates
on the first ones and evaluates on the last ``min(4, len // 2)`` (qlint/linter/trial_stage.py), so
rules choose their fixes on calibration data only.

Then, as a user applies the result: ``plan_from_report(report)`` (the kept findings' fixes) and the
backend default are each quantized with ``QuantPlan.quantize`` on the same calibration batches and
evaluated on the kit's held-out batches, which chose nothing.

For each model it prints every warning and error with its impact (dB, steady dB: the gain with
the evaluation batch that gains most left out, basis, kind) and the
output SQNR of the trial as intended beside the SQNR with that finding's fix applied, the trial
summary, lint's wall time, and two checks:

- acceptance (issue 15): every warning or error has a measured impact >= the threshold and its
  fix, applied, gains >= the threshold, or the finding says why no single fix applies
  (impact.kind coverage or diagnosis). ``fix-trial``, ``group-trial`` (applied together with
  other findings of the rule, past the single-trial budget) and ``rule-trial`` impacts are fixes
  applied; a ``keep-float-trial`` impact is only the bound of what a fix (a rewrite) could
  recover, and ``local-error`` is an estimate: both are listed as offending;
- physical bits: no QL203/QL104 finding reports more bits lost than its dtype has (every
  ``*bits*`` number in the finding's data <= ``dtype_bits``, 8 when absent, and >= 0).

``--pt2e`` takes the ``qlint model.pt2`` path instead: each model is exported with
``torch.export.export`` and the ExportedProgram linted (the pt2e trial); held out, the
default X86InductorQuantizer and the plan's pt2e quantizer (``to_pt2e_quantizer``, less what
the pt2e flow cannot apply: rewrites, equalization, bias correction) are each applied with
prepare_pt2e / calibration / convert_pt2e, as a .pt2 user applies them.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from findings_models import MODELS as BENCH_MODELS  # noqa: E402

import qlint  # noqa: E402
from qlint.advice.plan import default_plan, plan_from_report  # noqa: E402
from qlint.core.sqnr import SqnrSums  # noqa: E402
from qlint.errors import QlintError  # noqa: E402
from qlint.linter.findings import Finding, Report, Severity  # noqa: E402

DEFAULT_REAL_MODELS = "/work/shared/real_models"
REAL_MODELS = ("efficientnet_lite0", "minilm_l6", "silero_vad", "digit_cnn")
TRIAL_BATCHES = 16  # TrialOptions.batches's default: the trial evaluates on the last 4 batches it reads
THRESHOLD_DB = 0.5  # TrialOptions.min_impact_db's default, and the issue's "gains at least 0.5 dB"
NO_SINGLE_FIX_KINDS = ("coverage", "diagnosis")
# group-trial: the fix applied together with other findings of its rule (adaptive group testing past
# the single-trial budget); the finding says so in its impact detail, and the summary counts them
APPLIED_BASES = ("fix-trial", "rule-trial", "group-trial")
BITS_RULES = ("QL203", "QL104")


def load_model(name: str, real_models: str):
    if name in BENCH_MODELS:
        return BENCH_MODELS[name]()
    if real_models not in sys.path:
        sys.path.insert(0, real_models)
    import models  # the shared real-model kit

    model, example, calibration = models.load(name)
    return model, tuple(example), list(calibration), list(models.held_out(name))


def fmt(value: Any, spec: str = "6.2f") -> str:
    return "-" if value is None else format(value, spec)


def short(text: str, width: int = 150) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


def acceptance_offence(finding: Finding, threshold: float) -> str:
    """Why ``finding`` (a warning or error) fails the acceptance line; "" when it passes."""
    impact = finding.impact
    if impact is None:
        return "no measured impact"
    if impact.kind in NO_SINGLE_FIX_KINDS:
        return ""
    if impact.basis not in APPLIED_BASES:
        return f"impact basis {impact.basis}: the fix itself was not applied in a trial"
    if impact.ranked_db() < threshold:  # db is None where the fix makes a failing model run: it passes
        return f"fix gains {impact.db:+.2f} dB < {threshold:g} dB"
    return ""


def bit_numbers(value: Any, key: str = "") -> Iterator[tuple[str, float, Any]]:
    """(key, number, dtype_bits of the enclosing dict) for every numeric ``*bits*`` field."""
    if isinstance(value, dict):
        dtype_bits = value.get("dtype_bits")
        for k, v in value.items():
            if k == "dtype_bits":
                continue
            if "bits" in k and isinstance(v, (int, float)) and not isinstance(v, bool):
                yield k, float(v), dtype_bits
            elif "bits" in k and v == "inf":
                yield k, math.inf, dtype_bits
            else:
                for sub in bit_numbers(v, k):
                    yield sub[0], sub[1], sub[2] if sub[2] is not None else dtype_bits
    elif isinstance(value, list):
        for item in value:
            yield from bit_numbers(item, key)


def bits_offences(report: Report) -> list[str]:
    offences = []
    for finding in report.findings:
        if finding.rule not in BITS_RULES:
            continue
        for key, number, dtype_bits in bit_numbers(finding.data):
            limit = float(dtype_bits) if isinstance(dtype_bits, (int, float)) else 8.0
            if not (0.0 <= number <= limit):  # NaN fails too
                offences.append(
                    f"{finding.rule} {finding.severity.value} {finding.target}: "
                    f"{key}={number} (dtype has {limit:g} bits)"
                )
    return offences


def print_report(name: str, report: Report, wall: float, threshold: float) -> tuple[bool, bool]:
    trial = report.trial
    print(f"\n=== {name} ({report.model}, backend {report.backend}) — lint {wall:.1f} s")
    if trial is None:
        print("  trial: none — " + "; ".join(n.message for n in report.notices))
    else:
        coverage = f"{trial.int8_ops}/{trial.weighted_ops}"
        print(
            f"  trial: converted={trial.converted}"
            + (f" (failed at {trial.failed_stage})" if trial.failed_stage else "")
            + f", output SQNR {fmt(trial.output_sqnr_db, '.2f')} dB, int8 coverage {coverage}"
            + f" conv/linear/recurrent/attention ops, {trial.seconds:.1f} s, {trial.fix_trials} fix trials"
        )
        print(f"         calibrated on {trial.calibrated_on}; evaluated on {trial.evaluated_on}")
        print(
            f"         with every warning's fix: {fmt(trial.fixed_sqnr_db, '.2f')} dB "
            f"(recoverable {fmt(trial.recoverable_db, '+.2f')} dB)"
        )
        if trial.float_layers:
            print(
                f"         float layers: {', '.join(trial.float_layers[:8])}"
                + (f" (+{len(trial.float_layers) - 8})" if len(trial.float_layers) > 8 else "")
            )
    stages = ", ".join(
        f"{t.stage} {t.seconds:.1f}"
        for t in report.timings
        if not t.stage.startswith("QL") and not t.stage.startswith("rule")
    )
    print(f"  timings (s): {stages}")
    serious = [f for f in report.findings if f.severity is not Severity.INFO]
    infos = [f for f in report.findings if f.severity is Severity.INFO]
    demoted = [f for f in infos if "threshold, so this is info" in f.message]
    print(f"  {len(serious)} warnings/errors, {len(infos)} info ({len(demoted)} demoted below {threshold:g} dB)")
    if serious:
        print(
            f"  {'sev':7} {'rule':5} {'target':34} {'impact':>7} {'steady':>7} {'basis':16} {'kind':9} {'default':>7} {'fixed':>7}"
        )
    for f in serious:
        i = f.impact
        print(
            f"  {f.severity.value:7} {f.rule:5} {short(f.target, 34):34} "
            f"{fmt(i.db if i else None, '+7.2f'):>7} {fmt(i.steady_db if i else None, '+7.2f'):>7} "
            f"{(i.basis if i else '-'):16} {(i.kind if i else '-'):9} {fmt(i.base_sqnr_db if i else None, '7.2f'):>7} "
            f"{fmt(i.fixed_sqnr_db if i else None, '7.2f'):>7}"
        )
        print(f"          {short(f.message)}")
    for f in demoted:
        i = f.impact
        print(
            f"  (info)  {f.rule:5} {short(f.target, 34):34} {fmt(i.db if i else None, '+7.2f'):>7} "
            f"{fmt(i.steady_db if i else None, '+7.2f'):>7} {(i.basis if i else '-'):16}"
        )
    by_rule: dict[str, int] = {}
    for f in infos:
        by_rule[f.rule] = by_rule.get(f.rule, 0) + 1
    if by_rule:
        print("  info by rule: " + ", ".join(f"{rule}×{count}" for rule, count in sorted(by_rule.items())))
    for skipped in report.skipped:
        print(f"  skipped {skipped.rule}: {short(skipped.reason, 120)}" + (" (CRASHED)" if skipped.crashed else ""))
    offending = [(f, acceptance_offence(f, threshold)) for f in serious]
    offending = [(f, why) for f, why in offending if why]
    accepted = not offending
    print(f"  acceptance: {'PASS' if accepted else 'FAIL'}")
    for f, why in offending:
        print(f"    - {f.rule} {f.severity.value} {f.target}: {why}")
    bits = bits_offences(report)
    print(f"  physical bits: {'PASS' if not bits else 'FAIL'}")
    for line in bits:
        print(f"    - {line}")
    return accepted, not bits


def held_out_sqnr(model, quantized, held_out) -> float | None:
    import torch

    from qlint.core.batches import call_model

    sums = SqnrSums()
    with torch.no_grad():
        for batch in held_out:
            sums.add(call_model(model, batch), call_model(quantized, batch))
    return sums.sqnr_db()


def held_out_result(plan, model, calibration, held_out) -> str:
    """The plan's output SQNR on the held-out batches, or what failed (a quantize step, or
    the int8 model's forward pass, as the default does on a `.view` of a channels-last tensor)."""
    try:
        return f"{fmt(held_out_sqnr(model, plan.quantize(model, calibration), held_out), '.2f')} dB"
    except QlintError as error:  # QuantizeError: one line
        return f"fails to quantize ({short(str(error), 80)})"
    except RuntimeError as error:  # torch's int8 forward pass
        return f"fails to run ({short(str(error).splitlines()[0], 80)})"


def pt2e_held_out_result(plan, program, calibration, held_out) -> str:
    """``held_out_result`` for the pt2e flow: ``plan`` as a pt2e quantizer on the exported graph."""
    import copy

    from qlint.advice.verify_pt2e import pt2e_plan
    from qlint.measure.pt2e_trial import quantize_pt2e
    from qlint.measure.trial import TrialStepError

    model = program.module()
    try:
        converted, _ = quantize_pt2e(copy.deepcopy(model), pt2e_plan(plan)[0].to_pt2e_quantizer(), calibration)
        return f"{fmt(held_out_sqnr(model, converted, held_out), '.2f')} dB"
    except TrialStepError as step:
        return f"fails at {step.failure.stage} ({short(str(step.failure.error).splitlines()[0], 80)})"
    except RuntimeError as error:  # the int8 forward pass
        return f"fails to run ({short(str(error).splitlines()[0], 80)})"


def print_held_out(report: Report, model, calibration, held_out, program=None) -> None:
    """Default vs the plan of the kept findings, quantized as a user would, on the held-out batches."""
    plan = plan_from_report(report)
    if program is not None:
        default = pt2e_held_out_result(default_plan(report.backend), program, calibration, held_out)
        fixed = pt2e_held_out_result(plan, program, calibration, held_out)
    else:
        default = held_out_result(default_plan(report.backend), model, calibration, held_out)
        fixed = held_out_result(plan, model, calibration, held_out)
    print(
        f"  held-out ({len(held_out)} batches, chose nothing): default {default}; plan of the kept fixes {fixed} "
        f"({len(plan.modules)} module decisions, {len(plan.float_functions)} float functions, "
        f"{len(plan.rewrites)} rewrites)"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="", help="comma-separated names (default: all)")
    parser.add_argument("--real-models", default=DEFAULT_REAL_MODELS)
    parser.add_argument("--batches", type=int, default=8, help="calibration batches (at most 16) the trial uses")
    parser.add_argument(
        "--max-fix-trials", type=int, default=None, help="trial_options.max_fix_trials (default: qlint's, 12)"
    )
    parser.add_argument("--backend", default="x86")
    parser.add_argument(
        "--pt2e", action="store_true", help="lint each model exported (torch.export), as qlint model.pt2"
    )
    args = parser.parse_args(argv)
    real_available = (Path(args.real_models) / "models.py").is_file()
    names = [n for n in args.models.split(",") if n] or (
        (list(REAL_MODELS) if real_available else []) + list(BENCH_MODELS)
    )
    unknown = [n for n in names if n not in BENCH_MODELS and n not in REAL_MODELS]
    if unknown:
        print(f"error: unknown models {', '.join(unknown)}", file=sys.stderr)
        return 2
    if not real_available and any(n in REAL_MODELS for n in names):
        print(f"error: no real-model kit at {args.real_models}", file=sys.stderr)
        return 2
    if not 1 <= args.batches <= TRIAL_BATCHES:
        print(f"error: --batches must be 1..{TRIAL_BATCHES}", file=sys.stderr)
        return 2
    import torch

    print(
        f"qlint {qlint.__version__}, torch {torch.__version__}, backend {args.backend}, "
        f"impact threshold {THRESHOLD_DB} dB, "
        f"calibration batches {args.batches} (lint and quantization), held-out batches for evaluation only, max fix trials "
        f"{'default' if args.max_fix_trials is None else args.max_fix_trials}"
        + (", exported (torch.export) and linted as .pt2: the pt2e trial and flow" if args.pt2e else "")
    )
    verdicts = {}
    for name in names:
        model, example, calibration, held_out = load_model(name, args.real_models)
        data = calibration[: args.batches]
        options = {"batches": TRIAL_BATCHES, "min_impact_db": THRESHOLD_DB}
        if args.max_fix_trials is not None:
            options["max_fix_trials"] = args.max_fix_trials
        program = None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if args.pt2e:
                program = torch.export.export(model.eval(), tuple(example))
            start = time.perf_counter()
            report = qlint.lint(
                program if program is not None else model,
                example,
                calibration=data,
                backend=args.backend,
                trial_options=options,
                model_name=name,
            )
        wall = time.perf_counter() - start
        verdicts[name] = print_report(name, report, wall, THRESHOLD_DB) + (wall,)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            print_held_out(report, model, data, held_out, program)
        sys.stdout.flush()
    print("\n=== summary")
    for name, (accepted, physical, wall) in verdicts.items():
        print(
            f"  {name:20} acceptance {'PASS' if accepted else 'FAIL'}   physical bits "
            f"{'PASS' if physical else 'FAIL'}   lint {wall:6.1f} s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
