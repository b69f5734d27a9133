"""QL201 dynamic-static."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

import torch
import torch.nn as nn
from pydantic import Field
from torch.ao.quantization import QConfigMapping, default_dynamic_qconfig, get_default_qconfig_mapping

from qlint.core.graph import OpNode
from qlint.linter.calibration import FEATURES
from qlint.linter.context import LintContext
from qlint.linter.findings import Finding, LayerRow, Severity
from qlint.linter.json_values import finite_or_none
from qlint.linter.rule import Example, Need, ObservationSpec, Rule, RuleOptions

KINDS = frozenset({"linear"})


class DynamicStatic(Rule):
    """Flags linear layers whose calibration data says the other quantization mode fits better.

    ## What it does
    Measures, before and after every quantized linear layer, the statistic of torch's
    `DynamicStaticDetector`: S = (average over batches of max(batch) - min(batch)) /
    (max over all data - min over all data). When the output's S is at or below
    `tolerance` the activation range moves from batch to batch (non-stationary) and
    dynamic quantization is recommended; above it the range is stable and static
    quantization is recommended. The rule fires when that recommendation differs from
    how your qconfig quantizes the layer (dynamic vs static).

    Only linear layers are checked: no x86/fbgemm/qnnpack/onednn kernel quantizes a
    convolution dynamically (torch lists conv only as "future supported").

    ## Why is this bad?
    Static quantization fixes one scale and zero point per tensor from calibration. If
    each batch uses only a small, moving part of the overall range, most batches use a
    few of the 256 int8 levels and the error is large; dynamic quantization picks the
    activation scale per batch at run time. Conversely, dynamic quantization on a
    stationary activation pays a min/max pass per call for nothing and leaves the output
    in float.

    ## Example
    ```python
    # batches whose scale drifts: S(output) is small, but the layer is quantized statically
    mapping = get_default_qconfig_mapping("x86")
    ```

    ## Use instead
    ```python
    mapping = get_default_qconfig_mapping("x86").set_module_name("fc", default_dynamic_qconfig)
    ```

    ## Options
    - `tolerance`: S at or below this is non-stationary, so dynamic quantization is recommended (torch default 0.5).
    - `report_dynamic_to_static`: also report dynamically quantized layers whose activations are stationary.

    ## References
    - torch.ao.quantization.fx._model_report.detector.DynamicStaticDetector
    - https://pytorch.org/docs/stable/quantization.html#dynamic-quantization
    """

    code = "QL201"
    name = "dynamic-static"
    summary = "Calibration data recommends the other quantization mode (dynamic vs static) for a layer."
    severity = Severity.WARNING
    requires = frozenset({Need.GRAPH, Need.QCONFIG, Need.STATISTICS})
    observes = (
        ObservationSpec(KINDS, "input", 0, FEATURES),
        ObservationSpec(KINDS, "output", 0, None),
    )

    class Options(RuleOptions):
        tolerance: float = Field(0.5, gt=0, le=1, description="S threshold for non-stationary data.")
        report_dynamic_to_static: bool = Field(True, description="Report dynamic layers with stationary data.")

    options: Options  # this rule's own Options, so the type checker knows its fields

    def check(self, ctx: LintContext) -> Iterable[Finding | LayerRow]:
        tolerance = self.options.tolerance
        for node in ctx.graph.by_kind(*KINDS):
            measured = measure(ctx.statistics, node, tolerance)
            if measured is None:
                continue
            flagged = (
                node.qconfig is not None
                and node.is_quantized
                and measured.dynamic_recommended != bool(node.qconfig.is_dynamic)
                and (self.options.report_dynamic_to_static or not node.qconfig.is_dynamic)
            )
            if flagged:
                yield self._finding(node, measured)
            verdict = "dynamic" if measured.dynamic_recommended else "static"
            yield LayerRow(
                name=node.display,
                kind=node.kind,
                rule=self.code,
                statistic="S(output)",
                value=measured.output_comp_stat,
                verdict=f"{verdict} recommended" + (" (flagged)" if flagged else ""),
                extra={"input_comp_stat": measured.input_comp_stat},
            )

    def _finding(self, node: OpNode, measured: DynamicStaticMeasurement) -> Finding:
        tolerance = self.options.tolerance
        s_out = measured.output_comp_stat
        if measured.dynamic_recommended:
            message = (
                f"the output range of {node.display} changes from batch to batch "
                f"(S = average batch range / overall range = {s_out:.3g} <= {tolerance}), but it is "
                "quantized statically: one calibrated scale wastes most int8 levels on each batch. "
                f"Quantize it dynamically: mapping.set_module_name({node.display!r}, default_dynamic_qconfig)."
            )
            suggestion = {
                "action": "set_qconfig",
                "module": node.display,
                "node": node.name,
                "qconfig": "torch.ao.quantization.default_dynamic_qconfig",
                "mode": "dynamic",
            }
        else:
            message = (
                f"the output range of {node.display} is stable across batches (S = {s_out:.3g} > "
                f"{tolerance}), but it is quantized dynamically: static quantization would avoid the "
                "per-call range computation and keep the output in int8. Use a static qconfig for it."
            )
            suggestion = {
                "action": "set_qconfig",
                "module": node.display,
                "node": node.name,
                "qconfig": "static",
                "mode": "static",
            }
        return self.finding(
            node.display,
            message,
            data={
                "kind": "dynamic-recommended" if measured.dynamic_recommended else "static-recommended",
                "node": node.name,
                "tolerance": tolerance,
                "intent_dynamic": bool(node.qconfig and node.qconfig.is_dynamic),
                "dynamic_recommended": measured.dynamic_recommended,
                "input_comp_stat": measured.input_comp_stat,
                "output_comp_stat": measured.output_comp_stat,
            },
            suggestion=suggestion,
        )


@dataclasses.dataclass(frozen=True)
class DynamicStaticMeasurement:
    """torch's DynamicStaticDetector quantities for one linear layer."""

    dynamic_recommended: bool
    input_comp_stat: float | None  # S before the layer (None where undefined)
    output_comp_stat: float  # S after the layer


