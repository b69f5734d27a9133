"""QL101 unfused-pattern."""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from pydantic import Field
from torch.ao.quantization import DeQuantStub, QConfig, QConfigMapping, QuantStub, get_default_qconfig_mapping
from torch.ao.quantization.observer import FixedQParamsObserver

from qlint.core.batches import call_model
from qlint.core.graph import ModelGraph, OpNode
from qlint.core.sqnr import BatchPowers
from qlint.linter.context import LintContext
from qlint.linter.findings import Finding, Impact, Severity
from qlint.linter.rule import Example, Need, Rule, RuleOptions
from qlint.linter.suggestions import Provenance, Rewrite, Suggestions
from qlint.measure.rewrite import apply_rewrites
from qlint.measure.trial import ActivationError

REASON_EAGER = "eager-no-fuse"
REASON_FANOUT = "fan-out"
REASON_QCONFIG = "qconfig-mismatch"
REASON_TRAINING = "bn-training"
REASON_FUNCTIONAL = "functional-op"
REASON_CLAMP = "unfusable-activation"

_WHY = {
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
_FIX = {
    REASON_EAGER: "call torch.ao.quantization.fuse_modules(model, [{names}]) before prepare",
    REASON_FANOUT: "feed the other consumers from the fused output, or duplicate the first op for them",
    REASON_QCONFIG: "give every op of the pattern the same qconfig",
    REASON_TRAINING: "put the model in eval mode before prepare_fx (or use prepare_qat_fx for QAT)",
    REASON_FUNCTIONAL: "use the nn.Module (nn.Conv2d/nn.Linear) or fold the BN into the conv weights",
    REASON_CLAMP: "give the conv's output a fixed quantization range ending at the clip, so that int8 "
    "saturation does the clipping exactly (exact in float; the chain then needs no fused kernel)",
}
# Clipping activations that x86/qnnpack do not fuse, though the same chain ending in ReLU fuses.
_CLAMP_KINDS = frozenset({"relu6", "hardtanh"})


class UnfusedPattern(Rule):
    """Flags op patterns the backend could fuse that will stay unfused in your flow.

    ## What it does
    Finds conv-bn, conv-bn-relu, conv-relu, linear-relu, linear-bn1d, bn-relu and add-relu
    chains that the chosen backend can fuse into one quantized kernel, and checks whether
    your flow will actually fuse them. It reports why each one stays unfused: an eager flow
    without `fuse_modules`, an intermediate output used elsewhere (fan-out), ops with
    different qconfigs, a BatchNorm in training mode, or a functional conv/linear that FX
    cannot match.

    It also finds conv(-bn) → ReLU6/Hardtanh(0, c) chains that the backend fuses only without
    the clip (x86 fuses ReLU, not ReLU6). Where the calibration data reaches the clip, it
    suggests a fixed output range [0, c] for the conv (int8 saturation then clips exactly),
    and an op of its own to quantize the conv's input when nothing quantized produces it (a
    model input, a pad), measured in one trial with every other range group applied.

    ## Why is this bad?
    An unfused pattern quantizes every intermediate tensor to int8 and back: the conv
    output is rounded before BatchNorm rescales it, and again before ReLU clips it. Each
    rounding adds error, BatchNorm is not folded into the weights (so per-channel weight
    scales no longer see the real weights), and each op runs as its own kernel. Unfused
    conv-bn alone can cost several dB of SQNR and collapse accuracy in depthwise networks.

    ## Example
    ```python
    class Block(nn.Module):
        def forward(self, x):
            y = self.conv(x)            # conv output also feeds the skip path
            return self.relu(self.bn(y)) + y
    ```

    ## Use instead
    ```python
    class Block(nn.Module):
        def forward(self, x):
            y = self.relu(self.bn(self.conv(x)))
            return y + self.skip(x)
    ```
    In eager mode, call `torch.ao.quantization.fuse_modules(model.eval(), [["conv", "bn", "relu"]])`.

    ## Options
    - `include_add_relu`: also report add-relu pairs (fused at lowering time as `quantized::add_relu`).
    - `report_training_bn`: report conv-bn pairs whose BatchNorm is in training mode.

    ## References
    - https://pytorch.org/docs/stable/quantization.html#model-preparation-for-eager-mode-static-quantization
    - torch.ao.quantization.fuse_modules, torch.ao.quantization.quantize_fx.fuse_fx
    """

    code = "QL101"
    name = "unfused-pattern"
    summary = "A fusable op pattern will stay unfused in this quantization flow."
    severity = Severity.WARNING
    requires = frozenset({Need.GRAPH, Need.QCONFIG})

    class Options(RuleOptions):
        include_add_relu: bool = Field(True, description="Report add-relu pairs.")
        report_training_bn: bool = Field(True, description="Report BN in training mode.")

    options: Options  # this rule's own Options, so the type checker knows its fields

    def check(self, ctx: LintContext) -> Iterable[Finding]:
        graph = ctx.graph
        patterns = sorted(
            (p for p in ctx.backend.fusable if self.options.include_add_relu or p != ("add", "relu")),
            key=len,
            reverse=True,
        )
        covered: set[str] = set()
        clamps: list[tuple[list[OpNode], tuple[str, ...], OpNode]] = []
        functional: list[tuple[list[OpNode], tuple[str, ...]]] = []
        for head in graph.ops():
            if head.name in covered:
                continue
            for pattern in patterns:
                chain = _match_chain(graph, head, pattern)
                if chain is None:
                    continue
                reasons = self._reasons(ctx, chain)
                if reasons:
                    covered.update(n.name for n in chain)
                    if _foldable_functional(chain, reasons):
                        functional.append((chain, pattern))
                        clamp = _unfused_clamp(ctx, chain, pattern)
                        if clamp is not None:  # after the fold the conv is a module that fuses the BN
                            clamps.append((chain, pattern, clamp))
                    else:
                        yield self._report(graph, chain, pattern, reasons)
                    break
                # The longest pattern that matches fuses; shorter ones are part of it.
                covered.update(n.name for n in chain)
                clamp = _unfused_clamp(ctx, chain, pattern)
                if clamp is not None:
                    clamps.append((chain, pattern, clamp))
                break
        if functional:
            yield self._functional_finding(functional)
        by_range: dict[tuple[float, float] | None, list[tuple[list[OpNode], tuple[str, ...], OpNode]]] = {}
        observed: list[str] = []  # heads whose input needs an op of its own (observe_input rewrite)
        for entry, (clip, observe) in zip(clamps, _saturating_ranges(ctx, clamps) if clamps else [], strict=True):
            by_range.setdefault(clip, []).append(entry)
            head_module = _head_module(entry[0][0])
            if observe and clip is not None and head_module is not None:
                observed.append(head_module)
        fixed_groups = {
            clip: (_fixed_activation(ctx, clip), [h for h in (_head_module(ch[0]) for ch, _, _ in group) if h])
            for clip, group in by_range.items()
            if clip is not None
        }
        meter = _RangeMeter(ctx, list(fixed_groups.values()), [c for c, _ in functional], observed)
        folded = [h for h in (_head_module(chain[0]) for chain, _ in functional) if h is not None]
        for clip, group in by_range.items():
            yield self._clamp_finding(ctx, group, clip, meter, observed, folded)

    def _reasons(self, ctx: LintContext, chain: list[OpNode]) -> list[tuple[str, str]]:
        graph = ctx.graph
        reasons: list[tuple[str, str]] = []
        if ctx.eager_flow and not _eager_fused(chain):
            names = ", ".join(f'"{n.display}"' for n in chain)
            reasons.append((REASON_EAGER, names))
        for node, successor in zip(chain, chain[1:]):
            others = [c for c in graph.consumers(node.name) if c.name != successor.name]
            if others:
                reasons.append((REASON_FANOUT, ", ".join(o.display for o in others)))
        qconfig_keys = {_qconfig_key(n) for n in chain}
        if len(qconfig_keys) > 1:
            detail = "; ".join(f"{n.display}: {_qconfig_text(n)}" for n in chain)
            reasons.append((REASON_QCONFIG, detail))
        if self.options.report_training_bn and any(n.kind == "batch_norm" and n.training for n in chain):
            reasons.append((REASON_TRAINING, ""))
        if not graph.exported:
            for node in chain:
                if node.op != "module" and node.kind in _MODULE_ONLY_KINDS and (chain[0].kind != "add"):
                    reasons.append((REASON_FUNCTIONAL, node.kind))
                    break
        return reasons

    def _report(
        self, graph: ModelGraph, chain: list[OpNode], pattern: tuple[str, ...], reasons: list[tuple[str, str]]
    ) -> Finding:
        names = [n.display for n in chain]
        why = []
        fixes = []
        for code, detail in reasons:
            why.append(_WHY[code].format(others=detail, detail=detail, op=detail))
            fixes.append(_FIX[code].format(names=", ".join(f'"{n}"' for n in names)))
        fanout = [d for c, d in reasons if c == REASON_FANOUT]
        message = (
            f"{' → '.join(pattern)} ({', '.join(names)}) will stay unfused: {'; '.join(why)}. "
            "Unfused, each intermediate tensor is rounded to int8 and requantized and BN is not "
            f"folded into the weights, which adds error and kernels. Fix: {'; '.join(dict.fromkeys(fixes))}."
        )
        return self.finding(
            chain[0].display,
            message,
            data={
                "kind": "-".join(pattern),
                "node": chain[0].name,
                "pattern": list(pattern),
                "nodes": [n.name for n in chain],
                "modules": names,
                "reasons": [c for c, _ in reasons],
                "other_consumers": fanout[0].split(", ") if fanout else [],
            },
            suggestion={
                "action": "fuse",
                "modules": names,
                "pattern": list(pattern),
                "blockers": [c for c, _ in reasons],
            },
        )

    def _functional_finding(self, chains: list[tuple[list[OpNode], tuple[str, ...]]]) -> Finding:
        """One finding for every conv → BN chain that stays unfused only because the conv is a
        functional call: one fix (fold each BN into its conv), measured in one trial."""
        names = [[n.display for n in chain] for chain, _ in chains]
        first_chain, first_pattern = chains[0]
        kinds = sorted({n.kind for chain, _ in chains for n in chain if n.kind in _MODULE_ONLY_KINDS - {"batch_norm"}})
        listed = "; ".join(" → ".join(chain) for chain in names[:8]) + (
            f"; ... ({len(names)} in all)" if len(names) > 8 else ""
        )
        message = (
            f"{len(chains)} {'/'.join(kinds)} → batch_norm chain(s) will stay unfused: "
            + _WHY[REASON_FUNCTIONAL].format(op="/".join(kinds))
            + ". Unfused, each conv output is rounded to int8 before its BN rescales it, and the BN is "
            f"not folded into the weights. Chains: {listed}. Fix: {_FIX[REASON_FUNCTIONAL]} (qlint's "
            "fold_bn_into_functional_conv rewrite does it, exact in float)."
        )
        modules = [name for chain in names for name in chain]
        return self.finding(
            first_chain[0].display,
            message,
            data={
                "kind": "functional-op",
                "node": first_chain[0].name,
                "pattern": list(first_pattern),
                "chains": names,
                "nodes": [[n.name for n in chain] for chain, _ in chains],
                "modules": modules,
                "reasons": [REASON_FUNCTIONAL],
                "other_consumers": [],
            },
            suggestion={
                "action": "fuse",
                "modules": modules,
                "pattern": list(first_pattern),
                "blockers": [REASON_FUNCTIONAL],
            },
        )

    def _clamp_finding(
        self,
        ctx: LintContext,
        clamps: list[tuple[list[OpNode], tuple[str, ...], OpNode]],
        clip: tuple[float, float] | None,
        meter: _RangeMeter,
        observed: list[str],
        folded: list[str],
    ) -> Finding:
        """One finding for the chains that stop short of their clipping activation and share one
        saturating range, measured together with that range. ``folded``: the heads that are
        functional convs, a module only once the fold rewrite has run (the fix asks for it)."""
        lines, rounding = [], []
        for chain, _pattern, clamp in clamps:
            found = _chain_end_activation(ctx, chain)
            measured = found.sqnr_db if found is not None else None
            rounding.append(measured)
            text = f"{' → '.join(n.display for n in chain)} → {clamp.display}"
            lines.append(text + (f" (rounding before {clamp.kind}: {measured:.1f} dB)" if measured is not None else ""))
        first_chain, first_pattern, first_clamp = clamps[0]
        kinds = sorted({clamp.kind for _, _, clamp in clamps})
        why = _WHY[REASON_CLAMP].format(op="/".join(kinds))
        message = (
            f"{len(clamps)} {' → '.join(first_pattern)} chain(s) end in {'/'.join(kinds)} and fuse without "
            f"it on {ctx.backend.name}: {why}. Chains: {'; '.join(lines[:8])}"
            + (f"; ... ({len(lines)} in all)" if len(lines) > 8 else "")
            + "."
        )
        heads = [_head_module(chain[0]) for chain, _, _ in clamps]
        data = {
            "kind": "unfusable-activation",
            "node": first_chain[0].name,
            "pattern": list(first_pattern) + [first_clamp.kind],
            "chains": [[n.display for n in chain] + [clamp.display] for chain, _, clamp in clamps],
            "modules": heads,
            "reasons": [REASON_CLAMP],
            "rounding_sqnr_db": rounding,
        }
        if clip is None or None in heads:
            message += (
                " No fixed range applies: the values never reach the clip on the calibration data, "
                "or the conv is not a module a qconfig can name."
            )
            return self.finding(first_chain[0].display, message, data=data, severity=Severity.INFO)
        fixed = _fixed_activation(ctx, clip)
        targets = [h for h in heads if h is not None]
        message += f" Fix: {_FIX[REASON_CLAMP]}: [{clip[0]:g}, {clip[1]:g}] on {', '.join(targets[:4])}" + (
            f" and {len(targets) - 4} more" if len(targets) > 4 else ""
        )
        own_input = [h for h in targets if h in observed]
        if own_input:
            message += (
                f", with {', '.join(own_input[:4])} given an op of its own to quantize its input (no quantized "
                "op produces it, so FX would squeeze it into the fixed range too)"
            )
        if any(h in folded for h in targets):
            message += ", each functional conv first made a module by folding its BN into it (the fold rewrite)"
        impact = meter.impact(targets)
        if impact is not None and impact.fixed_sqnr_db is not None:
            message += f"; measured {impact.base_sqnr_db:.1f} → {impact.fixed_sqnr_db:.1f} dB"
        return self.finding(
            first_chain[0].display,
            message + ".",
            impact=impact,
            data=data | {"clip": list(clip)},
            suggestion={
                "action": "set_qconfig",
                "targets": targets,
                "activation": "FixedQParamsObserver",
                "dtype": "quint8",
                "scale": fixed.scale,
                "zero_point": fixed.zero_point,
                "quant_min": fixed.quant_min,
                "quant_max": fixed.quant_max,
                "observe_inputs": [h for h in targets if h in observed],
                "fold_functional": [h for h in targets if h in folded],
            },
        )


def _chain_end_activation(ctx: LintContext, chain: list[OpNode]) -> ActivationError | None:
    """The trial's rounding error where the chain hands its value to the clamp. Fusion renames
    it: a conv → BN pair folds into one module named after the conv, so the last chain node the
    trial observed is the one that stands for the chain's end."""
    if ctx.trial is None:
        return None
    return next((found for node in reversed(chain) if (found := ctx.trial.activation(node.name)) is not None), None)


def _foldable_functional(chain: list[OpNode], reasons: list[tuple[str, str]]) -> bool:
    """A chain kept unfused only because its conv is a functional call, with a BN to fold into it."""
    return [code for code, _ in reasons] == [REASON_FUNCTIONAL] and any(n.kind == "batch_norm" for n in chain)


def _unfused_clamp(ctx: LintContext, chain: list[OpNode], pattern: tuple[str, ...]) -> OpNode | None:
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


def _head_module(head: OpNode) -> str | None:
    """The module a qconfig names for the chain's conv: the module itself, or for a functional
    conv the module holding its weight (the fold rewrite makes that a plain conv module)."""
    if head.op == "module":
        return head.module
    return head.weight.rpartition(".")[0] or None if head.weight else None


def _saturating_ranges(
    ctx: LintContext, clamps: list[tuple[list[OpNode], tuple[str, ...], OpNode]]
) -> list[tuple[tuple[float, float] | None, bool]]:
    """Per chain, the fixed range [0, clip] whose int8 saturation computes its clamp exactly, from
    one float pass over the trial's calibration batches (the example inputs without one), and
    whether the conv's input needs an op of its own to be quantized.

    The range is None where the values never reach the clip: a fixed range would only waste
    levels there. FX quantizes a conv's input with the conv's own qconfig when no quantized op
    produced it (a model input, or an op the backend leaves float such as a pad); such a conv
    gets the observe_input rewrite, so that the fixed range is its output's alone."""
    if ctx.trial_bench is not None:
        batches = list(ctx.trial_bench.calibration)
    else:
        batches = [tuple(ctx.example_inputs)] if ctx.example_inputs else []
    if ctx.model_factory is None or not batches:
        return [(None, False)] * len(clamps)
    model = ctx.model_factory().eval()
    highest: dict[str, float] = {}

    def watch(fqn: str) -> None:
        def record(_module: nn.Module, args: tuple[Any, ...], _output: Any) -> None:
            highest[fqn] = max(highest.get(fqn, float("-inf")), float(args[0].max()))

        model.get_submodule(fqn).register_forward_hook(record)

    own_input: list[bool] = []
    for chain, _, clamp in clamps:
        watch(str(clamp.module))
        producers = ctx.graph.producers(chain[0].name)
        own_input.append(not (producers and producers[0].op != "input" and ctx.backend.supports(producers[0].kind)))
    with torch.no_grad():
        for batch in batches:  # a tensor, a tuple of arguments or a mapping of keyword arguments
            call_model(model, batch)
    ranges: list[tuple[tuple[float, float] | None, bool]] = []
    for (_, _, clamp), observe in zip(clamps, own_input, strict=True):
        high = 6.0
        if clamp.kind == "hardtanh":
            high = float(getattr(model.get_submodule(str(clamp.module)), "max_val", 6.0))
        reached = highest.get(str(clamp.module), 0.0) >= high
        ranges.append(((0.0, round(high, 4)), observe) if reached else (None, False))
    return ranges


@dataclasses.dataclass(frozen=True)
class _Fixed:
    scale: float
    zero_point: int
    quant_min: int
    quant_max: int

    def qconfig(self, weight: Any) -> QConfig:
        observer = FixedQParamsObserver.with_args(
            scale=self.scale,
            zero_point=self.zero_point,
            dtype=torch.quint8,
            quant_min=self.quant_min,
            quant_max=self.quant_max,
        )
        return QConfig(activation=observer, weight=weight)


def _fixed_activation(ctx: LintContext, clip: tuple[float, float]) -> _Fixed:
    """quint8 qparams for ``clip``, in the backend's activation range (7 bits where it reduces)."""
    quant_max = 127 if ctx.backend.wants_reduce_range else 255
    scale = (clip[1] - clip[0]) / quant_max
    return _Fixed(scale=scale, zero_point=round(-clip[0] / scale), quant_min=0, quant_max=quant_max)


class _RangeMeter:
    """Measures each group of fixed ranges as the gain of adding it to all the other groups.

    The groups work together (a wide stem output ruins what the later ranges save), so each
    finding's impact is measured with every other group applied: one trial for all groups and one
    for each group left out. Functional chains are measured after the fold rewrite, so that the
    gain is the ranges' own and not the fold's."""

    def __init__(
        self,
        ctx: LintContext,
        groups: list[tuple[_Fixed, list[str]]],
        functional: list[list[OpNode]],
        observed: list[str],
    ):
        self.ctx, self.groups = ctx, groups
        self.bench = ctx.trial_bench
        if self.bench is not None and (functional or observed):
            example, original = ctx.example_inputs or (), self.bench.model_factory
            provenance = [Provenance(rule="QL101")]
            asked = (
                Suggestions(rewrites=[Rewrite(kind="observe_input", modules=observed, provenance=provenance)])
                if observed
                else None
            )
            kinds = ["fold_bn_into_functional_conv"] * bool(functional) + ["observe_input"] * bool(observed)

            @functools.cache
            def rewritten_once() -> nn.Module:  # rewriting checks float outputs: once, not per trial
                return apply_rewrites(original(), asked, example, kinds=kinds)[0]

            self.bench = self.bench.variant(lambda: copy.deepcopy(rewritten_once()))
        self.functional, self.rewritten = bool(functional), bool(functional or observed)
        self._all: BatchPowers | None = None

    def _powers(self, groups: list[tuple[_Fixed, list[str]]]) -> BatchPowers | None:
        """The output's per-batch powers with ``groups`` fixed; None when no trial can tell."""
        mapping = self.ctx.qconfig_mapping
        if self.bench is None or mapping is None or self.ctx.trial is None or self.ctx.trial.output_powers is None:
            return None
        if not groups and not self.rewritten:
            return self.ctx.trial.output_powers  # the lint trial already measured the intended mapping
        mapping = copy.deepcopy(mapping)
        weight = mapping.global_qconfig.weight if mapping.global_qconfig is not None else None
        for fixed, targets in groups:
            for fqn in targets:
                mapping.set_module_name(fqn, fixed.qconfig(weight))
        return self.bench.output_powers(mapping)

    def impact(self, targets: list[str]) -> Impact | None:
        if self._all is None:
            self._all = self._powers(self.groups)
        others = [g for g in self.groups if g[1] != targets]
        base = self._powers(others)
        if base is None or self._all is None:
            return None
        detail = "fixed saturating range on every listed conv in one trial"
        if others:
            detail += f", with the {len(others)} other fixed-range group(s) applied in both"
        if self.functional:
            detail += ", both models with the functional conv → BN folds applied"
        if self.rewritten and not self.functional:
            detail += ", both models with the convs' inputs given ops of their own"
        return Impact.between(base, self._all, "rule-trial", detail)


_MODULE_ONLY_KINDS = frozenset({"conv1d", "conv2d", "conv3d", "linear", "batch_norm"})


def _match_chain(graph: ModelGraph, head: OpNode, pattern: tuple[str, ...]) -> list[OpNode] | None:
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


def _eager_fused(chain: list[OpNode]) -> bool:
    """After fuse_modules the head is an intrinsic module (ConvBnReLU2d…) and the rest Identity."""
    return any(n.module_type and ".intrinsic." in n.module_type for n in chain)


def _qconfig_key(node: OpNode):
    """Fusion needs the ops to agree on how the fused output is observed."""
    qc = node.qconfig
    if qc is None:
        return None
    return qc.activation.qparams_key() if qc.activation else None


def _qconfig_text(node: OpNode) -> str:
    qc = node.qconfig
    if qc is None:
        return "None (float)"
    act = qc.activation.observer if qc.activation else "none"
    return f"{act} via {qc.source}"


# --- examples --------------------------------------------------------------------------


class _ConvBnReluFanout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.relu = nn.ReLU()

    def forward(self, x):
        y = self.conv(x)
        return self.relu(self.bn(y)) + y


class _CleanBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.relu = nn.ReLU()
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        y = self.relu(self.bn(self.conv(x)))
        return F.relu(self.fc(y.mean((2, 3))))


class _EagerModel(nn.Module):
    def __init__(self, fused: bool = False) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.conv = nn.Conv2d(3, 8, 3)
        self.bn = nn.BatchNorm2d(8)
        self.relu = nn.ReLU()
        self.dequant = DeQuantStub()
        if fused:
            torch.ao.quantization.fuse_modules(self.eval(), [["conv", "bn", "relu"]], inplace=True)

    def forward(self, x):
        return self.dequant(self.relu(self.bn(self.conv(self.quant(x)))))


def _eager(fused: bool):
    model = _EagerModel(fused).eval()
    model.qconfig = torch.ao.quantization.get_default_qconfig("x86")
    return model


def _linear_relu_mixed_mapping() -> QConfigMapping:
    mapping = get_default_qconfig_mapping("x86")
    return mapping.set_module_name("relu", torch.ao.quantization.get_default_qconfig("qnnpack"))


class _LinearRelu(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.relu = nn.ReLU()

    def forward(self, x):
        return self.relu(self.fc(x))


class _SameConv(nn.Conv2d):
    """A conv subclass whose forward traces to F.conv2d (as in EfficientNet-Lite's padded convs)."""

    def forward(self, x):
        return F.conv2d(x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)


class _FunctionalConvBn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = _SameConv(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = _SameConv(8, 8, 3, padding=1), nn.BatchNorm2d(8)

    def forward(self, x):
        return self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))


def _image():
    return (torch.randn(2, 3, 16, 16),)


VALID = (
    Example("conv-bn-relu and linear-relu that prepare_fx fuses", lambda: _CleanBlock().eval(), _image),
    Example("eager model after fuse_modules", lambda: _eager(True), _image),
    Example("linear-relu with one qconfig", lambda: _LinearRelu().eval(), lambda: (torch.randn(4, 16),)),
)
INVALID = (
    Example("conv output also feeds the residual add", lambda: _ConvBnReluFanout().eval(), _image, flagged=("conv",)),
    Example("eager model without fuse_modules", lambda: _eager(False), _image, flagged=("conv",)),
    Example("BatchNorm left in training mode", lambda: _CleanBlock().train(), _image, flagged=("conv",)),
    Example(
        "conv-bn pairs whose conv forward traces to F.conv2d (one finding for all)",
        lambda: _FunctionalConvBn().eval(),
        _image,
        flagged=("conv1",),
    ),
    Example(
        "linear and relu with different qconfigs",
        lambda: _LinearRelu().eval(),
        lambda: (torch.randn(4, 16),),
        qconfig_mapping=_linear_relu_mixed_mapping,
        flagged=("fc",),
    ),
)
