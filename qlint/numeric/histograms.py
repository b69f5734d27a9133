"""Float vs quantized activation histograms of a few layers, for compare's HTML report.

The layers are those adding the most error themselves (:func:`worst_layers`); one more paired
pass streams their outputs into fixed-size counters whose range comes from the min/max compare
recorded, so nothing of an activation is kept.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from qlint.core.nested import first_float
from qlint.core.preserve import preserved_state
from qlint.linter.findings import CompareRow, Report
from qlint.measure.capture import PairedRunner
from qlint.measure.matching import match_layers
from qlint.numeric.diagnose import inherited_sqnr, local_sqnr


@dataclass
class LayerHistogram:
    name: str
    low: float
    high: float
    float_counts: list[int]
    quantized_counts: list[int]


def worst_layers(report: Report, count: int) -> list[str]:
    """The ``count`` layers adding the most error themselves (lowest local SQNR, see diagnose)."""
    rows = report.compare_rows()
    propagated = {row.name: row.sqnr_propagated for row in rows if row.sqnr_propagated is not None}

    def local(row: CompareRow) -> float:
        value, _ = local_sqnr(row, inherited_sqnr(row, propagated)[0])
        return float("inf") if value is None else value

    return [row.name for row in sorted(rows, key=local)[:count]]


def activation_histograms(
    float_model: nn.Module,
    quantized_model: nn.Module,
    data: Iterable,
    report: Report,
    layers: Sequence[str] | None = None,
    *,
    bins: int = 48,
    max_batches: int | None = None,
) -> dict[str, LayerHistogram]:
    """Float vs quantized output histograms (propagated) of a few layers, in one more pass.

    The bin range comes from the min/max that compare recorded, so the pass
    streams with fixed-size counters.
    """
    with preserved_state(float_model, quantized_model, watch_parameters=False):
        return _activation_histograms(float_model, quantized_model, data, report, layers, bins, max_batches)


def _activation_histograms(
    float_model: nn.Module,
    quantized_model: nn.Module,
    data: Iterable,
    report: Report,
    layers: Sequence[str] | None,
    bins: int,
    max_batches: int | None,
) -> dict[str, LayerHistogram]:
    names = list(layers) if layers is not None else worst_layers(report, 4)
    rows = {row.name: row for row in report.compare_rows()}
    match = match_layers(float_model, quantized_model, per_call=True)  # the rows' layers
    match.layers = [layer for layer in match.layers if layer.name in names and layer.name in rows]
    histograms: dict[str, LayerHistogram] = {}
    for layer in match.layers:
        summary = rows[layer.name].extra.get("propagated") or {}
        keys = ("float_min", "float_max", "quantized_min", "quantized_max")
        values = [summary[key] for key in keys if summary.get(key) is not None]
        if len(values) < len(keys):
            continue
        low, high = min(values), max(values)
        if high <= low:
            high = low + 1.0
        histograms[layer.name] = LayerHistogram(layer.name, low, high, [0] * bins, [0] * bins)

    def on_propagated(layer, reference, quantized, scale):
        histogram = histograms.get(layer.name)
        if histogram is None:
            return
        for counts, tensor in (
            (histogram.float_counts, first_float(reference)),
            (histogram.quantized_counts, quantized),
        ):
            found = torch.histc(tensor.float().reshape(-1), bins=bins, min=histogram.low, max=histogram.high)
            for index, value in enumerate(found.tolist()):
                counts[index] += int(value)

    runner = PairedRunner(float_model, quantized_model, match, shadow=False, on_propagated=on_propagated)
    with runner:
        for batch_index, _ in enumerate(runner.run(data)):
            if max_batches is not None and batch_index + 1 >= max_batches:
                break
    return histograms
