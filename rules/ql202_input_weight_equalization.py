"""QL202 input-weight-equalization."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn as nn
from pydantic import Field
from torch.ao.quantization import QConfigMapping, get_default_qconfig_mapping

from qlint.core.graph import ModelGraph, OpNode
from qlint.linter.calibration import FEATURES
from qlint.linter.context import LintContext
from qlint.linter.findings import Finding, LayerRow, Severity
from qlint.linter.json_values import json_float
from qlint.linter.rule import Example, Need, ObservationSpec, Rule, RuleOptions

KINDS = frozenset({"linear", "conv1d", "conv2d", "conv3d"})


def weight_channel_ranges(weight: torch.Tensor, in_channels: int) -> torch.Tensor | None:
    """Range (max - min) of the weights that multiply each input channel.

    Linear ``[out, in]``: per column. Conv ``[out, in/groups, *k]``: input channel
    ``g * in/groups + j`` meets ``weight[g*out/groups:(g+1)*out/groups, j]``.
    """
    w = weight.detach().to(torch.float64)
    if w.dim() < 2:
        return None
    per_group = w.shape[1]
    if per_group == 0 or in_channels % per_group:
        return None
    groups = in_channels // per_group
    if w.shape[0] % groups:
        return None
    grouped = w.reshape(groups, w.shape[0] // groups, per_group, -1)
    high = grouped.amax(dim=(1, 3)).reshape(-1)
    low = grouped.amin(dim=(1, 3)).reshape(-1)
    return high - low


def comparison_metrics(
    input_ranges: torch.Tensor, input_global: float, weight_ranges: torch.Tensor, weight_global: float
) -> torch.Tensor:
    """s_c = sqrt(w_c / W) / sqrt(i_c / I), in float64 (inf where i_c == 0)."""
    return torch.sqrt(weight_ranges / weight_global) / torch.sqrt(input_ranges / input_global)


class InputWeightEqualization(Rule):
    """Flags conv and linear layers whose per-channel input and weight ranges are unbalanced.

    ## What it does
    For every quantized conv/linear layer it computes, per input channel c, the statistic
    of torch's `InputWeightEqualizationDetector`:
    `s_c = sqrt(w_c / W) / sqrt(i_c / I)`, where `i_c` is the calibration range
    (max - min) of input channel c, `I` the range of the whole input, `w_c` the range of
    the weights that multiply channel c (a weight column of a linear, the input-channel
    slice of a conv) and `W` the range of the whole weight. A channel recommends
    equalization when `s_c < ratio_threshold` or `s_c > 1 / ratio_threshold`; the rule
    fires when at least `channel_fraction` of the channels do.

    Deliberate differences from torch (torch 2.x `detector.py`):
    - **Band direction.** torch's code recommends equalization when
      `ratio_threshold <= s_c <= 1/ratio_threshold`, i.e. when input and weight ranges
      are already balanced; its docstring says the opposite. Equalization scales input
      channel c by `1/r_c` and weight channel c by `r_c` with `r_c = sqrt(i_c / w_c)`,
      which makes both ranges `sqrt(i_c * w_c)`. If `s_c` is the same for every channel
      then `r_c = sqrt(I/W) / s_c` is one constant: equalization only rescales the whole
      tensors and changes no per-tensor quantization error. It helps exactly when `s_c`
      differs strongly from 1 (a channel's input range is large relative to its weights
      or vice versa), so qlint recommends *outside* the band.
    - **Zero ranges.** torch raises when `I` or `W` is 0 and yields `s_c = inf` (or 0)
      for a constant input channel (or zero weight column). Equalization cannot scale
      such a channel (it would divide by zero), so qlint never counts it as recommending,
      stores its metric as the string "inf"/"nan", and skips a layer whose whole input or
      weight is constant.
    - **Grouped convs.** torch repeats the per-group weight ranges; qlint pairs each input
      channel with the weights of its own group.
    - **Linear inputs with more than two dims** are read per feature (last axis); torch
      reads axis 1.

    ## Why is this bad?
    A quantized activation has one scale for all its channels, so the widest channel
    sets the step size and narrow channels are represented by a handful of int8 levels.
    When the weights that multiply those channels are comparatively wide, the error
    compounds. Equalization moves range between the input channel and its weights
    (an exact float re-parametrisation) so both quantize with less error.

    ## Example
    ```python
    # input channel 0 of fc spans +-100, the others +-1, and fc's weights are similar
    # in every column: one per-tensor scale is set by channel 0.
    y = fc(x)
    ```

    ## Use instead
    qlint's own equalization, a float-preserving cross-layer rescale: each output channel c of
    the layer before `fc` (a Linear, Conv or norm, through ReLUs only) is multiplied by a
    factor `f_c` read from the calibration ranges and `fc`'s weights for input channel c are
    divided by it, so the float model computes the same and its int8 ranges are balanced.
    ```python
    plan = QuantPlan.load("plan.json")         # qlint MODEL --calibration DATA --emit-plan plan.json
    int8_model = plan.quantize(model, calibration)  # what the finding's impact measured
    ```
    or on the command line `qlint quantize MODEL --plan plan.json --calibration DATA`; `qlint fix
    MODEL --plan plan.json --calibration DATA --output fixed.pt` writes the float model with the
    rescale applied, to quantize with the plan's mapping (`--emit-qconfig`) calibrated on the
    same DATA. This is not torch's `_equalization_config` (`default_equalization_qconfig`), a
    different algorithm that qlint does not measure: on silero_vad it lowered the held-out SQNR
    from 3.97 to 0.68 dB where qlint's rescale gained.

    It never recommends equalization on grouped and depthwise convolutions (one weight per
    group, not per input channel) or on Linear layers whose input is not 2-D (`(B, T, D)` in
    transformers). Those layers show "not applicable" in the per-layer table. A finding's
    impact is measured by the rescale in a fix trial (the plan's mapping with the layer
    equalized); on an exported graph, quantized with pt2e (which has no equalization), the fix
    is the layer kept float in the quantizer, and that trial measures it. A finding whose fix
    gains less than the impact threshold is reported as info.

    ## Options
    - `ratio_threshold`: channels with `s_c` below it or above its inverse recommend equalization (0 < t < 1).
    - `channel_fraction`: the rule fires when at least this fraction of channels recommend it (torch: 0.4).

    ## References
    - torch.ao.quantization.fx._model_report.detector.InputWeightEqualizationDetector
    - Nagel et al., "Data-Free Quantization Through Weight Equalization and Bias Correction", ICCV 2019
    """

    code = "QL202"
    name = "input-weight-equalization"
    summary = "Per-channel input and weight ranges are unbalanced: input-weight equalization would help."
    severity = Severity.WARNING
    requires = frozenset({Need.GRAPH, Need.QCONFIG, Need.STATISTICS})
    observes = (ObservationSpec(KINDS, "input", 0, FEATURES),)

    class Options(RuleOptions):
        ratio_threshold: float = Field(0.5, gt=0, lt=1, description="s_c band is [t, 1/t].")
        channel_fraction: float = Field(0.4, gt=0, le=1, description="Fraction of channels that must recommend.")

    options: Options  # this rule's own Options, so the type checker knows its fields

    def check(self, ctx: LintContext) -> Iterable[Finding | LayerRow]:
        t = self.options.ratio_threshold
        for node in ctx.graph.by_kind(*KINDS):
            measured = measure(ctx.statistics, ctx.graph, node, t, self.options.channel_fraction)
            if measured is None:
                continue
            blocker = equalization_blocker(ctx.graph, node)
            verdict = "equalize" if measured.equalization_recommended else "balanced"
            yield LayerRow(
                name=node.display,
                kind=node.kind,
                rule=self.code,
                statistic="fraction s_c outside band",
                value=measured.fraction_recommended,
                verdict=f"{verdict} (not applicable: {blocker})"
                if blocker and measured.equalization_recommended
                else verdict,
            )
            if node.qconfig is None or not node.is_quantized or not measured.equalization_recommended or blocker:
                continue
            worst = _most_unbalanced(measured.comp_metrics, measured.channels_recommended)
            message = (
                f"{sum(measured.channels_recommended)} of {len(measured.channels_recommended)} input channels "
                f"of {node.display} have unbalanced input vs weight ranges (s_c outside [{t:g}, {1 / t:g}]"
                + (f", e.g. channel {worst[0]}: s = {worst[1]:.3g}" if worst else "")
                + "): one per-tensor activation scale is set by the widest channels and the rest lose "
                "resolution. "
            )
            suggestion: dict[str, Any] = {"action": "equalize", "module": node.display, "node": node.name}
            if ctx.graph.exported:
                # the exported graph is quantized with pt2e, which has no equalization: the fix a .pt2
                # user can apply is the layer kept float (its measured gain is the finding's impact)
                message += (
                    "The pt2e flow has no input-weight equalization: keep this layer float in the quantizer "
                    f"(quantizer.set_module_name_qconfig({node.display!r}, None)), or quantize the nn.Module "
                    "with prepare_fx and equalization."
                )
                suggestion = {"action": "keep_float", "module": node.display, "reason": "no equalization in pt2e"}
            else:
                # qlint's rescale is what the finding's impact measured (its fix trial); torch's
                # _equalization_config is another algorithm, and made silero_vad worse (3.97 -> 0.68 dB)
                message += (
                    "Equalize it with qlint's rescale (each output channel of the layer before it, through "
                    "ReLUs, multiplied by a factor from the calibration ranges and this layer's weights divided "
                    "by it; the float outputs stay the same): `qlint quantize`/QuantPlan.quantize apply it with "
                    "the plan, and `qlint fix MODEL --plan PLAN --calibration DATA` writes the model with it "
                    "applied, to quantize with the plan's mapping."
                )
            yield self.finding(
                node.display,
                message,
                data={
                    "kind": "equalization-recommended",
                    "node": node.name,
                    "ratio_threshold": t,
                    "channel_fraction": self.options.channel_fraction,
                    "channels_recommended": measured.channels_recommended,
                    "comp_metrics": measured.comp_metrics,
                    "fraction_recommended": measured.fraction_recommended,
                    "equalization_recommended": measured.equalization_recommended,
                },
                suggestion=suggestion,
            )


def equalization_blocker(graph: ModelGraph, node: OpNode) -> str | None:
    """Why torch's input-weight equalization cannot apply to ``node``; None when it can.

    Its equalization observers scale every input channel of one weight: a grouped or depthwise
    conv has a weight per group, not per input channel, and prepare_fx crashes on it; and it
    reads Linear inputs as (batch, features), so (B, T, D) inputs crash it too."""
    weight = _weight_of(graph, node)
    inputs = node.inputs[0] if node.inputs else None
    if node.kind.startswith("conv") and weight is not None and inputs is not None and len(inputs.shape) > 1:
        if weight.dim() > 1 and weight.shape[1] != inputs.shape[1]:
            return "grouped or depthwise convolution"
    if node.kind == "linear" and inputs is not None and len(inputs.shape) != 2:
        return f"{len(inputs.shape)}-D input (torch equalizes 2-D Linear inputs only)"
    return None


@dataclasses.dataclass(frozen=True)
class EqualizationMeasurement:
    """torch's InputWeightEqualizationDetector quantities for one layer."""

    channels_recommended: list[bool]
    comp_metrics: list[float | None]  # s_c per input channel (None where not finite)
    fraction_recommended: float
    equalization_recommended: bool


