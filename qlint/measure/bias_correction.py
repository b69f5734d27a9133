"""Empirical bias correction: the mean shift that weight rounding gives each output channel, removed.

Rounding a conv or linear weight to int8 changes each output channel by (W_q − W)·x. Its mean
over the data, E[(W_q − W)·x], is not zero: rounding errors of one channel's weights do not
cancel against that channel's inputs, whose mean is far from zero after ReLU-like activations.
That bias then passes through every later layer. Subtracting it from the layer's bias removes
it and leaves only the zero-mean part of the rounding noise (Nagel et al., "Data-Free
Quantization Through Weight Equalization and Bias Correction", ICCV 2019, section 4.2, in its
empirical form: the mean measured on calibration data instead of predicted from BatchNorm).

How it streams: during calibration each quantized conv/linear module's input is summed over
the batch dimension, one sum per input shape (a tensor the size of one sample per layer,
never the activations themselves). Without its bias a conv or linear layer is linear in its
input, so after convert_fx, when the int8 weight torch built is known exactly,
``layer(Σx, W_q − W)`` summed over output positions and divided by their number is the mean
shift of each output channel. The converted module gets ``bias − shift``.

Only layers that convert_fx turned into quantized modules are corrected: a layer left float
has no rounding error to correct.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

_CONV_FUNCTIONS: dict[type[nn.Module], Callable[..., torch.Tensor]] = {
    nn.Conv1d: F.conv1d,
    nn.Conv2d: F.conv2d,
    nn.Conv3d: F.conv3d,
}


def _weighted_layer(module: nn.Module) -> nn.Module | None:
    """The conv/linear a prepared module runs: itself, or the first module of a fused one
    (torch's fused modules such as ConvReLU2d are Sequentials of conv and activation)."""
    candidate = module[0] if isinstance(module, nn.Sequential) and len(module) > 0 else module
    if type(candidate) is nn.Linear:
        return candidate
    if type(candidate) in _CONV_FUNCTIONS and getattr(candidate, "padding_mode", "zeros") == "zeros":
        return candidate
    return None


def _without_bias(layer: nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``(x, weight) -> layer(x)`` with ``weight`` and no bias: linear in ``x`` and in ``weight``."""
    if isinstance(layer, nn.Linear):
        return lambda x, weight: F.linear(x, weight)
    conv, options = (
        _CONV_FUNCTIONS[type(layer)],
        {k: getattr(layer, k) for k in ("stride", "padding", "dilation", "groups")},
    )
    return lambda x, weight: conv(x, weight, None, **options)


@dataclasses.dataclass
class _LayerSums:
    """Streaming input sums of one layer: Σ over the batch of its input, per input shape."""

    layer: nn.Module
    float_weight: torch.Tensor
    sums: dict[tuple[int, ...], torch.Tensor] = dataclasses.field(default_factory=dict)
    samples: dict[tuple[int, ...], int] = dataclasses.field(default_factory=dict)

    def add(self, x: torch.Tensor) -> None:
        x = x.detach()
        if isinstance(self.layer, nn.Linear):
            x = x.reshape(-1, x.shape[-1])  # a linear layer acts on the last dimension: each row is a sample
        # one sample's shape, in float32 (the calibration set's few thousand samples lose nothing that
        # matters; half the memory of float64 for a conv's sums), then float64 in mean_shift
        shape, total = tuple(x.shape[1:]), x.sum(0, keepdim=True, dtype=torch.float32)
        if shape in self.sums:
            self.sums[shape] += total
            self.samples[shape] += x.shape[0]
        else:
            self.sums[shape], self.samples[shape] = total, x.shape[0]

    def mean_shift(self, weight_error: torch.Tensor) -> torch.Tensor | None:
        """E[(W_q − W)·x] per output channel, or None when no input was seen."""
        error, apply = weight_error.to(torch.float64), _without_bias(self.layer)
        shift, positions = torch.zeros(error.shape[0], dtype=torch.float64, device=error.device), 0
        for shape, total in self.sums.items():
            out = apply(total.to(torch.float64), error)  # (1, channels, *positions): Σ over samples of the error
            shift += out.sum(dim=[d for d in range(out.dim()) if d != 1])
            positions += self.samples[shape] * (out.numel() // out.shape[1])
        return shift / positions if positions else None


class InputSums:
    """The input sums of every conv/linear layer of a prepared model that has a qconfig.

    Record them while calibrating (:meth:`recording`), then :meth:`correct` the converted model."""

    def __init__(self, prepared: fx.GraphModule) -> None:
        self._layers: dict[str, _LayerSums] = {}
        called = dict.fromkeys(str(node.target) for node in prepared.graph.nodes if node.op == "call_module")
        for name in called:
            module = prepared.get_submodule(name)
            layer = _weighted_layer(module)
            if layer is not None and getattr(module, "qconfig", None) is not None:
                # the float weight convert_fx will quantize (prepare_fx already folded any BatchNorm)
                weight = layer.weight
                if isinstance(weight, torch.Tensor):
                    self._layers[name] = _LayerSums(layer, weight.detach())

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Sum each layer's inputs while the body runs the prepared model."""

        def hook(sums: _LayerSums) -> Callable[[nn.Module, tuple[Any, ...]], None]:
            return lambda _module, inputs: sums.add(inputs[0])

        handles = [sums.layer.register_forward_pre_hook(hook(sums)) for sums in self._layers.values()]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def correct(self, converted: fx.GraphModule) -> list[str]:
        """Subtract each quantized layer's mean weight-rounding shift from its bias; returns the layers changed."""
        changed = []
        with torch.no_grad():
            for name, sums in self._layers.items():
                try:
                    quantized: Any = converted.get_submodule(name)  # a torch.ao quantized module, or float
                except AttributeError:  # convert_fx replaced it with something else
                    continue
                weight = getattr(quantized, "weight", None)
                if not callable(weight) or not hasattr(quantized, "set_weight_bias"):
                    continue  # convert_fx left it float
                int8_weight = weight()
                if not int8_weight.is_quantized:
                    continue
                shift = sums.mean_shift(int8_weight.dequantize() - sums.float_weight)
                if shift is None:
                    continue
                bias = quantized.bias()
                base = torch.zeros_like(shift, dtype=torch.float32) if bias is None else bias.detach()
                quantized.set_weight_bias(int8_weight, (base - shift.to(base.dtype)).contiguous())
                changed.append(name)
        return changed


__all__ = ["InputSums"]
