"""The trial quantization: what torch will build from the user's intent, measured.

One trial is what a user runs: ``prepare_fx`` on a private copy with the intended
QConfigMapping and the backend's BackendConfig, calibration, ``convert_fx``, and the
converted model run beside the float one. It records

- the first step that failed, with the exception and the model at that step;
- the output SQNR of the converted model against the float model;
- per layer, the local (shadow, torch NS's definition) and propagated SQNR;
- per observed activation, the SQNR of quantizing that tensor with the qparams its
  own observer chose (the error the activation's rounding and clipping cost);
- the conv/linear/recurrent/attention ops that stayed float, and why
  (:mod:`qlint.measure.fallback`).

:class:`TrialBench` holds the data (calibration and evaluation batches, the float
outputs) so that further trials of changed mappings (a finding's fix) only pay for
prepare/calibrate/convert and one evaluation.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch
import torch.fx as fx
import torch.fx.config as fx_config
import torch.nn as nn
from torch.ao.quantization import QConfigMapping
from torch.ao.quantization.fx import utils as fx_quantization_utils
from torch.ao.quantization.observer import UniformQuantizationObserverBase
from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

from qlint.core.backends import backend_config
from qlint.core.batches import as_call, call_model
from qlint.core.nested import first_float
from qlint.core.ops import module_kind, quantized_form
from qlint.core.sqnr import BatchPowers, SqnrSums
from qlint.errors import QlintError
from qlint.measure.bias_correction import InputSums
from qlint.measure.calibrated import CalibratedQParams
from qlint.measure.capture import PairedRunner
from qlint.measure.fallback import FloatLayer, float_layers, int8_coverage
from qlint.measure.matching import match_layers
from qlint.measure.metrics import PairwiseErrorStats
from qlint.measure.rewrite import apply_rewrites

STAGE_FLOAT, STAGE_PREPARE, STAGE_CALIBRATE, STAGE_CONVERT, STAGE_BIAS_CORRECTION, STAGE_RUN = (
    "float run",
    "prepare_fx",
    "calibration",
    "convert_fx",
    "bias correction",
    "quantized run",
)


_M = TypeVar("_M", bound=nn.Module)


@dataclasses.dataclass(frozen=True)
class TrialFailure:
    """A step of the trial raised: which, the error, and the model it ran on (to locate the node)."""

    stage: str
    error: BaseException
    model: nn.Module | None


@dataclasses.dataclass(frozen=True)
class LayerError:
    """The error one layer shows in the converted model, float vs quantized (dB)."""

    name: str  # float module fqn, or node name for functional ops
    kind: str
    shadow_db: float | None  # the error the layer adds on the input it really gets
    propagated_db: float | None  # the error at its output, everything upstream included


@dataclasses.dataclass(frozen=True)
class ActivationError:
    """The error of quantizing one activation with the qparams its observer chose."""

    name: str  # the node whose output is quantized
    sqnr_db: float
    levels: int  # the observer's level count (quant_max - quant_min + 1): 128 with reduce_range


@dataclasses.dataclass(frozen=True)
class TrialResult:
    backend: str
    calibrated_on: str  # "calibration data (12 batches)" or "the example inputs"
    evaluated_on: str
    failure: TrialFailure | None = None
    output_sqnr_db: float | None = None
    output_powers: BatchPowers | None = None  # per evaluation batch: does a gain rest on one of them
    layers: tuple[LayerError, ...] = ()
    activations: tuple[ActivationError, ...] = ()
    float_layers: tuple[FloatLayer, ...] = ()
    int8_ops: int = 0  # conv/linear/recurrent/attention ops running in int8 ...
    weighted_ops: int = 0  # ... out of all of them (a tracer leaf counts each layer inside)
    seconds: float = 0.0
    model: nn.Module | None = None  # the converted model (the full trial only)
    # When the intended model fails only because `.view` meets a quantized channels-last
    # tensor, the measurements come from the same model with those views as reshapes
    # (identical in float); this says so. `failure` still holds what failed as intended.
    workaround: str | None = None
    converter: str = "convert_fx"  # the step that built the int8 model (convert_pt2e for exported graphs)
    # The per-layer and per-activation comparisons are evidence: when one fails, the output
    # measurement stands and this says what is missing and why.
    evidence_note: str | None = None

    def with_output(
        self, powers: BatchPowers | None, fallbacks: Sequence[FloatLayer], int8_ops: int, weighted_ops: int
    ) -> TrialResult:
        """This result with the converted model's output measured and its float fallbacks counted."""
        return dataclasses.replace(
            self,
            output_sqnr_db=powers.sqnr_db() if powers else None,
            output_powers=powers,
            float_layers=tuple(fallbacks),
            int8_ops=int8_ops,
            weighted_ops=weighted_ops,
        )

    @property
    def converted(self) -> bool:
        """The model converted and ran as intended."""
        return self.failure is None

    @property
    def measured(self) -> bool:
        """Output, layer and activation measurements exist (as intended, or with the workaround)."""
        return self.failure is None or self.workaround is not None

    def layer(self, name: str) -> LayerError | None:
        return next((layer for layer in self.layers if layer.name == name), None)

    def activation(self, node: str) -> ActivationError | None:
        return next((found for found in self.activations if found.name == node), None)


