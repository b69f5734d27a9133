"""The model's output error with one layer quantized: measured, one float pass per layer.

For every matched module layer L, :class:`OnlyLayerRunner` runs the float model with every call of
L replaced by the quantized model's L on the input that call gets, put on the grid that input has in
the quantized model (L's input rounding, its int8 weights and its output rounding, with the
quantized model's own qparams), every other layer float. The error at
the model's output is then measured, not propagated through a linearisation: a sqrt, a sigmoid or
an LSTM after L bends it (silero_vad's ``stft_conv``: 11.1 dB estimated, 7.1 dB measured).

A layer whose quantized op is exact on the quantized input it gets (its shadow error is zero: a
ReLU or max-pool running on int8 values) adds no rounding of its own. Run alone it would only show
its input's rounding, which the layer feeding it made and is charged with; so it is given no error
(the layers that feed nothing but the model's inputs keep their input rounding: no other layer
made it).

The quantized output handed to the float model is laid out as the float layer's own output (x86's
quantized conv returns channels_last: digit_cnn's ``.view`` after its convs raised on it). A layer
whose substitution still makes the float model raise is not measured, with the reason, and the
other layers are: one layer's failure does not lose the whole ranking.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from qlint.core.batches import as_call
from qlint.core.nested import first_float, first_tensor, map_tensors
from qlint.core.sqnr import SqnrSums
from qlint.errors import ModelRunError
from qlint.measure.capture import FLOAT_RUN, PairedRunner
from qlint.measure.match_result import LayerMatch, MatchResult
from qlint.measure.node_tap import blamed_on


@dataclass
class OnlyLayerErrors:
    """Per module layer (by name): the model output's error with only that layer quantized, its
    isolated (local) error, whether it adds no rounding of its own, and why it could not be
    measured (the float model raised with it substituted; its noise power then counts nothing)."""

    output_signal_power: float
    output_noise_power: dict[str, float]
    isolated: dict[str, SqnrSums]
    adds_nothing: set[str]
    not_measured: dict[str, str]


def _laid_out_like(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``value`` (same shape) with ``like``'s strides, values unchanged: the float model's code
    after the layer may need its own layout (``.view`` on a channels_last tensor raises)."""
    if value.stride() == like.stride():
        return value
    return torch.empty_like(like).copy_(value)  # empty_like keeps a dense tensor's strides


def _replace_first(value: Any, replacement: torch.Tensor) -> Any:
    """``value`` with its first tensor replaced (an LSTM's ``(output, (h, c))`` keeps h and c)."""
    if isinstance(value, torch.Tensor):
        return replacement
    if isinstance(value, (tuple, list)) and value:
        return type(value)([_replace_first(value[0], replacement), *value[1:]])
    return value


