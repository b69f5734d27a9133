"""Verify a QuantPlan by quantizing twice and measuring: backend default vs the plan.

``verify(model, plan, calibration, eval_data)`` runs prepare_fx → calibrate → convert_fx
once with ``get_default_qconfig_mapping(backend)`` and once with the plan (its
float-preserving rewrites, ``to_qconfig_mapping()`` and equalization), then evaluates
both against the float model on the held-out ``eval_data``:

* output SQNR (dB, over all eval batches) and, with ``eval_fn``, the user's metric;
* per-layer activation SQNR, matched by module fqn (forward hooks on the prepared
  float-with-observers model vs the converted model, so fused modules compare like
  with like);
* int8 coverage of conv+linear ops, counted on the converted graph (quantized
  conv/linear modules and quantized functional calls over all conv/linear ops);
* model size (bytes of the serialized state_dict).

Then it prunes: every plan decision (module decision, equalization pair, applied
rewrite) is dropped when removing it does not lower SQNR (greedy, one pass). Then a
scheme search flips each Linear static <-> dynamic and keeps the flips that raise SQNR
(``search_schemes``; qlint/advice/verify_search.py). When ``target_sqnr`` is given and not met,
the most sensitive conv/linear layers (measured by the SQNR gained when each alone is
kept float) are kept float, as few as reach the target (at most ``max_float_fraction``
of the conv+linear layers); dynamic layers are candidates too.

Decisions are selected on ``eval_data`` (the batches the numbers are reported on);
pass separate held-out data to a second ``verify`` call for an unbiased estimate.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch.nn as nn

from qlint.advice.plan import Provenance, QuantPlan, Rewrite, default_plan
from qlint.advice.verify_report import DecisionOutcome, LayerComparison, RunResult, VerifyReport
from qlint.advice.verify_search import float_fallback, scheme_search
from qlint.advice.verify_session import (
    SQNR_TOLERANCE_DB,
    Quantized,
    Session,
    VerifyError,
    batch_list,
    conv_linear_coverage,
    conv_linear_modules,
    state_dict_bytes,
)
from qlint.core.preserve import preserved_state
from qlint.measure.rewrite import AppliedRewrite, rewrite_key


@dataclasses.dataclass(frozen=True)
class _Decision:
    """One decision of a plan that pruning may drop."""

    kind: str  # module | equalization | rewrite
    target: str  # the module fqn, the equalized module, or the rewrite's key
    detail: str = ""

    def removed_from(self, plan: QuantPlan, skip: Sequence[str]) -> tuple[QuantPlan, list[str]]:
        """The plan and the skipped rewrites without this decision."""
        if self.kind == "module":
            return plan.model_copy(update={"modules": [d for d in plan.modules if d.fqn != self.target]}), list(skip)
        if self.kind == "equalization":
            return plan.model_copy(
                update={"equalization": [p for p in plan.equalization if p.module != self.target]}
            ), list(skip)
        return plan, [*skip, self.target]


def _decisions(plan: QuantPlan, applied: Sequence[AppliedRewrite]) -> list[_Decision]:
    """Every decision of the plan, in the order pruning tries them."""
    decisions = [_Decision("module", d.fqn, d.describe()) for d in plan.modules]
    decisions += [_Decision("equalization", pair.module) for pair in plan.equalization]
    decisions += [
        _Decision("rewrite", rewrite_key(r.kind, r.nodes), ", ".join(r.modules))
        for r in applied
        if r.applied and r.kind != "equalize"
    ]
    return decisions


def _prune(
    session: Session,
    plan: QuantPlan,
    applied: Sequence[AppliedRewrite],
    outcomes: list[DecisionOutcome],
    notes: list[str],
) -> tuple[QuantPlan, list[str], float]:
    """Drop every decision whose removal does not lower SQNR (greedy, one pass), then fall
    back to the backend default when the pruned plan as a whole loses to it.

    Returns (plan, rewrites it skips, its output SQNR)."""
    skip: list[str] = []
    best = session.plan_sqnr(plan)
    for decision in _decisions(plan, applied):
        trial, trial_skip = decision.removed_from(plan, skip)
        without = session.plan_sqnr(trial, trial_skip)
        drop = without >= best - SQNR_TOLERANCE_DB
        outcomes.append(
            DecisionOutcome(
                kind=decision.kind,
                target=decision.target,
                kept=not drop,
                sqnr_with_db=round(best, 4),
                sqnr_without_db=round(without, 4),
                detail=decision.detail,
            )
        )
        if drop:
            plan, skip, best = trial, trial_skip, max(best, without)
    # Every kept decision helps given the others, yet decisions interact: together they
    # can still lose to the backend default. Then none of them is worth keeping.
    skip_all = sorted({rewrite_key(a.kind, a.nodes) for a in applied if a.applied} | set(skip))
    fresh = default_plan(plan.backend).model_copy(update={"model": plan.model})
    fresh_sqnr = session.plan_sqnr(fresh, skip_all)
    if best < fresh_sqnr - SQNR_TOLERANCE_DB:
        outcomes.append(
            DecisionOutcome(
                kind="plan",
                target="every remaining decision",
                kept=False,
                sqnr_with_db=round(best, 4),
                sqnr_without_db=round(fresh_sqnr, 4),
                detail="together they lose to the backend default",
            )
        )
        notes.append(
            f"the pruned plan ({best:.2f} dB) lost to the backend default ({fresh_sqnr:.2f} dB): "
            "verify continued from the default"
        )
        return fresh, skip_all, fresh_sqnr
    return plan, skip, best


def _layers(
    session: Session, default: tuple[RunResult, Quantized], verified: tuple[RunResult, Quantized]
) -> list[LayerComparison]:
    """Per conv/linear layer: activation SQNR and int8-ness under the default and the verified plan."""
    fqns = conv_linear_modules(session.traced)
    (default_result, default_q), (plan_result, plan_q) = default, verified
    default_layers = session.layer_sqnr(default_q, fqns)
    plan_layers = session.layer_sqnr(plan_q, fqns)
    default_float, plan_float = set(default_result.float_modules), set(plan_result.float_modules)
    return [
        LayerComparison(
            fqn=f,
            kind=type(session.traced.get_submodule(f)).__name__,
            default_sqnr_db=default_layers.get(f),
            plan_sqnr_db=plan_layers.get(f),
            default_int8=f not in default_float,
            plan_int8=f not in plan_float,
        )
        for f in fqns
    ]


def _record_rewrites(plan: QuantPlan, applied: Sequence[AppliedRewrite]) -> QuantPlan:
    """Add applied rewrites that the plan did not list, so the verified plan names every change."""
    rewrites = list(plan.rewrites)
    for a in applied:
        if a.applied and not a.requested_by_plan:
            rewrites.append(
                Rewrite(
                    kind=a.kind,
                    modules=list(a.modules),
                    params={"nodes": list(a.nodes)},
                    provenance=[
                        Provenance(
                            source="measurement",
                            metric="float relative error",
                            value=a.max_relative_error or 0.0,
                            detail="detected by qlint.measure.rewrite",
                        )
                    ],
                )
            )
    return plan.model_copy(update={"rewrites": rewrites})


# --------------------------------------------------------------------------------- API
def verify(
    model: nn.Module,
    plan: QuantPlan | None,
    calibration: Any,
    eval_data: Any,
    *,
    backend: str | None = None,
    target_sqnr: float | None = None,
    eval_fn: Callable[[nn.Module, Any], float] | None = None,
    equalization_qconfig: Any = None,
    prune: bool = True,
    max_float_fraction: float = 1.0,
    max_sensitivity_trials: int = 12,
    search_schemes: bool = True,
    max_scheme_trials: int = 24,
    model_name: str | None = None,
) -> VerifyReport:
    """Quantize ``model`` with the backend default and with ``plan``; measure, prune, search, fall back.

    ``calibration`` and ``eval_data`` are iterables of batches (a tensor, a tuple of
    positional tensors, or a dict of keyword tensors). ``eval_fn(quantized_model,
    eval_data) -> float`` adds the user's metric (also computed for the float model).
    The plan's equalization pairs are realized by :func:`qlint.measure.rewrite.apply_equalization`
    (a float-preserving cross-layer rescale using calibration ranges); pass torch's
    ``equalization_qconfig`` to use prepare_fx's ``_equalization_config`` instead.
    ``search_schemes`` tries each Linear static <-> dynamic after pruning (at most
    ``max_scheme_trials`` trial quantizations; with ``prune=False`` the plan's own decisions
    are not flipped). ``max_float_fraction`` caps how many conv/linear layers the
    target-SQNR fallback may keep float.
    """
    if not isinstance(model, nn.Module):
        raise VerifyError(f"expected an nn.Module, got {type(model).__name__}")
    # verify runs forward only on copies of the model; the guard gives back RNG, logging and attributes.
    with preserved_state(model, watch_parameters=False):
        return _verify(
            model,
            plan,
            calibration,
            eval_data,
            backend=backend,
            target_sqnr=target_sqnr,
            eval_fn=eval_fn,
            equalization_qconfig=equalization_qconfig,
            prune=prune,
            max_float_fraction=max_float_fraction,
            max_sensitivity_trials=max_sensitivity_trials,
            search_schemes=search_schemes,
            max_scheme_trials=max_scheme_trials,
            model_name=model_name,
        )


def _verify(
    model: nn.Module,
    plan: QuantPlan | None,
    calibration: Any,
    eval_data: Any,
    *,
    backend: str | None,
    target_sqnr: float | None,
    eval_fn: Callable[[nn.Module, Any], float] | None,
    equalization_qconfig: Any,
    prune: bool,
    max_float_fraction: float,
    max_sensitivity_trials: int,
    search_schemes: bool,
    max_scheme_trials: int,
    model_name: str | None,
) -> VerifyReport:
    plan = plan if plan is not None else default_plan(backend or "x86")
    backend = backend or plan.backend
    if backend != plan.backend:
        plan = plan.model_copy(update={"backend": backend})
    notes: list[str] = []
    session = Session(
        model,
        batch_list(calibration, "calibration"),
        batch_list(eval_data, "eval"),
        backend,
        equalization_qconfig,
        eval_fn,
    )
    float_metric = float(eval_fn(session.model, session.eval_data)) if eval_fn is not None else None

    # 1. measure the backend default and the plan as given
    default = session.measure("default", session.traced, None)
    rewritten, applied = session.rewritten(plan)
    requested, _ = session.measure("plan as given", rewritten, plan)

    # 2. prune the plan's decisions
    outcomes: list[DecisionOutcome] = []
    if prune:
        current, skip, best = _prune(session, plan, applied, outcomes, notes)
    else:
        current, skip, best = plan, [], session.plan_sqnr(plan)

    # 3. scheme search, then the target-SQNR fallback (qlint/advice/verify_search.py)
    if search_schemes:
        frozen = [] if prune else [d.fqn for d in plan.modules]  # --no-prune: plan decisions stay as given
        current, best, tried = scheme_search(session, current, best, skip, max_trials=max_scheme_trials, frozen=frozen)
        outcomes += tried
    kept_float: list[str] = []
    target_met: bool | None = None
    if target_sqnr is not None:
        current, best, kept_float, tried, note = float_fallback(
            session,
            current,
            best,
            skip,
            target_sqnr=target_sqnr,
            max_float_fraction=max_float_fraction,
            max_trials=max_sensitivity_trials,
            total_layers=default[0].total_layers,
        )
        outcomes += tried
        target_met = best >= target_sqnr
        notes += [note] if note else []

    # 4. measure the verified plan and report
    final_gm, final_applied = session.rewritten(current, skip)
    verified = session.measure("verified plan", final_gm, current)
    kept_keys = {rewrite_key(a.kind, a.nodes) for a in final_applied if a.applied}
    rewrites_report = [
        a
        if (rewrite_key(a.kind, a.nodes) in kept_keys or not a.applied)
        else a.model_copy(update={"applied": False, "reason": "pruned: did not raise SQNR"})
        for a in applied
    ]
    return VerifyReport(
        backend=backend,
        model=model_name or plan.model or type(model).__name__,
        eval_batches=len(session.eval_data),
        calibration_batches=len(session.calibration),
        target_sqnr_db=target_sqnr,
        target_met=target_met,
        float_metric=float_metric,
        default=default[0],
        requested=requested,
        plan=verified[0],
        layers=_layers(session, default, verified),
        decisions=outcomes,
        rewrites=rewrites_report,
        kept_float=kept_float,
        float_layer_fraction=round(1.0 - verified[0].int8_fraction, 4),
        verified_plan=_record_rewrites(current, rewrites_report),
        notes=notes,
    )


__all__ = [
    "VerifyReport",
    "RunResult",
    "LayerComparison",
    "DecisionOutcome",
    "VerifyError",
    "verify",
    "conv_linear_coverage",
    "state_dict_bytes",
    "SQNR_TOLERANCE_DB",
]
