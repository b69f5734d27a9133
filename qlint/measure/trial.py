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

This module holds what a trial records (:class:`TrialResult` and its parts) and one
quantization (:func:`quantize_fx`: prepare_fx → calibrate → convert_fx);
:class:`~qlint.measure.trial_bench.TrialBench` runs the trials on its data and
:mod:`qlint.measure.trial_errors` measures the converted model.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

import torch
import torch.fx as fx
import torch.fx.config as fx_config
import torch.nn as nn
from torch.ao.quantization import QConfigMapping
from torch.ao.quantization.fx import utils as fx_quantization_utils
from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

from qlint.core.backends import backend_config
from qlint.core.batches import as_call, call_model
from qlint.core.sqnr import BatchPowers
from qlint.core.torch_warnings import quiet_about_qlints_choices
from qlint.errors import QlintError
from qlint.measure.bias_correction import InputSums
from qlint.measure.calibrated import CalibratedQParams
from qlint.measure.fallback import FloatLayer

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


def convert_model(prepared: fx.GraphModule, **kwargs: Any) -> fx.GraphModule:
    """``convert_fx`` without the warnings of the observers it makes."""
    with quiet_about_qlints_choices():
        return convert_fx(prepared, **kwargs)


def prepare_model(model: nn.Module, mapping: QConfigMapping, example: tuple[Any, ...], **kwargs: Any) -> fx.GraphModule:
    """``prepare_fx`` without a Python stack trace recorded on every node of the prepared graph.

    prepare_fx's tracer records one by default, and the first one a process records
    symbolizes it by importing torch's compiler stack: over a second per process, which
    every ``qlint`` command paid, for metadata no trial reads. The caller's setting is restored."""
    previous = fx_config.do_not_emit_stack_traces
    fx_config.do_not_emit_stack_traces = True
    try:
        with quiet_about_qlints_choices():
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
        converted = convert_model(prepared, backend_config=config)
    except Exception as error:
        raise TrialStepError(STAGE_CONVERT, error, prepared) from error
    if input_sums is not None:
        try:
            input_sums.correct(converted)
        except Exception as error:  # an unusual layer torch's quantized modules reject
            raise TrialStepError(STAGE_BIAS_CORRECTION, error, converted) from error
    return converted, kept
