"""Merge :class:`TensorStats` across ranks of a ``torch.distributed`` group.

Every field of ``TensorStats`` merges by SUM, MIN or MAX (see the table in
:mod:`qlint.stats.accumulator`), so a cross-rank merge is three all_reduce
calls -- one per operator, each on one packed buffer -- after a small one
that checks every rank agrees on the settings and the channel count.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from qlint.stats.accumulator import TENSOR_FIELDS, TensorStats

_MIN_FIELDS = ("channel_min",)
_MAX_FIELDS = ("channel_max",)
_SUM_FIELDS = tuple(name for name in TENSOR_FIELDS if name not in _MIN_FIELDS + _MAX_FIELDS)


def all_reduce_stats(stats: TensorStats, group: dist.ProcessGroup | None = None) -> TensorStats:
    """Merge ``stats`` over all ranks of ``group``; every rank gets the same result.

    Must be called by every rank of the group (it is a collective). Ranks that
    saw no batch may hold stats without channels; they adopt the others'
    channel count. Raises ValueError on every rank alike if ranks disagree on
    ``channel_axis``, ``reference_percentile`` or the channel count. The input
    is not modified. With gloo the exchange goes through CPU tensors.
    """
    home_device = stats.device
    comm_device = _communication_device(group, home_device)
    num_channels = _agreed_channel_count(stats, group, comm_device)
    if num_channels == 0:
        # No rank saw data; only the batch counters (all zero) could differ.
        num_channels = stats.num_channels
    local = stats.to(comm_device)
    if local.num_channels == 0 and num_channels:
        local = TensorStats.empty(stats.channel_axis, stats.reference_percentile, num_channels, comm_device).merge(
            local
        )

    merged = {}
    reductions = ((_SUM_FIELDS, dist.ReduceOp.SUM), (_MIN_FIELDS, dist.ReduceOp.MIN), (_MAX_FIELDS, dist.ReduceOp.MAX))
    for fields, op in reductions:
        merged.update(_all_reduce_fields(local, fields, op, group))
    return TensorStats(stats.channel_axis, stats.reference_percentile, **merged).to(home_device)


def _communication_device(group: dist.ProcessGroup | None, home: torch.device) -> torch.device:
    backend = dist.get_backend(group)
    if backend == "nccl" and home.type != "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    if backend == "gloo":
        return torch.device("cpu")
    return home


def _agreed_channel_count(stats: TensorStats, group: dist.ProcessGroup | None, device: torch.device) -> int:
    """Check settings agree across ranks and return the channel count (0: no rank has data)."""
    axis_code = float("inf") if stats.channel_axis is None else float(stats.channel_axis)
    channels = stats.num_channels
    # Ranks without data (0 channels) must not count as disagreeing, so they
    # report -1 in the "max" slot and +inf in the "min" slot (negated for MAX).
    summary = torch.tensor(
        [
            axis_code,
            -axis_code,
            stats.reference_percentile,
            -stats.reference_percentile,
            channels if channels else -1.0,
            -(channels if channels else float("inf")),
        ],
        dtype=torch.float64,
        device=device,
    )
    dist.all_reduce(summary, op=dist.ReduceOp.MAX, group=group)
    axis_max, axis_min, q_max, q_min, channels_max, channels_min = summary.tolist()
    axis_min, q_min, channels_min = -axis_min, -q_min, -channels_min
    if axis_max != axis_min or q_max != q_min:
        raise ValueError(
            "ranks disagree on stats settings: channel_axis in "
            f"[{axis_min}, {axis_max}], reference_percentile in [{q_min}, {q_max}]"
        )
    if channels_max < 0:
        return 0
    if channels_max != channels_min:
        raise ValueError(f"ranks disagree on channel count: between {int(channels_min)} and {int(channels_max)}")
    return int(channels_max)


def _all_reduce_fields(
    stats: TensorStats, fields: tuple[str, ...], op: dist.ReduceOp.RedOpType, group: dist.ProcessGroup | None
) -> dict[str, torch.Tensor]:
    """All-reduce ``fields`` with ``op``, packing those of one dtype into one buffer."""
    result: dict[str, torch.Tensor] = {}
    for dtype in (torch.int64, torch.float64):
        names = [name for name in fields if getattr(stats, name).dtype == dtype]
        if not names:
            continue
        tensors = [getattr(stats, name) for name in names]
        packed = torch.cat([tensor.reshape(-1) for tensor in tensors])
        dist.all_reduce(packed, op=op, group=group)
        for name, piece in zip(names, packed.split([tensor.numel() for tensor in tensors])):
            result[name] = piece.reshape(getattr(stats, name).shape)
    return result
