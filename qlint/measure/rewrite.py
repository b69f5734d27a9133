"""Float-preserving graph rewrites applied to an fx GraphModule copy before quantizing.

This module applies the wanted rewrites to a traced copy and keeps those that leave the
float outputs unchanged; :mod:`qlint.measure.rewrite_candidates` finds where each applies
and :mod:`qlint.measure.rewrite_edits` makes the edits (input-weight equalization, which
needs calibration data: :mod:`qlint.measure.equalization`). The rewrites below, and two more
only where a plan asks for them: ``normalize_input`` (per-sample input normalization,
:mod:`qlint.measure.normalize`) and ``split_leading_token`` (a Linear's first token on a
copy, :mod:`qlint.measure.token_split`):

``fold_bn_into_functional_conv``
    A BatchNorm module (eval mode, with running statistics) whose only input is a
    functional convolution (``F.conv*d`` / ``torch.conv*d`` with ``get_attr`` weight and
    bias, as when an ``nn.Conv2d`` subclass with a custom forward is traced through).
    prepare_fx cannot fuse that pair, so the conv output is rounded to int8 before the BN
    rescales it; folding the BN statistics into the conv weight and bias removes the BN.

``fuse`` (duplicate a fan-out producer)
    A Conv/Linear module whose output feeds a BatchNorm module *and* other consumers
    (``y = conv(x); out = relu(bn(y)) + y``). prepare_fx fuses conv-bn only when the
    conv output has no other user, so the conv output is rounded to int8 before the BN
    re-amplifies it. The rewrite adds a copy of the conv (same weights, registered on
    the root as ``<fqn>_qlint_fanout``, with the same inputs) and feeds the other
    consumers from the copy; the original conv then feeds only the BN and fuses.
    Exact in float (the copy computes the same values); costs one extra conv.

``view_to_reshape``
    ``x.view(...)`` on the output of an op.  After convert_fx the quantized op may return
    a non-contiguous tensor, on which ``view`` raises; ``reshape`` is identical wherever
    ``view`` works.

``observe_input`` (only where a plan asks for it, by module name)
    ``conv(x)`` becomes ``conv(x + 0.0)``. FX quantizes a conv's input with the conv's own
    activation qconfig when nothing quantized produced it (a model input, or a pad the
    backend leaves float). A conv given a fixed output range (QL101) would then squeeze its
    input into that range too. The add is an op of its own with the default observer, so
    the conv receives an int8 input quantized over the input's own range. Exact in float.
    Applied after the folds, so it finds a folded functional conv by its module name.

``split_module`` (only where a plan asks for it: QL102's fix)
    Every call of a shared module after the first gets a copy of the module, registered
    beside it as ``<name>_qlint_call2``, ... and given the original's module-name qconfig.
    FX observes each call on its own anyway; the copies give each call its own quantized
    module, and so its own output qparams, in the converted model. Exact in float.

Rewrites are kept only when the float outputs on the example inputs stay within
``max_relative_error`` (default 1e-5, relative L2 error). All the wanted rewrites are
applied together and checked once; only when that check fails is each applied to its own
copy and checked, so that the ones that change the outputs are refused with the reason.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from pydantic import BaseModel, ConfigDict, Field
from torch.ao.quantization import QConfigMapping

from qlint.core.nested import tensors_in
from qlint.core.preserve import cloned
from qlint.core.trace import symbolic_graph
from qlint.errors import QlintError, TraceError
from qlint.measure.rewrite_candidates import (
    Candidate,
    find_rewrites,
    normalize_input_candidates,
    observe_input_candidates,
    split_module_candidates,
    split_token_candidates,
)
from qlint.measure.rewrite_edits import APPLY
from qlint.measure.token_split import split_ops_follow_linear

DEFAULT_MAX_RELATIVE_ERROR = 1e-5


class AppliedRewrite(BaseModel):
    """One rewrite that was tried: applied (float outputs unchanged) or refused (with why)."""

    model_config = ConfigDict(frozen=True)

    kind: str
    modules: list[str]
    nodes: list[str]
    applied: bool
    requested_by_plan: bool = False
    max_relative_error: float | None = None
    reason: str | None = None  # why it was refused
    note: str | None = None  # what an applied one did that a reader of per-layer numbers should know
    # equalize: how much each output channel of the previous layer was multiplied by (left out of
    # reports: verify divides it out to compare that layer with the original float model)
    output_scale: list[float] | None = Field(default=None, exclude=True, repr=False)


def checked(record: dict[str, Any], error: float, max_relative_error: float) -> AppliedRewrite:
    """A rewrite is kept only if float outputs stay within ``max_relative_error``."""
    if error <= max_relative_error:
        return AppliedRewrite(**record, applied=True, max_relative_error=error)
    return AppliedRewrite(
        **record,
        applied=False,
        max_relative_error=min(error, 1e30),
        reason=f"float outputs changed by {error:.3g} (> {max_relative_error:g})",
    )


def float_outputs(gm: nn.Module, inputs: Sequence[Any]) -> list[torch.Tensor]:
    """Every output tensor of ``gm`` on ``inputs``, as float: what a rewrite must leave unchanged."""
    with torch.no_grad():
        out = gm(*cloned(tuple(inputs)))  # a model that writes its inputs gets its own copy
    return [t.detach().float() for t in tensors_in(out)]


def rewrite_key(kind: str, nodes: Sequence[str]) -> str:
    """A stable name for one rewrite of one traced graph: ``kind:node,node``."""
    return f"{kind}:{','.join(nodes)}"


def relative_error(reference: Sequence[torch.Tensor], other: Sequence[torch.Tensor]) -> float:
    """Largest relative L2 error over the output tensors (inf when the structure differs)."""
    if len(reference) != len(other):
        return float("inf")
    worst = 0.0
    for a, b in zip(reference, other):
        if a.shape != b.shape:
            return float("inf")
        denominator = float(a.norm()) or 1.0
        worst = max(worst, float((a - b).norm()) / denominator)
    return worst


def _requested(plan: Any, candidate: Candidate) -> bool:
    if plan is None:
        return False
    return any(_asks_for(rewrite, candidate.kind, candidate.modules, candidate.nodes) for rewrite in plan.rewrites)


def _asks_for(rewrite: Any, kind: str, modules: Sequence[str], nodes: Sequence[str]) -> bool:
    """Whether the plan's ``rewrite`` names the rewrite of ``kind`` at ``modules`` / ``nodes``."""
    if rewrite.kind != kind:
        return False
    recorded = rewrite.params.get("nodes")
    if isinstance(recorded, list):  # a rewrite verify recorded names its graph nodes exactly
        return [str(n) for n in recorded] == list(nodes)
    names = set(rewrite.modules) | {str(rewrite.params.get("node", ""))}
    return bool(names & (set(modules) | set(nodes)))


