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
    """Drop every decision whose removal does not lower SQNR (until the trial count reaches
    ``until``), then fall back to the backend default when the pruned plan as a whole loses
    to it. Returns (plan, its SQNR, the decisions dropped one by one)."""
    decisions = decisions_of(plan)
    dropped: list[Decision] = []
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
                sqnr_with_db=rounded(best),
                sqnr_without_db=rounded(without),
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
                sqnr_with_db=rounded(best),
                sqnr_without_db=rounded(without),
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


def rounded(value: float) -> float | None:
    return None if value == FAILED else round(value, 4)