@contextlib.contextmanager
def quantized_engine(backend: str) -> Iterator[bool]:
    """Run with ``torch.backends.quantized.engine`` set to ``backend``; yields False when
    this torch build has no such engine. The caller's engine is restored."""
    previous = torch.backends.quantized.engine
    if backend not in torch.backends.quantized.supported_engines:
        yield False
        return
    torch.backends.quantized.engine = backend
    try:
        yield True
    finally:
        torch.backends.quantized.engine = previous


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    # prepare_fx warns per op, and GraphModule prints generated-code tracebacks to stderr
    # when a run fails: the trial reports failures itself.
    with warnings.catch_warnings(), torch.no_grad(), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        yield


class TrialStepError(Exception):
    """A step of prepare → calibrate → convert → run failed."""

    def __init__(self, stage: str, error: BaseException, model: nn.Module | None) -> None:
        super().__init__(f"{stage}: {error}")
        self.failure = TrialFailure(stage, error, model)


def copy_sharing_parameters(model: _M) -> _M:
    """A deep copy of ``model`` whose parameters are the original's tensors, not copies of them.

    prepare_fx and convert_fx change a model's module tree (observers, fused and quantized
    modules in place of the float ones) but never write a parameter in place: fusion and
    conversion build new tensors. The copy they consume needs modules of its own, not weights
    of its own, and sharing the weights saves a float copy of the model per quantization."""
    return copy.deepcopy(model, {id(p): p for p in model.parameters()})


def prepare_model(model: nn.Module, mapping: QConfigMapping, example: tuple[Any, ...], **kwargs: Any) -> fx.GraphModule:
    """``prepare_fx`` without a Python stack trace recorded on every node of the prepared graph.

    prepare_fx's tracer records one by default, and the first one a process records
    symbolizes it by importing torch's compiler stack: over a second per process, which
    every ``qlint`` command paid, for metadata no trial reads. The caller's setting is restored."""
    previous = fx_config.do_not_emit_stack_traces
    fx_config.do_not_emit_stack_traces = True
    try:
        return prepare_fx(model, mapping, example, **kwargs)
    finally:
        fx_config.do_not_emit_stack_traces = previous


def quantize_fx(
    model: nn.Module,
    mapping: QConfigMapping,
    backend: str,
    calibration: Sequence[Any],
    *,
    prepare_kwargs: dict[str, Any] | None = None,
    keep_prepared: bool = False,
    bias_correction: bool = False,
    calibrated: CalibratedQParams | None = None,
) -> tuple[fx.GraphModule, fx.GraphModule | None]:
    """prepare_fx → run ``calibration`` → convert_fx on ``model`` itself (pass a copy).

    Returns (converted, prepared): prepared only with ``keep_prepared`` (a copy is kept,
    because convert_fx consumes the model it converts; it shares the weights, which
    convert_fx does not write). With ``bias_correction``, calibration also streams each
    quantized conv/linear layer's input sums, and the converted layers' biases lose the
    mean shift their int8 weights cause (:mod:`qlint.measure.bias_correction`).
    ``calibrated``: the qparams earlier quantizations of this same float model (on these
    batches) calibrated; observers they cover are not calibrated again, and the ones calibrated
    now are added (:mod:`qlint.measure.calibrated`). Raises :class:`TrialStepError`."""
    try:
        return _quantize_fx(
            model, mapping, backend, calibration, prepare_kwargs, keep_prepared, bias_correction, calibrated
        )
    finally:
        _forget_quantized_models()


def _forget_quantized_models() -> None:
    """Drop torch's references to the models prepare_fx and convert_fx saw.

    torch caches ``assert_and_get_unique_device`` with an unbounded ``functools.cache``
    keyed by the module, so every model it was asked about (the model prepare_fx got,
    the prepared and the converted one) stays alive with its weights and observers:
    without this, memory grows with every trial quantization."""
    cache_clear = getattr(fx_quantization_utils.assert_and_get_unique_device, "cache_clear", None)
    if cache_clear is not None:
        cache_clear()