def applies(rewrite: Any, tried: Sequence[AppliedRewrite]) -> bool:
    """Whether the plan's ``rewrite`` is among the rewrites in ``tried`` that were applied."""
    return any(done.applied and _asks_for(rewrite, done.kind, done.modules, done.nodes) for done in tried)


def unmatched_plan_rewrites(
    plan: Any, tried: Sequence[AppliedRewrite], graph: str = "this model's graph"
) -> list[AppliedRewrite]:
    """A refused record for each rewrite ``plan`` asks for that no rewrite in ``tried`` matches:
    ``graph`` has no place it applies to, so it was never tried, and a report of ``tried`` alone
    would not name it. A rewrite the plan keeps waiting (``waiting_rewrites``) is not asked for yet."""
    waiting = plan.waiting_rewrites()
    return [
        AppliedRewrite(
            kind=rewrite.kind,
            modules=list(rewrite.modules),
            nodes=[],
            applied=False,
            requested_by_plan=True,
            reason=f"{graph} has no place it applies to",
        )
        for rewrite in plan.rewrites
        if rewrite not in waiting
        and not rewrite.satisfied_by_tracing()
        and not any(_asks_for(rewrite, done.kind, done.modules, done.nodes) for done in tried)
    ]


def apply_rewrites(
    graph_module: nn.Module,
    plan: Any = None,
    example_inputs: Sequence[Any] = (),
    *,
    kinds: Sequence[str] | None = None,
    skip: Sequence[str] = (),
    max_relative_error: float = DEFAULT_MAX_RELATIVE_ERROR,
) -> tuple[fx.GraphModule, list[AppliedRewrite]]:
    """Rewrite a copy of ``graph_module``; returns (rewritten copy, every rewrite tried).

    ``graph_module`` may be any traceable nn.Module (it is symbolically traced first).
    Rewrites are found in the graph itself; ``plan`` only marks which of them its
    findings asked for (``requested_by_plan``). ``kinds`` limits which kinds are tried;
    ``skip`` names rewrites not to apply, by :func:`rewrite_key` (``kind:node,node``).
    The input is never modified.
    """

    def wanted(candidate: Candidate) -> bool:
        return (kinds is None or candidate.kind in kinds) and rewrite_key(candidate.kind, candidate.nodes) not in skip

    return _rewrite(graph_module, plan, example_inputs, wanted, max_relative_error)


def apply_requested_rewrites(
    graph_module: nn.Module, plan: Any, example_inputs: Sequence[Any]
) -> tuple[fx.GraphModule, list[AppliedRewrite]]:
    """Like :func:`apply_rewrites`, but only the rewrites ``plan`` asks for (one finding's fix)."""
    return _rewrite(
        graph_module, plan, example_inputs, lambda candidate: _requested(plan, candidate), DEFAULT_MAX_RELATIVE_ERROR
    )


def _traced_copy(graph_module: nn.Module) -> fx.GraphModule:
    try:
        traced = symbolic_graph(copy.deepcopy(graph_module))
    except TraceError as failure:
        raise QlintError(f"cannot trace the model for rewriting: {failure}") from failure
    return traced.eval()