def measure(
    statistics, graph: ModelGraph, node: OpNode, ratio_threshold: float, channel_fraction: float
) -> EqualizationMeasurement | None:
    """s_c per input channel of ``node`` and the verdicts; None without usable statistics or weight."""
    stats = statistics.get(node.name, "input", 0)
    if stats is None or stats.num_channels == 0:
        return None
    weight = _weight_of(graph, node)
    if weight is None:
        return None
    weight_ranges = weight_channel_ranges(weight, stats.num_channels)
    if weight_ranges is None or weight_ranges.numel() != stats.num_channels:
        return None
    input_global = float(stats.epoch_range())
    weight_global = float(weight.detach().to(torch.float64).max() - weight.detach().to(torch.float64).min())
    if not (math.isfinite(input_global) and input_global > 0 and weight_global > 0):
        return None
    input_ranges = stats.channel_range().to(torch.float64).cpu()
    metrics = comparison_metrics(input_ranges, input_global, weight_ranges.cpu(), weight_global)
    usable = torch.isfinite(metrics) & (metrics > 0) & (input_ranges > 0) & (weight_ranges.cpu() > 0)
    recommended = usable & ((metrics < ratio_threshold) | (metrics > 1 / ratio_threshold))
    fraction = float(recommended.sum()) / len(recommended)
    return EqualizationMeasurement(
        [bool(v) for v in recommended.tolist()],
        [json_float(v) for v in metrics.tolist()],
        fraction,
        fraction >= channel_fraction,
    )


