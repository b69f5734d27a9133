"""The bench of a lint run's FX trials: the data (calibration and evaluation batches, the float
outputs) kept for every trial, so that a further trial of a changed mapping (a finding's fix)
pays only for prepare/calibrate/convert and one evaluation; a failure a float-preserving
rewrite avoids (``.view`` on a quantized tensor) is measured with that rewrite."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn as nn
from torch.ao.quantization import QConfigMapping

from qlint.core.batches import as_call, call_model
from qlint.core.nested import float_tensors
from qlint.core.sqnr import BatchPowers, SqnrSums
from qlint.errors import QlintError
from qlint.measure.calibrated import CalibratedQParams
from qlint.measure.fallback import float_layers, int8_coverage
from qlint.measure.rewrite import apply_rewrites
from qlint.measure.trial import (
    STAGE_FLOAT,
    STAGE_PREPARE,
    STAGE_RUN,
    ActivationError,
    LayerError,
    TrialFailure,
    TrialResult,
    TrialStepError,
    quantize_fx,
    quantized_engine,
)
from qlint.measure.trial_errors import activation_sqnr, layer_errors


@contextlib.contextmanager
def quiet_trial() -> Iterator[None]:
    """No grad, no warnings, no stderr: prepare_fx warns per op, and a failing GraphModule
    prints its generated code's traceback to stderr; a trial reports failures itself."""
    with warnings.catch_warnings(), torch.no_grad(), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        yield


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
        with quiet_trial():
            return self._output_sqnr(self._in_eval(model), self.reference())

    def reference(self) -> list[Any]:
        """The float model's outputs on the evaluation batches (computed once)."""
        if self._reference is None:
            model = self._in_eval(self.model_factory())
            with quiet_trial():
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
        with quantized_engine(self.backend) as available, quiet_trial():
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
            with quantized_engine(self.backend), quiet_trial():
                return self._output_sqnr(model, self.reference())
        finally:
            self.seconds += time.perf_counter() - began

    def _output_sqnr(self, converted: nn.Module, reference: list[Any]) -> float | None:
        powers = self._output_powers(converted, reference)
        return powers.sqnr_db() if powers else None

    def _output_powers(self, converted: nn.Module, reference: list[Any]) -> BatchPowers | None:
        """Signal and noise power per evaluation batch; None when no output is floating-point."""
        batches: list[tuple[float, float]] = []
        totals: list[list[float]] = []  # per output tensor: signal and noise power over every batch
        for batch, expected in zip(self.evaluation, reference):
            wanted, got = float_tensors(expected), float_tensors(call_model(converted, batch))
            if len(wanted) != len(got):
                raise ValueError(f"the values hold {len(wanted)} and {len(got)} floating-point tensors")
            if not wanted:
                continue
            totals += [[0.0, 0.0] for _ in range(len(wanted) - len(totals))]
            this_batch = SqnrSums()
            for total, pair in zip(totals, zip(wanted, got)):  # each tensor's powers, computed once
                one = SqnrSums()
                one.add(*pair)
                total[0] += one.signal_power
                total[1] += one.noise_power
                this_batch.signal_power += one.signal_power
                this_batch.noise_power += one.noise_power
            batches.append((this_batch.signal_power, this_batch.noise_power))
        tensors = tuple((signal, noise) for signal, noise in totals)
        return BatchPowers(tuple(batches), tensors) if batches else None


def _view_on_quantized(failure: TrialFailure | None) -> bool:
    """convert_fx's quantized convs return channels-last tensors, on which `.view` raises."""
    return failure is not None and failure.stage == STAGE_RUN and "view size is not compatible" in str(failure.error)