def _rewrite(
    graph_module: nn.Module,
    plan: Any,
    example_inputs: Sequence[Any],
    wanted: Callable[[Candidate], bool],
    max_relative_error: float,
) -> tuple[fx.GraphModule, list[AppliedRewrite]]:
    """The wanted rewrites of ``graph_module``, applied to a traced copy.

    All of them are applied together first and the float outputs checked once; each then
    records the error of the set. Only when that check fails (a rewrite that changes the
    outputs, or one that breaks the graph) is each applied and checked on its own copy, so
    that the bad ones are refused and the others kept. A model with many BN folds would
    otherwise pay a model copy and a forward pass per fold."""
    if not example_inputs:
        raise QlintError("apply_rewrites needs example inputs to check that float outputs are unchanged")
    current = _traced_copy(graph_module)
    # observe_input last: it names a conv module that a fold may create first, and its added
    # op would end the input's scaling front end that normalize_input follows
    planned = [
        *normalize_input_candidates(plan),
        *observe_input_candidates(plan),
        *split_token_candidates(plan),
        *split_module_candidates(plan),
    ]
    candidates = [c for c in [*find_rewrites(current), *planned] if wanted(c)]
    if candidates:
        reference = float_outputs(current, example_inputs)
        together = _all_applied(current, candidates, plan, reference, example_inputs, max_relative_error)
        if together is not None:
            applied = together
        else:  # the failed attempt changed the copy: start again from the input, one rewrite at a time
            current = _traced_copy(graph_module)
            current, applied = _one_by_one(current, candidates, plan, reference, example_inputs, max_relative_error)
    else:
        applied = []
    current.delete_all_unused_submodules()
    current.recompile()
    return current, applied


def _record(plan: Any, candidate: Candidate) -> dict[str, Any]:
    return dict(
        kind=candidate.kind,
        modules=candidate.modules,
        nodes=candidate.nodes,
        requested_by_plan=_requested(plan, candidate),
    )


def _applied_and_checked(
    gm: fx.GraphModule, candidates: Sequence[Candidate], reference: list[torch.Tensor], example_inputs: Sequence[Any]
) -> float:
    """``candidates`` applied to ``gm`` in place; the float outputs' relative error after them."""
    for candidate in candidates:
        APPLY[candidate.kind](gm, candidate)
    gm.graph.lint()
    gm.recompile()
    return relative_error(reference, float_outputs(gm, example_inputs))


def _all_applied(
    gm: fx.GraphModule,
    candidates: Sequence[Candidate],
    plan: Any,
    reference: list[torch.Tensor],
    example_inputs: Sequence[Any],
    max_relative_error: float,
) -> list[AppliedRewrite] | None:
    """Every candidate applied to ``gm`` in place; None when the float outputs changed or the graph broke."""
    try:
        error = _applied_and_checked(gm, candidates, reference, example_inputs)
    except Exception:  # one rewrite breaks the graph: the one-by-one pass finds which
        return None
    if error > max_relative_error:
        return None
    return [checked(_record(plan, c), error, max_relative_error) for c in candidates]


def _one_by_one(
    current: fx.GraphModule,
    candidates: Sequence[Candidate],
    plan: Any,
    reference: list[torch.Tensor],
    example_inputs: Sequence[Any],
    max_relative_error: float,
) -> tuple[fx.GraphModule, list[AppliedRewrite]]:
    """Each candidate applied to its own copy and kept only when the float outputs stay the same."""
    applied: list[AppliedRewrite] = []
    for candidate in candidates:
        trial = copy.deepcopy(current)
        record = _record(plan, candidate)
        try:
            error = _applied_and_checked(trial, [candidate], reference, example_inputs)
        except Exception as failure:  # a rewrite that breaks the graph is refused, not fatal
            applied.append(AppliedRewrite(**record, applied=False, reason=f"{type(failure).__name__}: {failure}"[:300]))
            continue
        outcome = checked(record, error, max_relative_error)
        applied.append(outcome)
        if outcome.applied:
            current = trial
    return current, applied


def fanout_follows_original(mapping: QConfigMapping, model: nn.Module) -> QConfigMapping:
    """A copy of ``mapping`` in which each fan-out copy (``<fqn>_qlint_fanout``) gets the qconfig
    its original has by name, and the ops a token split adds get its Linear's, so the rewrite
    changes no quantization decision."""
    result = copy.deepcopy(mapping)
    for name, module in model.named_modules():
        origin = getattr(module, "qlint_fanout_of", None)
        if isinstance(origin, str) and origin in result.module_name_qconfigs:
            result.set_module_name(name, result.module_name_qconfigs[origin])
    if isinstance(model, fx.GraphModule):
        split_ops_follow_linear(result, model)
    return result


__all__ = [
    "AppliedRewrite",
    "apply_requested_rewrites",
    "fanout_follows_original",
    "apply_rewrites",
    "applies",
    "rewrite_key",
    "relative_error",
    "unmatched_plan_rewrites",
    "DEFAULT_MAX_RELATIVE_ERROR",
]