def _weight_of(graph: ModelGraph, node: OpNode) -> torch.Tensor | None:
    """The node's weight; for fused modules (ConvReLU2d, LinearReLU) the inner op's weight."""
    candidates = [node.weight] if node.weight else []
    if node.module is not None:
        candidates += [f"{node.module}.weight", f"{node.module}.0.weight"]
    for fqn in candidates:
        weight = graph.parameter(fqn)
        if weight is not None:
            return weight
    return None


def _most_unbalanced(metrics: list, recommended: list) -> tuple[int, float] | None:
    best = None
    for index, (value, flag) in enumerate(zip(metrics, recommended)):
        if flag and isinstance(value, float):
            distance = abs(math.log(value))
            if best is None or distance > best[2]:
                best = (index, value, distance)
    return None if best is None else (best[0], best[1])


# --- examples --------------------------------------------------------------------------


class _Linear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x)


class _Conv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 8, 3)

    def forward(self, x):
        return self.conv(x)


class _Depthwise(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, groups=4)

    def forward(self, x):
        return self.conv(x)


def _linear():
    torch.manual_seed(0)
    return _Linear().eval()


def _depthwise():
    torch.manual_seed(0)
    return _Depthwise().eval()


def _conv():
    torch.manual_seed(0)
    return _Conv().eval()


