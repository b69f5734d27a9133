"""Calibration under torch.distributed: each rank runs its shard, the statistics are merged."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from qlint.errors import QlintError
from qlint.linter.calibration.points import ObservationPoint
from qlint.stats import TensorStats, all_reduce_stats


@dataclasses.dataclass(frozen=True)
class RankGroup:
    """The process group statistics are merged over; one rank of one when not distributed."""

    group: Any = None
    rank: int = 0
    world_size: int = 1

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def rank_group(wanted: bool | None, group: Any = None) -> RankGroup:
    """The group to merge over: ``wanted`` True insists, False refuses, None follows torch.distributed."""
    if wanted is False:
        return RankGroup()
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        if wanted:
            raise QlintError("distributed calibration was requested but torch.distributed is not initialized")
        return RankGroup()
    return RankGroup(group, dist.get_rank(group), dist.get_world_size(group))


def shard(batches: Iterable[Any], ranks: RankGroup) -> Iterator[Any]:
    """This rank's share of the batches: every ``world_size``-th one."""
    return (batch for number, batch in enumerate(batches) if number % ranks.world_size == ranks.rank)


def all_reduce(
    stats: dict[ObservationPoint, TensorStats], count: int, ranks: RankGroup
) -> tuple[dict[ObservationPoint, TensorStats], int]:
    """Statistics and batch count over every rank; each rank ends with the same values."""
    import torch.distributed as dist

    total = torch.tensor([count], dtype=torch.int64)
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=ranks.group)
    count = int(total.item())
    if count > 0:
        # Every rank must reduce the points in the same order.
        stats = {point: all_reduce_stats(stats[point], ranks.group) for point in sorted(stats, key=_point_key)}
    return stats, count


def _point_key(point: ObservationPoint) -> tuple:
    return (point.node, point.side, point.index, -99 if point.channel_axis is None else point.channel_axis)
