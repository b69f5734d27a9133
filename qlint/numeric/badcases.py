"""Worst-input search: the samples on which the quantized model strays most from the float one.

Per-layer averages hide inputs that break the quantized model (an outlier
image, a long sequence).  ``find_badcases`` scores every sample of a dataset
by a few output metrics and keeps the worst ``top`` per metric in bounded
memory (a heap per metric; only kept samples are copied).  ``save`` writes
them to ``badcases.pt`` and ``compare_badcases`` reruns the layer comparison
on them alone, which shows where the error starts for those inputs.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from qlint.core.batches import batch_size
from qlint.core.nested import first_float, map_tensors
from qlint.linter.findings import Report
from qlint.measure.capture import PairedRunner
from qlint.measure.matching import match_layers
from qlint.numeric.compare import compare

BADCASES_FORMAT = "qlint-badcases-v1"

# metric name -> (description, True when a larger value is worse)
METRICS = {
    "cosine": ("cosine similarity of the outputs (lower is worse)", False),
    "l1": ("mean absolute error of the outputs", True),
    "max_abs": ("largest absolute error of the outputs", True),
}


@dataclass
class BadCase:
    metric: str
    value: float
    index: int  # position of the sample in the dataset (batch order, then row)
    sample: Any  # the input, as a batch of one


@dataclass
class BadCaseSet:
    cases: dict[str, list[BadCase]] = field(default_factory=dict)
    samples_seen: int = 0

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
                metric: [{"value": case.value, "index": case.index, "sample": case.sample} for case in cases]
                for metric, cases in self.cases.items()
            },
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
            metric: [BadCase(metric, float(item["value"]), int(item["index"]), item["sample"]) for item in items]
            for metric, items in payload["cases"].items()
        }
        return cls(cases=cases, samples_seen=int(payload.get("samples_seen", 0)))


def split_samples(batch: Any, size: int) -> list[Any]:
    """One batch-of-one per sample. A tensor's batch dim is its first when that has ``size``
    entries, else its only dim that has (a recurrent state such as ``(layers, batch, hidden)``);
    members with no such dim (flags, shared tables) are shared by every sample."""

    def batch_dim(tensor: torch.Tensor) -> int | None:
        dims = [d for d in range(tensor.dim()) if tensor.shape[d] == size]
        if not dims:
            return None
        return 0 if dims[0] == 0 else dims[0] if len(dims) == 1 else None

    def take(row: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def one(tensor: torch.Tensor) -> torch.Tensor:
            dim = batch_dim(tensor)
            return tensor if dim is None else tensor.narrow(dim, row, 1).clone()

        return one

    return [map_tensors(batch, take(row)) for row in range(size)]


def per_sample_scores(reference: torch.Tensor, quantized: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each metric for each row (sample) of two outputs whose first dimension is the batch."""
    x = reference.double().reshape(reference.shape[0], -1)
    y = quantized.double().reshape(quantized.shape[0], -1)
    error = (x - y).abs()
    return {
        "cosine": torch.nn.functional.cosine_similarity(x, y, dim=1, eps=1e-12),
        "l1": error.mean(dim=1),
        "max_abs": error.max(dim=1).values,
    }


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

    Samples are scored on the first floating-point tensor of the output (a model's other
    outputs, such as a recurrent state, need not be batch-first), which must have the batch as
    its first dimension.  Memory holds at most ``top`` samples per metric, whatever the size
    of the dataset.
    """
    unknown = set(metrics) - set(METRICS)
    if unknown:
        raise ValueError(f"unknown badcase metrics {sorted(unknown)}; choose from {sorted(METRICS)}")
    # heap items: (badness, tie-breaker, value, index, sample); the root is the mildest kept case
    heaps: dict[str, list] = {metric: [] for metric in metrics}
    seen = 0
    match = match_layers(float_model, quantized_model)
    runner = PairedRunner(float_model, quantized_model, match, propagated=False, shadow=False, capture=False)
    with runner:
        for batch, float_output, quant_output in runner.run(itertools.islice(data, max_batches)):
            reference, quantized = first_float(float_output), first_float(quant_output)
            size = batch_size(batch)
            if reference is None or quantized is None or reference.shape[0] != size:
                raise ValueError("badcase search needs outputs whose first dimension is the batch")
            scores = per_sample_scores(reference, quantized)
            samples: list[Any] | None = None
            for metric in metrics:
                larger_is_worse = METRICS[metric][1]
                for row, value in enumerate(scores[metric].tolist()):
                    badness = value if larger_is_worse else -value
                    heap = heaps[metric]
                    if len(heap) >= top and badness <= heap[0][0]:
                        continue
                    if samples is None:
                        samples = split_samples(batch, size)
                    item = (badness, seen + row, value, seen + row, samples[row])
                    if len(heap) < top:
                        heapq.heappush(heap, item)
                    else:
                        heapq.heapreplace(heap, item)
            seen += size
    cases = {
        metric: [
            BadCase(metric, value, index, sample)
            for _, _, value, index, sample in sorted(heap, key=lambda item: item[0], reverse=True)
        ]
        for metric, heap in heaps.items()
    }
    return BadCaseSet(cases=cases, samples_seen=seen)


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
