"""QL104 per-channel: conv/linear weights quantized per-tensor where per-channel is available."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn as nn
from pydantic import Field
from torch.ao.quantization import QConfig, QConfigMapping, default_dynamic_qconfig, get_default_qconfig_mapping
from torch.ao.quantization.observer import HistogramObserver, MinMaxObserver

from qlint.core.graph import OpNode
from qlint.core.intent import ObserverSpec
from qlint.core.ops import CONV_KINDS, CONV_OR_LINEAR_KINDS
from qlint.core.sqnr import sqnr_db
from qlint.linter.context import INTENT_EAGER, LintContext
from qlint.linter.findings import Finding, Severity
from qlint.linter.rule import Example, Need, Rule, RuleOptions, seeded
from qlint.measure.weights import batch_norm_factor


class PerChannel(Rule):
    """Flags conv and linear layers whose weights are quantized per-tensor where the backend
    supports per-channel weights.

    ## What it does
    For every statically quantized conv or linear layer (and, with `include_dynamic`, every
    dynamically quantized one) whose backend kernel accepts per-channel weights, checks
    that the weight observer is per-channel. It reads the weight convert_fx will quantize:
    for a conv that fuses with the BatchNorm after it, the BN-folded weight
    `w * gamma / sqrt(running_var + eps)`, whose channels often differ far more than the raw
    conv's. When the weight is available it measures the evidence: the absolute maximum of
    every output channel, their spread (largest / smallest), how many times coarser the
    narrowest channel's step is under the per-tensor scale (in bits, never more than the
    dtype has), and the weight's SQNR quantized per-tensor and per-channel.

    It reports once per model, listing the layers worst first (by the SQNR per-channel
    weights gain), with one fix for all of them; lint's trial measures that fix's gain
    in output SQNR.

    ## Why is this bad?
    A per-tensor weight observer picks one scale for the whole weight, set by the channel
    with the largest values. Every channel with smaller weights then uses only a fraction
    of the int8 codes: a channel whose weights are 20× smaller than the widest one is
    quantized with about 12 levels instead of 255. Depthwise convolutions and layers
    after BatchNorm folding routinely have channel ranges that differ by 10-100×, and
    per-tensor weights there are a classic cause of large accuracy drops. Per-channel
    weights cost nothing at inference on x86, fbgemm, onednn and qnnpack.

    ## Example
    ```python
    qconfig = QConfig(activation=HistogramObserver.with_args(reduce_range=True),
                      weight=MinMaxObserver.with_args(dtype=torch.qint8,
                                                      qscheme=torch.per_tensor_symmetric))
    ```

    ## Use instead
    ```python
    qconfig = QConfig(activation=HistogramObserver.with_args(reduce_range=True),
                      weight=PerChannelMinMaxObserver.with_args(
                          dtype=torch.qint8, qscheme=torch.per_channel_symmetric, ch_axis=0))
    # or simply get_default_qconfig_mapping("x86")
    ```

    ## Options
    - `min_channel_spread`: only report layers whose largest/smallest channel absmax ratio is at
      least this (1.0 reports every per-tensor layer, including those whose weights are unavailable).
    - `include_dynamic`: also check dynamically quantized layers (dynamic linear).
    - `min_channels`: skip layers with fewer output channels than this (one channel gains nothing).

    ## References
    - https://pytorch.org/docs/stable/quantization.html#quantization-api-summary (per-channel quantization)
    - Krishnamoorthi, "Quantizing deep convolutional networks for efficient inference" (2018), sections 3.1 and 4
    - torch.ao.quantization.observer.PerChannelMinMaxObserver, default_per_channel_weight_observer
    """

    code = "QL104"
    name = "per-channel"
    summary = "A conv/linear weight is quantized per-tensor where per-channel is supported."
    severity = Severity.WARNING
    requires = frozenset({Need.GRAPH, Need.QCONFIG})

    class Options(RuleOptions):
        min_channel_spread: float = Field(1.0, ge=1.0, description="Minimum channel absmax spread.")
        include_dynamic: bool = Field(False, description="Also check dynamically quantized layers.")
        min_channels: int = Field(2, ge=1, description="Minimum number of output channels.")

    options: Options  # this rule's own Options, so the type checker knows its fields

    def check(self, ctx: LintContext) -> Iterable[Finding]:
        layers: list[tuple[OpNode, ObserverSpec, int | None, dict[str, Any] | None]] = []
        for node in ctx.graph.ops():
            weight = self._per_tensor_weight(ctx, node)
            if weight is None:
                continue
            tensor, folded = quantized_weight(ctx, node)
            evidence = _evidence(tensor, weight) if tensor is not None else None
            if evidence is not None:
                evidence["folded_batch_norm"] = folded
            channels = evidence["channels"] if evidence else _channels_from_shape(node)
            if channels is not None and channels < self.options.min_channels:
                continue
            spread = evidence.get("channel_spread") if evidence else None
            if self.options.min_channel_spread > 1.0:
                if spread is None or (spread != "inf" and spread < self.options.min_channel_spread):
                    continue
            layers.append((node, weight, channels, evidence))
        if layers:
            yield self._report(ctx, layers)

    def _per_tensor_weight(self, ctx: LintContext, node: OpNode) -> ObserverSpec | None:
        if node.kind not in CONV_OR_LINEAR_KINDS or not _supports_per_channel(ctx, node.kind):
            return None
        if (ctx.eager_flow or ctx.intent == INTENT_EAGER) and node.op != "module":
            return None  # eager mode quantizes modules only; a functional conv stays float
        qc = node.qconfig
        if qc is None or not qc.quantized or qc.weight is None:
            return None
        if qc.is_dynamic and not self.options.include_dynamic:
            return None
        weight = qc.weight
        if weight.is_float or weight.is_per_channel or weight.dtype != "torch.qint8":
            return None  # float/fp16 weights, or a dtype QL103 reports
        return weight

    def _report(
        self, ctx: LintContext, layers: list[tuple[OpNode, ObserverSpec, int | None, dict[str, Any] | None]]
    ) -> Finding:
        """One finding for the model: the layers worst first, each with its measured weight SQNR."""

        def gain(entry) -> float:
            evidence = entry[3] or {}
            tensor_db, channel_db = evidence.get("per_tensor_sqnr_db"), evidence.get("per_channel_sqnr_db")
            return channel_db - tensor_db if tensor_db is not None and channel_db is not None else -math.inf

        layers = sorted(layers, key=gain, reverse=True)
        node, weight, channels, evidence = layers[0]
        backend = ctx.backend.name
        default_note = ""
        if backend == "qnnpack":
            default_note = (
                " (qnnpack's default qconfig is per-tensor, but its conv and linear kernels accept per-channel weights)"
            )
        lines = [_layer_line(n, c, e, bool(n.qconfig and n.qconfig.is_dynamic)) for n, _, c, e in layers[:8]]
        more = f"; ... ({len(layers)} layers in all)" if len(layers) > 8 else ""
        message = (
            f"{len(layers)} conv/linear layer(s) quantize their weights per-tensor ({weight.observer}, "
            f"{weight.qscheme}) although {backend} supports per-channel weights{default_note}. One scale "
            "must cover the widest output channel, and every narrower channel uses only a fraction of the "
            f"int8 codes. Measured on the weights that will be quantized (BN folded in where conv-bn fuses): "
            f"{'; '.join(lines)}{more}. Fix: use PerChannelMinMaxObserver.with_args(dtype=torch.qint8, "
            "qscheme=torch.per_channel_symmetric, ch_axis=0) as the weight observer (what "
            "torch.ao.quantization.default_per_channel_weight_observer and the x86/fbgemm/onednn "
            "default qconfigs use)."
        )
        dynamic = bool(node.qconfig and node.qconfig.is_dynamic)
        data: dict[str, Any] = {
            "kind": "per-tensor-weight",
            "node": node.name,
            "op_kind": node.kind,
            "weight_observer": weight.observer,
            "weight_qscheme": weight.qscheme,
            "weight_dtype": weight.dtype,
            "quant_range": [weight.quant_min, weight.quant_max],
            "channels": channels,
            "dynamic": dynamic,
            "backend": backend,
            "qconfig_source": node.qconfig.source if node.qconfig else None,
            "weight_available": evidence is not None,
            "layers": [_layer_data(n, c, e) for n, _, c, e in layers],
        }
        if evidence:
            data.update({k: v for k, v in evidence.items() if k not in ("channels", "channel_absmax")})
            data["channel_absmax"] = evidence.get("channel_absmax")
        targets = [n.display for n, _, _, _ in layers]
        suggestion: dict[str, Any] = {
            "action": "set_weight_observer",
            "observer": "PerChannelMinMaxObserver",
            "qscheme": "torch.per_channel_symmetric",
            "ch_axis": 0,
            "dtype": "torch.qint8",
        }
        if len(targets) == 1:
            suggestion.update(target=node.display, node=node.name)
        else:
            suggestion["targets"] = targets
        return self.finding(node.display, message, data=data, suggestion=suggestion)


def _layer_line(node: OpNode, channels: int | None, evidence: dict[str, Any] | None, dynamic: bool) -> str:
    head = f"{node.display} ({'dynamic ' if dynamic else ''}{node.kind}"
    head += f", {channels} channels" if channels is not None else ""
    head += ", BN folded)" if evidence and evidence.get("folded_batch_norm") else ")"
    if not evidence or evidence.get("per_tensor_sqnr_db") is None:
        return head + ": weights not available"
    spread = evidence["channel_spread"]
    spread_text = "∞" if spread == "inf" else f"{spread:.1f}×"
    return (
        f"{head}: channel absmax spread {spread_text}, weight SQNR {evidence['per_tensor_sqnr_db']:.1f} dB "
        f"per-tensor vs {evidence['per_channel_sqnr_db']:.1f} dB per-channel"
    )


def _layer_data(node: OpNode, channels: int | None, evidence: dict[str, Any] | None) -> dict[str, Any]:
    keys = (
        "channel_spread",
        "resolution_loss",
        "bits_lost",
        "per_tensor_sqnr_db",
        "per_channel_sqnr_db",
        "folded_batch_norm",
    )
    return {
        "target": node.display,
        "node": node.name,
        "kind": node.kind,
        "channels": channels,
        **{key: evidence.get(key) for key in keys if evidence is not None},
    }


def quantized_weight(ctx: LintContext, node: OpNode) -> tuple[torch.Tensor | None, str | None]:
    """The weight convert_fx quantizes: for a conv whose only consumer is a BatchNorm module
    (conv-bn fuses), the BN-folded weight w * gamma / sqrt(running_var + eps); else the weight.
    Returns (tensor, the folded BN's fqn or None)."""
    tensor = ctx.graph.parameter(node.weight) if node.weight else None
    if tensor is None or node.kind not in CONV_KINDS:
        return tensor, None
    consumers = ctx.graph.consumers(node.name)
    if len(consumers) != 1 or consumers[0].kind != "batch_norm" or not consumers[0].module:
        return tensor, None
    bn = consumers[0].module
    if not ctx.backend.can_fuse((node.kind, "batch_norm")):
        return tensor, None
    gamma, variance = ctx.graph.parameter(f"{bn}.weight"), ctx.graph.parameter(f"{bn}.running_var")
    if variance is None or variance.numel() != tensor.shape[0]:
        return tensor, None
    if gamma is not None and gamma.numel() != variance.numel():
        gamma = None
    scale = batch_norm_factor(variance.double(), None if gamma is None else gamma.double(), _BN_EPS)
    shape = (-1,) + (1,) * (tensor.dim() - 1)
    return (tensor.detach().double() * scale.reshape(shape)).float(), bn


_BN_EPS = 1e-5  # nn.BatchNorm's default; the module's own eps is not in the graph, and moves ratios by <1e-4


def _supports_per_channel(ctx: LintContext, kind: str) -> bool:
    kinds = ctx.backend.per_channel_kinds
    if kind == "conv":  # an aten convolution of unknown rank
        return bool(kinds & CONV_KINDS)
    return kind in kinds


def _channels_from_shape(node: OpNode) -> int | None:
    shape = node.output.shape if node.output is not None else None
    if not shape:
        return None
    if node.kind == "linear":
        return shape[-1]
    return shape[1] if len(shape) > 1 else None


def _evidence(tensor: torch.Tensor, weight: ObserverSpec) -> dict[str, Any] | None:
    """Per-output-channel ranges and the resolution a per-tensor scale costs the narrowest channel."""
    if tensor.dim() < 2 or tensor.numel() == 0 or not tensor.is_floating_point():
        return None
    w = tensor.detach().float().reshape(tensor.shape[0], -1)
    if not bool(torch.isfinite(w).all()):
        return {"channels": int(w.shape[0])}
    absmax = w.abs().amax(dim=1)
    nonzero = absmax[absmax > 0]
    channels = int(w.shape[0])
    result: dict[str, Any] = {"channels": channels, "zero_channels": int(channels - nonzero.numel())}
    if nonzero.numel() == 0:
        return result
    qmin = weight.quant_min if weight.quant_min is not None else -128
    qmax = weight.quant_max if weight.quant_max is not None else 127
    levels = float(qmax - qmin)
    wmin, wmax = float(w.min()), float(w.max())
    if weight.qscheme is not None and "affine" in weight.qscheme:
        tensor_step = (max(wmax, 0.0) - min(wmin, 0.0)) / levels
    else:
        tensor_step = 2.0 * max(abs(wmin), abs(wmax)) / levels
    channel_steps = 2.0 * nonzero / levels  # per_channel_symmetric, the suggested fix
    loss = tensor_step / channel_steps
    worst = float(loss.max())
    high, low = float(nonzero.max()), float(nonzero.min())
    spread: Any = high / low
    if result["zero_channels"]:
        spread = "inf"
    result.update(
        {
            "channel_absmax_min": low,
            "channel_absmax_max": high,
            "channel_absmax": [round(float(v), 6) for v in absmax[:256]],
            "channel_spread": spread if isinstance(spread, str) else round(spread, 4),
            "resolution_loss": round(worst, 4),
            "resolution_loss_median": round(float(loss.median()), 4),
            # never more bits lost than the weight dtype has
            "bits_lost": round(min(math.log2(worst), math.log2(levels + 1)), 3) if worst > 1 else 0.0,
            "tensor_step": tensor_step,
            "narrowest_channel": int(torch.nonzero(absmax == low)[0, 0]),
        }
    )
    result.update(_weight_sqnr(tensor.detach().float(), int(qmin), int(qmax)))
    return result


def _weight_sqnr(weight: torch.Tensor, qmin: int, qmax: int) -> dict[str, float]:
    """SQNR (dB) of the weight quantized symmetric per-tensor and per-output-channel."""
    flat = weight.reshape(weight.shape[0], -1)
    half = (qmax - qmin) / 2.0
    tensor_scale = max(float(flat.abs().max()) / half, 1e-12)
    per_tensor = torch.fake_quantize_per_tensor_affine(flat, tensor_scale, 0, qmin, qmax)
    channel_scales = (flat.abs().amax(dim=1) / half).clamp_min(1e-12)
    per_channel = torch.fake_quantize_per_channel_affine(
        flat, channel_scales, torch.zeros_like(channel_scales, dtype=torch.int32), 0, qmin, qmax
    )
    return {
        "per_tensor_sqnr_db": round(float(sqnr_db(flat, per_tensor) or 0.0), 3),
        "per_channel_sqnr_db": round(float(sqnr_db(flat, per_channel) or 0.0), 3),
    }


# --- examples --------------------------------------------------------------------------


class _ConvHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(torch.relu(self.conv(x)), 1), 1))


