"""Quantizers with frozen qparams, and the input qparams a quantized layer saw.

Prepared models hold observers (PTQ) or fake-quant modules (QAT).  To show the
error convert would introduce without calibrating them on the comparison data,
``PairedRunner`` replaces each by a fake-quant with the qparams it holds now.
``InputSpec`` records how a converted layer's input was quantized, so that a
float tensor can be put on the same grid (the isolated run of ``PairedRunner``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn
from torch.ao.quantization import FakeQuantizeBase, ObserverBase

PER_TENSOR_SCHEMES = (torch.per_tensor_affine, torch.per_tensor_symmetric)

# The integer range of each quantized dtype (what a quantized tensor of it can hold).
DTYPE_RANGES = {torch.quint8: (0, 255), torch.qint8: (-128, 127), torch.qint32: (-(2**31), 2**31 - 1)}


@dataclass(frozen=True)
class QuantGrid:
    """A per-tensor quantization grid: ``scale * (q - zero_point)`` for q in [quant_min, quant_max]."""

    scale: float
    zero_point: int
    quant_min: int
    quant_max: int

    @property
    def low(self) -> float:
        return (self.quant_min - self.zero_point) * self.scale

    @property
    def high(self) -> float:
        return (self.quant_max - self.zero_point) * self.scale

    def fake_quantize(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` put on this grid (rounded, and clipped to its range), as float32."""
        return torch.fake_quantize_per_tensor_affine(
            value.detach().float(), self.scale, self.zero_point, self.quant_min, self.quant_max
        )


def grid_of(value: Any) -> QuantGrid | None:
    """The grid of a per-tensor quantized tensor (its dtype's whole integer range); else None."""
    if not (isinstance(value, torch.Tensor) and value.is_quantized and value.qscheme() in PER_TENSOR_SCHEMES):
        return None
    bounds = DTYPE_RANGES.get(value.dtype)
    if bounds is None:
        return None
    return QuantGrid(float(value.q_scale()), int(value.q_zero_point()), *bounds)


@dataclass
class FrozenQuantizer:
    """Fake-quantization with fixed qparams; ``scale`` is the per-tensor step (None per channel)
    and ``grid`` the per-tensor grid (None per channel)."""

    function: Callable[[torch.Tensor], torch.Tensor]
    scale: float | None
    grid: QuantGrid | None = None

    def __call__(self, value: torch.Tensor) -> torch.Tensor:
        return self.function(value)


def frozen_quantizer(module: nn.Module) -> FrozenQuantizer | None:
    """Fake-quantize with the qparams ``module`` holds now (observer or fake-quant).

    PTQ observers only watch values; freezing them into a fake-quant shows the
    error convert would introduce.  Fake-quant modules are frozen too, so that
    their scales do not drift with the comparison data.  None: leave as is.
    """
    if isinstance(module, FakeQuantizeBase):
        if not bool(module.fake_quant_enabled.reshape(-1)[0]):
            return None
        # Plain attributes of fake-quant/observer modules: nn.Module's stubs type them Tensor | Module.
        scale = cast(torch.Tensor, module.scale).detach().clone()
        zero_point = cast(torch.Tensor, module.zero_point).detach().clone()
    elif isinstance(module, ObserverBase) and hasattr(module, "quant_min") and hasattr(module, "calculate_qparams"):
        if getattr(module, "dtype", None) not in (torch.quint8, torch.qint8, torch.qint32):
            return None
        min_val = getattr(module, "min_val", None)
        if isinstance(min_val, torch.Tensor) and (min_val.numel() == 0 or not bool(torch.isfinite(min_val).all())):
            return None  # never calibrated: there are no qparams to freeze
        scale, zero_point = module.calculate_qparams()
    else:
        return None
    quant_min, quant_max = int(cast(int, module.quant_min)), int(cast(int, module.quant_max))
    if getattr(module, "qscheme", torch.per_tensor_affine) in PER_TENSOR_SCHEMES or scale.numel() == 1:
        scale_value, zero_value = float(scale.reshape(-1)[0]), int(zero_point.reshape(-1)[0])
        return FrozenQuantizer(
            lambda x: torch.fake_quantize_per_tensor_affine(x, scale_value, zero_value, quant_min, quant_max),
            scale_value,
            QuantGrid(scale_value, zero_value, quant_min, quant_max),
        )
    axis = int(cast(int, module.ch_axis))
    return FrozenQuantizer(
        lambda x: torch.fake_quantize_per_channel_affine(
            x, scale.float(), zero_point.to(torch.int32), axis, quant_min, quant_max
        ),
        None,
    )


@dataclass
class InputSpec:
    """How a quantized layer's input was quantized in the propagated run."""

    scale: float
    zero_point: int
    dtype: torch.dtype


def input_spec(value: Any) -> Any:
    """InputSpec for each per-tensor quantized tensor in ``value`` (nested like it), else None."""
    if isinstance(value, torch.Tensor) and value.is_quantized and value.qscheme() in PER_TENSOR_SCHEMES:
        return InputSpec(float(value.q_scale()), int(value.q_zero_point()), value.dtype)
    if isinstance(value, (tuple, list)):
        return type(value)(input_spec(item) for item in value)
    return None


def apply_input_spec(value: Any, spec: Any) -> Any:
    """Quantize the tensors of ``value`` as ``spec`` says; what it says nothing about stays as it is."""
    if isinstance(spec, InputSpec) and isinstance(value, torch.Tensor):
        return torch.quantize_per_tensor(value.detach(), spec.scale, spec.zero_point, spec.dtype)
    if isinstance(spec, (tuple, list)) and isinstance(value, (tuple, list)):
        return type(value)(apply_input_spec(item, item_spec) for item, item_spec in zip(value, spec))
    return value
