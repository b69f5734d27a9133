"""Where a float-preserving rewrite applies: the candidates found in a traced graph
(functional conv → BN folds, fan-out producers, ``.view`` on an op output) and the ones a
plan asks for by name (``observe_input``, ``normalize_input``, ``split_leading_token``,
``split_module``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from qlint.measure.normalize import KIND as NORMALIZE_KIND
from qlint.measure.token_split import KIND as SPLIT_KIND

FUNCTIONAL_CONVS = {F.conv1d: 1, F.conv2d: 2, F.conv3d: 3, torch.conv1d: 1, torch.conv2d: 2, torch.conv3d: 3}
BN_TYPES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
_FANOUT_PRODUCERS = {
    nn.Conv1d: nn.BatchNorm1d,
    nn.Conv2d: nn.BatchNorm2d,
    nn.Conv3d: nn.BatchNorm3d,
    nn.Linear: nn.BatchNorm1d,
}


class Candidate:
    def __init__(self, kind: str, modules: list[str], nodes: list[str]) -> None:
        self.kind, self.modules, self.nodes = kind, modules, nodes


def conv_bias_node(node: fx.Node) -> Any:
    if len(node.args) > 2:
        return node.args[2]
    return node.kwargs.get("bias")


def _owner_name(target: str) -> str:
    return target.rpartition(".")[0] or target


def find_rewrites(gm: fx.GraphModule) -> list[Candidate]:
    """Every foldable functional-conv → BN pair and every ``.view`` on an op output in ``gm``."""
    found: list[Candidate] = []
    modules = dict(gm.named_modules())
    for node in gm.graph.nodes:
        if node.op == "call_module" and isinstance(modules.get(str(node.target)), BN_TYPES):
            bn = modules[str(node.target)]
            if not node.args or not isinstance(node.args[0], fx.Node):
                continue
            conv = node.args[0]
            if conv.op != "call_function" or conv.target not in FUNCTIONAL_CONVS:
                continue
            if len(conv.users) != 1 or bn.running_mean is None or bn.training:
                continue
            weight = conv.args[1] if len(conv.args) > 1 else conv.kwargs.get("weight")
            bias = conv_bias_node(conv)
            if not (isinstance(weight, fx.Node) and weight.op == "get_attr"):
                continue
            if bias is not None and not (isinstance(bias, fx.Node) and bias.op == "get_attr"):
                continue
            found.append(
                Candidate(
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
                found.append(Candidate("view_to_reshape", [node.name], [node.name]))
    return found


def observe_input_candidates(plan: Any) -> list[Candidate]:
    """The ``observe_input`` rewrites ``plan`` asks for: found by module name when applied,
    because the conv may be a functional call that a fold turns into that module first."""
    if plan is None:
        return []
    return [
        Candidate("observe_input", [fqn], [fqn])
        for rewrite in plan.rewrites
        if rewrite.kind == "observe_input"
        for fqn in rewrite.modules
    ]


def normalize_input_candidates(plan: Any) -> list[Candidate]:
    """The ``normalize_input`` rewrites ``plan`` asks for (input name, biased layers)."""
    if plan is None:
        return []
    return [
        Candidate(NORMALIZE_KIND, list(rewrite.modules), [str(rewrite.params.get("input"))])
        for rewrite in plan.rewrites
        if rewrite.kind == NORMALIZE_KIND
    ]


def split_token_candidates(plan: Any) -> list[Candidate]:
    """The ``split_leading_token`` rewrites ``plan`` asks for, one per Linear; a split for dynamic
    Linears only leaves out each Linear the plan runs otherwise (``plan.token_split_linears()``)."""
    if plan is None:
        return []
    return [Candidate(SPLIT_KIND, [fqn], [fqn]) for fqn in plan.token_split_linears()]


def split_module_candidates(plan: Any) -> list[Candidate]:
    """The ``split_module`` rewrites ``plan`` asks for (QL102's fix), one per shared module."""
    if plan is None:
        return []
    return [
        Candidate("split_module", [fqn], [fqn])
        for rewrite in plan.rewrites
        if rewrite.kind == "split_module"
        for fqn in rewrite.modules
    ]


def _fanout_candidate(gm: fx.GraphModule, modules: dict[str, nn.Module], node: fx.Node) -> Candidate | None:
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
    return Candidate("fuse", [str(node.target), str(bns[0].target)], [node.name, bns[0].name] + others)