def measure(statistics, node: OpNode, tolerance: float) -> DynamicStaticMeasurement | None:
    """S before and after ``node`` and the recommendation; None without usable statistics."""
    pre = statistics.get(node.name, "input", 0)
    post = statistics.get(node.name, "output", 0)
    if pre is None or post is None:
        return None
    pre_stat = float(pre.batch_to_epoch_range_ratio())
    post_stat = float(post.batch_to_epoch_range_ratio())
    if math.isnan(post_stat):
        return None  # constant or non-finite output: S is undefined (torch raises)
    return DynamicStaticMeasurement(post_stat <= tolerance, finite_or_none(pre_stat), post_stat)


# --- examples --------------------------------------------------------------------------


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.relu = nn.ReLU()
        self.fc = nn.Linear(32, 8)

    def forward(self, x):
        return self.fc(self.relu(self.fc1(x)))


def _mlp():
    torch.manual_seed(0)
    return _Mlp().eval()


def _stationary(count: int = 8):
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(16, 16, generator=generator) for _ in range(count)]


def _drifting(count: int = 8):
    """Each batch lives on its own scale (e.g. sensor gain changes): non-stationary."""
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(16, 16, generator=generator) * 4.0**k for k in range(count)]


def _dynamic_mapping() -> QConfigMapping:
    return QConfigMapping().set_global(default_dynamic_qconfig)


def _static_mapping() -> QConfigMapping:
    return get_default_qconfig_mapping("x86")


def _inputs():
    return (torch.randn(16, 16),)


VALID = (
    Example("static quantization on stationary activations", _mlp, _inputs, _static_mapping, calibration=_stationary),
    Example("dynamic quantization on drifting activations", _mlp, _inputs, _dynamic_mapping, calibration=_drifting),
)
INVALID = (
    Example(
        "static quantization on activations whose scale drifts per batch",
        _mlp,
        _inputs,
        _static_mapping,
        calibration=_drifting,
        flagged=("fc",),
    ),
    Example(
        "dynamic quantization on stationary activations",
        _mlp,
        _inputs,
        _dynamic_mapping,
        calibration=_stationary,
        flagged=("fc",),
    ),
)
