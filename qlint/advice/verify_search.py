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
   not met, one sensitivity pass measures each quantized layer's own (shadow) SQNR; the
   worst layers are then kept float one at a time, each kept when the output SQNR rises,
   until the target is met or the budget of conv+linear layers is spent. Dynamic layers are
   candidates like static ones.

Every trial is recorded as a :class:`~qlint.advice.verify.DecisionOutcome` (kind
``bias_correction``, ``scheme`` or ``keep_float``); kept decisions carry a ``Provenance(source="measurement")``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch.fx as fx

from qlint.advice.plan import ActivationSpec, BiasCorrection, ModuleDecision, Provenance, QuantPlan
from qlint.advice.verify_provenance import KeptFlip, Mode, flip_credit
from qlint.advice.verify_report import SQNR_TOLERANCE_DB, DecisionOutcome
from qlint.advice.verify_session import (
    FAILED,
    Session,
    conv_linear_modules,
    functional_owners,
)
from qlint.core.backends import backend_info, host_vnni
from qlint.core.ops import CONV_OR_LINEAR_KINDS, NORM_KINDS, module_kind
from qlint.core.sqnr import predicted_gain_db

# Op kinds the search may flip. LSTM/GRU also have dynamic kernels, but FX leaves them
# float under a static mapping, so there is nothing to flip from.
_DYNAMIC_KINDS = ("linear",)
BIAS_CORRECTION_MIN_GAIN_DB = 0.1
# The most trials the 8-bit activations step takes: 8 and 7 bits on two folds, then 8 on every batch.
ACTIVATION_BITS_TRIALS = 5


def scheme_candidates(gm: fx.GraphModule, plan: QuantPlan, backend: str, frozen: Sequence[str] = ()) -> list[str]:
    """Called modules (graph order) that can run static or dynamic int8 and that the plan quantizes."""
    kinds = [kind for kind in _DYNAMIC_KINDS if backend_info(backend).has_dynamic_int8(kind)]
    called = dict.fromkeys(str(n.target) for n in gm.graph.nodes if n.op == "call_module")
    out = []
    for fqn in called:
        decision = plan.governing_decision(fqn)
        if fqn in frozen or (decision is not None and (decision.fqn in frozen or not decision.quantize)):
            continue
        if module_kind(gm.get_submodule(fqn)) in kinds:
            out.append(fqn)
    return out


def _mode(plan: QuantPlan, fqn: str) -> Mode:
    decision = plan.governing_decision(fqn)
    return decision.mode if decision is not None else "static"


def _with_mode(plan: QuantPlan, fqn: str, mode: Mode, provenance: Provenance) -> QuantPlan:
    """``plan`` with ``fqn`` run ``mode``; an existing decision keeps its weight spec and its history,
    a new one takes the specs of the ancestor's decision that covered the layer until now.

    A decision flipped back to what the layer gets without it (the plan's globals, or its
    ancestor's decision) is dropped rather than kept as an entry that changes nothing, and the
    plan is then the one measured before it."""
    old = plan.decision(fqn)
    if old is None:
        inherited = plan.governing_decision(fqn)
        specs = {} if inherited is None else {"activation": inherited.activation, "weight": inherited.weight}
        decision = ModuleDecision(fqn=fqn, mode=mode, provenance=[provenance], **specs)
        return plan.model_copy(update={"modules": [*plan.modules, decision]})
    without = plan.model_copy(update={"modules": [d for d in plan.modules if d.fqn != fqn]})
    if _same_effect(old.model_copy(update={"mode": mode}), without, fqn):
        return without
    new = old.model_copy(update={"mode": mode, "provenance": [*old.provenance, provenance]})
    return plan.model_copy(update={"modules": [new if d.fqn == fqn else d for d in plan.modules]})


def _same_effect(decision: ModuleDecision, plan: QuantPlan, fqn: str) -> bool:
    """Whether ``plan`` (without a decision of its own for ``fqn``) treats the layer as ``decision`` does."""
    inherited = plan.governing_decision(fqn)
    effect: tuple[Any, ...] | None
    if inherited is None:  # the globals: quantized static with the global specs, unless float by default
        effect = None if plan.float_by_default else (True, "static", None, None)
    else:
        effect = (inherited.quantize, inherited.mode, inherited.activation, inherited.weight)
    return (decision.quantize, decision.mode, decision.activation, decision.weight) == effect


def _flipped(plan: QuantPlan, fqns: Sequence[str], gain: float) -> QuantPlan:
    """``plan`` with each of ``fqns`` switched static <-> dynamic, the measured gain as provenance."""
    for fqn in fqns:
        mode: Mode = "static" if _mode(plan, fqn) == "dynamic" else "dynamic"
        plan = _with_mode(plan, fqn, mode, flip_credit(mode, len(fqns), gain))
    return plan


