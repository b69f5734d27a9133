"""QL203 activation-outlier."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn as nn
from pydantic import Field
from torch.ao.quantization import QConfigMapping, get_default_qconfig_mapping

from qlint.core.graph import OpNode
from qlint.linter.activation import (
    activation_bits,
    computes_its_module,
    functional_ops_of_scopes,
    measured_input,
    observer_owner,
    physical_bits,
)
from qlint.linter.calibration import FEATURES
from qlint.linter.context import LintContext
from qlint.linter.findings import Finding, LayerRow, Severity
from qlint.linter.fixes import Fix, KeepFloat, SetActivationObserver
from qlint.linter.json_values import json_float
from qlint.linter.rule import Example, Need, ObservationSpec, Rule, RuleOptions
from qlint.rules._ql203_measure import OutlierMeasurement, bulk_ratio, bulk_text, clip_value, measure

KINDS = frozenset({"linear", "conv1d", "conv2d", "conv3d", "conv"})


class ActivationOutlier(Rule):
    """Flags conv and linear layers whose input activations have outlier channels.

    ## What it does
    For every input channel of every quantized conv/linear layer it computes torch's
    `OutlierDetector` statistic: the average over calibration batches of
    max / `reference_percentile`-quantile of that channel. A channel is an outlier when
    this ratio exceeds `ratio_threshold` and the ratio could be computed in at least
    `fraction_batches_used_threshold` of the batches whose quantile was taken: every
    batch, as torch, unless `--percentile-every K` asks a layer input of more than 32
    channels to take it on the first batch and one in K after it. On a large batch the
    quantile is estimated from a sample of 256 values per channel (docs/performance.md
    gives the error each costs). It reports the outlier channels,
    their maxima and how many bits of int8 resolution they cost the other channels,
    never more bits than the activation's observer has (7 with `reduce_range`). The channel
    axis is axis 1 for conv inputs and the last axis for Linear inputs (the features of a
    `(B, D)` or `(B, T, D)` tensor). A channel whose reference quantile is 0 (mostly zeros,
    as after a ReLU) is listed but not counted as losing resolution: int8 holds zero
    exactly; a finding of only such channels, whose other channels lose nothing to them,
    is info and suggests no fix. Layers that read one tensor (a transformer's q, k and v)
    share one finding, whose fix reaches each one's observer. With lint's trial it also gives the measured SQNR of that
    activation under the qparams the converted model uses.

    Its fix differs from the default qconfig: a clipping `PercentileObserver` (99.99th
    percentile) on the module whose qconfig makes the observer of this input under
    prepare_fx: the producer upstream when torch quantizes it (observers are shared through
    ReLU, pooling and reshapes), else the first op on the way that torch quantizes (a ReLU
    after a float LSTMCell or GELU), else the layer itself (an input from a `sqrt`, which
    stays float); when that op is a functional one with no qconfig of its own, keeping the
    layer float. A functional op computing its own module's output (`F.conv2d` on `self.weight`
    in a same-padding `Conv2d` subclass, as in EfficientNet) gets that module's qconfig by name,
    so the fix goes on that module, and the message names the other ops of its forward that the
    qconfig reaches too. In an exported graph (`.pt2`, quantized with pt2e) every input edge has its own
    observer, so the clipping observer goes on the layer's input; qlint's pt2e quantizer
    (`QuantPlan.to_pt2e_quantizer()`) applies it. The trial measures the fix; where it does
    not gain the impact threshold the finding is info. The bits lost are counted in the
    level count of the observer the trial measured (8 for X86InductorQuantizer's uint8,
    7 for prepare_fx's x86 default with `reduce_range`).
    It also reports channels that are constant over all calibration data (severity
    info) and NaN or Inf activations (severity error).

    Deliberate differences from torch:
    - a batch whose reference quantile is 0 under a non-zero maximum gives torch a ratio
      of `float32 max`; qlint records the ratio as infinite (same verdict: outlier);
    - a negative average ratio (maximum above 0, quantile below 0) is used by magnitude,
      as torch's comment intends; torch's code leaves it negative, never an outlier;
    - channels with no usable batch get the metric "nan" (torch reports inf) and are
      never outliers (neither in torch, which lacks enough batches for them);
    - NaN/Inf values are excluded from every statistic and reported; torch's observer
      propagates them.

    ## Why is this bad?
    A per-tensor int8 activation has 256 levels spread over its whole observed range.
    A channel whose maximum is several times its 97.5th percentile stretches that range
    for rare values: every other channel then gets only a few levels (lost resolution),
    or, with a clipping observer, the spikes saturate. NaN/Inf make the qparams
    themselves NaN/Inf, and constant channels waste computation and range.

    ## Example
    ```python
    x = features(images)      # channel 3 is ~1 except for rare spikes of 40
    y = classifier(x)         # one per-tensor scale must cover the spikes
    ```

    ## Use instead
    Clip or normalise the offending channel before the layer (e.g. a clamp or a
    LayerNorm), calibrate with a percentile/histogram observer that ignores rare spikes,
    or keep this layer in float.

    ## Options
    - `ratio_threshold`: a channel is an outlier when its average max/percentile ratio exceeds this (torch: 3.5).
    - `reference_percentile`: the quantile compared with the maximum (torch: 0.975).
    - `fraction_batches_used_threshold`: minimum fraction of batches in which the ratio was computable (torch: 0.95).
    - `report_constant_channels`: also report channels that are constant over all calibration data.

    ## References
    - torch.ao.quantization.fx._model_report.detector.OutlierDetector
    - https://pytorch.org/docs/stable/quantization.html#model-preparation-for-quantization
    """

    code = "QL203"
    name = "activation-outlier"
    summary = "Input activations of a layer have outlier channels, constant channels or NaN/Inf values."
    severity = Severity.WARNING
    requires = frozenset({Need.GRAPH, Need.QCONFIG, Need.STATISTICS})
    observes = (ObservationSpec(KINDS, "input", 0, FEATURES, percentile=True),)

    class Options(RuleOptions):
        ratio_threshold: float = Field(3.5, gt=1, description="Outlier when max/percentile ratio exceeds this.")
        reference_percentile: float = Field(0.975, gt=0, lt=1, description="Quantile compared with the maximum.")
        fraction_batches_used_threshold: float = Field(
            0.95, ge=0, le=1, description="Minimum fraction of usable batches."
        )
        report_constant_channels: bool = Field(True, description="Report channels constant over all data.")

    options: Options  # this rule's own Options, so the type checker knows its fields

    def check(self, ctx: LintContext) -> Iterable[Finding | LayerRow]:
        # Layers reading one tensor (a transformer's q, k and v) share one finding: it is one
        # activation, with one set of channels, whichever layer's observer quantizes it.
        readers: list[tuple[list[OpNode], OutlierMeasurement]] = []
        for node in ctx.graph.by_kind(*KINDS):
            measured = measure(
                ctx.statistics, node, self.options.ratio_threshold, self.options.fraction_batches_used_threshold
            )
            if measured is None:
                continue
            yield _layer_row(self.code, node, measured)
            if node.qconfig is None or not node.is_quantized:
                continue
            same = next(
                (nodes for nodes, seen in readers if _read_one_tensor(ctx, nodes[0], seen, node, measured)), None
            )
            if same is not None:
                same.append(node)
            else:
                readers.append(([node], measured))
        for nodes, measured in readers:
            yield from self._findings(ctx, nodes, measured)

    def _findings(self, ctx: LintContext, nodes: list[OpNode], measured: OutlierMeasurement) -> Iterable[Finding]:
        stats, head, names = measured.stats, nodes[0], _joined(nodes)
        if measured.nan_count or measured.inf_count:
            bad = ((stats.nan_count + stats.inf_count) > 0).nonzero().flatten().tolist()
            yield self.finding(
                head.display,
                f"the input of {names} contains {measured.nan_count} NaN and {measured.inf_count} "
                f"Inf values during calibration (channels {_short(bad)}): observers would compute "
                "NaN/Inf qparams and the quantized model would produce garbage. Fix the numerics "
                "upstream (overflow, division by zero, log of 0) before quantizing.",
                data={
                    "kind": "non-finite",
                    "node": head.name,
                    "read_by": [node.display for node in nodes],
                    "nan_count": measured.nan_count,
                    "inf_count": measured.inf_count,
                    "channels": bad,
                },
                severity=Severity.ERROR,
            )
        outliers = measured.outlier.nonzero().flatten().tolist()
        if outliers:
            yield self._outlier_finding(ctx, nodes, measured, outliers)
        constant = measured.constant.nonzero().flatten().tolist()
        if constant and self.options.report_constant_channels:
            values = [json_float(stats.channel_max[c]) for c in constant]  # one per channel listed
            yield self.finding(
                head.display,
                f"{len(constant)} of {stats.num_channels} input channels of {names} are constant over "
                f"all calibration data (channels {_short(constant)}): they carry no information; fold them "
                "into the bias or prune them.",
                data={
                    "kind": "constant-channels",
                    "node": head.name,
                    "read_by": [node.display for node in nodes],
                    "constant_channels": constant,
                    "values": values,
                },
                severity=Severity.INFO,
            )

    def _outlier_finding(
        self, ctx: LintContext, nodes: list[OpNode], measured: OutlierMeasurement, outliers: list[int]
    ) -> Finding:
        stats, node = measured.stats, nodes[0]
        high, low = stats.channel_max.cpu(), stats.channel_min.cpu()
        ratios_all = measured.metric
        # A channel whose reference quantile is 0 (mostly zeros, e.g. after a ReLU) has an
        # infinite ratio, but its bulk is exact zeros: rounding cannot hurt it.
        sparse = [c for c in outliers if not math.isfinite(float(ratios_all[c]))]
        dense = [c for c in outliers if c not in sparse]
        mask = torch.zeros(stats.num_channels, dtype=torch.bool)
        mask[outliers] = True
        finite = torch.isfinite(high) & torch.isfinite(low)
        full = float(high[finite].max() - low[finite].min()) if bool(finite.any()) else math.nan
        rest = ~mask & finite
        without = float(high[rest].max() - low[rest].min()) if bool(rest.any()) else math.nan
        quantized_input = measured_input(ctx, node)
        bits = activation_bits(node, quantized_input, ctx.graph.exported, ctx.backend.name)
        loss_bits = physical_bits(math.log2(full / without) if full > 0 and without > 0 else math.nan, bits)
        maxima = [json_float(high[c]) for c in outliers]
        ratios = [json_float(ratios_all[c]) for c in outliers]
        # Inside an outlier channel, calibrating to the spike leaves the bulk of its values
        # (below the reference percentile) only 1/ratio of the range: log2(ratio) bits lost,
        # never more than the dtype has. Only where the ratio measures a positive bulk: torch's
        # flipped ratio of a negative channel flags it but says nothing of its bulk.
        bulk = bulk_ratio(stats)
        dense_ratios = [float(bulk[c]) for c in dense if math.isfinite(float(bulk[c]))]
        channel_bits = physical_bits(math.log2(max(dense_ratios)) if dense_ratios else math.nan, bits)
        measured_db = quantized_input.sqnr_db if quantized_input is not None else None
        clip = clip_value(stats, dense or outliers)
        spikes = max((m for m in maxima if isinstance(m, float)), default=math.nan)
        message = (
            f"{len(outliers)} input channel(s) of {_joined(nodes)} have outliers (channels {_short(outliers)}: "
            f"max / {self.options.reference_percentile:g}-quantile > {self.options.ratio_threshold:g}, max up to "
            f"{spikes:.4g}). One per-tensor scale must "
            "cover them"
            + (
                bulk_text(max(dense_ratios), channel_bits, bits)
                if math.isfinite(channel_bits) and channel_bits > 0
                else ""
            )
            + (
                f", and the other channels lose about {loss_bits:.1f} bits"
                if math.isfinite(loss_bits) and loss_bits >= 0.1
                else ""
            )
            + (
                f"; {len(sparse)} of them are mostly zeros (quantile 0), which int8 represents exactly"
                if sparse
                else ""
            )
            + (
                f". Measured: this activation quantized with its observer's qparams has {measured_db:.1f} dB SQNR"
                if measured_db is not None
                else ""
            )
            + "."
        )
        severity = None
        target: str | None
        if not dense and not (math.isfinite(loss_bits) and loss_bits >= 0.1):
            # Only mostly-zero channels, and the others lose nothing: int8 holds the zeros exactly
            # and the range is what the other channels need anyway, so no observer can gain and
            # no fix is suggested (an unmeasured info fix would still go into the plan).
            severity = Severity.INFO
            target, suggestion = None, None
            message += (
                " No fix is suggested: int8 holds the zeros exactly, and the other channels need this range "
                "anyway (they lose under 0.1 bits to these channels)."
            )
        else:
            target, suggestion, fix = _fix(ctx, nodes, _clip_text(clip, spikes, self.options.reference_percentile))
            message += " " + fix
        return self.finding(
            node.display,
            message,
            severity=severity,
            data={
                "kind": "outlier",
                "node": node.name,
                "read_by": [layer.display for layer in nodes],
                "outlier_channels": outliers,
                "mostly_zero_channels": sparse,
                "channel_max": maxima,
                "ratios": ratios,
                "resolution_loss_bits": json_float(loss_bits),
                "outlier_channel_bits_lost": json_float(channel_bits),
                "dtype_bits": bits,
                "int8_step": json_float(full / (2**bits - 1)),
                "int8_step_without_outliers": json_float(without / (2**bits - 1)),
                "activation_sqnr_db": measured_db,
                "clip_value": json_float(clip),
                "fix_target": target,
                "fix_targets": list(suggestion.targets) if isinstance(suggestion, SetActivationObserver) else [],
                "ratio_threshold": self.options.ratio_threshold,
                "reference_percentile": self.options.reference_percentile,
            },
            suggestion=suggestion,
        )


CLIP_PERCENTILE = 99.99  # what the suggested clipping observer keeps: rare spikes above it saturate


def _fix(ctx: LintContext, nodes: list[OpNode], clip_text: str) -> tuple[str, Fix | None, str]:
    """Where a clipping observer goes: on the op whose qconfig makes the observer of the input
    under prepare_fx (``observer_owner``: the producer, a ReLU on the way, or each layer itself);
    in an exported graph (pt2e) on the layers, whose input edges have observers of their own."""
    head = nodes[0]
    subject = None
    if ctx.graph.exported:
        modules = [node.module for node in nodes if node.module]
        if len(modules) < len(nodes):
            return (
                head.display,
                None,
                f"Fix: {_joined_names([node.display for node in nodes])} reads it in an op of the exported graph with no module of its own, which "
                "no per-module setting of the pt2e quantizer reaches: clip or normalise these channels before it.",
            )
        # pt2e observes the tensors a module's ops read: qlint's pt2e quantizer changes that observer
        targets = list(dict.fromkeys(modules))
        subject = f"{_joined_names(targets)}'s input tensor (shared by every op reading it)"
    else:
        owners = [observer_owner(ctx, node) for node in nodes]
        functional = [
            owner
            for owner, node in zip(owners, nodes)
            if owner is not node and owner.op != "module" and not computes_its_module(owner)
        ]
        if functional:
            return (
                head.display,
                KeepFloat(targets=[node.display for node in nodes]),
                f"Fix: the observer of this input is made by {functional[0].display} ({functional[0].kind}), a "
                f"functional op with no qconfig of its own to change: clip or normalise these channels before "
                f"{_joined_names([node.display for node in nodes])}, or keep {'it' if len(nodes) == 1 else 'them'} float.",
            )
        targets = list(dict.fromkeys(owner.module or owner.display for owner in owners))
        subject = _with_scope_note(ctx, targets, owners)
    return (
        targets[0],
        SetActivationObserver(targets=targets, percentile=CLIP_PERCENTILE),
        f"Fix: give {subject or _joined_names(targets)} a clipping activation observer{clip_text}: "
        f"PercentileObserver(percentile={CLIP_PERCENTILE:g}) instead of the default histogram search, so "
        "the rare spikes saturate and the bulk keeps its resolution; or clip/normalise these channels "
        "upstream, or keep the layer float.",
    )


def _with_scope_note(ctx: LintContext, targets: list[str], owners: list[OpNode]) -> str | None:
    """The targets, naming the other ops of their forward that their qconfig reaches too where
    a functional op inside them makes the observer; None when there are none."""
    others = functional_ops_of_scopes(ctx, {o.scope for o in owners if computes_its_module(o)}, owners)
    if not others:
        return None
    return (
        f"{_joined_names(targets)} (its functional {owners[0].kind} gets its qconfig by name, and so "
        f"do the other ops of its forward: {_joined_names(others)})"
    )


def _read_one_tensor(
    ctx: LintContext, first: OpNode, first_measured: OutlierMeasurement, node: OpNode, measured: OutlierMeasurement
) -> bool:
    """Whether two layers read one tensor: one producer, and the same channels measured.

    The producer alone is not enough: a node of several outputs (an eager-traced tuple) feeds
    different tensors under one name, and a conv and a Linear read one tensor along different
    channel axes. A layer that reads no node's output (a parameter) reads a tensor of its own."""
    producers, others = ctx.graph.producers(first.name), ctx.graph.producers(node.name)
    if not producers or not others or producers[0].name != others[0].name:
        return False
    a, b = first_measured.stats, measured.stats
    return (
        a.channel_axis == b.channel_axis
        and torch.equal(a.channel_min, b.channel_min)
        and torch.equal(a.channel_max, b.channel_max)
    )


def _joined(nodes: list[OpNode]) -> str:
    text = _joined_names([node.display for node in nodes])
    return text if len(nodes) == 1 else f"{text} (one tensor, read by each)"


def _joined_names(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def _clip_text(clip: float, spikes: float, quantile: float) -> str:
    """Where the flagged channels' bulk ends. clip_value estimates their reference quantile, not
    the per-tensor band the clipping observer will keep, so the text says which it is."""
    if not math.isfinite(clip):
        return ""
    return (
        f" (the bulk of the flagged channels, below their {quantile:g}-quantile, ends near {clip:.4g}; "
        f"their spikes reach {spikes:.4g})"
    )


def _layer_row(code: str, node: OpNode, measured: OutlierMeasurement) -> LayerRow:
    finite = measured.metric[torch.isfinite(measured.metric)]
    count = int(measured.outlier.sum())
    if measured.nan_count or measured.inf_count:
        verdict = "NaN/Inf"
    elif count:
        verdict = f"{count} outlier channel(s)"
    else:
        verdict = "ok"
    return LayerRow(
        name=node.display,
        kind=node.kind,
        rule=code,
        statistic="max p_r (max / quantile)",
        value=float(finite.max()) if finite.numel() else None,
        verdict=verdict,
        extra={
            "outlier_channels": measured.outlier.nonzero().flatten().tolist(),
            "constant_channels": int(measured.constant.sum()),
        },
    )


def _short(channels: list[int]) -> str:
    text = ", ".join(str(c) for c in channels[:8])
    return text + (f", ... ({len(channels)} in all)" if len(channels) > 8 else "")


# --- examples --------------------------------------------------------------------------


class _Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc(x)


class _ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)

    def forward(self, x):
        return self.conv(x)


def _head():
    torch.manual_seed(0)
    return _Head().eval()


def _convnet():
    torch.manual_seed(0)
    return _ConvNet().eval()


def _mapping() -> QConfigMapping:
    return get_default_qconfig_mapping("x86")


def _gaussian(shape, count=6):
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=generator) for _ in range(count)]


