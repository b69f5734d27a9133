"""Observer insertion: one StatsObserver per observation point, in a graph copy or by hooks."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import torch.fx as fx
import torch.nn as nn

from qlint.core.graph import ModelGraph
from qlint.core.nested import first_tensor
from qlint.linter.calibration.points import ALL_STATISTICS, ObservationPoint, StatisticNeeds
from qlint.stats import StatsObserver
from qlint.stats.batch import channel_count
from qlint.stats.selection import PERCENTILE_EVERY

DEFAULT_REFERENCE_PERCENTILE = 0.975
_OBSERVER_PREFIX = "qlint_stats_observer_"


def _new_observer(
    point: ObservationPoint,
    reference_percentile: float,
    needs: Mapping[ObservationPoint, StatisticNeeds] | None,
    traced_shape: Sequence[Any] | None,
    percentile_every: int,
) -> StatsObserver:
    """Without ``needs`` an observer computes everything; with it, only what its rules read.
    ``traced_shape``: the observed tensor's shape as shape propagation saw it, if known."""
    wanted = needs.get(point, ALL_STATISTICS) if needs is not None else ALL_STATISTICS
    return StatsObserver(
        point.channel_axis,
        reference_percentile,
        percentile=wanted.percentile,
        histogram=wanted.histogram,
        moments=wanted.moments,
        expected_channels=_traced_channels(traced_shape, point.channel_axis),
        percentile_every=percentile_every,
    )


def _traced_channels(shape: Sequence[Any] | None, channel_axis: int | None) -> int | None:
    """The channel count of a tensor of the traced ``shape`` (None: unknown)."""
    if shape is None:
        return None
    try:
        return channel_count(tuple(int(size) for size in shape), channel_axis)
    except (TypeError, ValueError, IndexError):
        return None  # symbolic sizes, or an axis the traced shape does not have


def _fx_shape(node: fx.Node) -> Sequence[Any] | None:
    return getattr(node.meta.get("tensor_meta"), "shape", None)


def insert_observers(
    graph_module: fx.GraphModule,
    points: Sequence[ObservationPoint],
    reference_percentile: float = DEFAULT_REFERENCE_PERCENTILE,
    needs: Mapping[ObservationPoint, StatisticNeeds] | None = None,
    *,
    percentile_every: int = PERCENTILE_EVERY,
):
    """A new GraphModule, sharing ``graph_module``'s modules, with a StatsObserver at every point.

    Returns (observed module, {point: observer}, [points that could not be observed]).
    An input observer feeds only the observed node (its other consumers are
    untouched); an output observer is a side branch of the node.
    """
    # Shares the (already private) modules and weights; only the graph is copied.
    observed = fx.GraphModule(graph_module, copy.deepcopy(graph_module.graph))
    nodes = {n.name: n for n in observed.graph.nodes}
    observers: dict[ObservationPoint, StatsObserver] = {}
    skipped: list[ObservationPoint] = []
    for number, point in enumerate(points):
        target = nodes.get(point.node)
        if target is None:
            skipped.append(point)
            continue
        name = f"{_OBSERVER_PREFIX}{number}"
        if point.side == "output":
            observer = _new_observer(point, reference_percentile, needs, _fx_shape(target), percentile_every)
            observed.add_submodule(name, observer)
            with observed.graph.inserting_after(target):
                observed.graph.call_module(name, (target,))
        else:
            source, replace = _input_slot(target, point.index)
            if source is None:
                skipped.append(point)
                continue
            observer = _new_observer(point, reference_percentile, needs, _fx_shape(source), percentile_every)
            observed.add_submodule(name, observer)
            with observed.graph.inserting_before(target):
                replace(observed.graph.call_module(name, (source,)))
        observers[point] = observer
    observed.graph.lint()
    observed.recompile()
    return observed, observers, skipped


def insert_hook_observers(
    model: nn.Module,
    graph: ModelGraph,
    points: Sequence[ObservationPoint],
    reference_percentile: float = DEFAULT_REFERENCE_PERCENTILE,
    needs: Mapping[ObservationPoint, StatisticNeeds] | None = None,
    *,
    percentile_every: int = PERCENTILE_EVERY,
):
    """For graphs from the eager-hooks front end: observers fed by forward hooks.

    Node k of module M in execution order is the k-th call of M in each forward pass.
    ``model`` is the private analysis copy; the caller removes the returned hook handles.
    """
    observed = model
    handles: list[Any] = []
    observers: dict[ObservationPoint, StatsObserver] = {}
    skipped: list[ObservationPoint] = []
    by_module: dict[str, dict[int, list[tuple[ObservationPoint, StatsObserver]]]] = {}
    for point in points:
        node = graph.node(point.node) if point.node in graph else None
        if node is None or node.module is None:
            skipped.append(point)
            continue
        call_index = [n.name for n in graph.call_sites(node.module)].index(node.name)
        info = (
            node.output
            if point.side == "output"
            else (node.inputs[point.index] if point.index < len(node.inputs) else None)
        )
        shape = info.shape if info is not None else None
        observer = _new_observer(point, reference_percentile, needs, shape, percentile_every)
        observers[point] = observer
        by_module.setdefault(node.module, {}).setdefault(call_index, []).append((point, observer))
    counters = [_attach_hooks(observed.get_submodule(fqn), per_call, handles) for fqn, per_call in by_module.items()]

    def new_batch(_module, _args):
        for counter in counters:
            counter["count"] = 0

    handles.append(observed.register_forward_pre_hook(new_batch))
    return observed, observers, skipped, handles


def _attach_hooks(module: nn.Module, per_call: dict[int, list], handles: list[Any]) -> dict[str, int]:
    """Feed observers from the module's k-th call; returns the counter the root resets."""
    counter = {"count": 0, "current": 0}

    def pre_hook(_module, args):
        counter["current"] = counter["count"]
        counter["count"] += 1
        for point, observer in per_call.get(counter["current"], ()):
            if point.side == "input" and point.index < len(args):
                observer(args[point.index])

    def post_hook(_module, _args, output):
        value = first_tensor(output)
        for point, observer in per_call.get(counter["current"], ()):
            if point.side == "output" and value is not None:
                observer(value)

    handles.append(module.register_forward_pre_hook(pre_hook))
    handles.append(module.register_forward_hook(post_hook))
    return counter


def _input_slot(node: fx.Node, index: int):
    """The fx node feeding argument ``index`` of ``node`` and a setter that rewires it."""
    args = list(node.args)
    if index < len(args) and isinstance(args[index], fx.Node):

        def replace(new: fx.Node) -> None:
            updated = list(node.args)
            updated[index] = new
            node.args = tuple(updated)

        return args[index], replace
    if index == 0 and not args:
        for key in ("input", "x"):
            if isinstance(node.kwargs.get(key), fx.Node):

                def replace_kw(new: fx.Node, key: str = key) -> None:
                    node.kwargs = {**node.kwargs, key: new}

                return node.kwargs[key], replace_kw
    return None, None
