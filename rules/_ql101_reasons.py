"""QL101's reasons a fusable chain stays unfused: their codes, what each costs and its fix, in words."""

from __future__ import annotations

from qlint.core.graph import OpNode
from qlint.linter.fixes import BLOCKED_BY_FANOUT, BLOCKED_BY_FUNCTIONAL_OP

REASON_EAGER = "eager-no-fuse"
REASON_FANOUT = BLOCKED_BY_FANOUT
REASON_QCONFIG = "qconfig-mismatch"
REASON_TRAINING = "bn-training"
REASON_FUNCTIONAL = BLOCKED_BY_FUNCTIONAL_OP
REASON_CLAMP = "unfusable-activation"

WHY = {
    REASON_EAGER: "the model uses QuantStub/DeQuantStub (eager mode), where nothing is fused "
    "unless you call torch.ao.quantization.fuse_modules",
    REASON_FANOUT: "the intermediate output is also used by {others}, so the ops cannot be merged",
    REASON_QCONFIG: "the ops have different qconfigs ({detail}); prepare_fx refuses to fuse them "
    "or silently applies the first op's qconfig to all",
    REASON_TRAINING: "the BatchNorm is in training mode; post-training fusion folds BN statistics "
    "and needs eval mode (call model.eval())",
    REASON_FUNCTIONAL: "the {op} is a functional call (e.g. F.conv2d in a custom forward); FX fuses "
    "only nn.Module conv/linear/BN calls",
    REASON_CLAMP: "the backend has no fused kernel ending in {op} (it fuses ReLU), so the output is rounded "
    "to int8 over its full signed range before {op} clips it",
}
FIX = {
    REASON_EAGER: "call torch.ao.quantization.fuse_modules(model, [{names}]) before prepare",
    REASON_FANOUT: "feed the other consumers from the fused output, or duplicate the first op for them",
    REASON_QCONFIG: "give every op of the pattern the same qconfig",
    REASON_TRAINING: "put the model in eval mode before prepare_fx (or use prepare_qat_fx for QAT)",
    REASON_FUNCTIONAL: "use the nn.Module (nn.Conv2d/nn.Linear) or fold the BN into the conv weights",
    REASON_CLAMP: "give the conv's output a fixed quantization range ending at the clip, so that int8 "
    "saturation does the clipping exactly (exact in float; the chain then needs no fused kernel)",
}


def foldable_functional(chain: list[OpNode], reasons: list[tuple[str, str]]) -> bool:
    """A chain kept unfused only because its conv is a functional call, with a BN to fold into it."""
    return [code for code, _ in reasons] == [REASON_FUNCTIONAL] and any(n.kind == "batch_norm" for n in chain)


def qconfig_text(node: OpNode) -> str:
    qc = node.qconfig
    if qc is None:
        return "None (float)"
    act = qc.activation.observer if qc.activation else "none"
    return f"{act} via {qc.source}"