def _uniform(shape, count=6):
    generator = torch.Generator().manual_seed(0)
    return [torch.rand(shape, generator=generator) + 1.0 for _ in range(count)]


def _spiky(shape, channel, count=6):
    """Positive activations with rare, large spikes in one channel (every batch has some)."""
    batches = _uniform(shape, count)
    generator = torch.Generator().manual_seed(1)
    for batch in batches:
        view = batch.select(1, channel)
        flat = view.reshape(-1)
        picks = torch.randperm(flat.numel(), generator=generator)[: max(1, flat.numel() // 100)]
        flat[picks] = 40.0
        view.copy_(flat.view_as(view))
    return batches


def _with_nan(shape, count=4):
    batches = _gaussian(shape, count)
    batches[1][0, 2] = float("nan")
    return batches


VALID = (
    Example(
        "well-behaved positive linear inputs",
        _head,
        lambda: (torch.randn(64, 16),),
        _mapping,
        calibration=lambda: _uniform((64, 16)),
    ),
    Example(
        "well-behaved conv inputs",
        _convnet,
        lambda: (torch.randn(2, 3, 16, 16),),
        _mapping,
        calibration=lambda: _uniform((2, 3, 16, 16)),
    ),
)
INVALID = (
    Example(
        "one linear input channel has rare large spikes",
        _head,
        lambda: (torch.randn(64, 16),),
        _mapping,
        calibration=lambda: _spiky((64, 16), 5),
        flagged=("fc",),
    ),
    Example(
        "one conv input channel has rare large spikes",
        _convnet,
        lambda: (torch.randn(2, 3, 16, 16),),
        _mapping,
        calibration=lambda: _spiky((2, 3, 16, 16), 1),
        flagged=("conv",),
    ),
    Example(
        "NaN in the calibration activations",
        _head,
        lambda: (torch.randn(64, 16),),
        _mapping,
        calibration=lambda: _with_nan((64, 16)),
        flagged=("fc",),
    ),
)
