"""Worst-input search: the samples on which the quantized model strays most from the float one.

Per-layer averages hide inputs that break the quantized model (an outlier
image, a long sequence).  ``find_badcases`` scores every sample of a dataset
by a few output metrics and keeps the worst ``top`` per metric in bounded
memory (a heap per metric; only kept samples are copied).  Every floating-point
output is scored (silero_vad's speech probability and its state), each metric per
output, and a sample scores its worst output's value: pooled by power, a large state
would hide a broken probability.  ``save`` writes them to ``badcases.pt`` and
``compare_badcases`` reruns the layer comparison on them alone, which shows where
the error starts for those inputs.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from qlint.core.batches import batch_size
from qlint.core.nested import as_float, map_tensors
from qlint.core.sqnr import sqnr_db_from_powers
from qlint.linter.findings import Report
from qlint.measure.capture import PairedRunner
from qlint.measure.matching import match_layers
from qlint.numeric.badcase_summary import METRICS, BadCaseSummary, WorstInput, WorstInputsOfMetric
from qlint.numeric.compare import compare

BADCASES_FORMAT = "qlint-badcases-v1"


@dataclass
class BadCase:
    metric: str
    value: float
    index: int  # position of the sample in the dataset (batch order, then row)
    sample: Any  # the input, as a batch of one
    output: str | None = None  # the output that scored worst on this sample (output[1])


@dataclass
class BadCaseSet:
    cases: dict[str, list[BadCase]] = field(default_factory=dict)
    samples_seen: int = 0
    outputs: list[str] = field(default_factory=list)  # the outputs every sample was scored on

    def worst(self, metric: str) -> list[BadCase]:
        return list(self.cases.get(metric, []))

    def inputs(self, metric: str | None = None) -> list[Any]:
        """Distinct samples (each a batch of one), over one metric or all of them."""
        chosen = [metric] if metric else list(self.cases)
        seen: dict[int, Any] = {}
        for name in chosen:
            for case in self.cases.get(name, []):
                seen.setdefault(case.index, case.sample)
        return list(seen.values())

    def save(self, path: str | Path = "badcases.pt") -> Path:
        path = Path(path)
        payload = {
            "format": BADCASES_FORMAT,
            "samples_seen": self.samples_seen,
            "cases": {
                metric: [
                    {"value": case.value, "index": case.index, "sample": case.sample, "output": case.output}
                    for case in cases
                ]
                for metric, cases in self.cases.items()
            },
            "outputs": list(self.outputs),
        }
        torch.save(payload, path)
        return path

    @classmethod
    def load(cls, path: str | Path) -> BadCaseSet:
        # Our own file of plain tensors and lists: the safe weights_only loader reads it.
        payload = torch.load(Path(path), weights_only=True)
        if not isinstance(payload, dict) or payload.get("format") != BADCASES_FORMAT:
            raise ValueError(f"{path} is not a qlint badcases file")
        cases = {
            metric: [
                BadCase(metric, float(item["value"]), int(item["index"]), item["sample"], item.get("output"))
                for item in items
            ]
            for metric, items in payload["cases"].items()
        }
        outputs = [str(name) for name in payload.get("outputs", [])]
        return cls(cases=cases, samples_seen=int(payload.get("samples_seen", 0)), outputs=outputs)

    def summary(self, report: Report, saved_to: str | Path | None = None) -> BadCaseSummary:
        """What the reports show: the worst samples per metric and ``report``, the comparison on them."""
        worst = [
            WorstInputsOfMetric(
                metric=metric,
                description=description,
                cases=[
                    WorstInput(sample=case.index, value=case.value, output=case.output) for case in self.worst(metric)
                ],
            )
            for metric, (description, _) in METRICS.items()
            if metric in self.cases
        ]
        return BadCaseSummary(
            samples_seen=self.samples_seen,
            outputs=list(self.outputs),
            worst=worst,
            saved_to=None if saved_to is None else str(saved_to),
            report=report,
        )


def _batch_dim(tensor: torch.Tensor, size: int) -> int | None:
    """A tensor's batch dim: its first when that has ``size`` entries, else its only dim that has
    (a recurrent state such as ``(layers, batch, hidden)``); None when there is no such dim."""
    dims = [d for d in range(tensor.dim()) if tensor.shape[d] == size]
    if not dims:
        return None
    return 0 if dims[0] == 0 else dims[0] if len(dims) == 1 else None


def split_samples(batch: Any, size: int) -> list[Any]:
    """One batch-of-one per sample, each tensor split on its batch dim (``_batch_dim``); members
    with no such dim (flags, shared tables) are shared by every sample."""

    def take(row: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def one(tensor: torch.Tensor) -> torch.Tensor:
            dim = _batch_dim(tensor, size)
            return tensor if dim is None else tensor.narrow(dim, row, 1).clone()

        return one

    return [map_tensors(batch, take(row)) for row in range(size)]


def per_sample_scores(reference: torch.Tensor, quantized: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each metric for each row (sample) of two outputs whose first dimension is the batch."""
    x = reference.double().reshape(reference.shape[0], -1)
    y = quantized.double().reshape(quantized.shape[0], -1)
    error = (x - y).abs()
    signal, noise = (x * x).sum(dim=1).tolist(), (error * error).sum(dim=1).tolist()
    sqnr = [sqnr_db_from_powers(s, n) for s, n in zip(signal, noise)]
    return {
        "sqnr": torch.tensor([float("nan") if value is None else value for value in sqnr], dtype=torch.float64),
        "cosine": torch.nn.functional.cosine_similarity(x, y, dim=1, eps=1e-12),
        "l1": error.mean(dim=1),
        "max_abs": error.max(dim=1).values,
    }


