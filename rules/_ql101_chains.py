"""QL101's pattern matching: the chains of a fusable pattern in a ModelGraph, the facts that
decide whether they fuse, and the clipping activation a fused chain stops short of."""

from __future__ import annotations

from qlint.core.graph import ModelGraph, OpNode
from qlint.linter.context import LintContext

MODULE_ONLY_KINDS = frozenset({"conv1d", "conv2d", "conv3d", "linear", "batch_norm"})


def match_chain(graph: ModelGraph, head: OpNode, pattern: tuple[str, ...]) -> list[OpNode] | None:
    if head.kind != pattern[0]:
        return None
    chain = [head]
    for kind in pattern[1:]:
        nxt = [
            c
            for c in graph.consumers(chain[-1].name)
            if c.kind == kind and graph.producers(c.name)[0].name == chain[-1].name
        ]
        if not nxt:
            return None
        chain.append(nxt[0])
    return chain


def eager_fused(chain: list[OpNode]) -> bool:
    """After fuse_modules the head is an intrinsic module (ConvBnReLU2d…) and the rest Identity."""
    return any(n.module_type and ".intrinsic." in n.module_type for n in chain)


def qconfig_key(node: OpNode):
    """Fusion needs the ops to agree on how the fused output is observed."""
    qc = node.qconfig
    if qc is None:
        return None
    return qc.activation.qparams_key() if qc.activation else None


# Clipping activations that x86/qnnpack do not fuse, though the same chain ending in ReLU fuses.
_CLAMP_KINDS = frozenset({"relu6", "hardtanh"})


def unfused_clamp(ctx: LintContext, chain: list[OpNode], pattern: tuple[str, ...]) -> OpNode | None:
    """The ReLU6 / Hardtanh(0, x) module right after a fused chain the backend would extend with ReLU."""
    if pattern[-1] == "relu" or not ctx.backend.can_fuse(pattern + ("relu",)):
        return None
    if ctx.backend.can_fuse(pattern + (chain[-1].kind,)):
        return None
    consumers = ctx.graph.consumers(chain[-1].name)
    if len(consumers) != 1:
        return None
    clamp = consumers[0]
    if clamp.kind not in _CLAMP_KINDS or clamp.op != "module" or not clamp.module:
        return None
    module = ctx.graph.modules.get(clamp.module)
    if ctx.backend.can_fuse(pattern + (clamp.kind,)) or module is None:
        return None
    if clamp.kind == "hardtanh" and ctx.model_factory is not None:
        low = getattr(ctx.model_factory().get_submodule(clamp.module), "min_val", None)
        if low != 0.0:
            return None  # only a clamp at 0 can become a ReLU
    return clamp


def head_module_name(head: OpNode) -> str | None:
    """The module a qconfig names for the chain's conv: the module itself, or for a functional
    conv the module holding its weight (the fold rewrite makes that a plain conv module)."""
    if head.op == "module":
        return head.module
    return head.weight.rpartition(".")[0] or None if head.weight else None
