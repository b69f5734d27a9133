"""Run a float model and its quantized counterpart side by side, one batch at a time.

``PairedRunner`` puts forward hooks on the matched modules of both models (and,
for functional ops of FX graphs, reads node outputs through an FX interpreter),
and for every batch:

1. runs the float model, keeping each layer's input and output for this batch;
2. runs the quantized model on its own (*propagated*), handing each layer's
   output to ``on_propagated`` next to the float output;
3. feeds each quantized layer the float layer's input, quantized with the
   qparams that layer saw in step 2 (*shadow*), handing the result to
   ``on_shadow``, so that only the error the layer adds itself shows.

Values of one batch are dropped before the next batch starts, so memory does
not grow with the number of batches.  ``ModelStateGuard`` makes sure neither
model is changed: hooks are removed, buffers (observer statistics, BN stats)
and train/eval flags are restored even when a batch raises.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
import torch.fx
from torch import nn
from torch.ao.quantization import FakeQuantizeBase, ObserverBase
from torch.func import functional_call

from qlint.core.batches import as_call
from qlint.core.nested import first_float, first_tensor, map_tensors
from qlint.numeric.matching import MODULE_SITE, NODE_SITE, CounterpartKind, LayerMatch, MatchResult
from qlint.numeric.metrics import quantization_scale
from qlint.numeric.weights import simulated_weight_parameters

_PER_TENSOR = (torch.per_tensor_affine, torch.per_tensor_symmetric)


# --- leaving models as they were ------------------------------------------------
class ModelStateGuard(contextlib.AbstractContextManager):
    """Put models in eval mode for the run and restore flags, buffers and hooks afterwards.

    Observers update their statistics on every call and fake-quant modules may
    re-estimate their scales, so a comparison run would otherwise leave the
    user's prepared model calibrated on our data.
    """

    def __init__(self, *models: nn.Module):
        self.models = models
        self.handles: list[Any] = []

    def __enter__(self) -> "ModelStateGuard":
        self.training = [(module, module.training) for model in self.models for module in model.modules()]
        self.buffers = []
        for model in self.models:
            for module in model.modules():
                for name, buffer in module.named_buffers(recurse=False):
                    self.buffers.append((module, name, buffer, buffer.detach().clone()))
        for model in self.models:
            model.eval()
        return self

    def add_handle(self, handle: Any) -> None:
        self.handles.append(handle)

    def __exit__(self, *exc_info) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        with torch.no_grad():
            for module, name, original, saved in self.buffers:
                if original.shape != saved.shape:
                    original.resize_(saved.shape)
                original.copy_(saved)
                if getattr(module, name, None) is not original:
                    setattr(module, name, original)
        for module, flag in self.training:
            module.training = flag


# --- quantizers with frozen qparams -----------------------------------------------
@dataclass
class FrozenQuantizer:
    """Fake-quantization with fixed qparams; ``scale`` is the per-tensor step (None per channel)."""

    function: Callable[[torch.Tensor], torch.Tensor]
    scale: Optional[float]

    def __call__(self, value: torch.Tensor) -> torch.Tensor:
        return self.function(value)


def frozen_quantizer(module: nn.Module) -> Optional[FrozenQuantizer]:
    """Fake-quantize with the qparams ``module`` holds now (observer or fake-quant).

    PTQ observers only watch values; freezing them into a fake-quant shows the
    error convert would introduce.  Fake-quant modules are frozen too, so that
    their scales do not drift with the comparison data.  None: leave as is.
    """
    if isinstance(module, FakeQuantizeBase):
        if not bool(module.fake_quant_enabled.reshape(-1)[0]):
            return None
        scale, zero_point = module.scale.detach().clone(), module.zero_point.detach().clone()
    elif isinstance(module, ObserverBase) and hasattr(module, "quant_min") and hasattr(module, "calculate_qparams"):
        if getattr(module, "dtype", None) not in (torch.quint8, torch.qint8, torch.qint32):
            return None
        min_val = getattr(module, "min_val", None)
        if isinstance(min_val, torch.Tensor) and (min_val.numel() == 0 or not bool(torch.isfinite(min_val).all())):
            return None  # never calibrated: there are no qparams to freeze
        scale, zero_point = module.calculate_qparams()
    else:
        return None
    quant_min, quant_max = int(module.quant_min), int(module.quant_max)
    if getattr(module, "qscheme", torch.per_tensor_affine) in _PER_TENSOR or scale.numel() == 1:
        scale_value, zero_value = float(scale.reshape(-1)[0]), int(zero_point.reshape(-1)[0])
        return FrozenQuantizer(
            lambda x: torch.fake_quantize_per_tensor_affine(x, scale_value, zero_value, quant_min, quant_max),
            scale_value,
        )
    axis = int(module.ch_axis)
    return FrozenQuantizer(
        lambda x: torch.fake_quantize_per_channel_affine(
            x, scale.float(), zero_point.to(torch.int32), axis, quant_min, quant_max),
        None,
    )


@dataclass
class InputSpec:
    """How a quantized layer's input was quantized in the propagated run."""

    scale: float
    zero_point: int
    dtype: torch.dtype


