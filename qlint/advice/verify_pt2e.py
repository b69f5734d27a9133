"""Verify a QuantPlan on an exported (aten) graph, such as a ``.pt2`` holds, with torch's pt2e flow.

prepare_fx cannot quantize an aten graph; a ``.pt2`` user quantizes it with ``prepare_pt2e``
and the quantizer :meth:`QuantPlan.to_pt2e_quantizer` builds (torchao's
X86InductorQuantizer with the plan's module decisions and activation observers), then
calibration and ``convert_pt2e``. :class:`Pt2eSession` measures plans that way, on the same
calibration, selection and eval batches as the prepare_fx verify, and
:func:`verify_pt2e` runs its steps that the pt2e flow can express:

1. the backend default and the plan as given, measured (and, for the default and the verified
   plan, the propagated SQNR of every conv/linear op: :mod:`qlint.measure.pt2e_errors`);
2. **prune** (:func:`qlint.advice.verify_prune.prune_decisions`): each module decision and
   float function dropped when removing it does not lower SQNR on the selection batches;
3. the verified plan, measured on the eval batches.

What the pt2e flow cannot apply is taken out of the plan first, each with a note: the
float-preserving rewrites, equalization and bias correction (they change an nn.Module's
graph or a converted module's bias), and the module decisions the quantizer cannot
express (:func:`qlint.advice.pt2e.pt2e_gaps`). The scheme search and the target-SQNR
fallback of the prepare_fx verify are not run (noted when asked for).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from qlint.advice.apply import Quantized, QuantizeError
from qlint.advice.plan import QuantPlan, default_plan
from qlint.advice.pt2e import pt2e_gaps
from qlint.advice.verify_prune import prune_decisions
from qlint.advice.verify_report import DecisionOutcome, LayerComparison, VerifyReport
from qlint.advice.verify_session import Measured, Progress, Session, VerifyError
from qlint.errors import QlintError, first_line
from qlint.measure.pt2e_errors import measure_errors, weighted_ops
from qlint.measure.pt2e_trial import pt2e_blocker, pt2e_float_layers, quantize_pt2e
from qlint.measure.trial import TrialStepError


class Pt2eSession(Session):
    """A verify :class:`Session` whose plans quantize with the pt2e flow."""

    @staticmethod
    def _float_copy(model: nn.Module) -> nn.Module:
        return copy.deepcopy(model)  # an exported module refuses .eval(): it runs as it was exported

    def _graph(self) -> fx.GraphModule:
        if not isinstance(self.model, fx.GraphModule):
            raise VerifyError(f"the pt2e flow quantizes exported graphs, not a {type(self.model).__name__}")
        return self.model

    def coverage(self, converted: fx.GraphModule) -> tuple[int, int, list[str]]:
        floats, int8, total = pt2e_float_layers(converted, None)
        return int8, total, [layer.target for layer in floats]

    def quantize(
        self, plan: QuantPlan, *, keep_prepared: bool = False, calibration: list[Any] | None = None
    ) -> Quantized:
        """``plan`` applied as a .pt2 user applies it: prepare_pt2e with ``plan.to_pt2e_quantizer()``,
        calibration on ``calibration`` (default: every calibration batch), convert_pt2e."""
        batches = self.calibration if calibration is None else calibration
        return quantize_plan_pt2e(self.model, plan, batches, keep_prepared=keep_prepared)

    def layer_sqnr(
        self,
        q: Quantized,
        fqns: Iterable[str],
        batches: list[Any],
        output_scales: Mapping[str, tuple[torch.Tensor, int]] | None = None,
    ) -> dict[str, float]:
        """Propagated SQNR per weighted op (named as lint names it) of the converted graph (pt2e
        has no equalization rescale: ``output_scales`` is always empty here)."""
        if q.prepared is None:
            raise QlintError("per-layer SQNR needs the prepared model")
        wanted = set(fqns)
        errors = measure_errors(q.prepared, q.converted, batches)
        return {
            found.op.target: found.propagated_db
            for found in errors.layers
            if found.op.target in wanted and found.propagated_db is not None
        }


def drop_unread_state(converted: fx.GraphModule) -> fx.GraphModule:
    """``converted`` (changed in place) without the parameters and buffers its graph never reads
    (its get_attr nodes; a submodule's by prefix). convert_pt2e folds each weight's quantization
    into an int8 constant and leaves the float weight behind as an attribute nothing reads: a
    state_dict, and torch.export, would carry it (QA's digit.pt2: 1919 KiB for the int8 model,
    1525 KiB for the float one; 394 KiB without them)."""
    read = {str(node.target) for node in converted.graph.nodes if node.op == "get_attr"}
    named = [*converted.named_parameters(remove_duplicate=False), *converted.named_buffers(remove_duplicate=False)]
    for name, _tensor in named:
        if name in read or any(name.startswith(prefix + ".") for prefix in read):
            continue
        owner, _, attribute = name.rpartition(".")
        delattr(converted.get_submodule(owner) if owner else converted, attribute)
    converted.delete_all_unused_submodules()
    return converted


def pt2e_plan(plan: QuantPlan) -> tuple[QuantPlan, list[str]]:
    """``plan`` without what the pt2e flow cannot apply, as a pt2e plan, and a note for each part taken out."""
    notes = []
    if plan.rewrites or plan.equalization:
        notes.append(
            f"{len(plan.rewrites)} rewrite(s) and {len(plan.equalization)} equalization pair(s) left out: they "
            "change the nn.Module's graph, and an exported graph is quantized as it is (apply them before "
            "torch.export, with qlint fix on the nn.Module)"
        )
    if plan.bias_correction is not None:
        notes.append("bias correction left out: convert_pt2e keeps float biases that qlint does not correct")
    gaps = pt2e_gaps(plan)
    notes += [f"{fqn}: {why}; left out" for fqn, why in gaps]
    left_out = {fqn for fqn, _ in gaps}
    kept = [decision for decision in plan.modules if decision.fqn not in left_out]
    # the plan it leaves is one for the pt2e flow (verify's verified plan says so, whatever it was given)
    changed = plan.model_copy(
        update={"rewrites": [], "equalization": [], "bias_correction": None, "modules": kept, "flow": "pt2e"}
    )
    return changed, notes


def quantize_plan_pt2e(
    model: nn.Module, plan: QuantPlan, calibration: list[Any], *, keep_prepared: bool = False
) -> Quantized:
    """``plan`` (as :func:`pt2e_plan` leaves it) applied to a copy of the exported graph ``model``
    as a .pt2 user applies it: prepare_pt2e with ``plan.to_pt2e_quantizer()``, calibration on
    every batch of ``calibration``, convert_pt2e. The one place verify's measured models and
    ``qlint quantize``'s saved one are built, so they are the same model. Raises
    :class:`QuantizeError` (one line) when a step fails."""
    try:
        converted, prepared = quantize_pt2e(copy.deepcopy(model), plan.to_pt2e_quantizer(), calibration, keep_prepared)
    except TrialStepError as step:
        raise QuantizeError(f"{step.failure.stage} failed: {first_line(step.failure.error)}") from step
    return Quantized(drop_unread_state(converted), prepared, [])


def build_pt2e(model: nn.Module, plan: QuantPlan, calibration: list[Any]) -> tuple[fx.GraphModule, list[str]]:
    """The int8 model ``qlint verify`` measures for ``plan`` on the exported graph ``model``: the
    plan without what the pt2e flow cannot apply (a note for each part left out), quantized by
    :func:`quantize_plan_pt2e`. Raises :class:`VerifyError` when the flow cannot run here
    (another backend, no torchao) and :class:`QuantizeError` when a step fails."""
    blocker = pt2e_blocker(plan.backend)
    if blocker is not None:
        raise VerifyError(blocker)
    applicable, notes = pt2e_plan(plan)
    return quantize_plan_pt2e(model, applicable, calibration).converted, notes


def verify_pt2e(
    model: nn.Module,
    plan: QuantPlan,
    calibration: list[Any],
    selection: list[Any],
    eval_data: list[Any],
    *,
    selected_on: str,
    prune: bool,
    max_trials: int,
    max_prune_trials: int | None,
    eval_fn: Callable[[nn.Module, Any], float] | None,
    skipped: list[str],
    model_name: str,
    progress: Progress | None,
) -> VerifyReport:
    """Default vs ``plan`` on an exported graph, pruned, with the pt2e flow. ``skipped``: the
    prepare_fx verify's steps asked for that the pt2e flow does not run (a note each)."""
    blocker = pt2e_blocker(plan.backend)
    if blocker is not None:
        raise VerifyError(blocker)
    session = Pt2eSession(
        model, calibration, selection, eval_data, eval_fn=eval_fn, max_trials=max_trials, progress=progress
    )
    given_plan, notes = pt2e_plan(plan)
    notes += [f"{step}: not run on an exported graph (the pt2e flow)" for step in skipped]
    float_metric = float(eval_fn(session.model, eval_data)) if eval_fn is not None else None
    layers = {op.target: op.kind for op in weighted_ops(session.traced)}
    default = session.measure("default quantizer", default_plan(plan.backend, model=plan.model), layers=list(layers))
    given = session.measure("plan as given", given_plan)
    current, best = given_plan, given.selection_sqnr
    outcomes: list[DecisionOutcome] = []
    if prune:
        # no step after pruning here: it may take every trial (at most max_prune_trials when given)
        until = session.share(session.left() if max_prune_trials is None else max_prune_trials)
        current, best, _dropped = prune_decisions(session, current, best, default, outcomes, notes, until)
    verified = session.measure("verified plan", current, layers=list(layers))
    floats = verified.result.float_modules
    if floats:
        shown = ", ".join(floats[:6]) + (f", ... ({len(floats)} in all)" if len(floats) > 6 else "")
        notes.append(f"{len(floats)} conv/linear op(s) stay float in the pt2e flow ({shown}): qlint's QL106 says why")
    return VerifyReport(
        backend=plan.backend,
        model=model_name,
        eval_batches=len(eval_data),
        calibration_batches=len(calibration),
        selection_batches=len(selection),
        selected_on=selected_on + "; quantized with prepare_pt2e/convert_pt2e",
        trials=session.trials,
        max_trials=session.max_trials,
        float_metric=float_metric,
        default=default.result,
        requested=given.result,
        plan=verified.result,
        layers=_layers(layers, default, verified),
        decisions=outcomes,
        float_layer_fraction=round(1.0 - verified.result.int8_fraction, 4),
        verified_plan=current,
        notes=notes,
    )


def _layers(kinds: dict[str, str], default: Measured, verified: Measured) -> list[LayerComparison]:
    """Per weighted op: propagated SQNR and int8-ness under the default and the verified plan."""
    default_float, plan_float = set(default.result.float_modules), set(verified.result.float_modules)
    return [
        LayerComparison(
            fqn=target,
            kind=kind,
            default_sqnr_db=(default.layers or {}).get(target),
            plan_sqnr_db=(verified.layers or {}).get(target),
            default_int8=None if default.result.failure else target not in default_float,
            plan_int8=None if verified.result.failure else target not in plan_float,
        )
        for target, kind in kinds.items()
    ]
