"""The [100-p, p] percentile band of a tensor: the range a clipping observer keeps."""

from __future__ import annotations

from typing import Any

import torch

# torch.quantile refuses inputs above 2**24 values; a larger tensor is strided down to this
MAX_BAND_SAMPLES = 1 << 20


def percentile_band(value: torch.Tensor, percentile: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(lower, upper) percentile of every value of ``value``, in its floating dtype (float32 for
    other dtypes). ``percentile`` in (50, 100]: the band holds ``2 * percentile - 100`` % of the values."""
    if not 50.0 < percentile <= 100.0:
        raise ValueError(f"percentile must be in (50, 100], got {percentile}")
    dtype = value.dtype if value.is_floating_point() else torch.float32
    flat = value.detach().flatten()
    if flat.numel() > MAX_BAND_SAMPLES:
        step = (flat.numel() + MAX_BAND_SAMPLES - 1) // MAX_BAND_SAMPLES
        flat = flat[::step]
    levels = torch.tensor([1.0 - percentile / 100.0, percentile / 100.0], dtype=torch.float32)
    low, high = torch.quantile(flat.float(), levels).to(dtype)
    return low, high


class PercentileBand:
    """Mixin for a min/max observer (torch.ao's or torchao's): its range is the widest
    [100-p, p] percentile band of any batch instead of the extremes, so rare spikes saturate
    and the bulk keeps its resolution. Put it before the observer class in the bases."""

    min_val: torch.Tensor
    max_val: torch.Tensor

    def __init__(self, percentile: float = 99.99, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not 50.0 < percentile <= 100.0:
            raise ValueError(f"percentile must be in (50, 100], got {percentile}")
        self.percentile = float(percentile)

    def forward(self, x_orig: torch.Tensor) -> torch.Tensor:
        if x_orig.numel() == 0:
            return x_orig
        low, high = percentile_band(x_orig.to(self.min_val.dtype), self.percentile)
        self.min_val.copy_(torch.minimum(low, self.min_val) if self.min_val.numel() else low)
        self.max_val.copy_(torch.maximum(high, self.max_val) if self.max_val.numel() else high)
        return x_orig

    def extra_repr(self) -> str:
        return f"percentile={self.percentile}, " + super().extra_repr()  # type: ignore[misc]
