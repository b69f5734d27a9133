"""The read-only context every rule receives, built once per lint run."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from torch.ao.quantization import QConfigMapping

from qlint.core.backends import BackendInfo
from qlint.core.graph import ModelGraph
from qlint.measure.trial import TrialBench, TrialResult

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

    @property
    def eager_flow(self) -> bool:
        """QuantStub/DeQuantStub mark a model meant for eager-mode quantization."""
        return self.graph.uses_eager_stubs()
