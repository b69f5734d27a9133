"""Per-layer quantization sensitivity: which layers hurt the model output most.

The exhaustive method quantizes one layer at a time and runs the whole model
for each (N calibrations and N x data forward passes).  ``sensitivity`` gets a
close ranking from one calibrated quantization and one pass over the data:

* the *isolated* run gives, for every layer L, the error vector ``e_L`` it adds
  if it alone is quantized (float input, quantized on L's input grid ->
  quantized layer -> minus float output);
* how much of ``e_L`` reaches the model output is ``||J_L e_L||^2``, with
  ``J_L`` the Jacobian of the float output with respect to L's output.  For a
  random sign vector ``v`` at the output, ``E[(v . J_L e_L)^2] = ||J_L e_L||^2``
  and ``v . J_L e_L = (J_L^T v) . e_L``; one backward pass gives ``J_L^T v``
  for all layers at once, so a few probes per batch estimate every layer's
  output error together (Hutchinson's trick).

The score is that estimated output noise power over the output signal power
(the noise-to-signal ratio if only this layer were quantized); the exhaustive
method measures the same ratio directly, which is what it is validated against.

A module the model calls several times is ranked once, every call's error together (each
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
from qlint.core.nested import first_float, map_tensors, tensors_in
from qlint.core.preserve import made_in_inference_mode, preserved_state
from qlint.core.sqnr import SqnrSums, sqnr_db_from_powers
from qlint.errors import QlintError
from qlint.measure.capture import PairedRunner
from qlint.measure.match_result import MODULE_SITE, LayerMatch
from qlint.measure.matching import match_layers
from qlint.measure.trial import convert_model, prepare_model


class SensitivityRow(BaseModel):
    model_config = ConfigDict(frozen=True)

    name: str
    kind: str
    score: float  # estimated output noise power / output signal power with only this layer quantized
    estimated_output_sqnr_db: float
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


def _output_tensors(output: Any) -> list[torch.Tensor]:
    """The floating-point tensors of an output, as produced (gradients still reach them)."""
    return [tensor for tensor in tensors_in(output) if tensor.is_floating_point()]


def _requires_grad_inputs(batch: Any) -> Any:
    """Float inputs that require grad, so the output has a graph even with frozen parameters
    (copies: a batch made under inference_mode cannot require grad itself)."""
    return map_tensors(batch, lambda t: t.detach().clone().requires_grad_(True) if t.is_floating_point() else t)


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


def _probe_vectors(
    outputs: list[torch.Tensor], samples: int, probes: int, exact_limit: int, generator: torch.Generator
):
    """(grad_outputs, weight) pairs whose weighted squared projections sum to ||J e||^2.

    When each sample's output has at most ``exact_limit`` elements (a classifier
    head), one-hot directions give the exact value; otherwise random signs give
    an unbiased estimate (Hutchinson).  One-hot directions need per-sample outputs.
    """
    per_sample_size = sum(tensor[0].numel() for tensor in outputs) if samples else 0
    if samples and per_sample_size <= exact_limit:
        for tensor_index, tensor in enumerate(outputs):
            for element in range(tensor[0].numel()):
                vectors = [torch.zeros_like(other) for other in outputs]
                vectors[tensor_index].reshape(samples, -1)[:, element] = 1.0
                yield vectors, 1.0
        return
    for _ in range(probes):
        signs = [torch.randint(0, 2, tensor.shape, generator=generator).to(tensor.dtype) * 2 - 1 for tensor in outputs]
        yield signs, 1.0 / probes


def sensitivity_rows(
    model: nn.Module,
    data: Iterable,
    backend: str = "x86",
    qconfig_mapping: QConfigMapping | None = None,
    *,
    quantized_model: nn.Module | None = None,
    probes: int = 8,
    exact_limit: int = 32,
    max_batches: int | None = None,
    seed: int = 0,
) -> list[SensitivityRow]:
    """Sensitivity of each quantized module layer, most sensitive first, with FLOPs/params shares."""
    data = reiterable(data, "sensitivity")
    inference = next((name for name, t in model.state_dict().items() if made_in_inference_mode(t)), None)
    if inference is not None:
        raise QlintError(
            f"sensitivity needs gradients through the model, but its {inference} is an inference "
            "tensor (made under torch.inference_mode); build or load the model outside inference_mode"
        )
    models = (model,) if quantized_model is None else (model, quantized_model)
    # Each step that runs the user's model opens a watching guard of its own (the paired
    # runner, the FLOP count); this one gives back RNG, logging and everything else.
    with preserved_state(*models, watch_parameters=False):
        return _sensitivity_rows(
            model, data, backend, qconfig_mapping, quantized_model, probes, exact_limit, max_batches, seed
        )


def _sensitivity_rows(
    model: nn.Module,
    data: Iterable,
    backend: str,
    qconfig_mapping: QConfigMapping | None,
    quantized_model: nn.Module | None,
    probes: int,
    exact_limit: int,
    max_batches: int | None,
    seed: int,
) -> list[SensitivityRow]:
    if quantized_model is None:
        quantized_model = quantize_with_fx(model, data, backend, qconfig_mapping, max_batches)
    match = match_layers(model, quantized_model)
    match.layers = [layer for layer in match.layers if layer.is_module]
    estimated = {layer.name: 0.0 for layer in match.layers}
    local = {layer.name: SqnrSums() for layer in match.layers}
    output_power = 0.0
    errors: dict[str, list[torch.Tensor]] = {}
    generator = torch.Generator().manual_seed(seed)

    def on_isolated(layer, reference, quantized, scale):
        error = quantized - reference
        errors.setdefault(layer.name, []).append(error)
        local[layer.name].add(reference, quantized)

    runner = PairedRunner(
        model,
        quantized_model,
        match,
        propagated=False,
        shadow=False,
        isolated=True,
        on_isolated=on_isolated,
        float_grad=True,
    )
    with runner:
        for index, batch in enumerate(data):
            if max_batches is not None and index >= max_batches:
                break
            errors.clear()
            float_output, _ = runner.run_batch(_requires_grad_inputs(batch))
            outputs = [tensor for tensor in _output_tensors(float_output) if tensor.grad_fn is not None]
            output_power += sum(
                float(tensor.detach().double().pow(2).sum()) for tensor in _output_tensors(float_output)
            )
            targets = [
                (name, raw)
                for name, calls in runner.float_outputs.items()
                if name in errors
                for raw in calls[: len(errors[name])]
                if isinstance(raw, torch.Tensor) and raw.requires_grad
            ]
            if not outputs or not targets:
                continue
            samples = batch_size(batch)
            per_sample = all(tensor.dim() > 0 and tensor.shape[0] == samples for tensor in outputs) and all(
                raw.dim() > 0 and raw.shape[0] == samples for _, raw in targets
            )
            probe_list = list(_probe_vectors(outputs, samples if per_sample else 0, probes, exact_limit, generator))
            for probe_index, (vectors, weight) in enumerate(probe_list):
                gradients = torch.autograd.grad(
                    outputs,
                    [raw for _, raw in targets],
                    grad_outputs=vectors,
                    retain_graph=probe_index < len(probe_list) - 1,
                    allow_unused=True,
                )
                call_index: dict[str, int] = {}
                for (name, _), gradient in zip(targets, gradients):
                    position = call_index.get(name, 0)
                    call_index[name] = position + 1
                    error = errors[name][position]
                    if gradient is None or gradient.shape != error.shape:
                        continue
                    product = gradient.detach().double() * error.double()
                    # Per-sample projections: cross-sample terms have zero mean but add variance.
                    projections = product.reshape(samples, -1).sum(1) if per_sample else product.sum().reshape(1)
                    estimated[name] += weight * float(projections.pow(2).sum())
            runner.float_outputs.clear()
            runner.float_inputs.clear()
        first = _first_batch(data)
    # Shares are of the whole model, not of the ranked layers: functional layers (F.conv2d
    # on a parameter, as EfficientNet-Lite's convolutions are) are compared but not ranked.
    costs = model_flops_and_params(model, match.layers, first)
    total_flops = costs.total_flops or 1.0
    total_params = costs.total_params or 1
    rows = []
    for layer in match.layers:
        flops, params = costs.layers.get(layer.name, (0.0, 0))
        noise = estimated[layer.name]
        rows.append(
            SensitivityRow(
                name=layer.name,
                kind=layer.kind,
                score=noise / output_power if output_power > 0 else 0.0,
                estimated_output_sqnr_db=sqnr_db_from_powers(output_power, noise),
                local_sqnr_db=local[layer.name].sqnr_db(),
                flops=flops,
                flops_share=flops / total_flops,
                params=params,
                params_share=params / total_params,
                calls=layer.calls,
            )
        )
    rows.sort(key=lambda row: row.score, reverse=True)
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
