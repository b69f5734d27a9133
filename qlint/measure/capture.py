"""Run a float model and its quantized counterpart side by side, one batch at a time.

``PairedRunner`` puts forward hooks on the matched modules of both models (and,
for functional ops of FX graphs, reads node outputs through an FX interpreter),
and for every batch:

1. runs the float model, keeping each layer's output for this batch.  The
   model goes on with a copy, so in-place ops downstream (``ReLU6(inplace=True)``,
   ``x += y``) cannot change what was kept;
2. runs the quantized model on its own (*propagated*), handing each layer's
   output to ``on_propagated`` next to the float output;
3. as each quantized module layer runs in step 2, runs the float layer (with
   the BN/ReLU the quantized one fused in) on that layer's dequantized input
   (*shadow*, torch NS ``add_shadow_loggers``'s definition), handing both
   outputs to ``on_shadow``: the error this layer adds, given the input it
   really gets. A layer whose int8 grid ends inside the range its only consumer
   clamps to is read after that clamp (:mod:`qlint.measure.consumer_clamp`);
4. for a layer fed by no other layer (its inputs are the model's), hands the
   float layer's input, the quantized layer's input and the grid the quantized
   model put that input on to ``on_input_grid``: whether the two models feed the
   layer different values only because the quantized model quantizes its input;
5. optionally (*isolated*, for sensitivity) feeds each quantized layer the float
   layer's input, put on the grid its input had in step 2, handing the result to
   ``on_isolated``: the error of quantizing this layer alone.

Values of one batch are dropped before the next batch starts, so memory does
not grow with the number of batches.  ``qlint.core.preserve.preserved_state``
makes sure neither model is changed: hooks are removed, buffers (observer
statistics, BN stats), parameters, attributes and train/eval flags are restored
even when a batch raises, and each model gets its own copy of every batch.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.ao.quantization import FakeQuantizeBase, ObserverBase
from torch.func import functional_call

from qlint.core.batches import as_call
from qlint.core.exported import put_in_eval
from qlint.core.nested import first_float, first_tensor, map_tensors
from qlint.core.preserve import preserved_state
from qlint.measure.call_sites import CallCounter, watched_calls
from qlint.measure.consumer_clamp import within
from qlint.measure.match_result import MODULE_SITE, NODE_SITE, CounterpartKind, LayerMatch, MatchResult, Site
from qlint.measure.metrics import quantization_scale
from qlint.measure.node_tap import NodeTap, blamed_on
from qlint.measure.quantizers import (
    FrozenQuantizer,
    QuantGrid,
    apply_input_spec,
    frozen_quantizer,
    grid_of,
    input_spec,
)
from qlint.measure.weights import simulated_weight_parameters

FLOAT_RUN, QUANT_RUN = "float", "quantized"

Callback = Callable[[LayerMatch, torch.Tensor, torch.Tensor, float | None], None]
# (layer, the float layer's input, the quantized layer's input dequantized, the grid it is on)
InputGridCallback = Callable[[LayerMatch, torch.Tensor, torch.Tensor, QuantGrid], None]


class PairedRunner:
    """Hooks both models for one comparison session; use as a context manager.

    ``on_propagated``, ``on_shadow`` and ``on_isolated`` receive (layer, float
    reference, quantized value, quantization step or None) as each pair becomes
    available; the tensors are valid only during the call (copy to keep them).
    ``on_input_grid`` receives, for each module layer no other layer feeds, (layer, the
    float layer's first input, the quantized layer's first input, the per-tensor grid the
    quantized model put it on) when the quantized model quantized that input.
    """

    def __init__(
        self,
        float_model: nn.Module,
        quantized_model: nn.Module,
        match: MatchResult,
        *,
        propagated: bool = True,
        shadow: bool = True,
        isolated: bool = False,
        on_propagated: Callback | None = None,
        on_shadow: Callback | None = None,
        on_isolated: Callback | None = None,
        on_input_grid: InputGridCallback | None = None,
        float_grad: bool = False,
        capture: bool = True,
    ):
        self.float_model, self.quantized_model, self.match = float_model, quantized_model, match
        self.propagated = propagated and on_propagated is not None
        self.shadow = shadow and on_shadow is not None
        self.isolated = isolated and on_isolated is not None
        self.on_propagated, self.on_shadow, self.on_isolated = on_propagated, on_shadow, on_isolated
        self.on_input_grid = on_input_grid
        self.float_grad = float_grad
        self.capture = capture  # False: only run both models (prepared-model simulation still applies)
        self.guard = preserved_state(float_model, quantized_model)
        self.float_inputs: dict[str, list] = defaultdict(list)  # isolated run only
        self.float_outputs: dict[str, list] = defaultdict(list)
        self.float_model_inputs: dict[str, list[torch.Tensor]] = defaultdict(list)  # on_input_grid only
        self.grid_calls: dict[str, int] = defaultdict(int)
        self.quant_calls: dict[str, int] = defaultdict(int)
        self.quant_inputs: dict[str, tuple[tuple, dict]] = {}  # shadow run: the current call's input
        self.input_specs: dict[str, list[Any]] = defaultdict(list)  # isolated run: each call's input grid
        self.module_calls = CallCounter()  # a layer read at one call of a shared module acts in that call
        # The runner's own calls (shadow and isolated runs; weight simulation re-entering a
        # module): the capture hooks ignore them.
        self.replaying = False
        self.simulating = False
        # Which model is running (FLOAT_RUN / QUANT_RUN, None between batches).  prepare_fx
        # without a deepcopy shares every module it does not swap (pooling, activations, and
        # in prepared models the layers too) between the float model and its counterpart, so
        # one module carries the hooks of both sides; each hook acts only in its own model's run.
        self.phase: str | None = None
        self.float_modules = dict(float_model.named_modules(remove_duplicate=False))
        self.quant_modules = dict(quantized_model.named_modules(remove_duplicate=False))
        self.frozen: dict[str, FrozenQuantizer] = {}
        self.quant_overrides: dict[str, Callable] = {}
        self.simulated_weights: dict[str, dict[str, torch.Tensor]] = {}
        self.read_after_clamp: set[str] = set()  # layers compared after their consumer's clamp

    # -- setup ----------------------------------------------------------
    def __enter__(self) -> PairedRunner:
        self.guard.__enter__()
        try:
            # Observers update their statistics on every call and fake-quants may re-estimate
            # their scales; eval mode and the guard keep the user's models as they were.
            put_in_eval(self.float_model, "the float model")
            put_in_eval(self.quantized_model, "the quantized model")
            self._install()
        except BaseException:
            self.guard.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.guard.__exit__(*exc_info)

    def _hook(self, module: nn.Module, hook: Callable, pre: bool = False, first: bool = False) -> None:
        if pre:
            self.guard.add_handle(module.register_forward_pre_hook(hook, with_kwargs=True, prepend=first))
        else:
            self.guard.add_handle(module.register_forward_hook(hook))

    def _install(self) -> None:
        if self.match.counterpart is CounterpartKind.PREPARED:
            self._install_prepared_simulation()
        float_node_callbacks: dict[str, Callable] = {}
        quant_node_callbacks: dict[str, Callable] = {}
        for run, name in watched_calls(self.match.layers if self.capture else [], FLOAT_RUN, QUANT_RUN):
            module = (self.float_modules if run == FLOAT_RUN else self.quant_modules)[name]
            # first: the capture pre-hooks on the module ask which call is running
            hook = self.module_calls.counting_hook(run, name, functools.partial(self.capturing, run))
            self._hook(module, hook, pre=True, first=True)
        for layer in self.match.layers if self.capture else []:
            self._install_float(layer, float_node_callbacks)
            self._install_quant(layer, quant_node_callbacks)
        self.float_runner = self._runner(self.float_model, self.match.float_graph, float_node_callbacks)
        self.quant_runner = self._runner(
            self.quantized_model, self.match.quant_graph, quant_node_callbacks, self.quant_overrides
        )

    def _runner(
        self, model: nn.Module, graph: torch.fx.GraphModule | None, callbacks: dict, overrides: dict | None = None
    ) -> Callable:
        if not callbacks and not overrides:
            return model
        if graph is None:
            raise ValueError("node callbacks and overrides need an FX graph")
        return NodeTap(graph, callbacks, overrides)

    def _install_prepared_simulation(self) -> None:
        """Freeze activation quantizers and fake-quantize PTQ weights for the run.

        In an FX graph the interpreter calls the frozen fake-quant instead of the
        observer (which then never sees our data); in eager models a forward hook
        replaces the observer's output.
        """
        in_graph = self.match.quant_graph is not None
        quantizer_names = {
            name
            for layer in self.match.layers
            for name in (layer.quant_input_quantizer, layer.quant_output_quantizer)
            if name
        }
        if self.match.quant_graph is not None:
            quantizer_names |= {
                str(node.target)
                for node in self.match.quant_graph.graph.nodes
                if node.op == "call_module"
                and isinstance(self.quant_modules.get(str(node.target)), (ObserverBase, FakeQuantizeBase))
            }
        else:
            # Eager prepare() attaches activation observers as `<module>.activation_post_process`
            # and calls them from a forward hook; a FakeQuantize's own inner observer is not one.
            quantizer_names |= {
                name
                for name, module in self.quant_modules.items()
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
                self._hook(self.quant_modules[name], self._frozen_hook(frozen))
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
                self.quant_overrides[layer.quant_site.name] = lambda args, kwargs, m=module, p=parameters: (
                    functional_call(m, p, args, kwargs)
                )
            else:
                self._hook(module, self._weight_simulation_hook(parameters))

    def _frozen_hook(self, frozen: FrozenQuantizer) -> Callable:
        def hook(module, args, output):
            return None if self.phase == FLOAT_RUN else frozen(args[0])

        return hook

    def _call_quant_module(self, fqn: str, args: tuple, kwargs: dict) -> Any:
        override = self.quant_overrides.get(fqn)
        if override is not None:
            return override(args, kwargs)
        return self.quant_modules[fqn](*args, **kwargs)

    def _weight_simulation_hook(self, parameters: dict[str, torch.Tensor]) -> Callable:
        def hook(module, args, output):
            if self.simulating or self.phase == FLOAT_RUN:
                # the functional_call below re-enters this hook; a module shared with the
                # float model keeps its float weights in the float run
                return None
            self.simulating = True
            try:
                return functional_call(module, parameters, args)
            finally:
                self.simulating = False

        return hook

    def _install_float(self, layer: LayerMatch, node_callbacks: dict) -> None:
        def keep_output(value):
            return self._keep_float_output(layer, value) if self.capturing(FLOAT_RUN, layer.float_exit) else None

        if layer.float_exit.kind == NODE_SITE:
            node_callbacks[layer.float_exit.name] = keep_output
        else:
            self._hook(self.float_modules[layer.float_exit.name], lambda module, args, output: keep_output(output))
        if self.isolated and layer.is_module:

            def keep_input(module, args, kwargs):
                if self.capturing(FLOAT_RUN, layer.float_entry):
                    self.float_inputs[layer.name].append(
                        (map_tensors(args, _float_copy), map_tensors(kwargs, _float_copy))
                    )

            self._hook(self.float_modules[layer.float_entry.name], keep_input, pre=True)
        if self._tracks_input_grid(layer):

            def keep_model_input(module, args, kwargs):
                if self.capturing(FLOAT_RUN, layer.float_entry):
                    first = args[0] if args and isinstance(args[0], torch.Tensor) else None
                    if first is not None and first.is_floating_point():
                        self.float_model_inputs[layer.name].append(_float_copy(first))

            self._hook(self.float_modules[layer.float_entry.name], keep_model_input, pre=True)

    def _tracks_input_grid(self, layer: LayerMatch) -> bool:
        """Whether ``on_input_grid`` measures this layer: a module layer fed by no other layer."""
        return self.on_input_grid is not None and layer.is_module and not layer.predecessors

    def _input_grid(self, layer: LayerMatch, value: Any) -> QuantGrid | None:
        """The grid the quantized model put a layer's input on: the quantized tensor's own
        (converted models), or the frozen input quantizer's (prepared models)."""
        grid = grid_of(value)
        if grid is None and layer.quant_input_quantizer in self.frozen:
            grid = self.frozen[layer.quant_input_quantizer].grid
        return grid

    def _compare_input_grid(self, layer: LayerMatch, args: tuple) -> None:
        index = self.grid_calls[layer.name]
        self.grid_calls[layer.name] += 1
        inputs = self.float_model_inputs.get(layer.name, [])
        value = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if value is None or index >= len(inputs) or self.on_input_grid is None:
            return
        grid = self._input_grid(layer, value)
        if grid is None:
            return
        actual = value.dequantize() if value.is_quantized else value.detach()
        if actual.is_floating_point() and actual.shape == inputs[index].shape:
            self.on_input_grid(layer, inputs[index], actual, grid)

    def _keep_float_output(self, layer: LayerMatch, value: Any) -> Any:
        """Keep the layer's output as produced and hand the model a copy to go on with.

        In-place ops downstream (``ReLU6(inplace=True)``, ``x += y``) then change
        the copy, not what is compared; and in ``float_grad`` mode the kept tensor
        stays on the autograd path to the model output (through the copy).
        """
        tensor = first_tensor(value)
        self.float_outputs[layer.name].append(tensor if self.float_grad or tensor is None else tensor.detach())
        return map_tensors(value, torch.Tensor.clone)

    def _install_quant(self, layer: LayerMatch, node_callbacks: dict) -> None:
        def compare_output(value):
            if not self.capturing(QUANT_RUN, layer.quant_site):
                return
            index = self.quant_calls[layer.name]
            self.quant_calls[layer.name] += 1
            quantized = first_float(value)
            if quantized is None:
                return
            scale = quantization_scale(value) or self._frozen_scale(layer)
            grid = self._output_grid(layer, value)
            if self.shadow:
                self._run_shadow(layer, quantized, scale, grid)
            outputs = self.float_outputs.get(layer.name, [])
            if self.propagated and index < len(outputs):
                reference = self.float_value(layer, outputs[index], grid)
                if reference is not None and reference.shape == quantized.shape:
                    self.on_propagated(layer, reference, quantized, scale)

        exit_name = layer.quant_output_quantizer if layer.quant_output_quantizer in self.frozen else None
        if exit_name is not None and exit_name in self.quant_overrides:
            frozen_call = self.quant_overrides[exit_name]

            def quantize_and_compare(args, kwargs, frozen_call=frozen_call):
                value = frozen_call(args, kwargs)
                compare_output(value)
                return value

            self.quant_overrides[exit_name] = quantize_and_compare
        elif layer.quant_site.kind == NODE_SITE and exit_name is None:
            node_callbacks[layer.quant_exit or layer.quant_site.name] = compare_output
        else:
            self._hook(
                self.quant_modules[exit_name or layer.quant_site.name], lambda m, a, output: compare_output(output)
            )
        tracks_grid = self._tracks_input_grid(layer)
        if layer.quant_site.kind == MODULE_SITE and (self.shadow or self.isolated or tracks_grid):

            def keep_input(module, args, kwargs):
                if not self.capturing(QUANT_RUN, layer.quant_site):
                    return
                if tracks_grid:  # before the layer runs: an in-place layer may change its input
                    self._compare_input_grid(layer, args)
                if self.shadow:  # dequantized or copied now: an in-place layer may change its input
                    self.quant_inputs[layer.name] = (map_tensors(args, _float_copy), map_tensors(kwargs, _float_copy))
                if self.isolated:
                    self.input_specs[layer.name].append(input_spec(args))

            self._hook(self.quant_modules[layer.quant_site.name], keep_input, pre=True)

    @property
    def in_own_call(self) -> bool:
        return self.replaying or self.simulating

    def capturing(self, phase: str, site: Site | None = None) -> bool:
        """Whether a capture hook of ``phase``'s model acts on the call now running (of ``site``)."""
        return self.phase == phase and not self.in_own_call and (site is None or self.module_calls.at(phase, site))

    def float_value(self, layer: LayerMatch, raw: Any, grid: QuantGrid | None = None) -> torch.Tensor | None:
        """The float value to compare: the stored output, with the fused ReLU applied if needed, and
        after the clamp that alone consumes it where ``grid`` ends inside its range (consumer_clamp)."""
        tensor = first_float(raw)
        if tensor is not None and layer.float_exit_relu:
            tensor = torch.relu(tensor)
        clamp = layer.consumer_clamp
        if tensor is not None and clamp is not None and within(grid, clamp):
            self.read_after_clamp.add(layer.name)
            tensor = tensor.clamp(clamp.low, clamp.high)
        return tensor

    def _output_grid(self, layer: LayerMatch, value: Any) -> QuantGrid | None:
        """A layer's quantized output grid: the tensor's own, or its frozen quantizer's; None: unknown
        (pt2e), or not needed (only a layer with a consumer clamp reads it, on every batch)."""
        if layer.consumer_clamp is None:
            return None
        frozen = self.frozen.get(layer.quant_output_quantizer or "")
        return grid_of(first_tensor(value)) or (frozen.grid if frozen is not None else None)

    def _frozen_scale(self, layer: LayerMatch) -> float | None:
        """The step of the layer's output grid where its value is not a quantized tensor: a
        prepared model's frozen output quantizer, a pt2e op's output quantize/dequantize pair."""
        frozen = self.frozen.get(layer.quant_output_quantizer or "")
        return frozen.scale if frozen is not None else layer.quant_output_scale

    # -- running --------------------------------------------------------
    def run_batch(self, batch: Any) -> tuple[Any, Any]:
        """Run one batch through both models; returns (float output, quantized output)."""
        self.float_inputs.clear()
        self.float_outputs.clear()
        self.float_model_inputs.clear()
        self.grid_calls.clear()
        self.quant_calls.clear()
        self.quant_inputs.clear()
        self.input_specs.clear()
        self.module_calls.clear()
        # Each model gets its own copy of the batch (as_call copies): a float model that writes
        # its input in place must not change what the quantized model sees, nor the caller's data.
        args, kwargs = as_call(batch)
        context = torch.enable_grad() if self.float_grad else torch.no_grad()
        try:
            self.phase = FLOAT_RUN
            with context, blamed_on("the float model"):
                float_output = self.float_runner(*args, **kwargs)
            self.phase = QUANT_RUN
            args, kwargs = as_call(batch)
            with torch.no_grad():
                with blamed_on("the quantized model"):
                    quant_output = self.quant_runner(*args, **kwargs)
                if self.isolated:
                    self._run_isolated()
        finally:
            self.phase = None
        return float_output, quant_output

    def _run_shadow(
        self, layer: LayerMatch, quantized: torch.Tensor, scale: float | None, grid: QuantGrid | None
    ) -> None:
        """torch NS's shadow: the float layer run on the quantized layer's (dequantized) input.

        Both sides then start from the same input, so the difference is the error
        this layer adds, whatever error its input carries.
        """
        inputs = self.quant_inputs.pop(layer.name, None)
        if inputs is None or not layer.is_module:
            return
        args, kwargs = inputs
        self.replaying = True
        try:
            with torch.no_grad():
                value = self.float_modules[layer.float_entry.name](*args, **kwargs)
                for name in layer.float_chain:  # BN / ReLU the quantized layer fused in
                    value = self.float_modules[name](value)
        finally:
            self.replaying = False
        reference = self.float_value(layer, value, grid)
        if reference is not None and reference.shape == quantized.shape and self.on_shadow is not None:
            self.on_shadow(layer, reference, quantized, scale)

    def _run_isolated(self) -> None:
        """Each quantized layer run on the float layer's input, put on the grid its input had.

        This is the error the layer would add if it alone were quantized, input
        quantization included: what ``qlint.numeric.sensitivity`` propagates.
        """
        if self.on_isolated is None:
            return  # self.isolated is only set with a callback
        for layer in self.match.layers:
            if not layer.is_module or layer.name not in self.float_inputs:
                continue
            specs = self.input_specs.get(layer.name, [])
            for call_index, (args, kwargs) in enumerate(self.float_inputs[layer.name]):
                outputs = self.float_outputs.get(layer.name, [])
                if call_index >= len(outputs):
                    break
                # each call on its own input's grid (a shared ReLU6 gets other grids after each conv)
                spec = specs[call_index] if call_index < len(specs) else None
                isolated_args = self._isolated_inputs(layer, args, spec)
                self.replaying = True
                try:
                    value = self._call_quant_module(layer.quant_site.name, isolated_args, kwargs)
                    output = first_float(value)
                    if layer.quant_output_quantizer in self.frozen and output is not None:
                        value = self.frozen[layer.quant_output_quantizer](output)
                finally:
                    self.replaying = False
                quantized = first_float(value)
                reference = self.float_value(layer, outputs[call_index], self._output_grid(layer, value))
                if quantized is not None and reference is not None and quantized.shape == reference.shape:
                    self.on_isolated(
                        layer, reference, quantized, quantization_scale(value) or self._frozen_scale(layer)
                    )

    def _isolated_inputs(self, layer: LayerMatch, args: tuple, spec: Any) -> tuple:
        if layer.quant_input_quantizer in self.frozen and args:
            first = self.frozen[layer.quant_input_quantizer](args[0])
            return (first,) + tuple(args[1:])
        if spec is not None:
            return apply_input_spec(args, spec)
        return args

    def run(self, data: Iterable) -> Iterator[tuple[Any, Any, Any]]:
        """Yield (batch, float output, quantized output) for every batch."""
        for batch in data:
            float_output, quant_output = self.run_batch(batch)
            yield batch, float_output, quant_output
            self.float_inputs.clear()
            self.float_outputs.clear()
            self.float_model_inputs.clear()


def _float_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A float copy of a layer input, detached (dequantizing makes one)."""
    return tensor.dequantize() if tensor.is_quantized else tensor.detach().clone()