def _input_spec(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.is_quantized and value.qscheme() in _PER_TENSOR:
        return InputSpec(float(value.q_scale()), int(value.q_zero_point()), value.dtype)
    if isinstance(value, (tuple, list)):
        return type(value)(_input_spec(item) for item in value)
    return None


def _apply_input_spec(value: Any, spec: Any) -> Any:
    if isinstance(spec, InputSpec) and isinstance(value, torch.Tensor):
        return torch.quantize_per_tensor(value.detach(), spec.scale, spec.zero_point, spec.dtype)
    if isinstance(spec, (tuple, list)) and isinstance(value, (tuple, list)):
        return type(value)(_apply_input_spec(item, item_spec) for item, item_spec in zip(value, spec))
    return map_tensors(value, lambda t: t.detach())


class _NodeTap(torch.fx.Interpreter):
    """Runs a GraphModule node by node, reporting selected node outputs.

    ``module_overrides`` replace the call of a submodule (by fqn): used to run
    prepared models with frozen fake-quant instead of their observers, and PTQ
    layers with fake-quantized weights, without touching the modules.
    """

    def __init__(self, graph_module: torch.fx.GraphModule, callbacks: dict[str, Callable[[Any], None]],
                 module_overrides: Optional[dict[str, Callable[..., Any]]] = None):
        super().__init__(graph_module, garbage_collect_values=True)
        self.callbacks = callbacks
        self.module_overrides = module_overrides or {}
        self.placeholders = [node.target for node in graph_module.graph.nodes if node.op == "placeholder"]

    def call_module(self, target: Any, args: tuple, kwargs: dict) -> Any:
        override = self.module_overrides.get(str(target))
        if override is not None:
            return override(args, kwargs)
        return super().call_module(target, args, kwargs)

    def run_node(self, node: torch.fx.Node) -> Any:
        result = super().run_node(node)
        callback = self.callbacks.get(node.name)
        if callback is not None:
            callback(result)
        return result

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs:
            positional = list(args) + [kwargs[name] for name in self.placeholders[len(args):] if name in kwargs]
            return self.run(*positional)
        return self.run(*args)


Callback = Callable[[LayerMatch, torch.Tensor, torch.Tensor, Optional[float]], None]


class PairedRunner:
    """Hooks both models for one comparison session; use as a context manager."""

    def __init__(
        self,
        float_model: nn.Module,
        quantized_model: nn.Module,
        match: MatchResult,
        *,
        propagated: bool = True,
        shadow: bool = True,
        on_propagated: Optional[Callback] = None,
        on_shadow: Optional[Callback] = None,
        float_grad: bool = False,
        capture: bool = True,
    ):
        self.float_model, self.quantized_model, self.match = float_model, quantized_model, match
        self.propagated, self.shadow = propagated, shadow
        self.on_propagated, self.on_shadow = on_propagated, on_shadow
        self.float_grad = float_grad
        self.capture = capture  # False: only run both models (prepared-model simulation still applies)
        self.guard = ModelStateGuard(float_model, quantized_model)
        self.float_inputs: dict[str, list] = defaultdict(list)
        self.float_outputs: dict[str, list] = defaultdict(list)
        self.quant_calls: dict[str, int] = defaultdict(int)
        self.input_specs: dict[str, Any] = {}
        self.shadowing = False
        self.simulating = False
        self.float_modules = dict(float_model.named_modules(remove_duplicate=False))
        self.quant_modules = dict(quantized_model.named_modules(remove_duplicate=False))
        self.frozen: dict[str, FrozenQuantizer] = {}
        self.quant_overrides: dict[str, Callable] = {}
        self.simulated_weights: dict[str, dict[str, torch.Tensor]] = {}

    # -- setup ----------------------------------------------------------
    def __enter__(self) -> "PairedRunner":
        self.guard.__enter__()
        try:
            self._install()
        except BaseException:
            self.guard.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.guard.__exit__(*exc_info)

    def _hook(self, module: nn.Module, hook: Callable, pre: bool = False) -> None:
        if pre:
            self.guard.add_handle(module.register_forward_pre_hook(hook, with_kwargs=True))
        else:
            self.guard.add_handle(module.register_forward_hook(hook))

    def _install(self) -> None:
        if self.match.counterpart is CounterpartKind.PREPARED:
            self._install_prepared_simulation()
        float_node_callbacks: dict[str, Callable] = {}
        quant_node_callbacks: dict[str, Callable] = {}
        for layer in self.match.layers if self.capture else []:
            self._install_float(layer, float_node_callbacks)
            self._install_quant(layer, quant_node_callbacks)
        self.float_runner = self._runner(self.float_model, self.match.float_graph, float_node_callbacks)
        self.quant_runner = self._runner(self.quantized_model, self.match.quant_graph, quant_node_callbacks,
                                         self.quant_overrides)

    def _runner(self, model: nn.Module, graph: Optional[torch.fx.GraphModule], callbacks: dict,
                overrides: Optional[dict] = None) -> Callable:
        if not callbacks and not overrides:
            return model
        return _NodeTap(graph, callbacks, overrides)

    def _install_prepared_simulation(self) -> None:
        """Freeze activation quantizers and fake-quantize PTQ weights for the run.

        In an FX graph the interpreter calls the frozen fake-quant instead of the
        observer (which then never sees our data); in eager models a forward hook
        replaces the observer's output.
        """
        in_graph = self.match.quant_graph is not None
        quantizer_names = {
            name for layer in self.match.layers
            for name in (layer.quant_input_quantizer, layer.quant_output_quantizer) if name
        }
        if in_graph:
            quantizer_names |= {
                str(node.target) for node in self.match.quant_graph.graph.nodes
                if node.op == "call_module" and isinstance(self.quant_modules.get(str(node.target)), (ObserverBase, FakeQuantizeBase))
            }
        else:
            # Eager prepare() attaches activation observers as `<module>.activation_post_process`
            # and calls them from a forward hook; a FakeQuantize's own inner observer is not one.
            quantizer_names |= {
                name for name, module in self.quant_modules.items()
                if name.rpartition(".")[2] == "activation_post_process"
                and isinstance(module, (ObserverBase, FakeQuantizeBase))
                and not isinstance(self.quant_modules.get(name.rpartition(".")[0]), FakeQuantizeBase)
            }
        for name in quantizer_names:
            frozen = frozen_quantizer(self.quant_modules[name])
            if frozen is None:
                continue
            self.frozen[name] = frozen
            if in_graph:
                self.quant_overrides[name] = lambda args, kwargs, f=frozen: f(args[0])
            else:
                self._hook(self.quant_modules[name], lambda module, args, output, f=frozen: f(args[0]))
        for layer in self.match.layers:
            if layer.quant_site.kind != MODULE_SITE:
                continue
            module = self.quant_modules[layer.quant_site.name]
            parameters = simulated_weight_parameters(module)
            if not parameters:
                continue
            self.simulated_weights[layer.name] = parameters
            if in_graph:
                # functional_call goes through module.__call__, so capture hooks still fire.
                self.quant_overrides[layer.quant_site.name] = (
                    lambda args, kwargs, m=module, p=parameters: functional_call(m, p, args, kwargs))
            else:
                self._hook(module, self._weight_simulation_hook(parameters))

    def _call_quant_module(self, fqn: str, args: tuple, kwargs: dict) -> Any:
        override = self.quant_overrides.get(fqn)
        if override is not None:
            return override(args, kwargs)
        return self.quant_modules[fqn](*args, **kwargs)

    def _weight_simulation_hook(self, parameters: dict[str, torch.Tensor]) -> Callable:
        def hook(module, args, output):
            if self.simulating:
                return None  # the functional_call below re-enters this hook
            self.simulating = True
            try:
                return functional_call(module, parameters, args)
            finally:
                self.simulating = False
        return hook

    def _install_float(self, layer: LayerMatch, node_callbacks: dict) -> None:
        def keep_output(value):
            if self.shadowing or self.simulating:
                return
            tensor = first_tensor(value)
            # Kept as produced (ReLU applied on read) so that gradients reach it in float_grad mode.
            self.float_outputs[layer.name].append(tensor if self.float_grad or tensor is None else tensor.detach())

        if layer.float_exit.kind == NODE_SITE:
            node_callbacks[layer.float_exit.name] = keep_output
        else:
            self._hook(self.float_modules[layer.float_exit.name], lambda module, args, output: keep_output(output))
        if self.shadow and layer.is_module:
            def keep_input(module, args, kwargs):
                self.float_inputs[layer.name].append((map_tensors(args, _detach), map_tensors(kwargs, _detach)))
            self._hook(self.float_modules[layer.float_entry.name], keep_input, pre=True)

    def _install_quant(self, layer: LayerMatch, node_callbacks: dict) -> None:
        def compare_output(value):
            if self.shadowing or self.simulating:
                return
            index = self.quant_calls[layer.name]
            self.quant_calls[layer.name] += 1
            outputs = self.float_outputs.get(layer.name, [])
            if not self.propagated or self.on_propagated is None or index >= len(outputs):
                return
            reference, quantized = self.float_value(layer, outputs[index]), first_float(value)
            if reference is not None and quantized is not None and reference.shape == quantized.shape:
                self.on_propagated(layer, reference, quantized, quantization_scale(value) or self._frozen_scale(layer))

        exit_name = layer.quant_output_quantizer if layer.quant_output_quantizer in self.frozen else None
        if exit_name is not None and exit_name in self.quant_overrides:
            frozen_call = self.quant_overrides[exit_name]

            def quantize_and_compare(args, kwargs, frozen_call=frozen_call):
                value = frozen_call(args, kwargs)
                compare_output(value)
                return value
            self.quant_overrides[exit_name] = quantize_and_compare
        elif layer.quant_site.kind == NODE_SITE and exit_name is None:
            node_callbacks[layer.quant_site.name] = compare_output
        else:
            self._hook(self.quant_modules[exit_name or layer.quant_site.name], lambda m, a, output: compare_output(output))
        if layer.quant_site.kind == MODULE_SITE:
            def keep_spec(module, args, kwargs):
                if not self.shadowing:
                    self.input_specs[layer.name] = _input_spec(args)
            self._hook(self.quant_modules[layer.quant_site.name], keep_spec, pre=True)

    @staticmethod
    def float_value(layer: LayerMatch, raw: Any) -> Optional[torch.Tensor]:
        """The float value to compare: the stored output, with the fused ReLU applied if needed."""
        tensor = first_float(raw)
        if tensor is not None and layer.float_exit_relu:
            tensor = torch.relu(tensor)
        return tensor

    def _frozen_scale(self, layer: LayerMatch) -> Optional[float]:
        frozen = self.frozen.get(layer.quant_output_quantizer or "")
        return frozen.scale if frozen is not None else None

    # -- running --------------------------------------------------------
    def run_batch(self, batch: Any) -> tuple[Any, Any]:
        """Run one batch through both models; returns (float output, quantized output)."""
        self.float_inputs.clear()
        self.float_outputs.clear()
        self.quant_calls.clear()
        args, kwargs = as_call(batch)
        context = torch.enable_grad() if self.float_grad else torch.no_grad()
        with context:
            float_output = self.float_runner(*args, **kwargs)
        with torch.no_grad():
            quant_output = self.quant_runner(*args, **kwargs)
            if self.shadow and self.on_shadow is not None:
                self._run_shadow()
        return float_output, quant_output

    def _run_shadow(self) -> None:
        for layer in self.match.layers:
            if not layer.is_module or layer.name not in self.float_inputs:
                continue
            spec = self.input_specs.get(layer.name)
            for call_index, (args, kwargs) in enumerate(self.float_inputs[layer.name]):
                outputs = self.float_outputs.get(layer.name, [])
                if call_index >= len(outputs):
                    break
                shadow_args = self._shadow_inputs(layer, args, spec)
                self.shadowing = True
                try:
                    value = self._call_quant_module(layer.quant_site.name, shadow_args, kwargs)
                    if layer.quant_output_quantizer in self.frozen:
                        value = self.frozen[layer.quant_output_quantizer](first_float(value))
                finally:
                    self.shadowing = False
                quantized = first_float(value)
                reference = self.float_value(layer, outputs[call_index])
                if quantized is not None and reference is not None and quantized.shape == reference.shape:
                    self.on_shadow(layer, reference, quantized, quantization_scale(value) or self._frozen_scale(layer))

    def _shadow_inputs(self, layer: LayerMatch, args: tuple, spec: Any) -> tuple:
        if layer.quant_input_quantizer in self.frozen and args:
            first = self.frozen[layer.quant_input_quantizer](args[0])
            return (first,) + tuple(args[1:])
        if spec is not None:
            return _apply_input_spec(args, spec)
        return args

    def run(self, data: Iterable) -> Iterator[tuple[Any, Any, Any]]:
        """Yield (batch, float output, quantized output) for every batch."""
        for batch in data:
            float_output, quant_output = self.run_batch(batch)
            yield batch, float_output, quant_output
            self.float_inputs.clear()
            self.float_outputs.clear()


def _detach(value: torch.Tensor) -> torch.Tensor:
    return value.detach()