def bias_correction_step(
    session: Session, plan: QuantPlan, best: float, until: int | None = None
) -> tuple[QuantPlan, float, list[DecisionOutcome]]:
    """The plan with bias correction switched, measured once; returns (plan, its SQNR, outcomes).

    Bias correction is kept on only when measured to gain more than ``BIAS_CORRECTION_MIN_GAIN_DB``."""
    if not session.can_try(until):
        return plan, best, []
    trying_on = plan.bias_correction is None
    tried = Provenance(source="measurement", detail="qlint verify bias-correction trial")
    switched = plan.model_copy(update={"bias_correction": BiasCorrection(provenance=[tried]) if trying_on else None})
    # Judged on trials calibrated on every batch, with a margin: judged apart from the selection
    # batches instead, the README example's calibration (batch peaks from 100 to 15,000) clips
    # every trial so hard that the correction's +1.2 dB vanishes into the clipping.
    value = session.trial("bias correction" if trying_on else "without bias correction", switched).selection_sqnr
    on, off = (value, best) if trying_on else (best, value)
    keep = on > off + BIAS_CORRECTION_MIN_GAIN_DB
    outcome = DecisionOutcome(
        kind="bias_correction",
        target="all int8 conv/linear layers",
        kept=keep,
        sqnr_with_db=round(on, 4),
        sqnr_without_db=round(off, 4),
        detail="bias lowered by the mean output shift of the int8 weights, on the calibration data",
        bar_db=BIAS_CORRECTION_MIN_GAIN_DB,
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


def activation_bits_step(
    session: Session, plan: QuantPlan, best: float, until: int | None = None
) -> tuple[QuantPlan, float, list[DecisionOutcome]]:
    """8-bit activations instead of 7 (``reduce_range=False``), measured once; returns (plan,
    its SQNR, outcomes).

    x86/fbgemm default to 7-bit activations because, on CPUs without VNNI, their kernels add
    pairs of u8*s8 products in 16 bits, which 8-bit activations can saturate. With VNNI the
    products accumulate in 32 bits, and torch's own onednn default is 8-bit. Tried only on a
    host that has VNNI (the kernels measured are the ones that run here), and the kept
    decision says which CPUs it needs. The fixed ranges QL101 chose at 7 bits move to 8 with
    the rest, over the same real range (their levels follow the plan's activation bits)."""
    vnni = host_vnni()
    if vnni is None or not backend_info(plan.backend).wants_reduce_range:
        return plan, best, []
    trial = _full_range(plan)
    held_apart = session.fit is not session.calibration
    # every trial it may take, or none: 8-bit and 7-bit on each fold, then 8-bit on every batch
    if trial == plan or session.left(until) < (ACTIVATION_BITS_TRIALS if held_apart else 1):
        return plan, best, []
    if session.judged_in_sample:
        how = "calibrated and judged on the same batches"
        detail = "reduce_range=False, judged on the calibration batches themselves (too few to hold any apart)"
    else:
        how = "calibrated apart from the selection batches"
        detail = "reduce_range=False, judged on batches it was not calibrated on"
    value = session.fitted_trial(f"8-bit activations ({how})", trial)
    before = session.fitted_trial(f"7-bit activations ({how})", plan)
    keep = value > before + SQNR_TOLERANCE_DB
    if keep and held_apart:
        # An observer's range is what this decision changes, and a few batches' worth of range
        # is noisy: it must also gain with the two halves of the calibration data swapped.
        other = session.fitted_trial("8-bit activations (folds swapped)", trial, swapped=True)
        other_before = session.fitted_trial("7-bit activations (folds swapped)", plan, swapped=True)
        keep = other > other_before + SQNR_TOLERANCE_DB
        detail += f" (folds swapped: {other:.2f} vs {other_before:.2f} dB)"
    fixed = _moved_fixed_ranges(plan, trial)
    outcome = DecisionOutcome(
        kind="activation_bits",
        target="every 7-bit activation" + (f" (observers and {fixed} fixed range(s))" if fixed else " observer"),
        kept=keep,
        sqnr_with_db=round(value, 4),
        sqnr_without_db=round(before, 4),
        detail=f"{detail}; safe on CPUs with VNNI (this one has {vnni}), not on older x86",
    )
    if not keep:
        return plan, best, [outcome]
    also = f", and {fixed} fixed range(s) at 256 levels instead of 128" if fixed else ""
    note = (
        f"8-bit activations (reduce_range=False{also}), measured +{value - before:.2f} dB on a CPU with {vnni}: "
        "deploy on CPUs with VNNI (AVX512-VNNI, AVX-VNNI or AMX); without it fbgemm's 16-bit sums can saturate"
    )
    chosen = trial.model_copy(update={"notes": [*trial.notes, note]})
    # later steps compare with trials calibrated on every batch, as the verified plan is
    return chosen, session.trial("8-bit activations", chosen).selection_sqnr, [outcome]


def _full_range(plan: QuantPlan) -> QuantPlan:
    """``plan`` with every observed 7-bit activation spec made 8-bit, and its fixed ranges with them."""

    def widened(spec: ActivationSpec) -> ActivationSpec:
        return spec.changed(reduce_range=False) if spec.reduce_range and spec.observer != "fixed" else spec

    modules = [
        d.model_copy(update={"activation": widened(d.activation)}) if d.activation is not None else d
        for d in plan.modules
    ]
    widest = plan.model_copy(update={"activation": widened(plan.activation), "modules": modules})
    return widest.with_fixed_ranges_at_activation_bits()


def _moved_fixed_ranges(before: QuantPlan, after: QuantPlan) -> int:
    """How many of ``before``'s fixed ranges ``after`` gives other levels."""
    levels = {d.fqn: d.activation.levels() for d in before.modules if d.activation and d.activation.observer == "fixed"}
    return sum(
        1
        for d in after.modules
        if d.activation is not None and d.fqn in levels and d.activation.levels() != levels[d.fqn]
    )


def scheme_search(
    session: Session,
    plan: QuantPlan,
    best: float,
    *,
    max_trials: int,
    frozen: Sequence[str] = (),
    until: int | None = None,
) -> tuple[QuantPlan, float, list[DecisionOutcome], list[KeptFlip]]:
    """Static <-> dynamic flips of Linear layers; returns (plan, its SQNR, one outcome per trial,
    the flips kept in order, which :func:`qlint.advice.verify_provenance.reconciled` reads).

    A flip is kept when it raises output SQNR by more than ``SQNR_TOLERANCE_DB`` *and* does
    not lower the number of int8 conv+linear ops: a dynamic layer's output is float, and
    prepare_fx leaves a static linear that consumes it float (it inserts no input
    observer), so a flip could otherwise "gain" by silently de-quantizing its consumer.

    Why this order: single flips alone get stuck. Making a middle layer dynamic is refused
    while its consumer is static (see above), and a chain of dynamic layers can be better
    as a whole than every shorter chain (bench model (c): the SQNR of "the last k linears
    dynamic" is not monotone in k, and only all of them together beat the static plan by
    the most). So:

    1. one group trial first: every candidate dynamic at once, kept on the same rule; when
       it is not kept, torch's ``quantize_dynamic`` recipe (every Linear dynamic, everything
       else float), kept on the same rule;
    2. then single flips, from the model's output backwards (reverse graph order), so
       that a flip to dynamic meets consumers that are already dynamic, and a flip back
       to static is tried where the chain starts;
    3. when that pass keeps a flip, the layers it rejected *before* its last kept flip
       (they were measured against an older plan) are tried once more.

    At most ``max_trials`` trial quantizations in all (and none past the trial count
    ``until``); with more single-flip candidates than the trials left, a sensitivity pass
    picks the ones with the lowest own (shadow) SQNR under ``plan``.
    No randomness: the result depends only on the measurements.
    """
    every = scheme_candidates(session.traced, plan, plan.backend, frozen)
    end = session.share(max_trials) if until is None else min(until, session.share(max_trials))
    if not every or not session.can_try(end):
        return plan, best, [], []
    int8 = session.measure("current plan", plan, evaluate=False).result.int8_layers
    outcomes: list[DecisionOutcome] = []
    flips: list[KeptFlip] = []

    def attempt(fqns: list[str], note: str, float_rest: bool = False) -> bool:
        nonlocal plan, best, int8
        before = _mode(plan, fqns[0])
        trial = _flipped(plan, fqns, 0.0)
        if float_rest:
            trial = trial.model_copy(update={"float_by_default": True})
        after: Mode = "static" if before == "dynamic" else "dynamic"
        measured = session.trial(f"{', '.join(fqns)} {before} -> {after}", trial)
        value, trial_int8 = measured.selection_sqnr, measured.result.int8_layers
        keep = value > best + SQNR_TOLERANCE_DB and trial_int8 >= int8
        detail = f"{before} -> {after}{note}"
        if trial_int8 < int8:
            detail += f"; int8 conv/linear/recurrent/attention ops {int8} -> {trial_int8}"
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
            flips.append(KeptFlip(tuple(fqns), after, sqnr_before=best, sqnr_after=value))
            plan, best, int8 = _flipped(plan, fqns, value - best), value, trial_int8
            if float_rest:
                plan = plan.model_copy(update={"float_by_default": True})
        return keep

    static = [f for f in every[::-1] if _mode(plan, f) == "static"]
    if len(static) > 1:
        kept = attempt(static, f", all {len(static)} at once")
        if not kept and not plan.float_by_default and session.can_try(end):
            # torch's quantize_dynamic recipe: a static op between dynamic Linears hands them
            # quantized tensors they have no kernel for, so the rest stays float; kept only
            # where int8 coverage does not fall (a model whose convs would go float is refused)
            attempt(static, f", all {len(static)} at once, everything else float", float_rest=True)
    candidates = every
    if len(candidates) > end - session.trials >= 2:  # the sensitivity pass is a trial of its own
        chosen = set(session.sensitivity_order(plan, candidates)[: end - session.trials])
        candidates = [f for f in candidates if f in chosen]
    pending = candidates[::-1]
    for note in ("", " (pass 2)"):
        rejected: list[str] = []
        retry: list[str] = []
        for fqn in pending:
            if not session.can_try(end):
                break
            if attempt([fqn], note):
                retry = list(rejected)
            else:
                rejected.append(fqn)
        if not retry:
            break
        pending = retry
    return plan, best, outcomes, flips


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
    """Keep the layers that add the most error float, one at a time, until ``target_sqnr`` is met.

    Returns (plan, its SQNR, layers kept float, outcomes, a note when the target is missed).
    One sensitivity pass (a trial) measures every candidate's own (shadow) SQNR under the
    plan; then the layers are tried from the worst up, each on top of those kept before, and
    kept when the output SQNR rises. At most ``max_float_fraction`` of the ``total_layers``
    conv+linear layers are kept float (norm layers cost no coverage), with at most
    ``max_trials`` trials in all. When the target is out of reach, the fallback still keeps
    each layer that gains within that budget: a better model at nearly the same coverage.

    The pass is skipped when even removing the error of every layer the budget allows could
    not gain ``MIN_FALLBACK_GAIN_DB`` (assuming each layer's relative error reaches the output
    unchanged, as the lint impact estimate does): the trials would be spent for nothing.
    """
    outcomes: list[DecisionOutcome] = []
    kept_float: list[str] = []
    conv_linear = set(conv_linear_modules(session.traced)) | set(functional_owners(session.traced))
    candidates = [f for f in _fallback_candidates(session.traced) if _quantized_by(plan, f)]
    budget = int(math.floor(max_float_fraction * max(1, total_layers) + 1e-9))
    end = session.share(max_trials)
    note = None
    if best < target_sqnr and candidates and budget > 0 and best > FAILED and session.can_try(end - 1):
        own = session.own_errors(plan, candidates)
        ranked = _affordable(sorted(own, key=lambda f: own[f]), conv_linear, budget)[: max(0, end - session.trials)]
        predicted = predicted_gain_db(best, [own[f] for f in ranked])
        if predicted < MIN_FALLBACK_GAIN_DB:
            ranked = []
            note = (
                f"the target fallback tried no layer: keeping the {len(own)} measured layers' worst float "
                f"could gain about {predicted:.2f} dB at most"
            )
        for fqn in ranked:
            if best >= target_sqnr or not session.can_try(end):
                break
            trial = _keep_float(plan, fqn, 0.0)
            value = session.trial(f"{', '.join([*kept_float, fqn])} kept float", trial).selection_sqnr
            keep = value > best + SQNR_TOLERANCE_DB
            outcomes.append(
                DecisionOutcome(
                    kind="keep_float",
                    target=fqn,
                    kept=keep,
                    sqnr_with_db=round(value, 4),
                    sqnr_without_db=round(best, 4),
                    detail=f"own SQNR {own[fqn]:.2f} dB",
                )
            )
            if keep:
                plan, best = _keep_float(plan, fqn, value - best), value
                kept_float.append(fqn)
    if best < target_sqnr:
        note = note or (
            f"target {target_sqnr:g} dB not reached: best {best:.2f} dB with {len(kept_float)} "
            f"layer(s) kept float (conv/linear budget {budget})"
        )
    return plan, best, kept_float, outcomes, note


MIN_FALLBACK_GAIN_DB = 0.5


def _quantized_by(plan: QuantPlan, fqn: str) -> bool:
    """Whether ``plan`` quantizes module ``fqn`` (a float-by-default plan only what it lists)."""
    decision = plan.governing_decision(fqn)
    if decision is None:
        return not plan.float_by_default
    return decision.quantize


def _affordable(ranked: Sequence[str], conv_linear: set[str], budget: int) -> list[str]:
    """``ranked`` cut where the conv/linear budget runs out (norm layers cost no coverage)."""
    out, used = [], 0
    for fqn in ranked:
        costs = fqn in conv_linear
        if costs and used >= budget:
            continue
        out.append(fqn)
        used += int(costs)
    return out


__all__ = ["activation_bits_step", "bias_correction_step", "scheme_search", "scheme_candidates", "float_fallback"]
