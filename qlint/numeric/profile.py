"""Per-op statistics of a model's inputs, outputs and weights over a dataset.

One typed row per (layer, role) with min, max, mean, variance, shape, dtype
and, for quantized tensors, scale and zero point: the table to read when a
layer's SQNR is low and one wants to see its ranges (a scale far larger than
the typical magnitude, a zero-point at the edge, an input with huge outliers).
Statistics stream (running sums in float64), so memory is constant in the
number of batches.
"""

from __future__ import annotations

import csv
import itertools
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any, cast

import torch
from pydantic import BaseModel, ConfigDict
from rich.table import Table
from torch import nn

from qlint.core.batches import call_model
from qlint.core.nested import first_tensor
from qlint.core.ops import layer_kind
from qlint.core.preserve import preserved_state
from qlint.measure.matching import float_layer_modules, quantized_layer_modules
from qlint.measure.metrics import finite_or_none

_PER_TENSOR = (torch.per_tensor_affine, torch.per_tensor_symmetric)


class ProfileRow(BaseModel):
    model_config = ConfigDict(frozen=True)

    layer: str
    kind: str
    role: str  # input | output | weight
    shape: list[int]
    dtype: str
    count: int
    min: float | None
    max: float | None
    mean: float | None
    var: float | None
    scale: float | None = None  # per-tensor scale, or the mean of per-channel scales
    zero_point: int | None = None
    qscheme: str | None = None


class _RunningStats:
    def __init__(self) -> None:
        self.count = 0
        self.total = 0.0
        self.total_squares = 0.0
        self.low = math.inf
        self.high = -math.inf
        self.shape: list[int] = []
        self.dtype = ""
        self.scale: float | None = None
        self.zero_point: int | None = None
        self.qscheme: str | None = None

    def update(self, tensor: torch.Tensor) -> None:
        if not self.dtype:
            self.shape, self.dtype = list(tensor.shape), str(tensor.dtype).replace("torch.", "")
        if tensor.is_quantized:
            self._note_qparams(tensor)
            tensor = tensor.dequantize()
        if not tensor.is_floating_point() and tensor.dtype not in (torch.int32, torch.int64, torch.int8, torch.uint8):
            return
        values = tensor.detach().reshape(-1).double()
        values = values[torch.isfinite(values)]
        if values.numel() == 0:
            return
        self.count += values.numel()
        self.total += float(values.sum())
        self.total_squares += float(values.pow(2).sum())
        self.low = min(self.low, float(values.min()))
        self.high = max(self.high, float(values.max()))

    def _note_qparams(self, tensor: torch.Tensor) -> None:
        scheme = tensor.qscheme()
        self.qscheme = str(scheme).replace("torch.", "")
        if scheme in _PER_TENSOR:
            self.scale, self.zero_point = float(tensor.q_scale()), int(tensor.q_zero_point())
        else:
            self.scale = float(tensor.q_per_channel_scales().double().mean())
            self.zero_point = None

    def row(self, layer: str, kind: str, role: str) -> ProfileRow:
        empty = self.count == 0
        mean = None if empty else self.total / self.count
        var = None if mean is None else max(0.0, self.total_squares / self.count - mean * mean)
        return ProfileRow(
            layer=layer,
            kind=kind,
            role=role,
            shape=self.shape,
            dtype=self.dtype or "unknown",
            count=self.count,
            min=None if empty else finite_or_none(self.low),
            max=None if empty else finite_or_none(self.high),
            mean=finite_or_none(mean),
            var=finite_or_none(var),
            scale=self.scale,
            zero_point=self.zero_point,
            qscheme=self.qscheme,
        )


def _weights(module: nn.Module) -> list[torch.Tensor]:
    weight = getattr(module, "weight", None)
    if callable(weight) and not isinstance(weight, torch.Tensor):
        return [weight()]  # packed quantized weights
    if hasattr(module, "get_weight"):
        return list(cast(Any, module).get_weight().values())
    if isinstance(weight, torch.Tensor):
        return [weight.detach()]
    if (
        isinstance(module, nn.Sequential)
        and len(module)
        and isinstance(getattr(module[0], "weight", None), torch.Tensor)
    ):
        return [cast(torch.Tensor, module[0].weight).detach()]  # float fused modules (ConvReLU2d) keep the conv first
    return []


def layer_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The layers profiled: top-level quantized/fused modules if any, else the float leaves."""
    quantized = quantized_layer_modules(model)
    return quantized if quantized else float_layer_modules(model)


def profile_model(model: nn.Module, data: Iterable, *, max_batches: int | None = None) -> list[ProfileRow]:
    """Input/output/weight statistics of every layer of ``model`` over ``data``."""
    layers = layer_modules(model)
    stats: dict[tuple[str, str], _RunningStats] = {}

    def statistics(name: str, role: str) -> _RunningStats:
        return stats.setdefault((name, role), _RunningStats())

    with preserved_state(model) as guard, torch.no_grad():
        model.eval()  # observers and BN statistics: the guard puts the user's values and modes back
        for name, module in layers.items():
            for weight in _weights(module):
                statistics(name, "weight").update(weight)

            def hook(module, args, output, name=name):
                first_input = first_tensor(args)
                if first_input is not None:
                    statistics(name, "input").update(first_input)
                first_output = first_tensor(output)
                if first_output is not None:
                    statistics(name, "output").update(first_output)

            guard.add_handle(module.register_forward_hook(hook))
        for batch in itertools.islice(data, max_batches):
            call_model(model, batch)
    order = {name: index for index, name in enumerate(layers)}
    roles = {"input": 0, "weight": 1, "output": 2}
    return [
        stats[key].row(key[0], layer_kind(layers[key[0]]) or type(layers[key[0]]).__name__, key[1])
        for key in sorted(stats, key=lambda key: (order[key[0]], roles[key[1]]))
    ]


def _number(value: float | None) -> str:
    return "" if value is None else f"{value:.4g}"


def profile_table(rows: list[ProfileRow], title: str = "Per-op statistics") -> Table:
    table = Table(title=title)
    for column in ("layer", "kind", "role", "shape", "dtype", "min", "max", "mean", "var", "scale", "zp"):
        table.add_column(column, justify="right" if column in ("min", "max", "mean", "var", "scale", "zp") else "left")
    for row in rows:
        table.add_row(
            row.layer,
            row.kind,
            row.role,
            "x".join(str(size) for size in row.shape),
            row.dtype,
            _number(row.min),
            _number(row.max),
            _number(row.mean),
            _number(row.var),
            _number(row.scale),
            "" if row.zero_point is None else str(row.zero_point),
        )
    return table


def write_profile_csv(rows: list[ProfileRow], path: str | Path) -> Path:
    path = Path(path)
    fields = list(ProfileRow.model_fields)
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        for row in rows:
            record = row.model_dump()
            record["shape"] = "x".join(str(size) for size in row.shape)
            writer.writerow(record)
    return path
