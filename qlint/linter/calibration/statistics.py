"""The read-only result of one calibration run, queried by graph node name."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any

from qlint.core.graph import ModelGraph
from qlint.linter.calibration.points import ObservationPoint
from qlint.stats import TensorStats


class CalibrationStatistics:
    """Read-only statistics of one calibration run, queried by graph node name.

    ``get(node, "input", 0)`` gives the :class:`TensorStats` of the first input of
    ``node`` (``"output"`` for its output), or None when that point was not
    observed. ``batches`` is the number of batches run (over all ranks).
    """

    def __init__(
        self, graph: ModelGraph, stats: Mapping[ObservationPoint, TensorStats], batches: int, world_size: int = 1
    ) -> None:
        self._graph = graph
        self._stats = MappingProxyType(dict(stats))
        self.batches = int(batches)
        self.world_size = int(world_size)

    @property
    def graph(self) -> ModelGraph:
        return self._graph

    @property
    def points(self) -> tuple[ObservationPoint, ...]:
        return tuple(self._stats)

    def items(self) -> Iterator[tuple[ObservationPoint, TensorStats]]:
        return iter(self._stats.items())

    def get(self, node: str, side: str = "input", index: int = 0, channel_axis: Any = "any") -> TensorStats | None:
        """Stats at a point; with several channel axes observed there, a per-channel one first."""
        matches = [(p, s) for p, s in self._stats.items() if p.node == node and p.side == side and p.index == index]
        if channel_axis != "any":
            matches = [(p, s) for p, s in matches if p.channel_axis == channel_axis]
        matches.sort(key=lambda item: item[0].channel_axis is None)
        return matches[0][1] if matches else None

    def __contains__(self, point: object) -> bool:
        return point in self._stats

    def __len__(self) -> int:
        return len(self._stats)

    def __repr__(self) -> str:
        return f"CalibrationStatistics(points={len(self._stats)}, batches={self.batches})"
