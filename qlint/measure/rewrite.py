"""Float-preserving graph rewrites applied to an fx GraphModule copy before quantizing.

Four rewrites are implemented here, and two more, only where a plan asks for them:
``normalize_input`` (per-sample input normalization, :mod:`qlint.measure.normalize`) and
``split_leading_token`` (a Linear's first token on a copy, :mod:`qlint.measure.token_split`):

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

Rewrites are kept only when the float outputs on the example inputs stay within
``max_relative_error`` (default 1e-5, relative L2 error). All the wanted rewrites are
applied together and checked once; only when that check fails is each applied to its own
copy and checked, so that the ones that change the outputs are refused with the reason.
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict
from torch.ao.quantization import QConfigMapping

from qlint.core.batches import as_call
from qlint.core.nested import tensors_in
from qlint.core.preserve import cloned
from qlint.core.trace import symbolic_graph
from qlint.errors import QlintError, TraceError
from qlint.measure.normalize import KIND as NORMALIZE_KIND
from qlint.measure.normalize import normalize_input
from qlint.measure.token_split import KIND as SPLIT_KIND
from qlint.measure.token_split import split_leading_token

DEFAULT_MAX_RELATIVE_ERROR = 1e-5

_FUNCTIONAL_CONVS = {F.conv1d: 1, F.conv2d: 2, F.conv3d: 3, torch.conv1d: 1, torch.conv2d: 2, torch.conv3d: 3}
_BN_TYPES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
_FANOUT_PRODUCERS = {
    nn.Conv1d: nn.BatchNorm1d,
    nn.Conv2d: nn.BatchNorm2d,
    nn.Conv3d: nn.BatchNorm3d,
    nn.Linear: nn.BatchNorm1d,
}
FANOUT_SUFFIX = "_qlint_fanout"


class AppliedRewrite(BaseModel):
    """One rewrite that was tried: applied (float outputs unchanged) or refused (with why)."""

    model_config = ConfigDict(frozen=True)

    kind: str
    modules: list[str]
    nodes: list[str]
    applied: bool
    requested_by_plan: bool = False
    max_relative_error: float | None = None
    reason: str | None = None


class _Candidate:
    def __init__(self, kind: str, modules: list[str], nodes: list[str]) -> None:
        self.kind, self.modules, self.nodes = kind, modules, nodes


# --------------------------------------------------------------------------- detection
def _attr_owner(gm: fx.GraphModule, target: str) -> tuple[nn.Module, str]:
    owner_path, _, name = target.rpartition(".")
    return (gm.get_submodule(owner_path) if owner_path else gm), name


def _conv_bias_node(node: fx.Node) -> Any:
    if len(node.args) > 2:
        return node.args[2]
    return node.kwargs.get("bias")


def _owner_name(target: str) -> str:
    return target.rpartition(".")[0] or target


def find_rewrites(gm: fx.GraphModule) -> list[_Candidate]:
    """Every foldable functional-conv → BN pair and every ``.view`` on an op output in ``gm``."""
    found: list[_Candidate] = []
    modules = dict(gm.named_modules())
    for node in gm.graph.nodes:
        if node.op == "call_module" and isinstance(modules.get(str(node.target)), _BN_TYPES):
            bn = modules[str(node.target)]
            if not node.args or not isinstance(node.args[0], fx.Node):
                continue
            conv = node.args[0]
            if conv.op != "call_function" or conv.target not in _FUNCTIONAL_CONVS:
                continue
            if len(conv.users) != 1 or bn.running_mean is None or bn.training:
                continue
            weight = conv.args[1] if len(conv.args) > 1 else conv.kwargs.get("weight")
            bias = _conv_bias_node(conv)
            if not (isinstance(weight, fx.Node) and weight.op == "get_attr"):
                continue
            if bias is not None and not (isinstance(bias, fx.Node) and bias.op == "get_attr"):
                continue
            found.append(
                _Candidate(
                    "fold_bn_into_functional_conv",
                    [_owner_name(str(weight.target)), str(node.target)],
                    [conv.name, node.name],
                )
            )
        fanout = _fanout_candidate(gm, modules, node)
        if fanout is not None:
            found.append(fanout)
        if node.op == "call_method" and node.target == "view":
            source = node.args[0] if node.args else None
            if isinstance(source, fx.Node) and source.op in ("call_module", "call_function", "call_method"):
                found.append(_Candidate("view_to_reshape", [node.name], [node.name]))
    return found


def _observe_input_candidates(plan: Any) -> list[_Candidate]:
    """The ``observe_input`` rewrites ``plan`` asks for: found by module name when applied,
    because the conv may be a functional call that a fold turns into that module first."""
    if plan is None:
        return []
    return [
        _Candidate("observe_input", [fqn], [fqn])
        for rewrite in plan.rewrites
        if rewrite.kind == "observe_input"
        for fqn in rewrite.modules
    ]


def _normalize_input_candidates(plan: Any) -> list[_Candidate]:
    """The ``normalize_input`` rewrites ``plan`` asks for (input name, biased layers)."""
    if plan is None:
        return []
    return [
        _Candidate(NORMALIZE_KIND, list(rewrite.modules), [str(rewrite.params.get("input"))])
        for rewrite in plan.rewrites
        if rewrite.kind == NORMALIZE_KIND
    ]


def _split_token_candidates(plan: Any) -> list[_Candidate]:
    """The ``split_leading_token`` rewrites ``plan`` asks for, one per Linear."""
    if plan is None:
        return []
    return [
        _Candidate(SPLIT_KIND, [fqn], [fqn])
        for rewrite in plan.rewrites
        if rewrite.kind == SPLIT_KIND
        for fqn in rewrite.modules
    ]


def _split_token(gm: fx.GraphModule, candidate: _Candidate) -> None:
    split_leading_token(gm, candidate.modules[0])


def _normalize_input(gm: fx.GraphModule, candidate: _Candidate) -> None:
    normalize_input(gm, candidate.nodes[0], candidate.modules)


def _observe_input(gm: fx.GraphModule, candidate: _Candidate) -> None:
    fqn = candidate.modules[0]
    calls = [
        n
        for n in gm.graph.nodes
        if (n.op == "call_module" and n.target == fqn)
        or (
            n.op == "call_function"
            and n.target in _FUNCTIONAL_CONVS
            and getattr(_conv_arguments(n).get("weight"), "target", None) == f"{fqn}.weight"
        )
    ]
    if not calls:
        raise QlintError(f"observe_input: no call of {fqn} in the graph")
    for node in calls:
        with gm.graph.inserting_before(node):
            observed = gm.graph.call_function(operator.add, (node.args[0], 0.0))
        node.args = (observed, *node.args[1:])


def _fanout_candidate(gm: fx.GraphModule, modules: dict[str, nn.Module], node: fx.Node) -> _Candidate | None:
    """A Conv/Linear module call feeding an eval-mode BN module plus other consumers."""
    if node.op != "call_module":
        return None
    producer = modules.get(str(node.target))
    bn_type = next((b for p, b in _FANOUT_PRODUCERS.items() if type(producer) is p), None)
    if bn_type is None or producer is None or len(node.users) < 2:
        return None
    bns = [
        u
        for u in node.users
        if u.op == "call_module"
        and isinstance(modules.get(str(u.target)), bn_type)
        and u.args
        and u.args[0] is node
        and len(u.args) == 1
        and not u.kwargs
    ]
    if len(bns) != 1:
        return None
    bn = modules[str(bns[0].target)]
    if bn.training or bn.running_mean is None or producer.training:
        return None
    others = [u.name for u in node.users if u is not bns[0]]
    return _Candidate("fuse", [str(node.target), str(bns[0].target)], [node.name, bns[0].name] + others)


# ----------------------------------------------------------------------------- applying
def _uses_of_attr(gm: fx.GraphModule, target: str) -> list[fx.Node]:
    return [u for n in gm.graph.nodes if n.op == "get_attr" and n.target == target for u in n.users]


def _fold(gm: fx.GraphModule, candidate: _Candidate) -> None:
    conv = next(n for n in gm.graph.nodes if n.name == candidate.nodes[0])
    bn_node = next(n for n in gm.graph.nodes if n.name == candidate.nodes[1])
    bn = gm.get_submodule(str(bn_node.target))
    if not isinstance(bn, _BN_TYPES) or bn.running_mean is None or bn.running_var is None:
        raise QlintError(f"{bn_node.target} is not a batch norm with running statistics")
    weight_node = conv.args[1] if len(conv.args) > 1 else conv.kwargs["weight"]
    bias_node = _conv_bias_node(conv)
    for attr in [weight_node] + ([bias_node] if bias_node is not None else []):
        if any(u is not conv for u in _uses_of_attr(gm, str(attr.target))):
            raise QlintError(f"{attr.target} is also used outside {conv.name}")
    owner, name = _attr_owner(gm, str(weight_node.target))
    weight = getattr(owner, name).detach()
    bias = getattr(*_attr_owner(gm, str(bias_node.target))).detach() if bias_node is not None else None
    with torch.no_grad():
        std = torch.sqrt(bn.running_var + bn.eps)
        gamma = bn.weight.detach() if bn.weight is not None else torch.ones_like(std)
        beta = bn.bias.detach() if bn.bias is not None else torch.zeros_like(std)
        factor = gamma / std
        new_weight = weight * factor.reshape(-1, *([1] * (weight.dim() - 1)))
        old_bias = bias if bias is not None else torch.zeros_like(bn.running_mean)
        new_bias = (old_bias - bn.running_mean) * factor + beta
    setattr(owner, name, nn.Parameter(new_weight.to(weight.dtype), requires_grad=False))
    if bias_node is not None:
        b_owner, b_name = _attr_owner(gm, str(bias_node.target))
        setattr(b_owner, b_name, nn.Parameter(new_bias.to(weight.dtype), requires_grad=False))
    else:
        owner_path = str(weight_node.target).rpartition(".")[0]
        b_name = "qlint_folded_bias"
        owner.register_parameter(b_name, nn.Parameter(new_bias.to(weight.dtype), requires_grad=False))
        with gm.graph.inserting_before(conv):
            new_bias_node = gm.graph.get_attr(f"{owner_path}.{b_name}" if owner_path else b_name)
        if len(conv.args) > 2:
            conv.args = conv.args[:2] + (new_bias_node,) + conv.args[3:]
        else:
            conv.kwargs = {**conv.kwargs, "bias": new_bias_node}
    bn_node.replace_all_uses_with(conv)
    gm.graph.erase_node(bn_node)
    _as_module_call(gm, conv)


_CONV_MODULES: dict[int, type[nn.Module]] = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
_CONV_ARGS = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")


def _conv_arguments(node: fx.Node) -> dict[str, Any]:
    given = dict(zip(_CONV_ARGS, node.args, strict=False)) | dict(node.kwargs)
    return {"stride": 1, "padding": 0, "dilation": 1, "groups": 1} | given


def _as_module_call(gm: fx.GraphModule, conv: fx.Node) -> None:
    """Turn a folded functional conv into a call of a plain ``nn.ConvNd`` at its owner's path.

    The owner is the module holding the weight (an ``nn.Conv2d`` subclass with a custom
    forward, traced through, as EfficientNet-Lite's padded convs are). prepare_fx then fuses
    what follows the conv (a ReLU), and a plan's decisions by module name reach it: a qconfig
    set by name never reaches a functional call in a traced GraphModule."""
    arguments = _conv_arguments(conv)
    weight, bias, source = arguments["weight"], arguments.get("bias"), arguments["input"]
    if not (isinstance(bias, fx.Node) and bias.op == "get_attr" and isinstance(source, fx.Node)):
        return
    owner_path = str(weight.target).rpartition(".")[0]
    if not owner_path or str(bias.target).rpartition(".")[0] != owner_path:
        return
    if any(n.op == "call_module" and n.target == owner_path for n in gm.graph.nodes):
        return  # the owner's own forward runs elsewhere
    owner = gm.get_submodule(owner_path)
    held = {name for name, _ in owner.named_parameters(recurse=False)} | {
        name for name, _ in owner.named_buffers(recurse=False)
    }
    if held - {str(weight.target).rpartition(".")[2], str(bias.target).rpartition(".")[2]}:
        return  # the owner holds more than this conv's weight and bias
    weight_value = getattr(owner, str(weight.target).rpartition(".")[2])
    groups = int(arguments["groups"])
    plain = _CONV_MODULES[_FUNCTIONAL_CONVS[cast(Any, conv.target)]](
        weight_value.shape[1] * groups,
        weight_value.shape[0],
        tuple(weight_value.shape[2:]),
        arguments["stride"],
        arguments["padding"],
        arguments["dilation"],
        groups,
        bias=True,
    )
    plain.weight = weight_value
    plain.bias = getattr(owner, str(bias.target).rpartition(".")[2])
    plain.train(owner.training)
    parent, _, leaf = owner_path.rpartition(".")
    parent_module = gm.get_submodule(parent) if parent else gm
    # The owner's children (e.g. the static padding the graph calls) move beside the conv:
    # prepare_fx swaps the conv for a fused module that would not carry them.
    children = dict(owner.named_children())
    if any(hasattr(parent_module, f"{leaf}_{name}") for name in children):
        return
    moved = {}
    for name, child in children.items():
        parent_module.add_module(f"{leaf}_{name}", child)
        moved[f"{owner_path}.{name}"] = f"{parent}.{leaf}_{name}" if parent else f"{leaf}_{name}"
    for node in gm.graph.nodes:
        if node.op == "call_module" and str(node.target) in moved:
            node.target = moved[str(node.target)]
    setattr(parent_module, leaf, plain)
    with gm.graph.inserting_before(conv):
        call = gm.graph.call_module(owner_path, (source,))
    conv.replace_all_uses_with(call)
    gm.graph.erase_node(conv)
    for attr in (weight, bias):
        if not attr.users:
            gm.graph.erase_node(attr)


def _duplicate_fanout(gm: fx.GraphModule, candidate: _Candidate) -> None:
    node = next(n for n in gm.graph.nodes if n.name == candidate.nodes[0])
    bn_node = next(n for n in gm.graph.nodes if n.name == candidate.nodes[1])
    base = str(node.target).replace(".", "_") + FANOUT_SUFFIX
    name, i = base, 1
    while hasattr(gm, name):
        i += 1
        name = f"{base}{i}"
    duplicate = copy.deepcopy(gm.get_submodule(str(node.target)))
    # verify gives the copy the original's qconfig (torch's stubs allow only Tensor | Module attributes)
    duplicate.qlint_fanout_of = str(node.target)  # type: ignore[assignment]
    gm.add_submodule(name, duplicate)
    with gm.graph.inserting_after(node):
        copy_node = gm.graph.call_module(name, node.args, dict(node.kwargs))
    node.replace_all_uses_with(copy_node, delete_user_cb=lambda user: user is not bn_node and user is not copy_node)


def _view_to_reshape(gm: fx.GraphModule, candidate: _Candidate) -> None:
    node = next(n for n in gm.graph.nodes if n.name == candidate.nodes[0])
    node.target = "reshape"


_APPLY = {
    "fold_bn_into_functional_conv": _fold,
    "view_to_reshape": _view_to_reshape,
    "fuse": _duplicate_fanout,
    "observe_input": _observe_input,
    NORMALIZE_KIND: _normalize_input,
    SPLIT_KIND: _split_token,
}


def _checked(record: dict[str, Any], error: float, max_relative_error: float) -> AppliedRewrite:
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


def _requested(plan: Any, candidate: _Candidate) -> bool:
    if plan is None:
        return False
    for rewrite in plan.rewrites:
        if rewrite.kind != candidate.kind:
            continue
        nodes = rewrite.params.get("nodes")
        if isinstance(nodes, list):  # a rewrite verify recorded names its graph nodes exactly
            if [str(n) for n in nodes] == list(candidate.nodes):
                return True
            continue
        names = set(rewrite.modules) | {str(rewrite.params.get("node", ""))}
        if names & (set(candidate.modules) | set(candidate.nodes)):
            return True
    return False


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

    def wanted(candidate: _Candidate) -> bool:
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
    wanted: Callable[[_Candidate], bool],
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
    planned = [*_normalize_input_candidates(plan), *_observe_input_candidates(plan), *_split_token_candidates(plan)]
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


def _record(plan: Any, candidate: _Candidate) -> dict[str, Any]:
    return dict(
        kind=candidate.kind,
        modules=candidate.modules,
        nodes=candidate.nodes,
        requested_by_plan=_requested(plan, candidate),
    )


def _applied_and_checked(
    gm: fx.GraphModule, candidates: Sequence[_Candidate], reference: list[torch.Tensor], example_inputs: Sequence[Any]
) -> float:
    """``candidates`` applied to ``gm`` in place; the float outputs' relative error after them."""
    for candidate in candidates:
        _APPLY[candidate.kind](gm, candidate)
    gm.graph.lint()
    gm.recompile()
    return relative_error(reference, float_outputs(gm, example_inputs))


def _all_applied(
    gm: fx.GraphModule,
    candidates: Sequence[_Candidate],
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
    return [_checked(_record(plan, c), error, max_relative_error) for c in candidates]


def _one_by_one(
    current: fx.GraphModule,
    candidates: Sequence[_Candidate],
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
        outcome = _checked(record, error, max_relative_error)
        applied.append(outcome)
        if outcome.applied:
            current = trial
    return current, applied


def fanout_follows_original(mapping: QConfigMapping, model: nn.Module) -> QConfigMapping:
    """A copy of ``mapping`` in which each fan-out copy (``<fqn>_qlint_fanout``) gets the qconfig
    its original has by name, so the rewrite changes no quantization decision."""
    result = copy.deepcopy(mapping)
    for name, module in model.named_modules():
        origin = getattr(module, "qlint_fanout_of", None)
        if isinstance(origin, str) and origin in result.module_name_qconfigs:
            result.set_module_name(name, result.module_name_qconfigs[origin])
    return result


# ------------------------------------------------------------------------ equalization
_POSITIVE_HOMOGENEOUS = {F.relu, torch.relu, "relu"}
_EQ_PREVIOUS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.LayerNorm, nn.BatchNorm1d, nn.BatchNorm2d)
_EQ_NEXT = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


def _equalization_path(gm: fx.GraphModule, module: str) -> tuple[fx.Node, fx.Node] | None:
    """(previous, next) call_module nodes with only ReLUs between them and no other consumer."""
    nodes = [n for n in gm.graph.nodes if n.op == "call_module" and str(n.target) == module]
    if len(nodes) != 1 or not isinstance(gm.get_submodule(module), _EQ_NEXT):
        return None
    node = nodes[0].args[0] if nodes[0].args else None
    while isinstance(node, fx.Node):
        if len(node.users) != 1:
            return None
        if node.op == "call_module":
            sub = gm.get_submodule(str(node.target))
            if isinstance(sub, nn.ReLU):
                node = node.args[0]
                continue
            if isinstance(sub, _EQ_PREVIOUS):
                if isinstance(sub, nn.LayerNorm) and (sub.weight is None or sub.weight.dim() != 1):
                    return None
                if isinstance(sub, (nn.Conv1d, nn.Conv2d, nn.Conv3d)) and sub.groups != 1:
                    return None
                return node, nodes[0]
            return None
        if node.op in ("call_function", "call_method") and node.target in _POSITIVE_HOMOGENEOUS:
            node = node.args[0]
            continue
        return None
    return None


def _input_channel_absmax(gm: fx.GraphModule, module: str, batches: Sequence[Any]) -> torch.Tensor:
    target = gm.get_submodule(module)
    seen: list[torch.Tensor] = []

    def hook(_m, args):
        x = args[0].detach()
        dim = -1 if isinstance(target, nn.Linear) else 1
        seen.append(x.abs().transpose(dim, -1).reshape(-1, x.shape[dim]).amax(0))

    handle = target.register_forward_pre_hook(hook)
    try:
        with torch.no_grad():
            for batch in batches:
                args, kwargs = as_call(batch)
                gm(*args, **kwargs)
    finally:
        handle.remove()
    return torch.stack(seen).amax(0)


def _equalize(gm: fx.GraphModule, previous: fx.Node, nxt: fx.Node, batches: Sequence[Any]) -> None:
    prev = gm.get_submodule(str(previous.target))
    following = gm.get_submodule(str(nxt.target))
    x_range = _input_channel_absmax(gm, str(nxt.target), batches).clamp_min(1e-8)
    # nn.Module's stubs type submodule attributes as Tensor | Module; these layers hold tensors.
    weight = cast(torch.Tensor, following.weight).detach()
    w_range = weight.abs().transpose(0, 1).reshape(weight.shape[1], -1).amax(1).clamp_min(1e-8)
    scale = torch.sqrt(w_range / x_range)
    scale = scale / torch.exp(torch.log(scale).mean())  # geometric mean 1: overall ranges unchanged
    with torch.no_grad():
        shape_w = (-1,) + (1,) * (cast(torch.Tensor, prev.weight).dim() - 1)
        cast(torch.Tensor, prev.weight).mul_(scale.reshape(shape_w))
        if getattr(prev, "bias", None) is not None:
            cast(torch.Tensor, prev.bias).mul_(scale)
        cast(torch.Tensor, following.weight).div_(scale.reshape((1, -1) + (1,) * (weight.dim() - 2)))


def apply_equalization(
    graph_module: fx.GraphModule,
    modules: Sequence[str],
    batches: Sequence[Any],
    *,
    max_relative_error: float = DEFAULT_MAX_RELATIVE_ERROR,
) -> tuple[fx.GraphModule, list[AppliedRewrite]]:
    """Input-weight equalization realized as a float-preserving rescale (cross-layer equalization).

    For each module (a Linear/Conv), the input channels are balanced against the weight
    columns: channel j of the input is multiplied by ``c_j = sqrt(range(W[:, j]) /
    range(x_j))`` and the column divided by it, so both ranges become
    ``sqrt(range(W[:, j]) * range(x_j))``. The input scaling is folded into the previous
    Linear/Conv/LayerNorm/BatchNorm (through ReLUs, which commute with positive scales), so
    no op is added and the float function is unchanged. Ranges come from ``batches``.
    """
    if not batches:
        raise QlintError("equalization needs calibration batches")
    current = copy.deepcopy(graph_module)
    example = as_call(batches[0])[0]
    reference = float_outputs(current, example)
    applied: list[AppliedRewrite] = []
    for module in modules:
        path = _equalization_path(current, module)
        if path is None:
            applied.append(
                AppliedRewrite(
                    kind="equalize",
                    modules=[module],
                    nodes=[],
                    applied=False,
                    requested_by_plan=True,
                    reason="no foldable previous Linear/Conv/norm (through ReLU only)",
                )
            )
            continue
        trial = copy.deepcopy(current)
        previous, nxt = (next(n for n in trial.graph.nodes if n.name == p.name) for p in path)
        record = dict(
            kind="equalize",
            modules=[str(previous.target), module],
            nodes=[previous.name, nxt.name],
            requested_by_plan=True,
        )
        _equalize(trial, previous, nxt, batches)
        error = relative_error(reference, float_outputs(trial, example))
        outcome = _checked(record, error, max_relative_error)
        applied.append(outcome)
        if outcome.applied:
            current = trial
    return current, applied


__all__ = [
    "AppliedRewrite",
    "apply_requested_rewrites",
    "fanout_follows_original",
    "apply_equalization",
    "apply_rewrites",
    "find_rewrites",
    "rewrite_key",
    "relative_error",
    "DEFAULT_MAX_RELATIVE_ERROR",
    "FANOUT_SUFFIX",
]
