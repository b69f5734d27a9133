"""Credits that describe the verified plan as it is, after verify changed it.

A plan entry's provenance says why the entry is there and what it was measured to gain. verify
changes entries after they were credited, and a credit then describes a configuration the plan
no longer has (QA on real models):

* MiniLM: the scheme search ran ``encoder.layer.0.output.dense`` dynamic, while its credit
  "QL203 ..., measured +0.60 dB" measured a static percentile activation observer, which a
  dynamic layer does not have;
* digit_cnn: ``fc_layers.2`` kept "gain when dynamic together with 1 other Linear = 3.54 dB"
  after a later flip set ``fc_layers.0`` back to static.

:func:`reconciled` runs on the verified plan's module decisions:

* a credit of the plan as given whose fix the verified decision no longer applies is dropped,
  and a plan note says which and why; when the fix still applies but verify changed the layer
  otherwise (static -> dynamic), the credit stays and a note says what it was measured with;
* a scheme-search credit for a mode the layer no longer runs is dropped (a later change
  superseded it), with a note;
* a scheme-search group credit whose group changed is re-measured when verify measured the
  group as it ended (the members set back by the flips kept right after it, nothing else kept
  in between: the last of those trials is the plan with the group as it is), and otherwise is
  labelled as measured with the other members, with no gain credited.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal

from qlint.advice.plan import ActivationSpec, ModuleDecision, Provenance, QuantPlan, WeightSpec

Mode = Literal["static", "dynamic"]
SCHEME_SEARCH = "qlint verify scheme search"


def flip_credit(mode: Mode, group_size: int, gain: float) -> Provenance:
    """The credit the scheme search gives each layer of a kept flip of ``group_size`` layers to ``mode``."""
    return Provenance(
        source="measurement",
        metric=f"output SQNR gain (dB) when {_together(mode, group_size)}",
        value=round(gain, 4),
        gain_db=round(gain, 4),
        detail=SCHEME_SEARCH,
    )


@dataclasses.dataclass(frozen=True)
class KeptFlip:
    """One flip the scheme search kept: the layers it switched to ``mode``, and the selection
    SQNR of the plan before and after it."""

    fqns: tuple[str, ...]
    mode: Mode
    sqnr_before: float
    sqnr_after: float

    @property
    def credit(self) -> Provenance:
        return flip_credit(self.mode, len(self.fqns), self.sqnr_after - self.sqnr_before)


@dataclasses.dataclass(frozen=True)
class _Effect:
    """What a decision does to its layer: the fields torch reads (a dynamic layer has no activation observer)."""

    quantize: bool
    mode: Mode | None
    activation: ActivationSpec | None
    weight: WeightSpec | None


def reconciled(given: QuantPlan, verified: QuantPlan, flips: Sequence[KeptFlip]) -> QuantPlan:
    """``verified`` with every module decision's credits describing the decision it has (see the module doc)."""
    notes = list(verified.notes)
    modules = []
    for decision in verified.modules:
        credits: list[Provenance] = []
        for credit in decision.provenance:
            now, note = _credit_now(credit, decision, given, verified, flips)
            credits += [now] if now is not None else []
            notes += [f"{decision.fqn}: {note}"] if note else []
        if not credits:  # a decision needs a reason; the notes say what happened to its credits
            credits = [Provenance(source="measurement", metric="changed by qlint verify (see the notes)")]
        modules.append(decision.model_copy(update={"provenance": credits}))
    return verified.model_copy(update={"modules": modules, "notes": notes})


def _credit_now(
    credit: Provenance, decision: ModuleDecision, given: QuantPlan, verified: QuantPlan, flips: Sequence[KeptFlip]
) -> tuple[Provenance | None, str | None]:
    """The credit as it stands in the verified plan (None: dropped), and a note when it changed."""
    for index, flip in enumerate(flips):
        if decision.fqn in flip.fqns and credit == flip.credit:
            return _flip_credit_now(index, flips, decision, verified)
    before = given.decision(decision.fqn)
    if before is None or credit not in before.provenance:
        return credit, None  # a credit verify gave after its last change (the target fallback)
    return _given_credit_now(credit, before, decision)


