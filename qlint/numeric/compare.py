"""compare(): per-layer numeric comparison of a float model and its quantized counterpart.

The result is a ``qlint.linter.findings.Report``: one ``CompareRow`` per matched layer
(weight SQNR, propagated and shadow activation SQNR, cosine, and the rest of
the metrics in ``extra``) and findings QL301 (low-sqnr-layer) and QL302
(error-onset), built in ``qlint.numeric.diagnose``.  A module the model calls several
times has a row per call, named by the call's FX node (``act``, ``act_1``): its calls see
other inputs and other errors, and each is another layer's predecessor.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

import torch
from pydantic import Field
from torch import nn

from qlint.core.function_paths import function_path
from qlint.core.nested import float_tensors, floats_are_finite
from qlint.core.preserve import preserved_state
from qlint.core.sqnr import SqnrSums
from qlint.errors import DataError, EmptyCalibrationError
from qlint.linter.findings import CompareRow, InputQuantization, Notice, Report, Severity, Timing
from qlint.measure.capture import PairedRunner
from qlint.measure.match_result import MODULE_SITE, NODE_SITE, LayerMatch, MatchResult
from qlint.measure.matching import match_layers
from qlint.measure.metrics import PairwiseErrorStats
from qlint.measure.quantizers import QuantGrid
from qlint.measure.weights import float_layer_weights, off_grid_fraction, quantized_layer_weights
from qlint.numeric.badcase_summary import BadCaseSummary
from qlint.numeric.diagnose import (
    DEFAULT_ONSET_JUMP_DB,
    DEFAULT_SQNR_THRESHOLD_DB,
    DEFAULT_WEIGHT_SQNR_THRESHOLD_DB,
    OTHER_MODEL_KINDS,
    diagnose,
)
from qlint.numeric.display import describe_sqnr
from qlint.numeric.next_step import NextStep, next_step
from qlint.numeric.sensitivity import SensitivityRow
from qlint.numeric.unfused_norm import unfused_norms

MODES = ("propagated", "shadow")


class CompareReport(Report):
    """What ``qlint compare --format json`` writes: the comparison's ``Report``, the sensitivity
    ranking of the quantized model's layers and the worst inputs, when they were asked for, and
    the next step when the model output stays below the threshold (:mod:`qlint.numeric.next_step`)."""

    sensitivity: list[SensitivityRow] | None = Field(
        default=None,
        description="The layers of the quantized model, most sensitive first (--sensitivity); null when not ranked.",
    )
    badcases: BadCaseSummary | None = Field(default=None, description="The worst inputs (--badcases); null without.")
    next_step: NextStep | None = Field(
        default=None,
        description="The commands that measure fixes, when the model output is below the threshold; null otherwise.",
    )


def qlint_version() -> str:
    try:
        return metadata.version("qlint")
    except metadata.PackageNotFoundError:
        return "0+unknown"


@dataclass
class InputGridStats:
    """Folded batch by batch, for a model-input layer: its float input ``x`` against ``x`` put on
    the quantized model's input grid (``q``: what that quantization costs), ``q`` against the
    quantized layer's real input (whether that quantization is the whole difference), and how
    much of ``x`` lies off the grid's range."""

    quantization: SqnrSums = field(default_factory=SqnrSums)
    match: SqnrSums = field(default_factory=SqnrSums)
    clipped: int = 0
    count: int = 0
    data_min: float = float("inf")
    data_max: float = float("-inf")
    grid: QuantGrid | None = None

    def update(self, float_input: torch.Tensor, actual: torch.Tensor, grid: QuantGrid) -> None:
        x = float_input.detach()
        on_grid = grid.fake_quantize(x)
        self.quantization.add(x, on_grid)
        self.match.add(on_grid, actual.detach())
        margin = grid.scale / 2  # within half a step of the range, a value only rounds
        self.clipped += int(((x < grid.low - margin) | (x > grid.high + margin)).sum())
        self.count += x.numel()
        if x.numel():
            low, high = torch.aminmax(x)
            self.data_min, self.data_max = min(self.data_min, float(low)), max(self.data_max, float(high))
        self.grid = grid

    def summary(self) -> InputQuantization | None:
        if self.grid is None or self.count == 0:
            return None
        return InputQuantization(
            sqnr=self.quantization.sqnr_db(),
            match_sqnr=self.match.sqnr_db(),
            low=self.grid.low,
            high=self.grid.high,
            step=self.grid.scale,
            clipped=self.clipped / self.count,
            data_min=self.data_min,
            data_max=self.data_max,
        )


