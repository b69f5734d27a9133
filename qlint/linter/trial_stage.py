"""Lint's trial quantization: whether it can run, on which data, and its summary.

The trial (``qlint.measure.trial``) quantizes a private copy of the traced model with
the intended QConfigMapping, the way the user will. It calibrates on the first
``TrialOptions.batches`` calibration batches when calibration data is given and can
be read twice (a list, a tensor, a DataLoader, a folder), otherwise on the example
inputs, and evaluates on the example inputs. The report says which.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import Field

from qlint.core.batches import batches_of
from qlint.errors import ConfigError, validation_problems
from qlint.linter.context import INTENT_DEFAULT, INTENT_MAPPING
from qlint.linter.findings import TrialSummary
from qlint.linter.rule import RuleOptions
from qlint.measure.pt2e_trial import Pt2eBench, pt2e_blocker
from qlint.measure.trial import TrialResult
from qlint.measure.trial_bench import TrialBench


class TrialOptions(RuleOptions):
    """How lint's trial quantization and the impact of its findings are measured."""

    enabled: bool = Field(True, description="Run the trial quantization (needs example inputs).")
    batches: int = Field(16, gt=0, description="Calibration batches each trial calibrates on.")
    min_impact_db: float = Field(
        0.5,
        ge=0,
        description=("A warning or error whose measured impact is below this (dB of output SQNR) becomes info."),
    )
    max_fix_trials: int = Field(
        12,
        ge=0,
        description=(
            "Single trials spent measuring findings' fixes; past these, the rest are measured in groups "
            "(adaptive group testing, at most as many group trials again)."
        ),
    )

    @classmethod
    def of(cls, options: None | TrialOptions | Mapping[str, Any]) -> TrialOptions:
        if options is None:
            return cls()
        if isinstance(options, TrialOptions):
            return options
        try:
            return cls(**dict(options))
        except ValueError as error:  # pydantic's ValidationError: unknown or bad option
            raise ConfigError(f"bad trial options: {validation_problems(error)}") from error


def trial_blocker(analysis: Any, example: Sequence[Any] | None, options: TrialOptions, backend: str) -> str | None:
    """Why no trial can run for this analysis; None when one can."""
    if not options.enabled:
        return "the trial quantization is turned off"
    if not example:
        return "no example inputs (pass --input-shape or --example-inputs)"
    if analysis.traced is None:
        return "the model could not be traced with torch.fx, so prepare_fx cannot quantize it"
    if analysis.traced.exported:
        blocker = pt2e_blocker(backend)
        if blocker is not None:
            return blocker
    if analysis.intent not in (INTENT_DEFAULT, INTENT_MAPPING) or analysis.qconfig_mapping is None:
        return f"the quantization intent is a {analysis.intent}, not a QConfigMapping prepare_fx can take"
    return None


def _calibration_batches(calibration: Any, count: int) -> list[Any] | None:
    """The first ``count`` batches, unless reading them would use up a one-shot iterator."""
    if calibration is None:
        return None
    if not isinstance(calibration, Mapping):
        try:
            if iter(calibration) is calibration:
                return None
        except TypeError:
            pass
    return list(itertools.islice(batches_of(calibration, "calibration data"), count)) or None


def _counted_batches(count: int, kind: str = "") -> str:
    """``4 batches``, ``1 later calibration batch``."""
    return f"{count} {kind + ' ' if kind else ''}{'batch' if count == 1 else 'batches'}"


def trial_bench(
    analysis: Any,
    example: Sequence[Any],
    calibration: Any,
    backend: str,
    options: TrialOptions,
    num_batches: int | None = None,
) -> TrialBench:
    """Calibrate on calibration batches and evaluate on later ones it did not calibrate on;
    with a single batch, or none, say that calibration and evaluation share data.
    ``num_batches``: the most calibration batches to read (``--num-batches``), as the
    statistics read them."""
    graph_module = analysis.traced.graph_module
    held_out = max(1, options.batches // 4)
    wanted = options.batches + held_out
    batches = _calibration_batches(calibration, wanted if num_batches is None else min(wanted, num_batches)) or []
    if len(batches) >= 2:
        evaluation_count = min(held_out, len(batches) // 2)
        calibration_batches, evaluation = batches[:-evaluation_count], batches[-evaluation_count:]
        calibrated_on = f"{_counted_batches(len(calibration_batches))} of the calibration data"
        evaluated_on = (
            f"{_counted_batches(len(evaluation), 'later calibration')} (held out from the trial's calibration)"
        )
    elif batches:
        calibration_batches = evaluation = batches
        calibrated_on = "the one calibration batch"
        evaluated_on = "the same batch (the data it was calibrated on)"
    else:
        calibration_batches = evaluation = [tuple(example)]
        why = "" if calibration is None else " (the calibration data is a one-shot iterator)"
        calibrated_on = f"the example inputs{why}"
        evaluated_on = "the example inputs (the data it was calibrated on)"
    if analysis.traced.exported:  # an aten graph: the pt2e flow quantizes it
        return Pt2eBench(
            lambda: copy.deepcopy(graph_module),
            backend,
            calibration_batches,
            evaluation,
            calibrated_on,
            evaluated_on,
            analysis.qconfig_mapping,
        )
    return TrialBench(
        lambda: copy.deepcopy(graph_module), backend, calibration_batches, evaluation, calibrated_on, evaluated_on
    )


def summary(bench: TrialBench, result: TrialResult, *, fixed_sqnr_db: float | None, fix_trials: int) -> TrialSummary:
    recoverable = None
    if fixed_sqnr_db is not None and result.output_sqnr_db is not None:
        recoverable = round(fixed_sqnr_db - result.output_sqnr_db, 3)
    return TrialSummary(
        backend=result.backend,
        calibrated_on=result.calibrated_on,
        evaluated_on=result.evaluated_on,
        converted=result.converted,
        workaround=result.workaround,
        failed_stage=result.failure.stage if result.failure else None,
        output_sqnr_db=None if result.output_sqnr_db is None else round(result.output_sqnr_db, 3),
        output_tensor_sqnr_db=_per_tensor(result),
        int8_ops=result.int8_ops,
        weighted_ops=result.weighted_ops,
        float_layers=[layer.target for layer in result.float_layers],
        fixed_sqnr_db=None if fixed_sqnr_db is None else round(fixed_sqnr_db, 3),
        recoverable_db=recoverable,
        fix_trials=fix_trials,
        seconds=round(bench.seconds, 3),
    )


def _per_tensor(result: TrialResult) -> list[float | None] | None:
    """Each output tensor's SQNR where the output holds several (None: one, or none measured)."""
    powers = result.output_powers
    if powers is None or len(powers.tensors) < 2:
        return None
    return [None if value is None else round(value, 3) for value in powers.tensor_sqnr_db()]