class _Depthwise(nn.Module):
    """A depthwise conv whose channel ranges differ by 64× (as after BatchNorm folding)."""

    def __init__(self, spread: float = 64.0) -> None:
        super().__init__()
        self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        with torch.no_grad():
            gains = torch.logspace(0, math.log10(spread), 8)
            self.dw.weight.copy_(torch.sign(self.dw.weight) * 0.01 * gains.view(8, 1, 1, 1))

    def forward(self, x):
        return self.dw(x)


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _conv_head() -> nn.Module:
    return seeded(_ConvHead)()


def _depthwise() -> nn.Module:
    return seeded(_Depthwise)()


def _flat_depthwise() -> nn.Module:
    return seeded(_Depthwise, 1.0)()


def _mlp() -> nn.Module:
    return seeded(_Mlp)()


def _image() -> tuple[torch.Tensor, ...]:
    return (torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0)),)


def _image8() -> tuple[torch.Tensor, ...]:
    return (torch.randn(2, 8, 8, 8, generator=torch.Generator().manual_seed(0)),)


def _rows() -> tuple[torch.Tensor, ...]:
    return (torch.randn(4, 16, generator=torch.Generator().manual_seed(0)),)


def _x86_default() -> QConfigMapping:
    return get_default_qconfig_mapping("x86")


