"""The read-only context every rule receives, built once per lint run."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch.fx as fx
from torch.ao.quantization import QConfigMapping

from qlint.core.backends import BackendInfo
from qlint.core.graph import ModelGraph
from qlint.measure.trial import TrialResult
from qlint.measure.trial_bench import TrialBench

# How the user stated their quantization intent.
INTENT_DEFAULT = "backend default mapping"
INTENT_MAPPING = "user QConfigMapping"
INTENT_PREPARED = "prepared model (observers in the graph)"
INTENT_EAGER = "eager .qconfig attributes"


@dataclasses.dataclass(frozen=True)
class LintContext:
    graph: ModelGraph
    backend: BackendInfo
    intent: str
    qconfig_mapping: QConfigMapping | None
    example_inputs: tuple[Any, ...] | None = None
    statistics: Any = None  # calibration statistics view, when calibration data was given
    model_name: str = "model"
    # Each call returns a fresh deep copy of the traced model, for rules that must run it
    # (e.g. a trial prepare/convert); the user's model is never handed out.
    model_factory: Callable[[], Any] | None = None
    # The trial quantization (qlint.measure.trial), when example inputs allowed one;
    # trial_skipped says why not.
    trial: TrialResult | None = None
    trial_bench: TrialBench | None = None  # for rules that measure their own fix (QL106)
    trial_skipped: str = "no trial quantization was run"

    def traced_model(self) -> fx.GraphModule | None:
        """A fresh private copy of the traced model when it is an fx GraphModule (rules that
        walk or run the graph), else None."""
        model = self.model_factory() if self.model_factory is not None else None
        return model if isinstance(model, fx.GraphModule) else None

    def data_batches(self) -> list[Any]:
        """Every batch the trial had, its calibration part then the later ones it evaluates on
        (the example inputs without a trial): for rules that measure the data themselves."""
        if self.trial_bench is None:
            return [self.example_inputs] if self.example_inputs is not None else []
        calibration, evaluation = self.trial_bench.calibration, self.trial_bench.evaluation
        seen = {id(batch) for batch in calibration}  # one batch can be both (a single-batch run)
        return [*calibration, *(batch for batch in evaluation if id(batch) not in seen)]

    @property
    def eager_flow(self) -> bool:
        """QuantStub/DeQuantStub mark a model meant for eager-mode quantization."""
        return self.graph.uses_eager_stubs()