@dataclass
class LayerStats:
    """Everything compare accumulates for one layer; constant size per layer."""

    weight: PairwiseErrorStats = field(default_factory=PairwiseErrorStats)
    weight_off_grid: float | None = None
    propagated: PairwiseErrorStats = field(default_factory=PairwiseErrorStats)
    shadow: PairwiseErrorStats = field(default_factory=PairwiseErrorStats)
    input_grid: InputGridStats = field(default_factory=InputGridStats)


def _check_modes(modes: Sequence[str]) -> tuple[bool, bool]:
    unknown = set(modes) - set(MODES)
    if unknown or not modes:
        raise ValueError(f"modes must be a non-empty subset of {MODES}, got {tuple(modes)}")
    return "propagated" in modes, "shadow" in modes


def weight_stats(layer: LayerMatch, float_model: nn.Module, quantized_model: nn.Module) -> PairwiseErrorStats:
    """SQNR & co. between a layer's float weights and its quantized weights (all weight tensors pooled)."""
    stats = PairwiseErrorStats()
    if layer.float_entry.kind != MODULE_SITE or layer.quant_site.kind != MODULE_SITE:
        return stats
    float_weights = float_layer_weights(layer, float_model)
    quant_weights = quantized_layer_weights(layer, quantized_model.get_submodule(layer.quant_site.name))
    for name, float_weight in float_weights.items():
        quant_weight = quant_weights.get(name)
        if quant_weight is not None and quant_weight.numel() == float_weight.numel():
            stats.update(float_weight, quant_weight.reshape(float_weight.shape))
    return stats


def weight_off_grid(layer: LayerMatch, float_model: nn.Module, quantized_model: nn.Module) -> float | None:
    """How many of a converted layer's int8 weights are not the rounding of its float weight
    (:func:`qlint.measure.weights.off_grid_fraction`); None where that cannot be told."""
    if layer.float_entry.kind != MODULE_SITE or layer.quant_site.kind != MODULE_SITE:
        return None
    float_weight = float_layer_weights(layer, float_model).get("weight")
    if float_weight is None:
        return None
    return off_grid_fraction(float_weight, quantized_model.get_submodule(layer.quant_site.name))


def compare(
    float_model: nn.Module,
    quantized_model: nn.Module,
    data: Iterable,
    *,
    modes: Sequence[str] = MODES,
    sqnr_threshold: float = DEFAULT_SQNR_THRESHOLD_DB,
    weight_sqnr_threshold: float = DEFAULT_WEIGHT_SQNR_THRESHOLD_DB,
    onset_jump_db: float = DEFAULT_ONSET_JUMP_DB,
    max_batches: int | None = None,
    model_name: str = "model",
    backend: str = "x86",
    match: MatchResult | None = None,
) -> Report:
    """Compare ``quantized_model`` with ``float_model`` layer by layer over ``data``.

    ``data`` yields batches: a tensor, a tuple of positional inputs or a dict of
    keyword inputs.  It is read once, batch by batch; nothing is kept across
    batches.  Neither model is changed (hooks removed, buffers and modes restored).
    ``sqnr_threshold`` (dB) applies to each layer's local activation SQNR
    (shadow when run, else propagated), ``weight_sqnr_threshold`` to weight SQNR.
    """
    report = compare_report(
        float_model,
        quantized_model,
        data,
        modes=modes,
        sqnr_threshold=sqnr_threshold,
        weight_sqnr_threshold=weight_sqnr_threshold,
        onset_jump_db=onset_jump_db,
        max_batches=max_batches,
        model_name=model_name,
        backend=backend,
        match=match,
    )
    return Report(**{name: value for name, value in report if name in Report.model_fields})