def _scaled_channels(shape, scales, count=4):
    generator = torch.Generator().manual_seed(0)
    view = (1, -1) + (1,) * (len(shape) - 2)
    factor = torch.tensor(scales, dtype=torch.float32).view(view)
    return [torch.randn(shape, generator=generator) * factor for _ in range(count)]


def _mapping() -> QConfigMapping:
    return get_default_qconfig_mapping("x86")


VALID = (
    Example(
        "linear input channels of similar range",
        _linear,
        lambda: (torch.randn(16, 8),),
        _mapping,
        calibration=lambda: _scaled_channels((16, 8), [1.0] * 8),
    ),
    Example(
        "conv input channels of similar range",
        _conv,
        lambda: (torch.randn(2, 4, 8, 8),),
        _mapping,
        calibration=lambda: _scaled_channels((2, 4, 8, 8), [1.0, 1.2, 0.9, 1.1]),
    ),
    # Unbalanced, but torch's equalization cannot apply: prepare_fx crashes on both.
    Example(
        "depthwise conv with unbalanced input channels",
        _depthwise,
        lambda: (torch.randn(2, 4, 8, 8),),
        _mapping,
        calibration=lambda: _scaled_channels((2, 4, 8, 8), [100.0, 0.01, 1.0, 30.0]),
    ),
    Example(
        "linear on (B, T, D) inputs with unbalanced features",
        _linear,
        lambda: (torch.randn(2, 16, 8),),
        _mapping,
        calibration=lambda: [b.transpose(1, 2) for b in _scaled_channels((2, 8, 16), [50.0] * 4 + [1.0] * 4)],
    ),
)
INVALID = (
    Example(
        "half the linear input channels are 50x wider than the rest",
        _linear,
        lambda: (torch.randn(16, 8),),
        _mapping,
        calibration=lambda: _scaled_channels((16, 8), [50.0] * 4 + [1.0] * 4),
        flagged=("fc",),
    ),
    Example(
        "conv input channels span very different ranges",
        _conv,
        lambda: (torch.randn(2, 4, 8, 8),),
        _mapping,
        calibration=lambda: _scaled_channels((2, 4, 8, 8), [100.0, 0.01, 1.0, 30.0]),
        flagged=("conv",),
    ),
)
