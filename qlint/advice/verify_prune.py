"""verify's pruning: each decision of a plan dropped when removing it does not lower SQNR.

Shared by the prepare_fx verify (:mod:`qlint.advice.verify`) and the pt2e one
(:mod:`qlint.advice.verify_pt2e`): both measure plans through a
:class:`~qlint.advice.verify_session.Session`.
"""

from __future__ import annotations

import dataclasses

from qlint.advice.plan import (
    EqualizationPair,
    FloatFunction,
    ModuleDecision,
    QuantPlan,
    Rewrite,
    default_plan,
)
from qlint.advice.verify_report import SQNR_TOLERANCE_DB, DecisionOutcome
from qlint.advice.verify_session import FAILED, Measured, Session
from qlint.measure.rewrite import rewrite_key

PlanItem = ModuleDecision | EqualizationPair | Rewrite | FloatFunction


@dataclasses.dataclass(frozen=True)
class Decision:
    """One decision of a plan that pruning may drop."""

    kind: str  # module | equalization | rewrite | function
    item: PlanItem

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
        gains = [db for p in self.item.provenance if (db := p.credited_db()) is not None]
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


def decisions_of(plan: QuantPlan) -> list[Decision]:
    """Every decision of the plan, in the order pruning tries them: least measured gain first."""
    decisions = [Decision("module", d) for d in plan.modules]
    decisions += [Decision("equalization", pair) for pair in plan.equalization]
    decisions += [Decision("rewrite", r) for r in plan.rewrites]
    decisions += [Decision("function", f) for f in plan.float_functions]
    return sorted(decisions, key=lambda d: d.measured_gain)


def prune_decisions(
    session: Session,
    plan: QuantPlan,
    best: float,
    default: Measured,
    outcomes: list[DecisionOutcome],
    notes: list[str],
    until: int,
) -> tuple[QuantPlan, float, list[Decision]]:
    """Drop every decision whose removal lowers neither SQNR nor int8 coverage (until the trial
    count reaches ``until``), then fall back to the backend default when the pruned plan as a whole loses
    to it. Returns (plan, its SQNR, the decisions dropped one by one)."""
    decisions = decisions_of(plan)
    dropped: list[Decision] = []
    # Removing a decision that quantizes a layer (an LSTM run dynamic) leaves that layer float,
    # which never costs SQNR: it is dropped only when no layer goes float, as the scheme search's
    # flips are (silero_vad lost its int8 LSTM for 0.03 dB on the selection batches). Float
    # layers are counted, not int8 ones: a rewrite that splits a module adds an int8 layer.
    floats = _float_layers(session.measure("current plan", plan, evaluate=False))
    unmeasured = [d for d in decisions if d.measured_gain == FAILED]
    if len(unmeasured) > 1 and session.can_try(until):
        # One trial first for every decision no measurement credited (rewrites found in the graph,
        # user decisions): when dropping them all costs nothing, none is worth a trial of its own.
        trial = plan
        for decision in unmeasured:
            trial = decision.removed_from(trial)
        measured = session.trial(f"without {len(unmeasured)} unmeasured decisions", trial)
        without, drop, more = _dropped(measured, best, floats)
        outcomes.append(
            DecisionOutcome(
                kind="group",
                target=f"{len(unmeasured)} unmeasured decisions",
                kept=not drop,
                sqnr_with_db=rounded(best),
                sqnr_without_db=rounded(without),
                detail=", ".join(d.target for d in unmeasured)[:300] + more,
            )
        )
        if drop:
            plan, best, floats = trial, max(best, without), _float_layers(measured)
            decisions = [d for d in decisions if d not in unmeasured]
    for done, decision in enumerate(decisions):
        if not session.can_try(until):
            notes.append(_untested_note(decisions[done:]))
            break
        trial = decision.removed_from(plan)
        measured = session.trial(f"without {decision.kind} {decision.target}", trial)
        without, drop, more = _dropped(measured, best, floats)
        outcomes.append(
            DecisionOutcome(
                kind=decision.kind,
                target=decision.target,
                kept=not drop,
                sqnr_with_db=rounded(best),
                sqnr_without_db=rounded(without),
                detail=decision.detail + more,
            )
        )
        if drop:
            plan, best, floats = trial, max(best, without), _float_layers(measured)
            dropped.append(decision)
    # Every kept decision helps given the others, yet decisions interact: together they
    # can still lose to the backend default. Then none of them is worth keeping, unless they
    # quantize layers the default leaves float (those float layers are what it wins with).
    if best < default.selection_sqnr - SQNR_TOLERANCE_DB and _float_layers(default) <= floats:
        outcomes.append(
            DecisionOutcome(
                kind="plan",
                target="every remaining decision",
                kept=False,
                sqnr_with_db=rounded(best),
                sqnr_without_db=rounded(default.selection_sqnr),
                detail="together they lose to the backend default",
            )
        )
        notes.append(
            f"the pruned plan ({best:.2f} dB) lost to the backend default ({default.selection_sqnr:.2f} dB) "
            "on the selection batches: verify continued from the default"
        )
        return default_plan(plan.backend, model=plan.model), default.selection_sqnr, []
    return plan, best, dropped


def _float_layers(measured: Measured) -> int:
    """Conv/linear/recurrent/attention ops a measured plan leaves float (int8 coverage's complement)."""
    return measured.result.total_layers - measured.result.int8_layers


def _dropped(without: Measured, best: float, floats: int) -> tuple[float, bool, str]:
    """(SQNR without the decision, whether to drop it, the float layers its removal adds)."""
    value, after = without.selection_sqnr, _float_layers(without)
    more = f"; without it float conv/linear/recurrent/attention ops {floats} -> {after}" if after > floats else ""
    # a plan that fails has no coverage to keep: any that runs is better
    return value, value >= best - SQNR_TOLERANCE_DB and (after <= floats or best == FAILED), more


def _untested_note(untested: list[Decision]) -> str:
    """What pruning kept without a trial: how many, their lowest measured gain (the note used to
    call a -0.01 dB decision one "with the most measured gain"), and what buys the trials."""
    measured = [d.measured_gain for d in untested if d.measured_gain != FAILED]
    gains = f"measured gains from {min(measured):+.2f} dB" if measured else ""
    unmeasured = len(untested) - len(measured)
    how = "; ".join(part for part in (gains, f"{unmeasured} never measured" if unmeasured else "") if part)
    return (
        f"pruning stopped at its share of the trial budget: {len(untested)} decision(s) kept without a "
        f"trial of their own ({how}); a larger max_trials (--max-trials) tests them"
    )


def rounded(value: float) -> float | None:
    return None if value == FAILED else round(value, 4)