def _given_credit_now(
    credit: Provenance, before: ModuleDecision, decision: ModuleDecision
) -> tuple[Provenance | None, str | None]:
    """A credit of the plan as given: dropped when verify undid its fix, annotated when verify
    changed the layer around a fix that still applies."""
    was, now = _effect(before), _effect(decision)
    if was == now:
        return credit, None
    if not was.quantize:
        undone = "it measured the layer kept float"
    elif was.mode == "dynamic" and now.mode != "dynamic":
        undone = "it measured the layer dynamic"
    elif was.activation is not None and (now.activation is None or now.activation.observer != was.activation.observer):
        undone = f"it measured the activation observer {was.activation.describe()}"
        if now.mode == "dynamic":
            undone += ", which a dynamic layer does not have"
    elif was.weight is not None and now.weight != was.weight:
        undone = f"it measured the weight {was.weight.describe()}"
    else:
        return (
            credit,
            f"'{credit.describe()}' was measured with the layer {before.describe()}; verify runs it {decision.describe()}",
        )
    return None, f"dropped '{credit.describe()}': {undone}; verify runs the layer {decision.describe()}"


def _flip_credit_now(
    index: int, flips: Sequence[KeptFlip], decision: ModuleDecision, verified: QuantPlan
) -> tuple[Provenance | None, str | None]:
    """A scheme-search credit: dropped when the layer left that mode, re-measured or labelled
    when the group it was measured with changed."""
    flip = flips[index]
    if not _runs(verified, decision.fqn, flip.mode):
        return (
            None,
            f"dropped '{flip.credit.describe()}': a later change of verify runs the layer {decision.describe()}",
        )
    members = {f for f in flip.fqns if _runs(verified, f, flip.mode)}
    if members == set(flip.fqns):
        return flip.credit, None
    remaining, last = set(flip.fqns), flip
    for later in flips[index + 1 :]:  # the flips that set members back, kept right after the group
        if later.mode == flip.mode or not set(later.fqns) <= remaining:
            break
        remaining -= set(later.fqns)
        last = later
    back = [f for f in flip.fqns if f not in members]
    if remaining == members and last is not flip:
        gain = round(last.sqnr_after - flip.sqnr_before, 4)
        other = "static" if flip.mode == "dynamic" else "dynamic"
        metric = f"output SQNR gain (dB) when {_together(flip.mode, len(members))}, after {_names(back)} went back to {other}"
        return Provenance(source="measurement", metric=metric, value=gain, gain_db=gain, detail=SCHEME_SEARCH), None
    metric = (
        f"output SQNR gain (dB) when {_together(flip.mode, len(flip.fqns))}, measured while {_names(back)} "
        f"also ran {flip.mode} (not this plan)"
    )
    detail = f"{SCHEME_SEARCH}: measured with another configuration, so it credits no gain"
    return Provenance(source="measurement", metric=metric, value=flip.credit.value, detail=detail), None


def _effect(decision: ModuleDecision) -> _Effect:
    if not decision.quantize:
        return _Effect(False, None, None, None)
    activation = decision.activation if decision.mode == "static" else None
    return _Effect(True, decision.mode, activation, decision.weight)


def _runs(plan: QuantPlan, fqn: str, mode: Mode) -> bool:
    """Whether ``plan`` quantizes module ``fqn`` in ``mode``."""
    decision = plan.governing_decision(fqn)
    if decision is None:
        return mode == "static" and not plan.float_by_default
    return decision.quantize and decision.mode == mode


def _together(mode: Mode, group_size: int) -> str:
    return mode if group_size == 1 else f"{mode} together with {group_size - 1} other Linear(s)"


def _names(fqns: Sequence[str], shown: int = 3) -> str:
    more = f" and {len(fqns) - shown} more" if len(fqns) > shown else ""
    return ", ".join(fqns[:shown]) + more


__all__ = ["KeptFlip", "flip_credit", "reconciled"]