def _quantize_fx(
    model: nn.Module,
    mapping: QConfigMapping,
    backend: str,
    calibration: Sequence[Any],
    prepare_kwargs: dict[str, Any] | None,
    keep_prepared: bool,
    bias_correction: bool,
    calibrated: CalibratedQParams | None,
) -> tuple[fx.GraphModule, fx.GraphModule | None]:
    config = backend_config(backend)
    example = as_call(calibration[0], what="calibration batch 0")[0] if calibration else ()
    try:
        prepared = prepare_model(model.eval(), mapping, example, backend_config=config, **(prepare_kwargs or {}))
    except QlintError:
        raise
    except Exception as error:  # torch raises many kinds for unsupported graphs
        raise TrialStepError(STAGE_PREPARE, error, model) from error
    if calibrated is not None:
        calibrated.reuse(prepared)
    input_sums = InputSums(prepared) if bias_correction else None
    try:
        with torch.no_grad(), input_sums.recording() if input_sums else contextlib.nullcontext():
            for batch in calibration:
                call_model(prepared, batch)
    except QlintError:  # the caller's data is wrong (a batch that is no call): theirs to fix
        raise
    except Exception as error:
        raise TrialStepError(STAGE_CALIBRATE, error, prepared) from error
    kept = copy_sharing_parameters(prepared) if keep_prepared else None
    if calibrated is not None:
        calibrated.record(prepared)
        calibrated.reuse(prepared)  # convert_fx reads what record computed instead of searching again
    try:
        converted = convert_fx(prepared, backend_config=config)
    except Exception as error:
        raise TrialStepError(STAGE_CONVERT, error, prepared) from error
    if input_sums is not None:
        try:
            input_sums.correct(converted)
        except Exception as error:  # an unusual layer torch's quantized modules reject
            raise TrialStepError(STAGE_BIAS_CORRECTION, error, converted) from error
    return converted, kept


