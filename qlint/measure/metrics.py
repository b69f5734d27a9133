"""Streaming pairwise error metrics between a float tensor and its quantized counterpart.

Every metric here is a function of a handful of running sums, so a stream of
batches can be folded in with constant memory: nothing of a batch is kept once
``update`` returns.  The sums are accumulated in float64 so that a long stream
does not lose the small error term against the large signal term.

SQNR is the definition of :mod:`qlint.core.sqnr` (total signal power over total noise
power), computed here from the same running sums as the other metrics.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from qlint.core.nested import first_tensor
from qlint.core.sqnr import SQNR_CAP_DB, sqnr_db_from_powers
from qlint.core.sqnr import sqnr_db as pair_sqnr_db

# Uniform rounding to a grid of step s leaves an error with standard deviation
# s/sqrt(12); a layer whose RMSE/scale is near this number is as good as the
# grid allows, and values far above it point at clipping or mismatched qparams.
UNIFORM_ROUNDING_RMSE_OVER_SCALE = 1.0 / math.sqrt(12.0)


def quantization_scale(value: Any) -> float | None:
    """The per-tensor scale of the first tensor in ``value`` when it is quantized, else None."""
    tensor = first_tensor(value)
    if tensor is not None and tensor.is_quantized:
        if tensor.qscheme() in (torch.per_tensor_affine, torch.per_tensor_symmetric):
            return float(tensor.q_scale())
    return None


@dataclass
class PairwiseErrorStats:
    """Running sums for one (float, quantized) stream of tensors.

    Cosine similarity is the cosine between the two streams seen as single long
    vectors, which is what a per-batch cosine converges to for a stationary
    stream and is exact to combine across batches.
    """

    count: int = 0
    signal_power: float = 0.0  # sum x^2
    quantized_power: float = 0.0  # sum y^2
    cross_power: float = 0.0  # sum x*y
    noise_power: float = 0.0  # sum (x-y)^2
    abs_error_sum: float = 0.0  # sum |x-y|
    max_abs_error: float = 0.0
    float_min: float = math.inf
    float_max: float = -math.inf
    quantized_min: float = math.inf
    quantized_max: float = -math.inf
    scale_sum: float = 0.0
    scale_count: int = 0
    nonfinite_values: int = 0

    def update(self, reference: torch.Tensor, quantized: torch.Tensor, scale: float | None = None) -> None:
        """Fold one pair in.  ``scale`` is the quantized tensor's step, when known."""
        if reference.is_quantized:
            reference = reference.dequantize()
        if quantized.is_quantized:
            if scale is None:
                scale = quantization_scale(quantized)
            quantized = quantized.dequantize()
        if reference.numel() != quantized.numel():
            raise ValueError(f"cannot compare tensors of {reference.numel()} and {quantized.numel()} elements")
        x = reference.detach().reshape(-1).float()
        y = quantized.detach().reshape(-1).float()
        if self._fold(x, y, scale) is None:
            # Rare path: drop NaN/Inf pairs (counted) and fold the rest.
            finite = torch.isfinite(x) & torch.isfinite(y)
            self.nonfinite_values += int((~finite).sum())
            self._fold(x[finite], y[finite], scale)

    def _fold(self, x: torch.Tensor, y: torch.Tensor, scale: float | None) -> bool | None:
        """Add one pair's sums; None (and nothing added) when a sum is not finite."""
        if x.numel() == 0:
            return True
        error = x - y
        # float32 products, float64 accumulation: exact enough for 0.01 dB and no float64 copies.
        signal = float((x * x).sum(dtype=torch.float64))
        quantized_power = float((y * y).sum(dtype=torch.float64))
        cross = float((x * y).sum(dtype=torch.float64))
        noise = float((error * error).sum(dtype=torch.float64))
        if not all(math.isfinite(value) for value in (signal, quantized_power, cross, noise)):
            return None
        abs_error = error.abs()
        x_min, x_max = torch.aminmax(x)
        y_min, y_max = torch.aminmax(y)
        self.count += x.numel()
        self.signal_power += signal
        self.quantized_power += quantized_power
        self.cross_power += cross
        self.noise_power += noise
        self.abs_error_sum += float(abs_error.sum(dtype=torch.float64))
        self.max_abs_error = max(self.max_abs_error, float(abs_error.max()))
        self.float_min = min(self.float_min, float(x_min))
        self.float_max = max(self.float_max, float(x_max))
        self.quantized_min = min(self.quantized_min, float(y_min))
        self.quantized_max = max(self.quantized_max, float(y_max))
        if scale is not None and scale > 0:
            self.scale_sum += float(scale)
            self.scale_count += 1
        return True

    # -- derived metrics -------------------------------------------------
    @property
    def empty(self) -> bool:
        return self.count == 0

    def sqnr_db(self) -> float | None:
        if self.empty:
            return None
        return sqnr_db_from_powers(self.signal_power, self.noise_power)

    def cosine(self) -> float | None:
        if self.empty:
            return None
        norms = math.sqrt(self.signal_power) * math.sqrt(self.quantized_power)
        if norms == 0.0:
            # Two all-zero streams agree exactly; one all-zero stream does not.
            return 1.0 if self.noise_power == 0.0 else 0.0
        return max(-1.0, min(1.0, self.cross_power / norms))

    def normalized_l2(self) -> float | None:
        """||x - y|| / ||x|| over the stream (torch ns's normalized L2 error)."""
        if self.empty:
            return None
        if self.signal_power == 0.0:
            return 0.0 if self.noise_power == 0.0 else None
        return math.sqrt(self.noise_power / self.signal_power)

    def rmse(self) -> float | None:
        if self.empty:
            return None
        return math.sqrt(self.noise_power / self.count)

    def mean_abs_error(self) -> float | None:
        if self.empty:
            return None
        return self.abs_error_sum / self.count

    def mean_scale(self) -> float | None:
        if self.scale_count == 0:
            return None
        return self.scale_sum / self.scale_count

    def rmse_over_scale(self) -> float | None:
        """RMSE in units of the quantization step; ~0.289 is pure rounding error."""
        rmse, scale = self.rmse(), self.mean_scale()
        if rmse is None or scale is None:
            return None
        return rmse / scale

    def summary(self) -> dict[str, Any]:
        """JSON-able metrics (finite floats or None) for a report row."""
        values = {
            "sqnr_db": self.sqnr_db(),
            "cosine": self.cosine(),
            "normalized_l2": self.normalized_l2(),
            "max_abs_error": None if self.empty else self.max_abs_error,
            "mean_abs_error": self.mean_abs_error(),
            "rmse": self.rmse(),
            "scale": self.mean_scale(),
            "rmse_over_scale": self.rmse_over_scale(),
            "float_min": None if self.empty else self.float_min,
            "float_max": None if self.empty else self.float_max,
            "quantized_min": None if self.empty else self.quantized_min,
            "quantized_max": None if self.empty else self.quantized_max,
            "elements": self.count,
        }
        if self.nonfinite_values:
            values["nonfinite_values"] = self.nonfinite_values
        return {key: finite_or_none(value) for key, value in values.items()}


def finite_or_none(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def sqnr_db(reference: torch.Tensor, quantized: torch.Tensor) -> float:
    """One-shot SQNR of a single pair (the definition of :mod:`qlint.core.sqnr`)."""
    value = pair_sqnr_db(reference, quantized)
    return SQNR_CAP_DB if value is None else value