def _qnnpack_default() -> QConfigMapping:
    return get_default_qconfig_mapping("qnnpack")


def _per_tensor_x86() -> QConfigMapping:
    qconfig = QConfig(
        activation=HistogramObserver.with_args(reduce_range=True),
        weight=MinMaxObserver.with_args(dtype=torch.qint8, qscheme=torch.per_tensor_symmetric),
    )
    return get_default_qconfig_mapping("x86").set_global(qconfig)


def _dynamic() -> QConfigMapping:
    return QConfigMapping().set_object_type(nn.Linear, default_dynamic_qconfig)


VALID = (
    Example("x86 default mapping: per-channel weights", _conv_head, _image, qconfig_mapping=_x86_default),
    Example(
        "dynamic linear with per-tensor weights when include_dynamic is off", _mlp, _rows, qconfig_mapping=_dynamic
    ),
    Example(
        "per-tensor depthwise conv whose channels have equal ranges, min_channel_spread=4",
        _flat_depthwise,
        _image8,
        qconfig_mapping=_per_tensor_x86,
        options={"min_channel_spread": 4.0},
    ),
)
INVALID = (
    Example("per-tensor weights on x86", _conv_head, _image, qconfig_mapping=_per_tensor_x86, flagged=("conv", "fc")),
    Example(
        "qnnpack's default mapping uses per-tensor weights",
        _mlp,
        _rows,
        qconfig_mapping=_qnnpack_default,
        backend="qnnpack",
        flagged=("fc1", "fc2"),
    ),
    Example(
        "depthwise conv with a 64x channel spread, min_channel_spread=4",
        _depthwise,
        _image8,
        qconfig_mapping=_per_tensor_x86,
        options={"min_channel_spread": 4.0},
        flagged=("dw",),
    ),
    Example(
        "dynamic linear with per-tensor weights when include_dynamic is on",
        _mlp,
        _rows,
        qconfig_mapping=_dynamic,
        options={"include_dynamic": True},
        flagged=("fc1", "fc2"),
    ),
)
