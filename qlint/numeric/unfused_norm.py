"""BatchNorms that read the separately rounded int8 output of the conv (or Linear) before them.

prepare_fx fuses a conv with the BatchNorm after it only when the conv is a module whose
output feeds nothing else. Otherwise (a functional ``F.conv2d`` on a module's weight, as all
49 convolutions of EfficientNet-Lite0 are; a conv output that also feeds a residual add) the
quantized model rounds the conv output to int8, per tensor, and the BN then rescales each
channel. Scaling a channel leaves its SQNR as it is, so the BN cannot add that error, only
reweight it: keeping the BN float keeps the rounding (efficientnet_lite0: 0.0 dB held-out).
Folding the BN into the conv removes the rounding between them; qlint's
``fold_bn_into_functional_conv`` and ``fuse`` rewrites (:mod:`qlint.measure.rewrite`) do that,
exact in float. This module finds the pairs those rewrites apply to in the float graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from qlint.linter.fixes import BLOCKED_BY_FANOUT, BLOCKED_BY_FUNCTIONAL_OP, Fuse
from qlint.measure.rewrite_candidates import find_rewrites


@dataclass(frozen=True)
class UnfusedNorm:
    """A BN (``norm``, its fqn) that reads ``producer``'s int8 output, and qlint can fold into it."""

    norm: str
    producer: str  # the conv/Linear module (for a functional conv: the module owning its weight)
    producer_node: str  # the producer's float graph node: the compare row of a functional conv
    functional: bool  # a functional conv (the fold rewrite), else a fan-out conv module (fuse)

    def reads(self, upstream: list[str]) -> bool:
        """Whether a row fed by ``upstream`` (row names) reads this producer's output."""
        return self.producer_node in upstream or self.producer in upstream

    @property
    def rewrite(self) -> str:
        return "fold_bn_into_functional_conv" if self.functional else "fuse"

    def blocker_text(self) -> str:
        if self.functional:
            return f"{self.producer}'s conv is a functional call, which prepare_fx does not fuse"
        return f"{self.producer}'s output also feeds other ops, so prepare_fx does not fuse it with the BN"

    def suggestion(self, producer_kind: str) -> Fuse:
        """The typed fix: a plan turns it into the rewrite that folds this BN into its producer."""
        return Fuse(
            modules=[self.producer, self.norm],
            pattern=[producer_kind, "batch_norm"],
            blockers=[BLOCKED_BY_FUNCTIONAL_OP if self.functional else BLOCKED_BY_FANOUT],
        )


def unfused_norms(float_graph: fx.GraphModule | None) -> list[UnfusedNorm]:
    """Every BN of ``float_graph`` that a qlint rewrite can fold into the conv before it."""
    if float_graph is None:
        return []
    found = []
    for candidate in find_rewrites(float_graph):
        if candidate.kind in ("fold_bn_into_functional_conv", "fuse"):
            producer, norm = candidate.modules[0], candidate.modules[1]
            functional = candidate.kind == "fold_bn_into_functional_conv"
            found.append(UnfusedNorm(norm, producer, candidate.nodes[0], functional))
    return found


def unfused_norm_text(
    pair: UnfusedNorm, local_text: str, local_share: str, producer_row: str, producer_inputs: list[str]
) -> tuple[str, str]:
    """(why, fix) of an onset at a BN that amplifies what it reads from its unfused producer."""
    inputs = f" ({', '.join(producer_inputs)})" if producer_inputs else ""
    why = (
        f"{local_text}, so about {local_share} of the error is the BN's own output rounding, which a float BN "
        "keeps too (the ops after it read int8), and the rest is amplified. It reads "
        f"{producer_row}'s int8 output, rounded per tensor before the BN rescales each channel "
        f"({pair.blocker_text()}). Scaling a channel keeps its SQNR: the drop is the BN giving weight to "
        f"channels whose small values that rounding, and the noise {producer_row} received, swamp. Keeping "
        f"{pair.norm} float keeps that rounding and gains nothing"
    )
    fix = (
        f"fold {pair.norm} into {pair.producer} (qlint's {pair.rewrite} rewrite does it, exact in float), "
        "so the channels are scaled in the per-channel weights before a single rounding. If the drop "
        f"stays after the fold, the noise comes from {producer_row}'s inputs{inputs}: improve their precision"
    )
    return why, fix