class TrialBench:
    """The data of a lint run's trials: a model factory, calibration and evaluation batches.

    ``model_factory`` returns a fresh private copy of the float model on every call."""

    def __init__(
        self,
        model_factory: Callable[[], nn.Module],
        backend: str,
        calibration: Sequence[Any],
        evaluation: Sequence[Any],
        calibrated_on: str,
        evaluated_on: str,
    ) -> None:
        self.model_factory, self.backend = model_factory, backend
        self.calibration, self.evaluation = list(calibration), list(evaluation)
        self.calibrated_on, self.evaluated_on = calibrated_on, evaluated_on
        self._reference: list[Any] | None = None
        self.seconds = 0.0  # time spent in trials, all of them
        # set by run() when the intended model fails in a way a float-preserving rewrite avoids
        # (`.view` on a quantized tensor): every later trial of this bench quantizes this copy
        self._rewritten: nn.Module | None = None
        # What this bench's trials calibrated, for its later trials: valid while the float model
        # (the factory's, or _rewritten) stays the same.
        self._calibrated = CalibratedQParams()

    def variant(self, model_factory: Callable[[], nn.Module]) -> TrialBench:
        """The same data, another float model (a changed copy): its trials compare with its own outputs."""
        return TrialBench(
            model_factory, self.backend, self.calibration, self.evaluation, self.calibrated_on, self.evaluated_on
        )

    @staticmethod
    def _in_eval(model: nn.Module) -> nn.Module:
        """The float model as it is compared (in eval mode)."""
        return model.eval()

    def float_sqnr_of(self, model: nn.Module) -> float | None:
        """SQNR of another float model's outputs against this bench's float model (how much a
        float change changes the outputs; 200 dB when it changes nothing)."""
        with _quiet():
            return self._output_sqnr(self._in_eval(model), self.reference())

    def reference(self) -> list[Any]:
        """The float model's outputs on the evaluation batches (computed once)."""
        if self._reference is None:
            model = self._in_eval(self.model_factory())
            with _quiet():
                self._reference = [call_model(model, batch) for batch in self.evaluation]
        return self._reference

    def run(self, mapping: QConfigMapping, *, measure_layers: bool = True) -> TrialResult:
        """The full trial: convert, then measure output, layers, activations and fallbacks."""
        began = time.perf_counter()
        result = self._run(mapping, measure_layers)
        if result.failure is not None and self._rewritten is None:
            note = self._workaround(result.failure)
            if note is not None:
                retry = self._run(mapping, measure_layers)
                if retry.failure is None:
                    result = dataclasses.replace(retry, failure=result.failure, workaround=note)
                else:
                    self._rewritten = None
                    self._calibrated = CalibratedQParams()
        seconds = time.perf_counter() - began
        self.seconds += seconds
        return dataclasses.replace(result, seconds=seconds)

    def _run(self, mapping: QConfigMapping, measure_layers: bool) -> TrialResult:
        base = TrialResult(self.backend, self.calibrated_on, self.evaluated_on)
        with quantized_engine(self.backend) as available, _quiet():
            if not available:
                error = RuntimeError(f"this torch build has no {self.backend} quantized engine")
                return dataclasses.replace(base, failure=TrialFailure(STAGE_PREPARE, error, None))
            try:
                reference = self.reference()
            except Exception as error:  # the float model itself fails: QL105 locates the node on a copy
                return dataclasses.replace(base, failure=TrialFailure(STAGE_FLOAT, error, self._in_eval(self._model())))
            try:
                converted, prepared = quantize_fx(
                    self._model(),
                    mapping,
                    self.backend,
                    self.calibration,
                    keep_prepared=measure_layers,
                    calibrated=self._calibrated,
                )
            except TrialStepError as step:
                return dataclasses.replace(base, failure=step.failure)
            try:
                powers = self._output_powers(converted, reference)
            except Exception as error:
                return dataclasses.replace(base, failure=TrialFailure(STAGE_RUN, error, converted))
            fallbacks = float_layers(converted, mapping)
            int8, total = int8_coverage(converted, fallbacks)
            base = base.with_output(powers, fallbacks, int8, total)
            if not measure_layers or prepared is None:
                return base
            # a fix trial (measure_layers=False) never pays for this copy of the float model
            layers: tuple[LayerError, ...] = ()
            activations: tuple[ActivationError, ...] = ()
            try:
                layers = layer_errors(self._in_eval(self._model()), converted, self.evaluation)
                activations = activation_sqnr(prepared, converted, self.evaluation)
            except Exception as error:  # the model's own code or torch's observers (Inf in a histogram)
                missing = "activation" if layers else "per-layer and activation"
                note = f"trial: no {missing} comparison: it raised {type(error).__name__}: {error}"
                base = dataclasses.replace(base, evidence_note=note[:300])
        return dataclasses.replace(base, layers=layers, activations=activations, model=converted)

    def _model(self) -> nn.Module:
        return copy.deepcopy(self._rewritten) if self._rewritten is not None else self.model_factory()

    def _workaround(self, failure: TrialFailure) -> str | None:
        """For a failure a float-preserving rewrite avoids, set ``_rewritten`` and say what it is."""
        if not _view_on_quantized(failure) or not self.calibration:
            return None
        example = as_call(self.calibration[0])[0]
        try:
            rewritten, applied = apply_rewrites(self.model_factory(), None, example, kinds=("view_to_reshape",))
        except QlintError:  # the model cannot be traced again: no workaround
            return None
        views = [node for record in applied if record.applied for node in record.nodes]
        if not views:
            return None
        self._rewritten = rewritten
        self._calibrated = CalibratedQParams()  # another float graph: nothing recorded applies
        return f"measured with .view → .reshape at {', '.join(views)} (identical in float)"

    def output_sqnr(self, mapping: QConfigMapping) -> float | None:
        """Output SQNR of the model converted under ``mapping``; None when the trial fails."""
        result = self.run(mapping, measure_layers=False)
        return result.output_sqnr_db

    def output_powers(self, mapping: QConfigMapping) -> BatchPowers | None:
        """Per evaluation batch, the output's signal and noise power under ``mapping``; None when
        the trial fails."""
        return self.run(mapping, measure_layers=False).output_powers

    def sqnr_of(self, model: nn.Module) -> float | None:
        """Output SQNR of any model (a changed copy of the converted one) on the evaluation data."""
        began = time.perf_counter()
        try:
            with quantized_engine(self.backend), _quiet():
                return self._output_sqnr(model, self.reference())
        finally:
            self.seconds += time.perf_counter() - began

    def _output_sqnr(self, converted: nn.Module, reference: list[Any]) -> float | None:
        powers = self._output_powers(converted, reference)
        return powers.sqnr_db() if powers else None

    def _output_powers(self, converted: nn.Module, reference: list[Any]) -> BatchPowers | None:
        """Signal and noise power per evaluation batch; None when no output is floating-point."""
        batches = []
        for batch, expected in zip(self.evaluation, reference):
            sums = SqnrSums()
            sums.add(expected, call_model(converted, batch))
            if sums.pairs:
                batches.append((sums.signal_power, sums.noise_power))
        return BatchPowers(tuple(batches)) if batches else None


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


def _view_on_quantized(failure: TrialFailure | None) -> bool:
    """convert_fx's quantized convs return channels-last tensors, on which `.view` raises."""
    return failure is not None and failure.stage == STAGE_RUN and "view size is not compatible" in str(failure.error)


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
