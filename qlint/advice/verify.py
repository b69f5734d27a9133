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
* int8 coverage of conv+linear ops, counted on the converted graph;
* model size (bytes of the serialized state_dict).

A model whose default quantization fails (``.view`` on a quantized tensor, a missing
kernel) is reported as failed, and the plan is still measured.

Then it improves the plan within a budget of ``max_trials`` trial quantizations, shared
in order (``max_prune_trials`` for the first two steps, ``max_scheme_trials`` for the third,
the rest for the last):

1. **bias correction**: one trial, kept when it gains more than 0.1 dB;
2. **prune**: each decision (module decision, equalization pair, rewrite) is dropped when
   removing it does not lower SQNR. Decisions are tried from the least measured gain up
   (lint measured each finding's fix; unmeasured decisions come first), so the budget goes
   where a decision is most likely useless. A plan that as a whole loses to the default is
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
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch.nn as nn

from qlint.advice.plan import (
    BiasCorrection,
    EqualizationPair,
    FloatFunction,
    ModuleDecision,
    Provenance,
    QuantPlan,
    Rewrite,
    default_plan,
)
from qlint.advice.verify_report import DecisionOutcome, LayerComparison, RunResult, VerifyReport
from qlint.advice.verify_search import activation_bits_step, bias_correction_step, float_fallback, scheme_search
from qlint.advice.verify_session import (
    FAILED,
    SQNR_TOLERANCE_DB,
    Measured,
    Progress,
    Session,
    VerifyError,
    batch_list,
    conv_linear_coverage,
    conv_linear_modules,
    state_dict_bytes,
)
from qlint.core.preserve import preserved_state
from qlint.measure.rewrite import AppliedRewrite, apply_rewrites, rewrite_key

DEFAULT_MAX_TRIALS = 10  # trial quantizations beyond the default, the plan as given and the verified plan
# Shares of that budget, taken in order (a smaller budget goes to the first steps): bias
# correction and pruning, then the scheme search, then the target-SQNR fallback (the rest).
DEFAULT_PRUNE_TRIALS = 5
DEFAULT_SCHEME_TRIALS = 4
SELECTION_BATCHES = 4  # calibration batches (the last ones) that select decisions by default

_Item = ModuleDecision | EqualizationPair | Rewrite | FloatFunction


@dataclasses.dataclass(frozen=True)
class _Decision:
    """One decision of a plan that pruning may drop."""

    kind: str  # module | equalization | rewrite | function
    item: _Item

    @property
    def target(self) -> str:
        if isinstance(self.item, ModuleDecision):
            return self.item.fqn
        if isinstance(self.item, EqualizationPair):
            return self.item.module
        if isinstance(self.item, FloatFunction):
            return self.item.function
        nodes = self.item.params.get("nodes")
        return rewrite_key(self.item.kind, nodes if isinstance(nodes, list) else self.item.modules)

    @property
    def detail(self) -> str:
        if isinstance(self.item, ModuleDecision):
            return self.item.describe()
        if isinstance(self.item, Rewrite):
            return ", ".join(self.item.modules)
        if isinstance(self.item, FloatFunction):
            return "keep float"
        return ""

    @property
    def measured_gain(self) -> float:
        """The most a measurement credited this decision with (dB); -inf when none measured it."""
        gains = [p.gain_db for p in self.item.provenance if p.gain_db is not None]
        return max(gains) if gains else FAILED

    def added_to(self, plan: QuantPlan) -> QuantPlan:
        if isinstance(self.item, ModuleDecision):
            return plan.model_copy(update={"modules": [*plan.modules, self.item]})
        if isinstance(self.item, EqualizationPair):
            return plan.model_copy(update={"equalization": [*plan.equalization, self.item]})
        if isinstance(self.item, FloatFunction):
            return plan.model_copy(update={"float_functions": [*plan.float_functions, self.item]})
        return plan.model_copy(update={"rewrites": [*plan.rewrites, self.item]})

    def removed_from(self, plan: QuantPlan) -> QuantPlan:
        if isinstance(self.item, ModuleDecision):
            return plan.model_copy(update={"modules": [d for d in plan.modules if d != self.item]})
        if isinstance(self.item, EqualizationPair):
            return plan.model_copy(update={"equalization": [p for p in plan.equalization if p != self.item]})
        if isinstance(self.item, FloatFunction):
            return plan.model_copy(update={"float_functions": [f for f in plan.float_functions if f != self.item]})
        return plan.model_copy(update={"rewrites": [r for r in plan.rewrites if r != self.item]})


def _decisions(plan: QuantPlan) -> list[_Decision]:
    """Every decision of the plan, in the order pruning tries them: least measured gain first."""
    decisions = [_Decision("module", d) for d in plan.modules]
    decisions += [_Decision("equalization", pair) for pair in plan.equalization]
    decisions += [_Decision("rewrite", r) for r in plan.rewrites]
    decisions += [_Decision("function", f) for f in plan.float_functions]
    return sorted(decisions, key=lambda d: d.measured_gain)


def _prune(
    session: Session,
    plan: QuantPlan,
    best: float,
    default: Measured,
    outcomes: list[DecisionOutcome],
    notes: list[str],
    until: int,
) -> tuple[QuantPlan, float, list[_Decision]]:
    """Drop every decision whose removal does not lower SQNR (until the trial count reaches
    ``until``), then fall back to the backend default when the pruned plan as a whole loses
    to it. Returns (plan, its SQNR, the decisions dropped one by one)."""
    decisions = _decisions(plan)
    dropped: list[_Decision] = []
    unmeasured = [d for d in decisions if d.measured_gain == FAILED]
    if len(unmeasured) > 1 and session.can_try(until):
        # One trial first for every decision no measurement credited (rewrites found in the graph,
        # user decisions): when dropping them all costs nothing, none is worth a trial of its own.
        trial = plan
        for decision in unmeasured:
            trial = decision.removed_from(trial)
        without = session.trial(f"without {len(unmeasured)} unmeasured decisions", trial).selection_sqnr
        drop = without >= best - SQNR_TOLERANCE_DB
        outcomes.append(
            DecisionOutcome(
                kind="group",
                target=f"{len(unmeasured)} unmeasured decisions",
                kept=not drop,
                sqnr_with_db=_rounded(best),
                sqnr_without_db=_rounded(without),
                detail=", ".join(d.target for d in unmeasured)[:300],
            )
        )
        if drop:
            plan, best = trial, max(best, without)
            decisions = [d for d in decisions if d not in unmeasured]
    for done, decision in enumerate(decisions):
        if not session.can_try(until):
            notes.append(
                f"pruning stopped at its share of the trial budget: {len(decisions) - done} decision(s) "
                "with the most measured gain were kept without a trial of their own"
            )
            break
        trial = decision.removed_from(plan)
        without = session.trial(f"without {decision.kind} {decision.target}", trial).selection_sqnr
        drop = without >= best - SQNR_TOLERANCE_DB
        outcomes.append(
            DecisionOutcome(
                kind=decision.kind,
                target=decision.target,
                kept=not drop,
                sqnr_with_db=_rounded(best),
                sqnr_without_db=_rounded(without),
                detail=decision.detail,
            )
        )
        if drop:
            plan, best = trial, max(best, without)
            dropped.append(decision)
    # Every kept decision helps given the others, yet decisions interact: together they
    # can still lose to the backend default. Then none of them is worth keeping.
    if best < default.selection_sqnr - SQNR_TOLERANCE_DB:
        outcomes.append(
            DecisionOutcome(
                kind="plan",
                target="every remaining decision",
                kept=False,
                sqnr_with_db=_rounded(best),
                sqnr_without_db=_rounded(default.selection_sqnr),
                detail="together they lose to the backend default",
            )
        )
        notes.append(
            f"the pruned plan ({best:.2f} dB) lost to the backend default ({default.selection_sqnr:.2f} dB) "
            "on the selection batches: verify continued from the default"
        )
        return default_plan(plan.backend, model=plan.model), default.selection_sqnr, []
    return plan, best, dropped


def _retry_dropped(
    session: Session,
    plan: QuantPlan,
    best: float,
    dropped: Sequence[_Decision],
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
    if bias_rejected:
        tried = Provenance(source="measurement", detail="qlint verify: retried after the scheme search")
        trial = trial.model_copy(update={"bias_correction": BiasCorrection(provenance=[tried])})
    value = session.trial(f"{len(back)} dropped decision(s) again", trial).selection_sqnr
    keep = value > best + SQNR_TOLERANCE_DB
    what = [d.target for d in back] + (["bias correction"] if bias_rejected else [])
    outcome = DecisionOutcome(
        kind="group",
        target=f"{len(what)} decision(s) dropped before the scheme search",
        kept=keep,
        sqnr_with_db=_rounded(value),
        sqnr_without_db=_rounded(best),
        detail=", ".join(what)[:300],
    )
    return (trial, value, outcome) if keep else (plan, best, outcome)


def _rounded(value: float) -> float | None:
    return None if value == FAILED else round(value, 4)


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
    that every change verify measures is a decision of the plan (and pruning may drop it)."""
    rewrites = list(plan.rewrites)
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
    max_prune_trials: int = DEFAULT_PRUNE_TRIALS,
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
    trial quantizations of every step together; within it, bias correction and pruning take
    at most ``max_prune_trials``, the scheme search ``max_scheme_trials``, and the target
    fallback what is left (at most ``max_sensitivity_trials``). ``eval_fn(quantized_model,
    eval_data) -> float`` adds the user's metric (also computed for the float model).
    The plan's equalization pairs are realized by :func:`qlint.measure.rewrite.apply_equalization`
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
        selected_on = (
            f"{len(selection)} selection batches"
            if selection_data is not None
            else f"the last {len(selection)} of {len(calibration)} calibration batches"
        )
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


def _verify(
    session: Session,
    plan: QuantPlan,
    *,
    selected_on: str,
    target_sqnr: float | None,
    prune: bool,
    max_prune_trials: int,
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

    # 1. measure the backend default and the plan as given (with every rewrite the graph allows)
    default = session.measure("default mapping", default_plan(plan.backend, model=plan.model), layers=fqns)
    _, detected = apply_rewrites(session.traced, plan, session.example)
    given_plan = _with_detected_rewrites(plan, detected)
    given = session.measure("plan as given", given_plan)
    current, best = given_plan, given.selection_sqnr

    # 2. bias correction (one trial, first in the budget; --no-prune keeps a plan's own), then pruning
    outcomes: list[DecisionOutcome] = []
    until = session.share(max_prune_trials)
    dropped: list[_Decision] = []
    if bias_correction and (prune or current.bias_correction is None):
        current, best, outcomes = bias_correction_step(session, current, best, until)
    bias_rejected = bias_correction and prune and current.bias_correction is None and bool(outcomes)
    if prune:
        current, best, tried = activation_bits_step(session, current, best, until)
        outcomes += tried
        current, best, dropped = _prune(session, current, best, default, outcomes, notes, until)

    # 3. scheme search, what it makes worth trying again, then the target-SQNR fallback
    if search_schemes:
        until = session.share(max_scheme_trials)
        frozen = [] if prune else [d.fqn for d in plan.modules]  # --no-prune: plan decisions stay as given
        searched, after, tried = scheme_search(
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

    # 4. measure the verified plan on the eval batches and report
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
        rewrites=_rewrites_report(detected, current),
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
    "conv_linear_coverage",
    "state_dict_bytes",
    "SQNR_TOLERANCE_DB",
]