def compare_report(
    float_model: nn.Module,
    quantized_model: nn.Module,
    data: Iterable,
    *,
    modes: Sequence[str] = MODES,
    sqnr_threshold: float = DEFAULT_SQNR_THRESHOLD_DB,
    weight_sqnr_threshold: float = DEFAULT_WEIGHT_SQNR_THRESHOLD_DB,
    onset_jump_db: float = DEFAULT_ONSET_JUMP_DB,
    max_batches: int | None = None,
    model_name: str = "model",
    backend: str = "x86",
    match: MatchResult | None = None,
    data_name: str | None = None,
    trust_pickle: bool = False,
) -> CompareReport:
    """:func:`compare`, with the next step decided from the model output's SQNR
    (:func:`qlint.numeric.next_step.next_step`; ``data_name``: the DATA its commands name;
    ``trust_pickle``: the model files were trusted, so its commands trust them too).
    What ``qlint compare`` reports."""
    propagated, shadow = _check_modes(modes)
    # The paired runner watches parameters while the models run; this guard covers the rest
    # of the call (layer matching traces the models) and the process state.
    with preserved_state(float_model, quantized_model, watch_parameters=False):
        report, output_sqnr_db = _compare(
            float_model,
            quantized_model,
            data,
            propagated,
            shadow,
            sqnr_threshold,
            weight_sqnr_threshold,
            onset_jump_db,
            max_batches,
            model_name,
            backend,
            match,
        )
    step = next_step(output_sqnr_db, sqnr_threshold, report.findings, model_name, data_name, trust_pickle=trust_pickle)
    return CompareReport(**dict(report), next_step=step)


