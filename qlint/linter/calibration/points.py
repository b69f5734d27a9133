"""Which tensors calibration observes: the rules' ``observes`` specs resolved on the graph."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

from qlint.core.graph import ModelGraph
from qlint.linter.rule import Need, ObservationSpec, Rule

FEATURES = "features"
_CONV_LIKE = (
    "conv",
    "conv1d",
    "conv2d",
    "conv3d",
    "conv_transpose1d",
    "conv_transpose2d",
    "conv_transpose3d",
    "batch_norm",
)


@dataclasses.dataclass(frozen=True, order=True)
class ObservationPoint:
    """One concrete tensor point: the ``index``-th input (or the output) of graph node ``node``."""

    node: str
    side: str
    index: int
    channel_axis: int | None


@dataclasses.dataclass(frozen=True)
class StatisticNeeds:
    """Which optional statistics some rule observing a point reads (min, max and counts are always there)."""

    percentile: bool = False
    histogram: bool = False
    moments: bool = False

    def with_spec(self, spec: ObservationSpec) -> StatisticNeeds:
        return StatisticNeeds(
            self.percentile or spec.percentile, self.histogram or spec.histogram, self.moments or spec.moments
        )


# What an observer computes when no rule says: everything.
ALL_STATISTICS = StatisticNeeds(percentile=True, histogram=True, moments=True)

PointNeeds = dict[ObservationPoint, StatisticNeeds]


def resolve_channel_axis(spec_axis: Any, kind: str) -> int | None:
    """``"features"`` → 1 for conv-like ops, the last axis (-1) for linear and the rest."""
    if spec_axis != FEATURES:
        return spec_axis
    return 1 if kind in _CONV_LIKE else -1


def resolve_points(graph: ModelGraph, rules: Iterable[Rule]) -> list[ObservationPoint]:
    """Every distinct point that the rules' ``observes`` specs name in ``graph``."""
    return in_graph_order(graph, resolve_point_needs(graph, rules))


def in_graph_order(graph: ModelGraph, points: Iterable[ObservationPoint]) -> list[ObservationPoint]:
    return sorted(points, key=lambda p: (graph.position(p.node), p.side, p.index, str(p.channel_axis)))


def resolve_point_needs(graph: ModelGraph, rules: Iterable[Rule]) -> PointNeeds:
    """Each distinct point → the optional statistics any rule observing it reads."""
    needs: PointNeeds = {}
    for rule in rules:
        for spec in _specs_of(rule):
            for node in graph.ops():
                if node.kind in spec.kinds:
                    axis = resolve_channel_axis(spec.channel_axis, node.kind)
                    point = ObservationPoint(node.name, spec.side, spec.index, axis)
                    needs[point] = needs.get(point, StatisticNeeds()).with_spec(spec)
    return needs


def _specs_of(rule: Rule) -> Sequence[ObservationSpec]:
    if Need.STATISTICS not in rule.requires:
        return ()
    return tuple(getattr(rule, "observes", ()) or ())
