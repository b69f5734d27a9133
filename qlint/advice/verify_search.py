"""The measured search steps of :func:`qlint.advice.verify.verify`.

0. **Bias correction** (:func:`bias_correction_step`, before pruning, so that it is first in
   the trial budget and pruning measures the other decisions with it). One trial: the plan
   with bias correction switched (on when the plan has none, off when it has it). Kept
   on when it raises the output SQNR by more than ``BIAS_CORRECTION_MIN_GAIN_DB``: the
   correction is fitted on the calibration batches, which include the default selection
   batches, so a small gain on them is no evidence. Rounding int8
   weights shifts each output channel's mean; on a deep convnet those shifts add up
   (EfficientNet-Lite0: +8 dB), on a model whose weights round evenly it gains nothing.

Then, after greedy pruning:

1. **Scheme search** (:func:`scheme_search`). The Linears that the backend can quantize
   dynamically are flipped static <-> dynamic (a :class:`~qlint.advice.plan.ModuleDecision`
   with ``mode``): first all at once, then, if that does not gain, all at once with
   everything else float (``float_by_default``: torch's ``quantize_dynamic`` recipe), then
   one at a time from the output backwards. A
   flip is kept when the output SQNR rises by more than ``SQNR_TOLERANCE_DB`` and int8
   coverage does not fall. No finding has to recommend it: dynamic quantization of a
   stationary layer can still win, because it quantizes each batch with its exact range
   (no clipping, no histogram guess) and its output stays float, which removes one
   per-tensor requantization (e.g. of the model output).
2. **Target-SQNR float fallback** (:func:`float_fallback`). When a target is given and
   not met, the layers whose float fallback alone gains most are kept float, as few as
   reach the target, within a budget of conv+linear layers. Dynamic layers are candidates
   like static ones.

Every trial is recorded as a :class:`~qlint.advice.verify.DecisionOutcome` (kind
``bias_correction``, ``scheme`` or ``keep_float``); kept decisions carry a ``Provenance(source="measurement")``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch.fx as fx

from qlint.advice.plan import BiasCorrection, ModuleDecision, Provenance, QuantPlan
from qlint.advice.verify_report import DecisionOutcome
from qlint.advice.verify_session import SQNR_TOLERANCE_DB, Session, conv_linear_modules, functional_owners
from qlint.core.backends import backend_info
from qlint.core.ops import CONV_OR_LINEAR_KINDS, NORM_KINDS, module_kind

# Op kinds the search may flip. LSTM/GRU also have dynamic kernels, but FX leaves them
# float under a static mapping, so there is nothing to flip from.
_DYNAMIC_KINDS = ("linear",)
BIAS_CORRECTION_MIN_GAIN_DB = 0.1


def _dynamic_int8(backend: str, kind: str) -> bool:
    return any(
        o.is_dynamic and o.input_dtype == "torch.quint8" and o.weight_dtype == "torch.qint8"
        for o in backend_info(backend).dtype_options(kind)
    )


def scheme_candidates(gm: fx.GraphModule, plan: QuantPlan, backend: str, frozen: Sequence[str] = ()) -> list[str]:
    """Called modules (graph order) that can run static or dynamic int8 and that the plan quantizes."""
    kinds = [kind for kind in _DYNAMIC_KINDS if _dynamic_int8(backend, kind)]
    called = dict.fromkeys(str(n.target) for n in gm.graph.nodes if n.op == "call_module")
    out = []
    for fqn in called:
        decision = plan.decision(fqn)
        if fqn in frozen or (decision is not None and not decision.quantize):
            continue
        if module_kind(gm.get_submodule(fqn)) in kinds:
            out.append(fqn)
    return out


def _mode(plan: QuantPlan, fqn: str) -> str:
    decision = plan.decision(fqn)
    return decision.mode if decision is not None else "static"


def _with_mode(plan: QuantPlan, fqn: str, mode: str, provenance: Provenance) -> QuantPlan:
    """``plan`` with ``fqn`` run ``mode``; an existing decision keeps its weight spec and its history."""
    old = plan.decision(fqn)
    if old is None:
        return plan.model_copy(
            update={"modules": [*plan.modules, ModuleDecision(fqn=fqn, mode=mode, provenance=[provenance])]}
        )
    new = old.model_copy(update={"mode": mode, "provenance": [*old.provenance, provenance]})
    return plan.model_copy(update={"modules": [new if d.fqn == fqn else d for d in plan.modules]})


def _flipped(plan: QuantPlan, fqns: Sequence[str], gain: float) -> QuantPlan:
    """``plan`` with each of ``fqns`` switched static <-> dynamic, the measured gain as provenance."""
    for fqn in fqns:
        mode = "static" if _mode(plan, fqn) == "dynamic" else "dynamic"
        what = mode if len(fqns) == 1 else f"{mode} together with {len(fqns) - 1} other Linear(s)"
        provenance = Provenance(
            source="measurement",
            metric=f"output SQNR gain (dB) when {what}",
            value=round(gain, 4),
            gain_db=round(gain, 4),
            detail="qlint verify scheme search",
        )
        plan = _with_mode(plan, fqn, mode, provenance)
    return plan


def bias_correction_step(
    session: Session, plan: QuantPlan, best: float
) -> tuple[QuantPlan, float, list[DecisionOutcome]]:
    """The plan with bias correction switched, measured once; returns (plan, its SQNR, outcomes).

    Bias correction is kept on only when measured to gain more than ``BIAS_CORRECTION_MIN_GAIN_DB``."""
    if not session.can_try():
        return plan, best, []
    trying_on = plan.bias_correction is None
    tried = Provenance(source="measurement", detail="qlint verify bias-correction trial")
    trial = plan.model_copy(update={"bias_correction": BiasCorrection(provenance=[tried]) if trying_on else None})
    value = session.trial("bias correction" if trying_on else "without bias correction", trial).selection_sqnr
    on, off = (value, best) if trying_on else (best, value)
    keep = on > off + BIAS_CORRECTION_MIN_GAIN_DB
    outcome = DecisionOutcome(
        kind="bias_correction",
        target="all int8 conv/linear layers",
        kept=keep,
        sqnr_with_db=round(on, 4),
        sqnr_without_db=round(off, 4),
        detail="bias lowered by the mean output shift of the int8 weights, on the calibration data",
    )
    if not keep:
        return plan.model_copy(update={"bias_correction": None}), off, [outcome]
    gain = round(on - off, 4)
    measured = Provenance(
        source="measurement",
        metric="output SQNR gain (dB) with bias correction",
        value=gain,
        gain_db=gain,
        detail="qlint verify bias-correction trial",
    )
    earlier = [] if plan.bias_correction is None else plan.bias_correction.provenance
    return plan.model_copy(update={"bias_correction": BiasCorrection(provenance=[*earlier, measured])}), on, [outcome]


def scheme_search(
    session: Session, plan: QuantPlan, best: float, *, max_trials: int, frozen: Sequence[str] = ()
) -> tuple[QuantPlan, float, list[DecisionOutcome]]:
    """Static <-> dynamic flips of Linear layers; returns (plan, its SQNR, one outcome per trial).

    A flip is kept when it raises output SQNR by more than ``SQNR_TOLERANCE_DB`` *and* does
    not lower the number of int8 conv+linear ops: a dynamic layer's output is float, and
    prepare_fx leaves a static linear that consumes it float (it inserts no input
    observer), so a flip could otherwise "gain" by silently de-quantizing its consumer.

    Why this order: single flips alone get stuck. Making a middle layer dynamic is refused
    while its consumer is static (see above), and a chain of dynamic layers can be better
    as a whole than every shorter chain (bench model (c): the SQNR of "the last k linears
    dynamic" is not monotone in k, and only all of them together beat the static plan by
    the most). So:

    1. one group trial first: every candidate dynamic at once (torch's classic
       ``quantize_dynamic`` recipe for Linear layers), kept on the same rule;
    2. then single flips, from the model's output backwards (reverse graph order), so
       that a flip to dynamic meets consumers that are already dynamic, and a flip back
       to static is tried where the chain starts;
    3. when that pass keeps a flip, the layers it rejected *before* its last kept flip
       (they were measured against an older plan) are tried once more.

    At most ``max_trials`` trial quantizations in all, within the session's budget; with
    more candidates than that, the ones with the lowest per-layer activation SQNR under
    ``plan`` (on the selection batches) are searched; the ``quantize_dynamic`` recipe's group
    trial takes every Linear.
    No randomness: the result depends only on the measurements.
    """
    every = scheme_candidates(session.traced, plan, plan.backend, frozen)
    candidates = every
    if not candidates or max_trials <= 0 or not session.can_try():
        return plan, best, []
    if len(candidates) > max_trials:
        chosen = set(session.sensitivity_order(plan, candidates)[:max_trials])
        candidates = [f for f in candidates if f in chosen]
    int8 = session.measure("current plan", plan, evaluate=False).result.int8_layers
    outcomes: list[DecisionOutcome] = []
    trials = 0

    def attempt(fqns: list[str], note: str, float_rest: bool = False) -> bool:
        nonlocal plan, best, int8, trials
        trials += 1
        before = _mode(plan, fqns[0])
        trial = _flipped(plan, fqns, 0.0)
        if float_rest:
            trial = trial.model_copy(update={"float_by_default": True})
        after = "static" if before == "dynamic" else "dynamic"
        measured = session.trial(f"{', '.join(fqns)} {before} -> {after}", trial)
        value, trial_int8 = measured.selection_sqnr, measured.result.int8_layers
        keep = value > best + SQNR_TOLERANCE_DB and trial_int8 >= int8
        detail = f"{before} -> {after}{note}"
        if trial_int8 < int8:
            detail += f"; int8 conv+linear {int8} -> {trial_int8}"
        outcomes.append(
            DecisionOutcome(
                kind="scheme",
                target=", ".join(fqns),
                kept=keep,
                sqnr_with_db=round(value, 4),
                sqnr_without_db=round(best, 4),
                detail=detail,
            )
        )
        if keep:
            plan, best, int8 = _flipped(plan, fqns, value - best), value, trial_int8
            if float_rest:
                plan = plan.model_copy(update={"float_by_default": True})
        return keep

    static = [f for f in candidates[::-1] if _mode(plan, f) == "static"]
    if len(static) > 1 and session.can_try():
        kept = attempt(static, f", all {len(static)} at once")
        if not kept and not plan.float_by_default and session.can_try() and trials < max_trials:
            # torch's quantize_dynamic recipe, over every Linear (a Linear left out would go
            # float): a static op between dynamic Linears hands them quantized tensors they have
            # no kernel for, so the rest stays float; kept only where int8 coverage does not
            # fall (a model whose convs would go float is refused)
            everyone = [f for f in every[::-1] if _mode(plan, f) == "static"]
            attempt(everyone, f", all {len(everyone)} at once, everything else float", float_rest=True)
    pending = candidates[::-1]
    for note in ("", " (pass 2)"):
        rejected: list[str] = []
        retry: list[str] = []
        for fqn in pending:
            if trials >= max_trials or not session.can_try():
                break
            if attempt([fqn], note):
                retry = list(rejected)
            else:
                rejected.append(fqn)
        if not retry:
            break
        pending = retry
    return plan, best, outcomes


# ------------------------------------------------------------------- target-SQNR fallback
_FALLBACK_KINDS = CONV_OR_LINEAR_KINDS | NORM_KINDS


def _fallback_candidates(gm: fx.GraphModule) -> list[str]:
    """Layers the target-SQNR fallback may keep float: called conv/linear/norm modules, functional owners."""
    called = [str(n.target) for n in gm.graph.nodes if n.op == "call_module"]
    modules = [t for t in dict.fromkeys(called) if module_kind(gm.get_submodule(t)) in _FALLBACK_KINDS]
    return modules + [o for o in functional_owners(gm) if o not in modules]


def _keep_float(plan: QuantPlan, fqn: str, gain: float) -> QuantPlan:
    provenance = Provenance(
        source="measurement",
        metric="output SQNR gain (dB) when kept float",
        value=round(gain, 4),
        gain_db=round(gain, 4),
        detail="qlint verify target-SQNR fallback",
    )
    modules = [d for d in plan.modules if d.fqn != fqn]
    modules.append(ModuleDecision(fqn=fqn, quantize=False, provenance=[provenance]))
    return plan.model_copy(update={"modules": modules})


def float_fallback(
    session: Session,
    plan: QuantPlan,
    best: float,
    *,
    target_sqnr: float,
    max_float_fraction: float,
    max_trials: int,
    total_layers: int,
) -> tuple[QuantPlan, float, list[str], list[DecisionOutcome], str | None]:
    """Keep the most sensitive layers float until ``target_sqnr`` is met.

    Returns (plan, its SQNR, layers kept float, outcomes, a note when the target is missed).
    At most ``max_float_fraction`` of the ``total_layers`` conv+linear layers are kept float
    (norm layers cost no coverage); with more candidates than ``max_trials``, the ones
    with the lowest per-layer SQNR are measured.
    """
    outcomes: list[DecisionOutcome] = []
    kept_float: list[str] = []
    conv_linear = set(conv_linear_modules(session.traced)) | set(functional_owners(session.traced))
    candidates = [
        f for f in _fallback_candidates(session.traced) if (decision := plan.decision(f)) is None or decision.quantize
    ]
    budget = int(math.floor(max_float_fraction * max(1, total_layers) + 1e-9))
    if best < target_sqnr and candidates and session.can_try():
        if len(candidates) > max_trials:
            candidates = session.sensitivity_order(plan, candidates)[:max_trials]
        gains: dict[str, float] = {}
        for fqn in candidates:  # most sensitive first: the budget goes where a fallback can gain most
            if not session.can_try():
                break
            gains[fqn] = session.trial(f"{fqn} kept float", _keep_float(plan, fqn, 0.0)).selection_sqnr - best
        candidates = list(gains)
        used = 0
        for fqn in sorted(candidates, key=lambda f: -gains[f]):
            if best >= target_sqnr or gains[fqn] <= SQNR_TOLERANCE_DB:
                break
            costs = fqn in conv_linear
            if costs and used >= budget:
                continue
            trial = _keep_float(plan, fqn, gains[fqn])
            if not session.known(trial) and not session.can_try():
                break
            value = session.trial(f"{', '.join([*kept_float, fqn])} kept float", trial).selection_sqnr
            outcomes.append(
                DecisionOutcome(
                    kind="keep_float",
                    target=fqn,
                    kept=value > best,
                    sqnr_with_db=round(value, 4),
                    sqnr_without_db=round(best, 4),
                    detail=f"alone: {gains[fqn]:+.2f} dB",
                )
            )
            if value > best:
                plan, best = trial, value
                kept_float.append(fqn)
                used += int(costs)
    note = None
    if best < target_sqnr:
        note = (
            f"target {target_sqnr:g} dB not reached: best {best:.2f} dB with {len(kept_float)} "
            f"layer(s) kept float (conv/linear budget {budget})"
        )
    return plan, best, kept_float, outcomes, note


__all__ = ["bias_correction_step", "scheme_search", "scheme_candidates", "float_fallback"]
