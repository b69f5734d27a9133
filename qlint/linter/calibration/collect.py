"""``collect_statistics``: points → observers → run → (merge across ranks) → statistics."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from qlint.core.preserve import preserved_state
from qlint.errors import ConfigError, EmptyCalibrationError
from qlint.linter.calibration.distributed import all_reduce, rank_group, shard
from qlint.linter.calibration.observers import DEFAULT_REFERENCE_PERCENTILE, insert_hook_observers, insert_observers
from qlint.linter.calibration.points import in_graph_order, resolve_point_needs
from qlint.linter.calibration.run import batch_total, limited_batches, run_calibration
from qlint.linter.calibration.statistics import CalibrationStatistics
from qlint.linter.findings import Notice
from qlint.linter.rule import Need, Rule
from qlint.stats import thread_scratch_buffers
from qlint.stats.selection import PERCENTILE_EVERY


@dataclasses.dataclass(frozen=True)
class CalibrationOptions:
    """How calibration runs (``lint(..., calibration_options=...)`` takes these as a dict)."""

    quiet: bool = False  # no progress bar
    num_batches: int | None = None  # run at most this many batches
    distributed: bool | None = None  # True: merge across ranks; False: never; None: when initialized
    group: Any = None  # the torch.distributed process group to merge over
    shard: bool = False  # each rank takes every world_size-th batch of the same data
    # Points of more than 32 channels select QL203's reference quantile on one batch in this
    # many (1: every batch, torch's statistic; qlint.stats.selection says what more costs).
    percentile_every: int = PERCENTILE_EVERY

    def __post_init__(self) -> None:
        if self.percentile_every < 1:
            raise ConfigError(f"percentile_every must be at least 1, got {self.percentile_every}")
        if self.num_batches is not None and self.num_batches < 1:
            # 0 would run no batch and blame the data for being empty
            raise ConfigError(f"num_batches must be at least 1 (or None: every batch), got {self.num_batches}")

    @classmethod
    def of(cls, options: None | CalibrationOptions | Mapping[str, Any]) -> CalibrationOptions:
        if options is None:
            return cls()
        if isinstance(options, CalibrationOptions):
            return options
        known = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(str(key) for key in options if key not in known)
        if unknown:
            raise ConfigError(f"unknown calibration option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**dict(options))


def collect_statistics(
    analysis: Any,
    rules: Sequence[Rule],
    calibration: Any,
    options: None | CalibrationOptions | Mapping[str, Any] = None,
) -> tuple[CalibrationStatistics, list[Notice]]:
    """Observe the analysis copy's tensor points while ``calibration`` runs through it."""
    opts = CalibrationOptions.of(options)
    graph = analysis.graph
    data_rules = [r for r in rules if Need.STATISTICS in r.requires]
    needs = resolve_point_needs(graph, data_rules)
    points = in_graph_order(graph, needs)
    q = _reference_percentile(data_rules)
    hooks: list[Any] = []
    shared = analysis.traced.graph_module if analysis.traced is not None else analysis.model
    with preserved_state(shared):
        if analysis.traced is not None:
            observed, observers, skipped = insert_observers(
                analysis.traced.graph_module, points, q, needs, percentile_every=opts.percentile_every
            )
        else:
            observed, observers, skipped, hooks = insert_hook_observers(
                analysis.model, graph, points, q, needs, percentile_every=opts.percentile_every
            )
        ranks = rank_group(opts.distributed, opts.group)
        batches = limited_batches(calibration, opts.num_batches)
        if ranks.distributed and opts.shard:
            batches = shard(batches, ranks)
        try:
            count = run_calibration(
                observed, batches, quiet=opts.quiet or ranks.rank != 0, total=batch_total(calibration, opts.num_batches)
            )
        finally:
            for handle in hooks:
                handle.remove()
    stats = {point: observers[point].stats for point in observers}
    thread_scratch_buffers().clear()  # work buffers sized for the largest activation: not kept after lint
    if ranks.distributed:
        stats, count = all_reduce(stats, count, ranks)
    if count == 0:
        raise EmptyCalibrationError(
            "calibration data is empty: it yielded no batch (pass a tensor, a list of batches or a non-empty folder)"
        )
    notices = [
        Notice(
            message=f"calibration: cannot observe {point.side} {point.index} of {point.node}; "
            "rules that need it skip that layer"
        )
        for point in skipped
    ]
    return CalibrationStatistics(graph, stats, count, ranks.world_size), notices


def _reference_percentile(rules: Sequence[Rule]) -> float:
    for rule in rules:
        value = getattr(rule.options, "reference_percentile", None)
        if isinstance(value, float):
            return value
    return DEFAULT_REFERENCE_PERCENTILE
