"""Calibration: run data through an observed copy of the model and collect statistics.

``collect_statistics`` is what the engine calls when calibration data is given and a
selected rule needs :data:`Need.STATISTICS`. It resolves every rule's ``observes``
specs against the :class:`ModelGraph` (:mod:`.points`), inserts one
:class:`qlint.stats.StatsObserver` per distinct point into a copy of the traced
GraphModule's graph (:mod:`.observers`; the user's model is never touched), runs the
batches under ``torch.no_grad()`` in eval mode on the model's device (:mod:`.run`),
and returns a read-only :class:`CalibrationStatistics`. Observers fold each batch
into mergeable :class:`TensorStats`; no activation is kept from one batch to the next.

Under ``torch.distributed`` each rank calibrates its own shard and the statistics are
merged with :func:`qlint.stats.all_reduce_stats` (:mod:`.distributed`), so every rank
builds the same global report.
"""

from qlint.linter.calibration.collect import CalibrationOptions, collect_statistics
from qlint.linter.calibration.observers import DEFAULT_REFERENCE_PERCENTILE, insert_hook_observers, insert_observers
from qlint.linter.calibration.points import (
    FEATURES,
    ObservationPoint,
    StatisticNeeds,
    resolve_channel_axis,
    resolve_point_needs,
    resolve_points,
)
from qlint.linter.calibration.run import run_calibration
from qlint.linter.calibration.statistics import CalibrationStatistics

__all__ = [
    "DEFAULT_REFERENCE_PERCENTILE",
    "FEATURES",
    "CalibrationOptions",
    "CalibrationStatistics",
    "ObservationPoint",
    "StatisticNeeds",
    "collect_statistics",
    "insert_hook_observers",
    "insert_observers",
    "resolve_channel_axis",
    "resolve_point_needs",
    "resolve_points",
    "run_calibration",
]