def _compare(
    float_model: nn.Module,
    quantized_model: nn.Module,
    data: Iterable,
    propagated: bool,
    shadow: bool,
    sqnr_threshold: float,
    weight_sqnr_threshold: float,
    onset_jump_db: float,
    max_batches: int | None,
    model_name: str,
    backend: str,
    match: MatchResult | None,
) -> tuple[Report, float | None]:
    """The report and the model output's SQNR (None when the outputs never paired up)."""
    started = time.perf_counter()
    match = match or match_layers(float_model, quantized_model, per_call=True)
    stats = {layer.name: LayerStats() for layer in match.layers}
    output_sqnr, output_stats = SqnrSums(), PairwiseErrorStats()
    unpaired_outputs: str | None = None
    output_tensors = 0
    batches = 0

    def on_propagated(layer, reference, quantized, scale):
        stats[layer.name].propagated.update(reference, quantized, scale)

    def on_shadow(layer, reference, quantized, scale):
        stats[layer.name].shadow.update(reference, quantized, scale)

    def on_input_grid(layer, float_input, actual, grid):
        stats[layer.name].input_grid.update(float_input, actual, grid)

    runner = PairedRunner(
        float_model,
        quantized_model,
        match,
        propagated=propagated,
        shadow=shadow,
        on_propagated=on_propagated,
        on_shadow=on_shadow,
        on_input_grid=on_input_grid,
    )
    with runner:
        for layer in match.layers:
            stats[layer.name].weight = weight_stats(layer, float_model, quantized_model)
            stats[layer.name].weight_off_grid = weight_off_grid(layer, float_model, quantized_model)
        for _, float_output, quant_output in runner.run(_finite_batches(data)):
            paired = _fold_outputs(output_sqnr, output_stats, float_output, quant_output)
            if isinstance(paired, str):
                unpaired_outputs = paired
            else:
                output_tensors = max(output_tensors, paired)
            batches += 1
            if max_batches is not None and batches >= max_batches:
                break
    elapsed = time.perf_counter() - started

    rows = build_rows(match, stats, runner.read_after_clamp)
    findings = diagnose(
        rows,
        sqnr_threshold=sqnr_threshold,
        weight_sqnr_threshold=weight_sqnr_threshold,
        onset_jump_db=onset_jump_db,
        unfused_norms=unfused_norms(match.float_graph),
    )
    notices = [Notice(message=note) for note in match.notes]
    if runner.read_after_clamp:
        notices.append(Notice(message=_after_clamp_note(match, runner.read_after_clamp)))
    notices.append(
        Notice(
            message=(
                f"compared {len(rows)} layers of a {match.counterpart.value} model over {batches} batches; "
                f"model output SQNR {_format_db(output_sqnr.sqnr_db())}, cosine {_format_float(output_stats.cosine())}"
                + (
                    f", both over all {output_tensors} floating-point tensors of the output"
                    if output_tensors > 1
                    else ""
                )
            )
        )
    )
    if unpaired_outputs is not None:
        notices.append(
            Notice(
                level=Severity.WARNING,
                message=f"the two models' outputs do not pair up ({unpaired_outputs}); batches where they do not are "
                "left out of the model output SQNR",
            )
        )
    if match.unmatched_float:
        notices.append(
            Notice(
                level=Severity.WARNING,
                message=(
                    "float layers without a quantized counterpart (not compared): " + ", ".join(match.unmatched_float)
                ),
            )
        )
    if match.unmatched_quantized:
        notices.append(
            Notice(
                level=Severity.WARNING,
                message=(
                    "quantized layers without a float counterpart (compared only through the model output): "
                    + ", ".join(match.unmatched_quantized)
                ),
            )
        )
    if batches == 0:  # a report of no numbers would read as clean
        raise EmptyCalibrationError("the data yielded no batches: there is nothing to compare")
    elsewhere = [f.target for f in findings if f.data.get("kind") in OTHER_MODEL_KINDS]
    if elsewhere:  # said once for the whole report: every layer after the first is affected
        notices.append(
            Notice(
                level=Severity.WARNING,
                message=f"QUANT was not quantized from this float model ({', '.join(elsewhere)}: see QL301/QL302): "
                f"from {elsewhere[0]} on, the numbers measure the difference between two float models as well as "
                "quantization; compare QUANT against the float model it was quantized from",
            )
        )
    report = Report(
        qlint_version=qlint_version(),
        torch_version=torch.__version__,
        model=model_name,
        backend=backend,
        frontend=match.counterpart.value,
        findings=findings,
        notices=notices,
        timings=[Timing(stage="numeric-compare", seconds=elapsed)],
        layers=rows,
    )
    return report, output_sqnr.sqnr_db()


def _finite_batches(data: Iterable) -> Iterator[Any]:
    """The batches of ``data``; one holding NaN or Inf is refused, since every SQNR would be
    measured against what the models make of it."""
    for number, batch in enumerate(data):
        if not floats_are_finite(batch):
            raise DataError(f"batch {number} of the data holds NaN or Inf values: there is no SQNR to measure on it")
        yield batch


def _fold_outputs(sums: SqnrSums, stats: PairwiseErrorStats, reference: Any, quantized: Any) -> int | str:
    """Fold one batch's model outputs in: every floating-point tensor, in order (verify's output
    SQNR, ``qlint.core.sqnr.SqnrSums``). The number of tensor pairs, or why the outputs do not pair
    up (nothing is folded in then)."""
    references, approximations = float_tensors(reference), float_tensors(quantized)
    if len(references) != len(approximations):
        return f"{len(references)} and {len(approximations)} floating-point tensors"
    for x, y in zip(references, approximations):
        if x.numel() != y.numel():
            return f"tensors of {x.numel()} and {y.numel()} elements"
    sums.add(references, approximations)
    for x, y in zip(references, approximations):
        stats.update(x, y)
    return len(references)


