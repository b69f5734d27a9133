"""The FX trial's measurements of a converted model against its float model: per layer the
shadow (torch NS's definition) and propagated SQNR, and per observed activation the SQNR of
rounding it with the qparams the converted model runs with."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.ao.quantization.observer import UniformQuantizationObserverBase

from qlint.core.batches import call_model
from qlint.core.nested import first_float
from qlint.core.ops import module_kind, quantized_form
from qlint.core.sqnr import SqnrSums
from qlint.measure.capture import PairedRunner
from qlint.measure.matching import match_layers
from qlint.measure.metrics import PairwiseErrorStats
from qlint.measure.trial import ActivationError, LayerError


def layer_errors(float_model: nn.Module, converted: nn.Module, batches: Sequence[Any]) -> tuple[LayerError, ...]:
    """Per layer of ``converted``: its own (shadow, torch NS's definition) and propagated SQNR
    against ``float_model`` (the model it was converted from) on ``batches``."""
    match = match_layers(float_model, converted)
    shadow = {layer.name: PairwiseErrorStats() for layer in match.layers}
    propagated = {layer.name: PairwiseErrorStats() for layer in match.layers}
    runner = PairedRunner(
        float_model,
        converted,
        match,
        on_propagated=lambda layer, ref, q, scale: propagated[layer.name].update(ref, q, scale),
        on_shadow=lambda layer, ref, q, scale: shadow[layer.name].update(ref, q, scale),
    )
    with runner:
        for _ in runner.run(batches):
            pass
    layers = []
    for layer in match.layers:
        local, at_output = shadow[layer.name].sqnr_db(), propagated[layer.name].sqnr_db()
        if local is None and at_output is None:
            continue  # integer-valued ops (shape arithmetic) carry no signal
        layers.append(LayerError(layer.name, layer.kind, local, at_output))
    return tuple(layers)


def _attr_value(graph_module: fx.GraphModule, node: Any) -> Any:
    if isinstance(node, fx.Node) and node.op == "get_attr":
        return getattr(graph_module, str(node.target), None)
    return node


def converted_qparams(converted: fx.GraphModule) -> dict[str, tuple[float, int]]:
    """(scale, zero point) of every tensor the converted model quantizes, keyed by the node
    that produced the float value: input quantize ops, quantized modules' outputs, and
    quantized functional ops' outputs. These are the qparams the int8 model runs with."""
    found: dict[str, tuple[float, int]] = {}
    for node in converted.graph.nodes:
        scale = zero_point = None
        name = node.name
        if node.op == "call_module":
            module = converted.get_submodule(str(node.target))
            if quantized_form(module) == "static":
                scale, zero_point = getattr(module, "scale", None), getattr(module, "zero_point", None)
        elif node.op == "call_function" and node.target is torch.quantize_per_tensor and len(node.args) >= 3:
            source = node.args[0]
            name = source.name if isinstance(source, fx.Node) else name
            scale, zero_point = _attr_value(converted, node.args[1]), _attr_value(converted, node.args[2])
        elif node.op == "call_function" and str(getattr(node.target, "__module__", "")).startswith(
            "torch._ops.quantized"
        ):
            attrs = [arg for arg in node.args if isinstance(arg, fx.Node) and arg.op == "get_attr"]
            scales = [a for a in attrs if "scale" in str(a.target)]
            points = [a for a in attrs if "zero_point" in str(a.target)]
            if scales and points:
                scale, zero_point = _attr_value(converted, scales[-1]), _attr_value(converted, points[-1])
        try:
            if scale is not None and zero_point is not None:
                found.setdefault(name, (float(scale), int(zero_point)))
        except (TypeError, ValueError, RuntimeError):  # a per-channel tensor: not an activation's qparams
            continue
    return found


_DTYPE_RANGE = {torch.quint8: (0, 255), torch.qint8: (-128, 127)}


def activation_sqnr(
    prepared: fx.GraphModule, converted: fx.GraphModule, batches: Sequence[Any]
) -> tuple[ActivationError, ...]:
    """Per observed activation, the SQNR of the float tensor rounded and clipped with the
    qparams the converted model runs with.

    The float values come from ``prepared`` (a calibrated copy: its observers pass values
    through); the qparams from ``converted``, so no observer searches its qparams twice."""
    qparams = converted_qparams(converted)
    observed: dict[str, tuple[str, float, int, int, int]] = {}
    levels: dict[str, int] = {}
    for node in prepared.graph.nodes:
        if node.op != "call_module" or not node.args or not isinstance(node.args[0], fx.Node):
            continue
        module = prepared.get_submodule(str(node.target))
        source = node.args[0].name
        dtype = getattr(module, "dtype", None)
        dtype_range = _DTYPE_RANGE.get(dtype) if isinstance(dtype, torch.dtype) else None
        if module_kind(module) != "observer" or dtype_range is None or getattr(module, "is_dynamic", False):
            continue
        if source in qparams:
            scale, zero_point = qparams[source]
        else:  # convert_fx renamed the node (functional ops): ask the observer itself
            if not isinstance(module, UniformQuantizationObserverBase):
                continue
            try:
                scales, points = module.calculate_qparams()
                scale, zero_point = float(scales), int(points)
                dtype_range = (int(module.quant_min), int(module.quant_max))
            except (TypeError, ValueError, RuntimeError):  # per-channel, or never ran
                continue
        observed[str(node.target)] = (source, scale, zero_point, *dtype_range)
        # the level count the observer spreads its range over (the dtype's, or fewer with reduce_range)
        low, high = getattr(module, "quant_min", dtype_range[0]), getattr(module, "quant_max", dtype_range[1])
        levels[str(node.target)] = int(high) - int(low) + 1
    sums = {target: SqnrSums() for target in observed}
    handles = []
    for target, (_, scale, zero_point, low, high) in observed.items():

        def hook(_module, args, target=target, scale=scale, zero_point=zero_point, low=low, high=high):
            value = first_float(args)
            if value is not None and not value.is_quantized:
                rounded = torch.fake_quantize_per_tensor_affine(value.float(), scale, zero_point, low, high)
                sums[target].add(value, rounded)

        handles.append(prepared.get_submodule(target).register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            for batch in batches:
                call_model(prepared, batch)
    finally:
        for handle in handles:
            handle.remove()
    result: dict[str, ActivationError] = {}
    for target, (source, *_rest) in observed.items():
        value = sums[target].sqnr_db()
        if value is not None:
            result.setdefault(source, ActivationError(source, round(value, 4), levels[target]))
    return tuple(result.values())