class OnlyLayerRunner(PairedRunner):
    """A PairedRunner that can also run the float model with one layer's quantized output
    (from the isolated run of the same batch) in place of its float one."""

    def __init__(self, float_model: nn.Module, quantized_model: nn.Module, match: MatchResult):
        super().__init__(
            float_model,
            quantized_model,
            match,
            propagated=False,
            shadow=True,
            isolated=True,
            on_shadow=self._keep_shadow,
            on_isolated=self._keep_isolated,
        )
        self.isolated_changed: set[str] = set()  # this batch: layers whose isolated run changed the output
        self.isolated_sums: dict[str, SqnrSums] = defaultdict(SqnrSums)
        self.shadow_sums: dict[str, SqnrSums] = defaultdict(SqnrSums)
        self.substituted: LayerMatch | None = None
        self.substituted_calls = 0

    def _keep_shadow(self, layer: LayerMatch, reference: torch.Tensor, quantized: torch.Tensor, _scale) -> None:
        self.shadow_sums[layer.name].add(reference, quantized)

    def _keep_isolated(self, layer: LayerMatch, reference: torch.Tensor, quantized: torch.Tensor, _scale) -> None:
        self.isolated_sums[layer.name].add(reference, quantized)
        if not torch.equal(reference, quantized):
            self.isolated_changed.add(layer.name)

    def adds_nothing(self, layer: LayerMatch) -> bool:
        """Exact on the quantized input it gets (shadow), with that input rounded by another layer."""
        shadow = self.shadow_sums.get(layer.name)
        return bool(layer.predecessors) and shadow is not None and shadow.pairs > 0 and shadow.noise_power == 0.0

    def _keep_float_output(self, layer: LayerMatch, value: Any) -> Any:
        if self.substituted is None:
            return super()._keep_float_output(layer, value)
        if layer.name != self.substituted.name:
            return None  # every other layer runs float
        # The quantized layer on the input this call gets now: a later call of a shared module
        # gets the error its earlier calls made (EfficientNet-Lite0's _swish after the stem and
        # after the head), which a value kept from the float run would erase.
        index = self.substituted_calls
        self.substituted_calls += 1
        inputs, specs = self.float_inputs.get(layer.name, []), self.input_specs.get(layer.name, [])
        raw = first_tensor(value)
        if index >= len(inputs) or raw is None:
            return None
        args, kwargs = inputs[index]
        self.replaying = True
        try:
            quantized_value = self._call_quant_module(
                layer.quant_site.name,
                self._isolated_inputs(layer, args, specs[index] if index < len(specs) else None),
                kwargs,
            )
            output = first_float(quantized_value)
            if layer.quant_output_quantizer in self.frozen and output is not None:
                output = self.frozen[layer.quant_output_quantizer](output)
        finally:
            self.replaying = False
        if output is None or output.shape != raw.shape:
            return None
        quantized = output.to(raw.dtype)
        if layer.float_exit_relu:
            # the float ReLU runs after this value; keep it where the quantized output is 0
            quantized = torch.where(quantized > 0, quantized, torch.clamp(raw, max=0.0))
        return _replace_first(value, _laid_out_like(quantized, raw))

    def run_with_only(self, layer: LayerMatch, batch: Any) -> Any:
        """The float model's output on ``batch`` with only ``layer`` quantized: each call of it runs
        the quantized layer on the input it gets, on the grid that call's input had in the quantized
        run of ``run_batch`` on the same batch."""
        self.module_calls.clear()
        self.float_inputs.clear()  # the isolated run's; this pass keeps each call's input again
        self.substituted, self.substituted_calls = layer, 0
        args, kwargs = as_call(batch)
        self.phase = FLOAT_RUN
        try:
            # qlint's substitution made whatever raises here: neither model raises on the data alone
            with (
                torch.no_grad(),
                blamed_on(f"the float model with {layer.name}'s quantized output in place of its own"),
            ):
                return self.float_runner(*args, **kwargs)
        finally:
            self.phase, self.substituted = None, None
            self.float_inputs.clear()
            self.float_model_inputs.clear()


def only_layer_errors(
    float_model: nn.Module,
    quantized_model: nn.Module,
    match: MatchResult,
    data: Iterable,
    max_batches: int | None = None,
) -> OnlyLayerErrors:
    """For every module layer of ``match``: the output noise power with only it quantized."""
    layers = [layer for layer in match.layers if layer.is_module]
    noise = {layer.name: 0.0 for layer in layers}
    not_measured: dict[str, str] = {}
    signal = 0.0
    runner = OnlyLayerRunner(float_model, quantized_model, match)
    with runner:
        for index, batch in enumerate(data):
            if max_batches is not None and index >= max_batches:
                break
            runner.isolated_changed.clear()
            float_output, _ = runner.run_batch(batch)
            reference = map_tensors(float_output, torch.Tensor.detach)
            power = SqnrSums()
            power.add(reference, reference)
            signal += power.signal_power
            for layer in layers:
                # a layer exact so far adds nothing in this batch either: its only-L error would be
                # its input's rounding, made by the layer feeding it
                if (
                    layer.name in not_measured
                    or layer.name not in runner.isolated_changed
                    or runner.adds_nothing(layer)
                ):
                    continue
                try:
                    output = runner.run_with_only(layer, batch)
                except ModelRunError as error:
                    not_measured[layer.name] = str(error)
                    continue
                sums = SqnrSums()
                sums.add(reference, output)
                noise[layer.name] += sums.noise_power
        adds_nothing = {layer.name for layer in layers if runner.adds_nothing(layer)}
    for name in not_measured:
        noise[name] = 0.0  # the batches before it failed are not its whole error
    return OnlyLayerErrors(signal, noise, dict(runner.isolated_sums), adds_nothing - set(not_measured), not_measured)
