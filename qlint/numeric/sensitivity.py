"""Per-layer quantization sensitivity: which layers hurt the model output most.

A layer's score is the model output's noise-to-signal power ratio with only that layer
quantized as the quantized model quantizes it (its input's grid, int8 weights and output grid),
every other layer float: measured by ``qlint.numeric.only_layer``, one float pass per layer, on
one quantized model (the one given, or one ``prepare_fx``/``convert_fx`` run).
``exhaustive_sensitivity`` instead quantizes one layer at a time with ``prepare_fx`` (a
calibration per layer, and each layer gets grids of its own).

A module the model calls several times is ranked once, every call quantized together (each
call on its own input grid): what keeping that module float, or changing its qconfig, would
remove. compare's table has a row per call; a ranked row says how many calls it covers.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn
from torch.ao.quantization import QConfigMapping, get_default_qconfig_mapping
from torch.utils.flop_counter import FlopCounterMode

from qlint.core.batches import as_call, batch_size, call_model, reiterable
from qlint.core.exported import put_in_eval
from qlint.core.nested import first_float
from qlint.core.preserve import preserved_state
from qlint.core.sqnr import SqnrSums, sqnr_db_from_powers
from qlint.measure.match_result import MODULE_SITE, LayerMatch
from qlint.measure.matching import match_layers
from qlint.measure.trial import convert_model, prepare_model
from qlint.numeric.only_layer import only_layer_errors


class SensitivityRow(BaseModel):
    model_config = ConfigDict(frozen=True)

    name: str
    kind: str
    score: float  # output noise power / output signal power with only this layer quantized, measured (0 if not)
    output_sqnr_db: float | None  # the model output's SQNR, measured with only this layer quantized; None if not
    local_sqnr_db: float | None
    flops: float
    flops_share: float
    params: int
    params_share: float
    calls: int = Field(
        default=1,
        description="How many calls of the module the score covers: a module the model calls several times is "
        "ranked once, as a keep-float or qconfig fix for it changes every call.",
    )
    not_measured: str | None = Field(
        default=None,
        description="Why the output error with only this layer quantized could not be measured (the float model "
        "raised with the layer's quantized output in place of its own); the layer is then ranked last, with score 0 "
        "and no output_sqnr_db.",
    )


def _first_batch(data: Iterable) -> Any:
    for batch in data:
        return batch
    raise ValueError("the data yielded no batches")


def _example_inputs(batch: Any) -> tuple:
    args, kwargs = as_call(batch)
    if kwargs:
        raise TypeError("prepare_fx needs positional example inputs; yield tensors or tuples, not dicts")
    return args


def quantize_with_fx(
    model: nn.Module,
    data: Iterable,
    backend: str = "x86",
    qconfig_mapping: QConfigMapping | None = None,
    max_batches: int | None = None,
) -> torch.fx.GraphModule:
    """prepare_fx + calibration over ``data`` + convert_fx, on a copy of ``model``."""
    mapping = qconfig_mapping if qconfig_mapping is not None else get_default_qconfig_mapping(backend)
    prepared = prepare_model(copy.deepcopy(model).eval(), mapping, _example_inputs(_first_batch(data)))
    with torch.no_grad():
        for index, batch in enumerate(data):
            if max_batches is not None and index >= max_batches:
                break
            call_model(prepared, batch)
    return convert_model(prepared)


def _gates(recurrent: nn.Module) -> int:
    """Gate count of a recurrent layer or cell (LSTM 4, GRU 3, plain RNN 1)."""
    if isinstance(recurrent, (nn.LSTM, nn.LSTMCell)):
        return 4
    return 3 if isinstance(recurrent, (nn.GRU, nn.GRUCell)) else 1


class ModelCosts(BaseModel):
    """Per-sample FLOPs and parameter counts of the ranked layers, and of the whole model."""

    model_config = ConfigDict(frozen=True)

    layers: dict[str, tuple[float, int]]  # name -> (FLOPs per sample, parameters)
    total_flops: float  # the whole forward pass, per sample
    total_params: int  # every parameter of the model, shared ones once


def model_flops_and_params(model: nn.Module, layers: list[LayerMatch], batch: Any) -> ModelCosts:
    """Multiply-accumulate count x2 (FLOPs) per sample and parameter count of each module layer,
    and the totals of the whole model (functional layers, which are not ranked, included).

    The whole forward's total is torch's ``FlopCounterMode`` count (matrix products,
    convolutions, attention; the per-layer counts of those agree with it) plus the one FLOP
    per output element counted for the ranked element-wise layers (batch norm, activations),
    which torch's counter leaves out: so the shares of the ranked layers add up to at most 1.
    """
    modules = dict(model.named_modules(remove_duplicate=False))
    counts: dict[str, list] = {layer.name: [0.0, 0] for layer in layers if layer.float_entry.kind == MODULE_SITE}
    samples = max(1, batch_size(batch))
    element_wise = [0.0]  # FLOPs of ranked layers torch's counter does not count

    def counter(name):
        def hook(module, args, output):
            out = first_float(output)
            if out is None:
                return
            if hasattr(module, "kernel_size") and hasattr(module, "in_channels") and hasattr(module, "groups"):
                per_output = module.in_channels // module.groups
                for size in module.kernel_size:
                    per_output *= size
                counts[name][0] += 2.0 * out.numel() * per_output / samples
            elif isinstance(module, nn.Linear):
                counts[name][0] += 2.0 * out.numel() * module.in_features / samples
            elif isinstance(module, (nn.RNNBase, nn.RNNCellBase)):
                # per step and direction: a (gates x hidden) by (input + hidden) matrix product
                directions = 2 if getattr(module, "bidirectional", False) else 1
                steps = out.numel() / (module.hidden_size * directions)
                width = module.input_size + module.hidden_size
                layers = getattr(module, "num_layers", 1)
                flops = 2.0 * _gates(module) * module.hidden_size * width * steps * directions * layers
                counts[name][0] += flops / samples
            else:
                counts[name][0] += float(out.numel()) / samples
                element_wise[0] += float(out.numel()) / samples

        return hook

    with preserved_state(model) as guard, torch.no_grad():
        put_in_eval(model)
        for name in counts:
            module = modules[name]
            counts[name][1] = sum(parameter.numel() for parameter in module.parameters())
            guard.add_handle(module.register_forward_hook(counter(name)))
        with FlopCounterMode(display=False) as flop_counter:
            call_model(model, batch)
    return ModelCosts(
        layers={name: (flops, params) for name, (flops, params) in counts.items()},
        total_flops=flop_counter.get_total_flops() / samples + element_wise[0],
        total_params=sum(parameter.numel() for parameter in model.parameters()),  # shared ones once
    )


def sensitivity_rows(
    model: nn.Module,
    data: Iterable,
    backend: str = "x86",
    qconfig_mapping: QConfigMapping | None = None,
    *,
    quantized_model: nn.Module | None = None,
    max_batches: int | None = None,
) -> list[SensitivityRow]:
    """Sensitivity of each quantized module layer, most sensitive first, with FLOPs/params shares."""
    data = reiterable(data, "sensitivity")
    models = (model,) if quantized_model is None else (model, quantized_model)
    # Each step that runs the user's model opens a watching guard of its own (the paired
    # runner, the FLOP count); this one gives back RNG, logging and everything else.
    with preserved_state(*models, watch_parameters=False):
        return _sensitivity_rows(model, data, backend, qconfig_mapping, quantized_model, max_batches)


def _sensitivity_rows(
    model: nn.Module,
    data: Iterable,
    backend: str,
    qconfig_mapping: QConfigMapping | None,
    quantized_model: nn.Module | None,
    max_batches: int | None,
) -> list[SensitivityRow]:
    if quantized_model is None:
        quantized_model = quantize_with_fx(model, data, backend, qconfig_mapping, max_batches)
    match = match_layers(model, quantized_model)
    match.layers = [layer for layer in match.layers if layer.is_module]
    measured = only_layer_errors(model, quantized_model, match, data, max_batches)
    output_power = measured.output_signal_power
    first = _first_batch(data)
    # Shares are of the whole model, not of the ranked layers: functional layers (F.conv2d
    # on a parameter, as EfficientNet-Lite's convolutions are) are compared but not ranked.
    costs = model_flops_and_params(model, match.layers, first)
    total_flops = costs.total_flops or 1.0
    total_params = costs.total_params or 1
    rows = []
    for layer in match.layers:
        flops, params = costs.layers.get(layer.name, (0.0, 0))
        noise = measured.output_noise_power[layer.name]
        failure = measured.not_measured.get(layer.name)
        rows.append(
            SensitivityRow(
                name=layer.name,
                kind=layer.kind,
                score=noise / output_power if output_power > 0 else 0.0,
                output_sqnr_db=None if failure else sqnr_db_from_powers(output_power, noise),
                local_sqnr_db=measured.isolated[layer.name].sqnr_db() if layer.name in measured.isolated else None,
                flops=flops,
                flops_share=flops / total_flops,
                params=params,
                params_share=params / total_params,
                calls=layer.calls,
                not_measured=failure,
            )
        )
    rows.sort(key=lambda row: (row.not_measured is None, row.score), reverse=True)
    return rows


def sensitivity(
    model: nn.Module,
    data: Iterable,
    backend: str = "x86",
    qconfig_mapping: QConfigMapping | None = None,
    **options: Any,
) -> list[tuple[str, float]]:
    """(module fqn, score), most sensitive first; see ``sensitivity_rows`` for FLOPs/params shares."""
    return [(row.name, row.score) for row in sensitivity_rows(model, data, backend, qconfig_mapping, **options)]


def exhaustive_sensitivity(
    model: nn.Module,
    data: Iterable,
    backend: str = "x86",
    qconfig_mapping: QConfigMapping | None = None,
    *,
    layers: list[str] | None = None,
    max_batches: int | None = None,
) -> list[tuple[str, float]]:
    """The reference: quantize one layer at a time (others float) and measure output noise/signal."""
    data = reiterable(data, "exhaustive_sensitivity")
    with preserved_state(model, watch_parameters=False):  # every forward pass runs on a copy
        return _exhaustive_sensitivity(model, data, backend, qconfig_mapping, layers, max_batches)


def _exhaustive_sensitivity(
    model: nn.Module,
    data: Iterable,
    backend: str,
    qconfig_mapping: QConfigMapping | None,
    layers: list[str] | None,
    max_batches: int | None,
) -> list[tuple[str, float]]:
    mapping = qconfig_mapping if qconfig_mapping is not None else get_default_qconfig_mapping(backend)
    resolved = prepare_model(copy.deepcopy(model).eval(), mapping, _example_inputs(_first_batch(data)))
    if layers is None:
        full = match_layers(model, convert_model(copy.deepcopy(resolved)))
        layers = [layer.name for layer in full.layers if layer.is_module]
    scores = []
    float_model = copy.deepcopy(model).eval()
    for name in layers:
        qconfig = getattr(resolved.get_submodule(name), "qconfig", None)
        single = QConfigMapping().set_global(None).set_module_name(name, qconfig)
        quantized = quantize_with_fx(model, data, backend, single, max_batches)
        output = SqnrSums()
        with torch.no_grad():
            for index, batch in enumerate(data):
                if max_batches is not None and index >= max_batches:
                    break
                # every floating-point output tensor, as the estimate's output power counts them
                output.add(call_model(float_model, batch), call_model(quantized, batch))
        scores.append((name, output.noise_power / output.signal_power if output.signal_power > 0 else 0.0))
    scores.sort(key=lambda item: item[1], reverse=True)
    return scores


def _ranks(values: list[float]) -> list[float]:
    """Ranks 1..n with ties given their average rank."""
    order = sorted(range(len(values)), key=lambda index: values[index])
    ranks = [0.0] * len(values)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
            end += 1
        for position in range(start, end + 1):
            ranks[order[position]] = (start + end) / 2.0 + 1.0
        start = end + 1
    return ranks


def spearman(first: list[float], second: list[float]) -> float:
    """Spearman rank correlation (Pearson correlation of the ranks)."""
    if len(first) != len(second) or len(first) < 2:
        raise ValueError("spearman needs two sequences of the same length >= 2")
    a, b = _ranks(first), _ranks(second)
    mean_a, mean_b = sum(a) / len(a), sum(b) / len(b)
    covariance = sum((x - mean_a) * (y - mean_b) for x, y in zip(a, b))
    spread = math.sqrt(sum((x - mean_a) ** 2 for x in a) * sum((y - mean_b) ** 2 for y in b))
    return covariance / spread if spread else 0.0


def top_k_spearman(reference: list[tuple[str, float]], estimate: list[tuple[str, float]], k: int = 10) -> float:
    """Spearman between the two scorings over the reference's top-k layers."""
    estimated = dict(estimate)
    top = [name for name, _ in reference[:k] if name in estimated]
    reference_scores = dict(reference)
    return spearman([reference_scores[name] for name in top], [estimated[name] for name in top])


__all__ = [
    "SensitivityRow",
    "sensitivity",
    "sensitivity_rows",
    "exhaustive_sensitivity",
    "quantize_with_fx",
    "spearman",
    "top_k_spearman",
]