def _named_floats(value: Any, name: str = "output") -> list[tuple[str, torch.Tensor]]:
    """The floating-point tensors of a model output with their place in it (``output[1]``,
    ``output['prob']``), in the order of ``qlint.core.nested``: depth first, dict values in order."""
    if isinstance(value, torch.Tensor):
        tensor = as_float(value)
        return [] if tensor is None else [(name, tensor)]
    if isinstance(value, (list, tuple)):
        return [pair for index, item in enumerate(value) for pair in _named_floats(item, f"{name}[{index}]")]
    if isinstance(value, dict):
        return [pair for key, item in value.items() for pair in _named_floats(item, f"{name}[{key!r}]")]
    return []


def output_scores(float_output: Any, quant_output: Any, size: int) -> tuple[list[str], dict[str, torch.Tensor]]:
    """Every metric per sample on each floating-point output that has a batch dim, stacked
    (outputs, samples), with the outputs' names. Outputs without a batch dim (a table shared by
    every sample) cannot be told apart per sample and are left out."""
    references, approximations = _named_floats(float_output), _named_floats(quant_output)
    if len(references) != len(approximations):
        raise ValueError(
            f"the models' outputs do not pair up ({len(references)} and {len(approximations)} floating-point "
            "tensors): the worst inputs cannot be scored"
        )
    names: list[str] = []
    scores: dict[str, list[torch.Tensor]] = {}
    for (name, x), (_, y) in zip(references, approximations):
        dim = _batch_dim(x, size)
        if dim is None or x.numel() != y.numel():
            continue
        for metric, values in per_sample_scores(x.movedim(dim, 0), y.reshape(x.shape).movedim(dim, 0)).items():
            scores.setdefault(metric, []).append(values)
        names.append(name)
    if not names:
        raise ValueError("badcase search needs an output with the batch as one of its dimensions")
    return names, {metric: torch.stack(values) for metric, values in scores.items()}


def find_badcases(
    float_model: nn.Module,
    quantized_model: nn.Module,
    data: Iterable,
    *,
    top: int = 10,
    metrics: Sequence[str] = tuple(METRICS),
    max_batches: int | None = None,
) -> BadCaseSet:
    """The ``top`` worst samples of ``data`` for each metric in ``metrics``.

    Every floating-point output with a batch dim (its first, or its only dim of the batch's
    size, as a recurrent state's) is scored; a sample's value for a metric is that of its worst
    output, which its case names (``output[1]``). Memory holds at most ``top`` samples per
    metric, whatever the size of the dataset.
    """
    worse_when_larger: dict[str, bool] = {name: larger for name, (_, larger) in METRICS.items()}
    unknown = set(metrics) - set(METRICS)
    if unknown:
        raise ValueError(f"unknown badcase metrics {sorted(unknown)}; choose from {sorted(METRICS)}")
    # heap items: (badness, tie-breaker, value, index, sample); the root is the mildest kept case
    heaps: dict[str, list] = {metric: [] for metric in metrics}
    seen = 0
    outputs: list[str] = []
    match = match_layers(float_model, quantized_model)
    runner = PairedRunner(float_model, quantized_model, match, propagated=False, shadow=False, capture=False)
    with runner:
        for batch, float_output, quant_output in runner.run(itertools.islice(data, max_batches)):
            size = batch_size(batch)
            names, scores = output_scores(float_output, quant_output, size)
            outputs = outputs or names
            samples: list[Any] | None = None
            for metric in metrics:
                larger_is_worse = worse_when_larger[metric]
                # NaN (an undefined SQNR) never ranks: the worst output is the worst defined one
                per_output = scores[metric].nan_to_num(nan=-math.inf if larger_is_worse else math.inf)
                values, worst_output = per_output.max(dim=0) if larger_is_worse else per_output.min(dim=0)
                for row, (value, output) in enumerate(zip(values.tolist(), worst_output.tolist())):
                    if not math.isfinite(value):
                        continue
                    badness = value if larger_is_worse else -value
                    heap = heaps[metric]
                    if len(heap) >= top and badness <= heap[0][0]:
                        continue
                    if samples is None:
                        samples = split_samples(batch, size)
                    item = (badness, seen + row, value, seen + row, samples[row], names[output])
                    if len(heap) < top:
                        heapq.heappush(heap, item)
                    else:
                        heapq.heapreplace(heap, item)
            seen += size
    cases = {
        metric: [
            BadCase(metric, value, index, sample, output)
            for _, _, value, index, sample, output in sorted(heap, key=lambda item: item[0], reverse=True)
        ]
        for metric, heap in heaps.items()
    }
    return BadCaseSet(cases=cases, samples_seen=seen, outputs=outputs)


def compare_badcases(
    float_model: nn.Module,
    quantized_model: nn.Module,
    badcases: BadCaseSet | str | Path,
    *,
    metric: str | None = None,
    **compare_options: Any,
) -> Report:
    """Rerun ``compare`` on the saved worst inputs (one metric's, or all distinct ones)."""
    if not isinstance(badcases, BadCaseSet):
        badcases = BadCaseSet.load(badcases)
    inputs = badcases.inputs(metric)
    if not inputs:
        raise ValueError("the badcase set holds no samples")
    compare_options.setdefault("model_name", "badcases")
    return compare(float_model, quantized_model, inputs, **compare_options)
