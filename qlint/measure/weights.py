"""Float and quantized weights of matched layers, as plain float tensors.

Every counterpart kind stores weights differently: converted modules expose
``weight()`` (a quantized tensor), dynamic RNNs ``get_weight()`` (a dict), QAT
modules a float weight plus ``weight_fake_quant``, and PTQ-prepared modules a
float weight plus a ``qconfig`` whose weight observer convert would use.  The
functions here hide that so metrics see two dicts of float tensors.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from qlint.measure.match_result import LayerMatch

_PER_TENSOR = (torch.per_tensor_affine, torch.per_tensor_symmetric)


def batch_norm_factor(running_var: torch.Tensor, gamma: torch.Tensor | None, eps: float) -> torch.Tensor:
    """gamma / sqrt(running_var + eps): the per-channel factor BN folding multiplies in."""
    if gamma is None:
        gamma = torch.ones_like(running_var)
    return gamma.detach() / torch.sqrt(running_var.detach() + eps)


def _batch_norm_factor(batch_norm: nn.Module) -> torch.Tensor | None:
    running_var = getattr(batch_norm, "running_var", None)
    if running_var is None:
        return None
    return batch_norm_factor(running_var, getattr(batch_norm, "weight", None), float(getattr(batch_norm, "eps", 1e-5)))


def fold_batch_norm(weight: torch.Tensor, batch_norm: nn.Module, transposed: bool = False) -> torch.Tensor:
    """The weight conv/linear ends up with once an eval-mode BN is folded into it."""
    factor = _batch_norm_factor(batch_norm)
    if factor is None:
        return weight
    channel_dim = 1 if transposed else 0
    shape = [1] * weight.dim()
    shape[channel_dim] = -1
    return weight * factor.reshape(shape)


def _own_weights(module: nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: parameter.detach()
        for name, parameter in module.named_parameters(recurse=False)
        if name.startswith("weight") and parameter is not None
    }


def float_layer_weights(layer: LayerMatch, float_model: nn.Module) -> dict[str, torch.Tensor]:
    module = float_model.get_submodule(layer.float_entry.name)
    weights = _own_weights(module)
    if layer.folded_batch_norm and "weight" in weights:
        batch_norm = float_model.get_submodule(layer.folded_batch_norm)
        weights["weight"] = fold_batch_norm(weights["weight"], batch_norm, layer.kind.startswith("conv_transpose"))
    return weights


def _inner_float_module(module: nn.Module) -> nn.Module:
    """The weighted module inside a float fused Sequential (torch.ao.nn.intrinsic.ConvReLU2d)."""
    # QAT ConvBn modules are Sequentials too (torch's fused base class) but own their weight.
    if (
        isinstance(module, nn.Sequential)
        and len(module) > 0
        and not isinstance(getattr(module, "weight", None), torch.Tensor)
    ):
        return module[0]
    return module


def fake_quantize_with_observer(weight: torch.Tensor, observer: nn.Module) -> torch.Tensor:
    """Quantize-dequantize ``weight`` with the qparams ``observer`` picks for it."""
    observer(weight.detach())
    # Observers keep these as plain attributes, which nn.Module's stubs type as Tensor | Module.
    attributes = cast(Any, observer)
    scale, zero_point = attributes.calculate_qparams()
    if getattr(observer, "qscheme", torch.per_tensor_affine) in _PER_TENSOR:
        return torch.fake_quantize_per_tensor_affine(
            weight,
            float(scale.reshape(-1)[0]),
            int(zero_point.reshape(-1)[0]),
            attributes.quant_min,
            attributes.quant_max,
        )
    return torch.fake_quantize_per_channel_affine(
        weight,
        scale.float(),
        zero_point.to(torch.int32),
        attributes.ch_axis,
        attributes.quant_min,
        attributes.quant_max,
    )


def simulated_weight_parameters(module: nn.Module) -> dict[str, torch.Tensor]:
    """Parameter name -> fake-quantized weight for a PTQ-prepared layer (float weights + qconfig).

    Empty when the layer quantizes its own weight (QAT ``weight_fake_quant``),
    has no qconfig, or when the qconfig does not quantize weights to an integer type.
    """
    qconfig = getattr(module, "qconfig", None)
    inner = _inner_float_module(module)
    if qconfig is None or getattr(inner, "weight_fake_quant", None) is not None or not hasattr(inner, "weight"):
        return {}
    observer = qconfig.weight()
    if getattr(observer, "dtype", None) not in (torch.qint8, torch.quint8, torch.qint32) or not hasattr(
        observer, "quant_min"
    ):
        return {}
    prefix = "0." if inner is not module else ""
    weight = cast(torch.Tensor, inner.weight)  # nn.Module's stubs type attributes as Tensor | Module
    return {f"{prefix}weight": fake_quantize_with_observer(weight.detach(), observer).detach()}


def quantized_layer_weights(layer: LayerMatch, quant_module: nn.Module) -> dict[str, torch.Tensor]:
    """Dequantized weights of the quantized counterpart, keyed like the float module's parameters."""
    weight_attribute = getattr(quant_module, "weight", None)
    if callable(weight_attribute) and not isinstance(weight_attribute, torch.Tensor):
        # Converted static/dynamic modules store packed params; weight() unpacks them.
        return {"weight": weight_attribute().dequantize().detach()}
    if hasattr(quant_module, "get_weight"):
        # Dynamic RNNs: {"weight_ih_l0": qtensor, ...}, named like the float LSTM's parameters.
        return {name: value.dequantize().detach() for name, value in cast(Any, quant_module).get_weight().items()}
    inner = _inner_float_module(quant_module)
    weight = getattr(inner, "weight", None)
    if not isinstance(weight, torch.Tensor):
        return {}
    weight = weight.detach()
    batch_norm = getattr(quant_module, "bn", None)
    if batch_norm is not None and hasattr(batch_norm, "running_var"):
        # QAT ConvBn: the fake-quant is applied to the BN-folded weight.
        weight = fold_batch_norm(weight, batch_norm, layer.kind.startswith("conv_transpose"))
    weight_fake_quant = getattr(inner, "weight_fake_quant", None)
    if weight_fake_quant is not None:
        with torch.no_grad():
            return {"weight": weight_fake_quant(weight).detach()}
    simulated = simulated_weight_parameters(quant_module)
    if simulated:
        key = next(iter(simulated))
        if batch_norm is None:
            return {"weight": simulated[key]}
    return {"weight": weight}


