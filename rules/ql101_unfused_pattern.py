"""QL101 unfused-pattern."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F
from pydantic import Field
from torch.ao.quantization import DeQuantStub, QConfigMapping, QuantStub, get_default_qconfig_mapping

from qlint.core.graph import ModelGraph, OpNode
from qlint.linter.context import LintContext
from qlint.linter.findings import Finding, Severity
from qlint.linter.rule import Example, Need, Rule, RuleOptions
from qlint.rules._ql101_chains import (
    MODULE_ONLY_KINDS,
    eager_fused,
    head_module_name,
    match_chain,
    qconfig_key,
    unfused_clamp,
)
from qlint.rules._ql101_ranges import RangeMeter, chain_end_activation, fixed_activation, saturating_ranges
from qlint.rules._ql101_reasons import (
    FIX,
    REASON_CLAMP,
    REASON_EAGER,
    REASON_FANOUT,
    REASON_FUNCTIONAL,
    REASON_QCONFIG,
    REASON_TRAINING,
    WHY,
    foldable_functional,
    qconfig_text,
)


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
    suggests a fixed output range [0, c] for the conv (int8 saturation then clips exactly) with
    the levels of the plan's activations (128 on x86; when `qlint verify` gives them 8 bits,
    the range gets 256 levels with them), and an op of its own to quantize the conv's input
    when nothing quantized produces it (a model input, a pad), measured in one trial with
    every other range group applied.

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
                chain = match_chain(graph, head, pattern)
                if chain is None:
                    continue
                reasons = self._reasons(ctx, chain)
                if reasons:
                    covered.update(n.name for n in chain)
                    if foldable_functional(chain, reasons):
                        functional.append((chain, pattern))
                        clamp = unfused_clamp(ctx, chain, pattern)
                        if clamp is not None:  # after the fold the conv is a module that fuses the BN
                            clamps.append((chain, pattern, clamp))
                    else:
                        yield self._report(graph, chain, pattern, reasons)
                    break
                # The longest pattern that matches fuses; shorter ones are part of it.
                covered.update(n.name for n in chain)
                clamp = unfused_clamp(ctx, chain, pattern)
                if clamp is not None:
                    clamps.append((chain, pattern, clamp))
                break
        if functional:
            yield self._functional_finding(functional)
        by_range: dict[tuple[float, float] | None, list[tuple[list[OpNode], tuple[str, ...], OpNode]]] = {}
        observed: list[str] = []  # heads whose input needs an op of its own (observe_input rewrite)
        for entry, (clip, observe) in zip(clamps, saturating_ranges(ctx, clamps) if clamps else [], strict=True):
            by_range.setdefault(clip, []).append(entry)
            head_module = head_module_name(entry[0][0])
            if observe and clip is not None and head_module is not None:
                observed.append(head_module)
        fixed_groups = {
            clip: (fixed_activation(ctx, clip), [h for h in (head_module_name(ch[0]) for ch, _, _ in group) if h])
            for clip, group in by_range.items()
            if clip is not None
        }
        meter = RangeMeter(ctx, list(fixed_groups.values()), [c for c, _ in functional], observed)
        folded = [h for h in (head_module_name(chain[0]) for chain, _ in functional) if h is not None]
        for clip, group in by_range.items():
            yield self._clamp_finding(ctx, group, clip, meter, observed, folded)

    def _reasons(self, ctx: LintContext, chain: list[OpNode]) -> list[tuple[str, str]]:
        graph = ctx.graph
        reasons: list[tuple[str, str]] = []
        if ctx.eager_flow and not eager_fused(chain):
            names = ", ".join(f'"{n.display}"' for n in chain)
            reasons.append((REASON_EAGER, names))
        for node, successor in zip(chain, chain[1:]):
            others = [c for c in graph.consumers(node.name) if c.name != successor.name]
            if others:
                reasons.append((REASON_FANOUT, ", ".join(o.display for o in others)))
        qconfig_keys = {qconfig_key(n) for n in chain}
        if len(qconfig_keys) > 1:
            detail = "; ".join(f"{n.display}: {qconfig_text(n)}" for n in chain)
            reasons.append((REASON_QCONFIG, detail))
        if self.options.report_training_bn and any(n.kind == "batch_norm" and n.training for n in chain):
            reasons.append((REASON_TRAINING, ""))
        if not graph.exported:
            for node in chain:
                if node.op != "module" and node.kind in MODULE_ONLY_KINDS and (chain[0].kind != "add"):
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
            why.append(WHY[code].format(others=detail, detail=detail, op=detail))
            fixes.append(FIX[code].format(names=", ".join(f'"{n}"' for n in names)))
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
        kinds = sorted({n.kind for chain, _ in chains for n in chain if n.kind in MODULE_ONLY_KINDS - {"batch_norm"}})
        listed = "; ".join(" → ".join(chain) for chain in names[:8]) + (
            f"; ... ({len(names)} in all)" if len(names) > 8 else ""
        )
        message = (
            f"{len(chains)} {'/'.join(kinds)} → batch_norm chain(s) will stay unfused: "
            + WHY[REASON_FUNCTIONAL].format(op="/".join(kinds))
            + ". Unfused, each conv output is rounded to int8 before its BN rescales it, and the BN is "
            f"not folded into the weights. Chains: {listed}. Fix: {FIX[REASON_FUNCTIONAL]} (qlint's "
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
        meter: RangeMeter,
        observed: list[str],
        folded: list[str],
    ) -> Finding:
        """One finding for the chains that stop short of their clipping activation and share one
        saturating range, measured together with that range. ``folded``: the heads that are
        functional convs, a module only once the fold rewrite has run (the fix asks for it)."""
        lines, rounding = [], []
        for chain, _pattern, clamp in clamps:
            found = chain_end_activation(ctx, chain)
            measured = found.sqnr_db if found is not None else None
            rounding.append(measured)
            text = f"{' → '.join(n.display for n in chain)} → {clamp.display}"
            lines.append(text + (f" (rounding before {clamp.kind}: {measured:.1f} dB)" if measured is not None else ""))
        first_chain, first_pattern, first_clamp = clamps[0]
        kinds = sorted({clamp.kind for _, _, clamp in clamps})
        why = WHY[REASON_CLAMP].format(op="/".join(kinds))
        message = (
            f"{len(clamps)} {' → '.join(first_pattern)} chain(s) end in {'/'.join(kinds)} and fuse without "
            f"it on {ctx.backend.name}: {why}. Chains: {'; '.join(lines[:8])}"
            + (f"; ... ({len(lines)} in all)" if len(lines) > 8 else "")
            + "."
        )
        heads = [head_module_name(chain[0]) for chain, _, _ in clamps]
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
        fixed = fixed_activation(ctx, clip)
        targets = [h for h in heads if h is not None]
        message += f" Fix: {FIX[REASON_CLAMP]}: [{clip[0]:g}, {clip[1]:g}] on {', '.join(targets[:4])}" + (
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
