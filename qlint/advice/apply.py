"""A plan applied to a model: the one path from a QuantPlan to a converted int8 model.

``qlint verify`` measures every plan through :func:`quantize_with_plan`, and
``QuantPlan.quantize`` hands the same function to users, so the model a user builds
from a verified plan is the model verify measured. The steps:

1. trace a copy of the model with torch.fx (the caller's model is never changed);
2. apply the float-preserving rewrites the plan lists (and only those), each checked to
   leave the float outputs unchanged (:mod:`qlint.measure.rewrite`);
3. realize the plan's equalization pairs as a float-preserving cross-layer rescale,
   with ranges read from the calibration batches;
4. prepare_fx with the plan's QConfigMapping (fan-out copies follow their originals),
   calibrate on every calibration batch, convert_fx;
5. when the plan asks for it, correct the int8 layers' biases for the mean shift their
   rounded weights cause (input sums streamed during calibration).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol

import torch.fx as fx
import torch.nn as nn
from torch.ao.quantization import QConfigMapping
from torch.fx.experimental.optimization import fuse as fuse_conv_bn

from qlint.core.batches import as_call
from qlint.core.ops import is_aten_graph
from qlint.errors import QlintError, first_line
from qlint.measure.calibrated import CalibratedQParams
from qlint.measure.equalization import apply_equalization
from qlint.measure.rewrite import (
    DEFAULT_MAX_RELATIVE_ERROR,
    AppliedRewrite,
    apply_requested_rewrites,
    apply_rewrites,
    fanout_follows_original,
    float_outputs,
    relative_error,
    unmatched_plan_rewrites,
)
from qlint.measure.trial import TrialStepError, quantize_fx

_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


class PlanToApply(Protocol):
    """What applying a plan reads from it (a :class:`qlint.advice.plan.QuantPlan`)."""

    @property
    def backend(self) -> str: ...

    @property
    def rewrites(self) -> Sequence[Any]: ...

    @property
    def equalization(self) -> Sequence[Any]: ...

    @property
    def modules(self) -> Sequence[Any]: ...

    @property
    def bias_correction(self) -> Any: ...

    def to_qconfig_mapping(self, *, rewritten: bool = False) -> QConfigMapping: ...

    def dynamic_equalized_modules(self) -> list[str]: ...

    def waiting_rewrites(self) -> list[Any]: ...


class QuantizeError(QlintError):
    """prepare_fx, calibration or convert_fx failed under a plan."""


@dataclasses.dataclass(frozen=True)
class Quantized:
    """A plan applied: the converted model, the calibrated float-with-observers model when
    it was asked for, and every rewrite that was tried."""

    converted: fx.GraphModule
    prepared: fx.GraphModule | None
    rewrites: list[AppliedRewrite]


def rewritten(
    model: nn.Module, plan: PlanToApply, calibration: Sequence[Any]
) -> tuple[fx.GraphModule, list[AppliedRewrite]]:
    """A traced copy of ``model`` with the plan's rewrites and equalization applied."""
    if not calibration:
        raise QuantizeError("quantizing needs at least one calibration batch")
    if is_aten_graph(model):  # prepare_fx would quantize none of its aten ops, and say nothing
        raise QuantizeError(
            "this model is an exported (aten) graph such as a .pt2 holds, which prepare_fx cannot "
            "quantize; quantize the nn.Module instead (module:factory with --weights)"
        )
    example = as_call(calibration[0], what="calibration batch 0")[0]
    gm, applied = apply_requested_rewrites(model, plan, example)
    applied += unmatched_plan_rewrites(plan, applied)
    refuse_unknown_modules(gm, plan)
    gm, equalized = equalized_by_plan(gm, plan, calibration)
    return gm, applied + equalized


def refuse_unapplied(applied: Sequence[AppliedRewrite]) -> None:
    """QuantizeError naming each rewrite or equalization pair the plan asks for that was not
    applied (no place for it in this graph, float outputs changed, no calibration range): the
    int8 model would then not be the one the plan was measured as."""
    missed = [record for record in applied if record.requested_by_plan and not record.applied]
    if not missed:
        return
    named = "; ".join(f"{r.kind} {'+'.join(r.modules)}: {r.reason or 'refused'}" for r in missed[:3])
    more = f"; and {len(missed) - 3} more" if len(missed) > 3 else ""
    raise QuantizeError(
        f"{len(missed)} of the plan's rewrites could not be applied to this model ({named}{more}), so the "
        "int8 model would not be the one the plan was measured as; run qlint verify on this model to get "
        "a plan for it"
    )


def equalized_by_plan(
    gm: fx.GraphModule, plan: PlanToApply, calibration: Sequence[Any]
) -> tuple[fx.GraphModule, list[AppliedRewrite]]:
    """``gm`` with the plan's equalization pairs realized as the float-preserving rescale, its
    ranges read from ``calibration``: the one place :func:`rewritten` (so QuantPlan.quantize and
    verify) and :func:`fixed_model` (``qlint fix --calibration``) do it, so they agree."""
    if not plan.equalization:
        return gm, []
    modules = [pair.module for pair in plan.equalization]
    return apply_equalization(gm, modules, calibration, dynamic=plan.dynamic_equalized_modules())


