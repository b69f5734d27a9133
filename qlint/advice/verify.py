"""Verify a QuantPlan by quantizing and measuring: backend default vs the plan, then better.

``verify(model, plan, calibration, eval_data)`` quantizes the model with
``get_default_qconfig_mapping(backend)`` and with the plan, each through
:func:`qlint.advice.apply.quantize_with_plan` (the path ``QuantPlan.quantize`` gives
users: the plan's float-preserving rewrites, equalization and mapping, calibrated on
``calibration``), and measures both against the float model:

* output SQNR (dB) and, with ``eval_fn``, the user's metric;
* per-layer activation SQNR, matched by module fqn (forward hooks on the prepared
  float-with-observers model vs the converted model, so fused modules compare like
  with like);
* int8 coverage of conv/linear/recurrent/attention ops, counted on the converted graph as lint's
  trial counts it;
* model size (bytes of the serialized state_dict).

A model whose default quantization fails (``.view`` on a quantized tensor, a missing
kernel) is reported as failed, and the plan is still measured.

Then it improves the plan within a budget of ``max_trials`` trial quantizations, taken in
order: bias correction one, 8-bit activations (on a VNNI CPU) up to five, pruning half of
what is then left (all of it when no later step will spend any), the scheme search up to
``max_scheme_trials`` of the rest, the target fallback the rest. A step that needs fewer
leaves them to the next, so a larger ``max_trials`` buys pruning and the later steps:

1. **bias correction**: one trial, kept when it gains more than 0.1 dB; on a CPU with VNNI,
   8-bit activations next (:func:`qlint.advice.verify_search.activation_bits_step`);
2. **prune**: each decision (module decision, equalization pair, rewrite) is dropped when
   removing it lowers neither SQNR nor int8 coverage (a layer left float never costs SQNR).
   Decisions are tried from the least measured gain up (lint measured each finding's fix;
   unmeasured decisions come first), so the budget goes where a decision is most likely useless. A plan that as a whole loses to the default is
   replaced by it (no trial: the default is measured anyway).
3. **scheme search**: Linears flipped static <-> dynamic where that raises SQNR
   (:func:`qlint.advice.verify_search.scheme_search`). When a flip is kept, what the two
   steps before rejected is tried once more on top of it, in one trial: a decision's worth
   depends on the scheme (a token split gains nothing under one static range).
4. **target fallback**: with ``target_sqnr``, the layers with the most error of their own
   kept float, one at a time while the output SQNR rises, until the target is met or the
   float-layer budget is spent (:func:`qlint.advice.verify_search.float_fallback`).

Decisions are selected on the **selection** batches (by default the last calibration
batches; ``selection_data`` to pass others). 8-bit activations, which change every observer's
range, are judged on trials calibrated on the calibration batches that do not select, and
again with the two halves swapped (on the MNIST CNN they gained on the batches they were
calibrated on and lost 3 dB on held-out ones); the other trials calibrate on every batch, as
the verified plan does. The report's numbers come from ``eval_data``,
which decides nothing, so the verified plan's SQNR there is an unbiased estimate.

An exported (aten) graph, such as a ``.pt2`` holds, is verified with the pt2e flow instead
(:mod:`qlint.advice.verify_pt2e`): default and plan measured, the plan pruned; the steps
above that change an nn.Module (bias correction, rewrites, the scheme search, the fallback)
are not run there, and the report says so.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch.nn as nn

from qlint.advice.apply import refuse_unknown_modules
from qlint.advice.plan import (
    BiasCorrection,
    ModuleDecision,
    Provenance,
    QuantPlan,
    Rewrite,
    default_plan,
)
from qlint.advice.verify_provenance import KeptFlip, reconciled
from qlint.advice.verify_prune import Decision, prune_decisions, rounded
from qlint.advice.verify_pt2e import verify_pt2e
from qlint.advice.verify_report import SQNR_TOLERANCE_DB, DecisionOutcome, LayerComparison, RunResult, VerifyReport
from qlint.advice.verify_search import (
    activation_bits_step,
    bias_correction_step,
    float_fallback,
    scheme_candidates,
    scheme_search,
)
from qlint.advice.verify_session import (
    Measured,
    Progress,
    Session,
    VerifyError,
    batch_list,
    conv_linear_modules,
    state_dict_bytes,
)
from qlint.core.ops import is_aten_graph
from qlint.core.preserve import preserved_state
from qlint.measure.rewrite import AppliedRewrite, applies, apply_rewrites, rewrite_key, unmatched_plan_rewrites

DEFAULT_MAX_TRIALS = 10  # trial quantizations beyond the default, the plan as given and the verified plan
# The scheme search's share of that budget. Bias correction (1) and 8-bit activations (up to 5)
# come first; pruning then takes half of what is left, or all of it when no later step will
# spend any (:func:`_prune_until`); the target-SQNR fallback takes the rest.
DEFAULT_SCHEME_TRIALS = 4
SELECTION_BATCHES = 4  # calibration batches (the last ones) that select decisions by default


def _retry_dropped(
    session: Session,
    plan: QuantPlan,
    best: float,
    dropped: Sequence[Decision],
    bias_rejected: bool,
) -> tuple[QuantPlan, float, DecisionOutcome | None]:
    """One trial of ``plan`` with what pruning dropped and, when its trial lost, bias correction,
    all added back: kept when it gains. Decisions interact, and the scheme search can change
    what a decision does (a token split is worth nothing while its Linear's input has one
    static range, and several dB once the Linear quantizes each call dynamically)."""
    taken = {d.fqn for d in plan.modules}
    back = [d for d in dropped if not (isinstance(d.item, ModuleDecision) and d.item.fqn in taken)]
    if not (back or bias_rejected) or not session.can_try():
        return plan, best, None
    trial = plan
    for decision in back:
        trial = decision.added_to(trial)
    what = [d.target for d in back] + (["bias correction"] if bias_rejected else [])
    if bias_rejected:
        tried = Provenance(source="measurement", detail="qlint verify: retried after the scheme search")
        trial = trial.model_copy(update={"bias_correction": BiasCorrection(provenance=[tried])})
    value = session.trial(f"{len(back)} dropped decision(s) again", trial).selection_sqnr
    keep = value > best + SQNR_TOLERANCE_DB
    if keep and bias_rejected:  # its credit: the gain of this trial, which added it with the others
        others = f" with {len(what) - 1} other dropped decision(s)" if len(what) > 1 else ""
        gain = round(value - best, 4)
        measured = tried.model_copy(
            update={
                "metric": f"output SQNR gain (dB) when added back after the scheme search{others}",
                "value": gain,
                "gain_db": None if others else gain,
            }
        )
        trial = trial.model_copy(update={"bias_correction": BiasCorrection(provenance=[measured])})
    outcome = DecisionOutcome(
        kind="group",
        target=f"{len(what)} decision(s) dropped before the scheme search",
        kept=keep,
        sqnr_with_db=rounded(value),
        sqnr_without_db=rounded(best),
        detail=", ".join(what)[:300],
    )
    return (trial, value, outcome) if keep else (plan, best, outcome)


def _layers(fqns: Sequence[str], session: Session, default: Measured, verified: Measured) -> list[LayerComparison]:
    """Per conv/linear layer: activation SQNR and int8-ness under the default and the verified plan."""
    default_layers, plan_layers = default.layers or {}, verified.layers or {}
    default_float, plan_float = set(default.result.float_modules), set(verified.result.float_modules)
    return [
        LayerComparison(
            fqn=f,
            kind=type(session.traced.get_submodule(f)).__name__,
            default_sqnr_db=default_layers.get(f),
            plan_sqnr_db=plan_layers.get(f),
            default_int8=None if default.result.failure else f not in default_float,
            plan_int8=None if verified.result.failure else f not in plan_float,
        )
        for f in fqns
    ]


def _with_detected_rewrites(plan: QuantPlan, detected: Sequence[AppliedRewrite]) -> QuantPlan:
    """``plan`` plus the float-preserving rewrites found in the graph that it did not list, so
    that every change verify measures is a decision of the plan (and pruning may drop it). A
    rewrite the plan lists that this graph has no place for, or whose float check failed, is
    left out: it changes nothing verify measures, and QuantPlan.quantize refuses a plan whose
    rewrites do not apply (the report names it, with why). One the plan keeps waiting stays."""
    waiting = plan.waiting_rewrites()
    rewrites = [rewrite for rewrite in plan.rewrites if rewrite in waiting or applies(rewrite, detected)]
    for a in detected:
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


def _rewrites_report(detected: Sequence[AppliedRewrite], verified: QuantPlan) -> list[AppliedRewrite]:
    """Every rewrite found in the graph, marked pruned when the verified plan does not apply it."""
    kept = {
        rewrite_key(r.kind, r.params["nodes"]) for r in verified.rewrites if isinstance(r.params.get("nodes"), list)
    }
    kept_kinds = {r.kind for r in verified.rewrites if not isinstance(r.params.get("nodes"), list)}
    report = []
    for a in detected:
        if a.applied and rewrite_key(a.kind, a.nodes) not in kept and a.kind not in kept_kinds:
            a = a.model_copy(update={"applied": False, "reason": "pruned: did not raise SQNR"})
        report.append(a)
    return report


# --------------------------------------------------------------------------------- API
def verify(
    model: nn.Module,
    plan: QuantPlan | None,
    calibration: Any,
    eval_data: Any,
    *,
    selection_data: Any = None,
    backend: str | None = None,
    target_sqnr: float | None = None,
    eval_fn: Callable[[nn.Module, Any], float] | None = None,
    equalization_qconfig: Any = None,
    prune: bool = True,
    max_trials: int = DEFAULT_MAX_TRIALS,
    max_prune_trials: int | None = None,
    max_float_fraction: float = 1.0,
    max_sensitivity_trials: int = DEFAULT_MAX_TRIALS,
    search_schemes: bool = True,
    max_scheme_trials: int = DEFAULT_SCHEME_TRIALS,
    bias_correction: bool = True,
    model_name: str | None = None,
    progress: Progress | None = None,
) -> VerifyReport:
    """Quantize ``model`` with the backend default and with ``plan``; measure, prune, search, fall back.

    ``calibration``, ``eval_data`` and ``selection_data`` are iterables of batches (a
    tensor, a tuple of positional tensors, or a dict of keyword tensors). Decisions are
    chosen on ``selection_data`` (default: the last ``SELECTION_BATCHES`` calibration
    batches) and the report's numbers come from ``eval_data``. ``max_trials`` bounds the
    trial quantizations of every step together; within it, bias correction takes one,
    8-bit activations up to five, pruning half of what is then left (all of it when no later
    step will spend any; at most ``max_prune_trials`` when given), the scheme search at most
    ``max_scheme_trials``, and the target fallback what is left (at most
    ``max_sensitivity_trials``). ``eval_fn(quantized_model, eval_data) -> float`` adds the
    user's metric (also computed for the float model).
    The plan's equalization pairs are realized by :func:`qlint.measure.equalization.apply_equalization`
    (a float-preserving cross-layer rescale using calibration ranges); pass torch's
    ``equalization_qconfig`` to use prepare_fx's ``_equalization_config`` instead.
    ``max_float_fraction`` caps how many conv/linear layers the target-SQNR fallback may
    keep float. ``bias_correction=False`` skips the bias-correction trial (a plan that asks
    for bias correction needs ``QuantPlan.quantize`` or ``qlint quantize``; a QConfigMapping
    cannot express it). ``progress(label, trials done, budget)`` is called before each quantization.
    """
    if not isinstance(model, nn.Module):
        raise VerifyError(f"expected an nn.Module, got {type(model).__name__}")
    if max_trials < 0:
        raise VerifyError(f"max_trials must be >= 0, got {max_trials}")
    plan = plan if plan is not None else default_plan(backend or "x86")
    if backend is not None and backend != plan.backend:
        plan = plan.model_copy(update={"backend": backend})
    calibration = batch_list(calibration, "calibration")
    selection = (
        batch_list(selection_data, "selection") if selection_data is not None else calibration[-SELECTION_BATCHES:]
    )
    # verify runs forward only on copies of the model; the guard gives back RNG, logging and attributes.
    with preserved_state(model, watch_parameters=False):
        if is_aten_graph(model):
            asked = [
                ("bias correction", bias_correction),
                ("the scheme search", search_schemes),
                ("the target-SQNR fallback", target_sqnr is not None),
            ]
            return verify_pt2e(
                model,
                plan,
                calibration,
                selection,
                batch_list(eval_data, "eval"),
                selected_on=_selected_on(selection, calibration, selection_data is not None),
                prune=prune,
                max_trials=max_trials,
                max_prune_trials=max_prune_trials,
                eval_fn=eval_fn,
                skipped=[step for step, wanted in asked if wanted],
                model_name=model_name or plan.model or "exported model",
                progress=progress,
            )
        session = Session(
            model,
            calibration,
            selection,
            batch_list(eval_data, "eval"),
            equalization_qconfig=equalization_qconfig,
            eval_fn=eval_fn,
            max_trials=max_trials,
            progress=progress,
        )
        selected_on = _selected_on(selection, calibration, selection_data is not None)
        if session.fit is not session.calibration:
            selected_on += f"; 8-bit activations judged on trials calibrated on the other {len(session.fit)}"
        return _verify(
            session,
            plan,
            selected_on=selected_on,
            target_sqnr=target_sqnr,
            prune=prune,
            max_prune_trials=max_prune_trials,
            max_float_fraction=max_float_fraction,
            max_sensitivity_trials=max_sensitivity_trials,
            search_schemes=search_schemes,
            max_scheme_trials=max_scheme_trials,
            bias_correction=bias_correction,
            model_name=model_name or plan.model or type(model).__name__,
        )


def _selected_on(selection: list[Any], calibration: list[Any], given: bool) -> str:
    if given:
        return f"{len(selection)} selection batches"
    return f"the last {len(selection)} of {len(calibration)} calibration batches"


# With the default selection of 4 or fewer calibration batches, every batch selects.
IN_SAMPLE_NOTE = (
    "8-bit activations were judged on the batches they were calibrated on: {n} calibration batch(es) "
    f"leave none to hold apart from the selection batches; more than {SELECTION_BATCHES} calibration "
    "batches (or separate selection batches) give a held-out check"
)


def _prune_until(session: Session, max_prune_trials: int | None, *, later_steps: bool) -> int:
    """The trial count at which pruning stops: half of the trials left (rounded up), or all of
    them when no later step (scheme search, target fallback) will spend any; at most
    ``max_prune_trials`` when given. A fixed share could not grow with ``max_trials``: on a VNNI
    CPU, bias correction and 8-bit activations used all of it, and pruning never ran."""
    left = session.left()
    share = (left + 1) // 2 if later_steps else left
    return session.share(share if max_prune_trials is None else min(share, max_prune_trials))


def _verify(
    session: Session,
    plan: QuantPlan,
    *,
    selected_on: str,
    target_sqnr: float | None,
    prune: bool,
    max_prune_trials: int | None,
    max_float_fraction: float,
    max_sensitivity_trials: int,
    search_schemes: bool,
    max_scheme_trials: int,
    bias_correction: bool,
    model_name: str,
) -> VerifyReport:
    notes: list[str] = []
    float_metric = float(session.eval_fn(session.model, session.eval_data)) if session.eval_fn is not None else None
    fqns = conv_linear_modules(session.traced)

    # 1. measure the backend default and the plan as given (with every rewrite the graph allows),
    # after refusing a plan that names modules this model lacks (made for another model): every
    # trial of it would fail the same way, and only the last one would say why
    with_rewrites, detected = apply_rewrites(session.traced, plan, session.example)
    refuse_unknown_modules(with_rewrites, plan)
    default = session.measure("default mapping", default_plan(plan.backend, model=plan.model), layers=fqns)
    given_plan = _with_detected_rewrites(plan, detected)
    given = session.measure("plan as given", given_plan)
    current, best = given_plan, given.selection_sqnr

    # 2. bias correction (one trial, first in the budget; --no-prune keeps a plan's own),
    # 8-bit activations, then pruning with its share of what they left
    outcomes: list[DecisionOutcome] = []
    dropped: list[Decision] = []
    flips: list[KeptFlip] = []
    if bias_correction and (prune or current.bias_correction is None):
        current, best, outcomes = bias_correction_step(session, current, best)
    bias_rejected = bias_correction and prune and current.bias_correction is None and bool(outcomes)
    if prune:
        current, best, tried = activation_bits_step(session, current, best)
        outcomes += tried
        notes += [IN_SAMPLE_NOTE.format(n=len(session.calibration))] if tried and session.judged_in_sample else []
        later = target_sqnr is not None or (
            search_schemes and bool(scheme_candidates(session.traced, current, current.backend))
        )
        until = _prune_until(session, max_prune_trials, later_steps=later)
        current, best, dropped = prune_decisions(session, current, best, default, outcomes, notes, until)

    # 3. scheme search, what it makes worth trying again, then the target-SQNR fallback
    if search_schemes:
        until = session.share(max_scheme_trials)
        frozen = [] if prune else [d.fqn for d in plan.modules]  # --no-prune: plan decisions stay as given
        searched, after, tried, flips = scheme_search(
            session, current, best, max_trials=max_scheme_trials, frozen=frozen, until=until
        )
        outcomes += tried
        if searched is not current:  # a flip was kept: what the flip changes may revive a dropped decision
            current, best = searched, after
            current, best, retried = _retry_dropped(session, current, best, dropped, bias_rejected)
            outcomes += [retried] if retried else []
    kept_float: list[str] = []
    target_met: bool | None = None
    if target_sqnr is not None:
        current, best, kept_float, tried, note = float_fallback(
            session,
            current,
            best,
            target_sqnr=target_sqnr,
            max_float_fraction=max_float_fraction,
            max_trials=max_sensitivity_trials,
            total_layers=max(given.result.total_layers, default.result.total_layers),
        )
        outcomes += tried
        notes += [note] if note else []

    # 4. credits that describe the plan as it now is, then measure it on the eval batches and report
    current = reconciled(given_plan, current, flips)
    verified = session.measure("verified plan", current, layers=fqns)
    if target_sqnr is not None:
        target_met = verified.result.sqnr_db is not None and verified.result.sqnr_db >= target_sqnr
    return VerifyReport(
        backend=plan.backend,
        model=model_name,
        eval_batches=len(session.eval_data),
        calibration_batches=len(session.calibration),
        selection_batches=len(session.selection),
        selected_on=selected_on,
        trials=session.trials,
        max_trials=session.max_trials,
        target_sqnr_db=target_sqnr,
        target_met=target_met,
        float_metric=float_metric,
        default=default.result,
        requested=given.result,
        plan=verified.result,
        layers=_layers(fqns, session, default, verified),
        decisions=outcomes,
        rewrites=_rewrites_report(detected, current) + session.equalizations(current),
        left_out_rewrites=[a for a in detected if a.requested_by_plan and not a.applied]
        + unmatched_plan_rewrites(plan, detected),
        kept_float=kept_float,
        float_layer_fraction=round(1.0 - verified.result.int8_fraction, 4),
        verified_plan=current,
        notes=notes,
    )


__all__ = [
    "DEFAULT_MAX_TRIALS",
    "VerifyReport",
    "RunResult",
    "LayerComparison",
    "DecisionOutcome",
    "VerifyError",
    "verify",
    "state_dict_bytes",
    "SQNR_TOLERANCE_DB",
]