def _format_db(value: float | None) -> str:
    """An SQNR in the info line, as the tables show it: "exact" at the cap (no error), not 200 dB."""
    return "n/a" if value is None else describe_sqnr(value)


def _format_float(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"


def _after_clamp_note(match: MatchResult, names: set[str]) -> str:
    """Which layers were read after their consumer's clamp (qlint.measure.consumer_clamp), and why."""
    pairs = [
        (layer.name, layer.consumer_clamp.node)
        for layer in match.layers
        if layer.name in names and layer.consumer_clamp
    ]
    shown = ", ".join(f"{name} (then {clamp})" for name, clamp in pairs[:5])
    more = f" and {len(pairs) - 5} more" if len(pairs) > 5 else ""
    return (
        f"{len(pairs)} layers are compared after the clamp that alone consumes their output: {shown}{more}. "
        "Their int8 output grid lies inside that clamp's range, so values beyond it never reach the model "
        "in either model (torch's numeric suite compares them raw; see docs/numeric-suite.md)"
    )


def build_rows(
    match: MatchResult, stats: dict[str, LayerStats], read_after_clamp: set[str] | None = None
) -> list[CompareRow]:
    rows = []
    float_nodes = {node.name: node for node in match.float_graph.graph.nodes} if match.float_graph else {}
    for layer in match.layers:
        layer_stats = stats[layer.name]
        if layer_stats.propagated.empty and layer_stats.shadow.empty and layer_stats.weight.empty:
            continue  # e.g. an int-valued functional op (shape arithmetic): nothing numeric to say
        extra: dict[str, Any] = {
            "quantized_target": layer.quant_site.name,
            "quantized_class": layer.quant_class,
            "matched_by": layer.matched_by,
            "predecessors": list(layer.predecessors),
            "between": list(layer.between),
            "absorbed": list(layer.absorbed),
        }
        if layer.quant_exit is not None:  # pt2e: the dequantize of the op's output pair, where it is read
            extra["quantized_exit"] = layer.quant_exit
        if read_after_clamp and layer.name in read_after_clamp and layer.consumer_clamp is not None:
            extra["read_after_clamp"] = layer.consumer_clamp.node  # both sides compared after this clamp
        for label, accumulated in (
            ("propagated", layer_stats.propagated),
            ("shadow", layer_stats.shadow),
            ("weight", layer_stats.weight),
        ):
            if not accumulated.empty:
                extra[label] = accumulated.summary()
        # the row's cosine and error columns come from one comparison, which the row names
        error_stats = layer_stats.propagated if not layer_stats.propagated.empty else layer_stats.shadow
        error_mode = None if error_stats.empty else "propagated" if error_stats is layer_stats.propagated else "shadow"
        rows.append(
            CompareRow(
                name=layer.name,
                kind=layer.kind,
                weight_sqnr=layer_stats.weight.sqnr_db(),
                weight_off_grid=layer_stats.weight_off_grid,
                sqnr_propagated=layer_stats.propagated.sqnr_db(),
                sqnr_shadow=layer_stats.shadow.sqnr_db(),
                cosine=error_stats.cosine(),
                error_mode=error_mode,
                functional=layer.float_entry.kind == NODE_SITE,
                function=_function_of(layer, float_nodes),
                input_quantization=layer_stats.input_grid.summary(),
                module=layer.module,
                call=layer.float_entry.call,
                calls=layer.calls,
                extra=extra,
            )
        )
    return rows


def _function_of(layer: LayerMatch, float_nodes: dict[str, torch.fx.Node]) -> str | None:
    """The public path of the function a functional layer's float node calls (None for a module)."""
    node = float_nodes.get(layer.float_entry.name) if layer.float_entry.kind == NODE_SITE else None
    return function_path(node.target) if node is not None and node.op == "call_function" else None