def refuse_unknown_modules(gm: fx.GraphModule, plan: PlanToApply) -> None:
    """QuantizeError when the plan's decisions or equalization pairs name a module that is not in
    ``gm`` (the model after the plan's rewrites, which may add modules) nor a prefix of one of its
    modules: torch ignores a qconfig for a name it never meets, so that part of the plan would
    silently do nothing."""
    names = {name for name, _ in gm.named_modules() if name}
    wanted = [decision.fqn for decision in plan.modules]
    wanted += [name for pair in plan.equalization for name in (pair.module, pair.previous) if name]
    unknown = [
        fqn
        for fqn in dict.fromkeys(wanted)
        if fqn not in names and not any(name.startswith(fqn + ".") for name in names)
    ]
    if unknown:
        raise QuantizeError(
            f"the plan names {len(unknown)} module(s) this model does not have: {', '.join(unknown[:4])}"
            + (", ..." if len(unknown) > 4 else "")
            + " (a plan made for another model?)"
        )


def quantize_with_plan(
    model: nn.Module,
    plan: PlanToApply,
    calibration: Sequence[Any],
    *,
    keep_prepared: bool = False,
    prepare_kwargs: dict[str, Any] | None = None,
) -> Quantized:
    """``model`` quantized as ``plan`` says: rewrites, equalization, mapping, calibration.

    Raises :class:`QuantizeError` (one line) when a torch step fails."""
    gm, applied = rewritten(model, plan, calibration)
    return quantize_rewritten(
        gm, plan, calibration, applied, keep_prepared=keep_prepared, prepare_kwargs=prepare_kwargs
    )


def quantize_rewritten(
    gm: fx.GraphModule,
    plan: PlanToApply,
    calibration: Sequence[Any],
    applied: list[AppliedRewrite],
    *,
    keep_prepared: bool = False,
    prepare_kwargs: dict[str, Any] | None = None,
    calibrated: CalibratedQParams | None = None,
) -> Quantized:
    """The second half of :func:`quantize_with_plan`: ``gm`` (the output of :func:`rewritten`,
    consumed: pass a copy to keep it) prepared with the plan's mapping, calibrated, converted.
    ``calibrated``: what earlier quantizations of this same float graph calibrated on these
    batches (see :func:`qlint.measure.trial.quantize_fx`)."""
    refuse_unknown_modules(gm, plan)
    mapping = fanout_follows_original(plan.to_qconfig_mapping(rewritten=True), gm)
    try:
        converted, prepared = quantize_fx(
            gm,
            mapping,
            plan.backend,
            calibration,
            prepare_kwargs=prepare_kwargs,
            keep_prepared=keep_prepared,
            bias_correction=plan.bias_correction is not None,
            calibrated=calibrated,
        )
    except TrialStepError as step:  # torch raises many kinds for unsupported graphs
        raise QuantizeError(f"{step.failure.stage} failed: {first_line(step.failure.error)}") from step.failure.error
    return Quantized(converted, prepared, applied)


def fixed_model(
    model: nn.Module,
    plan: PlanToApply | None,
    example_inputs: Sequence[Any],
    calibration: Sequence[Any] = (),
) -> tuple[fx.GraphModule, list[AppliedRewrite], bool]:
    """The float model ``qlint fix`` saves: a traced copy with the plan's rewrites (every rewrite
    the graph allows when there is no plan), with ``calibration`` batches the plan's equalization
    rescale (as :func:`rewritten` applies it; without them none: its scales come from the data),
    then each conv/linear → BatchNorm pair folded, as prepare_fx would fuse it. Returns (model,
    rewrites and equalizations tried, a plan rewrite the graph has no place for among them as
    refused, whether BatchNorms were folded).

    Folding makes the rewrites real in the file: a fan-out copy exists so that its original
    feeds only the BN, and after the fold that original *is* the folded conv. The fold is kept
    only when the float outputs stay within the rewrites' tolerance."""
    if plan is None:
        gm, applied = apply_rewrites(model, None, example_inputs)
    else:
        gm, applied = apply_requested_rewrites(model, plan, example_inputs)
        where = "this exported (aten) graph" if is_aten_graph(model) else "this model's graph"
        applied = applied + unmatched_plan_rewrites(plan, applied, where)
        if calibration:
            refuse_unknown_modules(gm, plan)  # a pair naming no module would silently equalize nothing
            gm, equalized = equalized_by_plan(gm, plan, calibration)
            applied = applied + equalized
    reference = float_outputs(gm, example_inputs)
    # no_trace: a re-trace would inline the modules rewrites add (qlint_normalize_x), which the
    # emitted mapping names to keep float
    folded = fuse_conv_bn(copy.deepcopy(gm).eval(), inplace=True, no_trace=True)
    if (
        not isinstance(folded, fx.GraphModule)
        or relative_error(reference, float_outputs(folded, example_inputs)) > DEFAULT_MAX_RELATIVE_ERROR
    ):
        return gm, applied, False
    bn_before = sum(isinstance(m, _BATCH_NORMS) for m in gm.modules())
    bn_after = sum(isinstance(m, _BATCH_NORMS) for m in folded.modules())
    return folded, applied, bn_after < bn_before


__all__ = [
    "PlanToApply",
    "QuantizeError",
    "Quantized",
    "equalized_by_plan",
    "fixed_model",
    "quantize_rewritten",
    "quantize_with_plan",
    "refuse_unapplied",
    "rewritten",
]