def off_grid_fraction(float_weight: torch.Tensor, quant_module: nn.Module) -> float | None:
    """The fraction of a converted layer's integer weights more than one step away from the
    rounding of ``float_weight`` on the layer's own grid (its scales and zero points).

    Quantizing a weight rounds it to the nearest grid point (a tie or the quantizer's narrower
    range moves it by one step at most), so a fraction above a few percent says the int8 weights
    were made from another float tensor (a model a rewrite changed). None where the layer holds
    no quantized weight tensor (fake-quantized, prepared, dynamic recurrent layers)."""
    weight_attribute = getattr(quant_module, "weight", None)
    if not callable(weight_attribute) or isinstance(weight_attribute, torch.Tensor):
        return None
    quantized = weight_attribute()
    if not isinstance(quantized, torch.Tensor) or not quantized.is_quantized:
        return None
    if quantized.numel() != float_weight.numel() or not quantized.numel():
        return None
    integers = quantized.int_repr()
    weight = float_weight.detach().reshape(quantized.shape).double()
    if quantized.qscheme() in (torch.per_channel_affine, torch.per_channel_symmetric):
        shape = [1] * weight.dim()
        shape[quantized.q_per_channel_axis()] = -1
        scale = quantized.q_per_channel_scales().double().reshape(shape)
        zero_point = quantized.q_per_channel_zero_points().double().reshape(shape)
    else:
        scale = torch.tensor(quantized.q_scale(), dtype=torch.float64)
        zero_point = torch.tensor(float(quantized.q_zero_point()), dtype=torch.float64)
    # The quantizer's range may be narrower than the dtype's (a clipping or 4-bit observer): each
    # channel's own smallest and largest integers stand for it, so clipped weights count as rounded.
    actual = integers.double()
    if quantized.qscheme() in (torch.per_channel_affine, torch.per_channel_symmetric):
        dims = [d for d in range(actual.dim()) if d != quantized.q_per_channel_axis()]
        low, high = actual.amin(dims, keepdim=True), actual.amax(dims, keepdim=True)
    else:
        low, high = actual.min(), actual.max()
    expected = torch.minimum(torch.maximum(torch.round(weight / scale) + zero_point, low), high)
    return float(((expected - actual).abs() > 1).double().mean())
