"""Calibration: run data through an observed copy of the model and collect statistics.

``collect_statistics`` is what the engine calls when calibration data is given and a
selected rule needs :data:`Need.STATISTICS`. It resolves every rule's
``observes`` specs against the :class:`ModelGraph`, inserts one
:class:`qlint.stats.StatsObserver` per distinct point into a deep copy of the traced
GraphModule (the user's model is never touched), runs the batches under
``torch.no_grad()`` in eval mode on the model's device, and returns a read-only
:class:`CalibrationStatistics`. Observers fold each batch into mergeable
:class:`TensorStats`; no activation is kept from one batch to the next.

Under ``torch.distributed`` each rank calibrates its own shard and the statistics
are merged with :func:`qlint.stats.all_reduce_stats`, so every rank builds the same
global report.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import sys
import time
from pathlib import Path
from types import MappingProxyType
from typing import Any, Iterable, Iterator, Mapping, Optional, Sequence

import torch
import torch.fx as fx
import torch.nn as nn

from qlint.errors import LoadError, QlintError
from qlint.linter.findings import Notice
from qlint.core.graph import ModelGraph
from qlint.core.preserve import preserved_state
from qlint.linter.rule import Need, ObservationSpec, Rule
from qlint.stats import StatsObserver, TensorStats, all_reduce_stats, kernel, thread_scratch_buffers
from qlint.stats.batch import channel_count
from qlint.stats.memory import FreeHeapReturner, return_free_heap_to_os

FEATURES = "features"
DEFAULT_REFERENCE_PERCENTILE = 0.975
_CONV_LIKE = ("conv", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
              "conv_transpose3d", "batch_norm")
_OBSERVER_PREFIX = "qlint_stats_observer_"
_CALIBRATION_SUFFIXES = (".pt", ".pth", ".bin", ".tensor", ".tensors")


class EmptyCalibrationError(QlintError):
    """The calibration data held no batch at all."""


class CalibrationError(QlintError):
    """A calibration batch could not be run through the model."""


@dataclasses.dataclass(frozen=True, order=True)
class ObservationPoint:
    """One concrete tensor point: the ``index``-th input (or the output) of graph node ``node``."""

    node: str
    side: str
    index: int
    channel_axis: Optional[int]


def resolve_channel_axis(spec_axis: Any, kind: str) -> Optional[int]:
    """``"features"`` → 1 for conv-like ops, the last axis (-1) for linear and the rest."""
    if spec_axis != FEATURES:
        return spec_axis
    return 1 if kind in _CONV_LIKE else -1


def resolve_points(graph: ModelGraph, rules: Iterable[Rule]) -> list[ObservationPoint]:
    """Every distinct point that the rules' ``observes`` specs name in ``graph``."""
    return _in_graph_order(graph, resolve_point_needs(graph, rules))


def _in_graph_order(graph: ModelGraph, points: Iterable[ObservationPoint]) -> list[ObservationPoint]:
    return sorted(points, key=lambda p: (graph.position(p.node), p.side, p.index, str(p.channel_axis)))


def resolve_point_needs(graph: ModelGraph, rules: Iterable[Rule]) -> dict[ObservationPoint, tuple[bool, bool]]:
    """Each distinct point → (percentile, histogram): whether any rule observing it needs them."""
    needs: dict[ObservationPoint, tuple[bool, bool]] = {}
    for rule in rules:
        for spec in _specs_of(rule):
            for node in graph.ops():
                if node.kind in spec.kinds:
                    axis = resolve_channel_axis(spec.channel_axis, node.kind)
                    point = ObservationPoint(node.name, spec.side, spec.index, axis)
                    percentile, histogram = needs.get(point, (False, False))
                    needs[point] = (percentile or spec.percentile, histogram or spec.histogram)
    return needs


def _specs_of(rule: Rule) -> Sequence[ObservationSpec]:
    if Need.STATISTICS not in rule.requires:
        return ()
    return tuple(getattr(rule, "observes", ()) or ())


class CalibrationStatistics:
    """Read-only statistics of one calibration run, queried by graph node name.

    ``get(node, "input", 0)`` gives the :class:`TensorStats` of the first input of
    ``node`` (``"output"`` for its output), or None when that point was not
    observed. ``batches`` is the number of batches run (over all ranks).
    """

    def __init__(self, graph: ModelGraph, stats: Mapping[ObservationPoint, TensorStats], batches: int,
                 world_size: int = 1) -> None:
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

    def get(self, node: str, side: str = "input", index: int = 0,
            channel_axis: Any = "any") -> Optional[TensorStats]:
        """Stats at a point; with several channel axes observed there, a per-channel one first."""
        matches = [(p, s) for p, s in self._stats.items()
                   if p.node == node and p.side == side and p.index == index]
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


# ------------------------------------------------------------------------------ running
def collect_statistics(analysis: Any, rules: Sequence[Rule], calibration: Any,
                       options: Any = None) -> tuple[CalibrationStatistics, list[Notice]]:
    """Observe the analysis copy's tensor points while ``calibration`` runs through it."""
    opts = dict(options or {})
    graph: ModelGraph = analysis.graph
    data_rules = [r for r in rules if Need.STATISTICS in r.requires]
    needs = resolve_point_needs(graph, data_rules)
    points = _in_graph_order(graph, needs)
    notices: list[Notice] = []
    q = _reference_percentile(data_rules)
    shared = analysis.traced.graph_module if analysis.traced is not None else analysis.model
    with preserved_state(shared):
        stats, count, world = _calibrate(analysis, graph, points, q, calibration, opts, notices, needs)
    return CalibrationStatistics(graph, stats, count, world), notices


def _calibrate(analysis: Any, graph: ModelGraph, points: Sequence[ObservationPoint], q: float,
               calibration: Any, opts: dict[str, Any], notices: list[Notice],
               needs: Optional[Mapping[ObservationPoint, tuple[bool, bool]]] = None):
    hooks: list[Any] = []
    if analysis.traced is not None:
        observed, observers, skipped = insert_observers(analysis.traced.graph_module, points, q, needs)
    else:
        observed, observers, skipped, hooks = insert_hook_observers(analysis.model, graph, points, q, needs)
    for point in skipped:
        notices.append(Notice(message=f"calibration: cannot observe {point.side} {point.index} of "
                                      f"{point.node}; rules that need it skip that layer"))
    group, rank, world = _distributed(opts)
    batches = _limit(calibration, opts.get("num_batches"))
    if world > 1 and opts.get("shard"):
        batches = (b for i, b in enumerate(batches) if i % world == rank)
    try:
        count = run_calibration(observed, batches, quiet=bool(opts.get("quiet")) or rank != 0,
                                total=_length(calibration, opts.get("num_batches")))
    finally:
        for handle in hooks:
            handle.remove()
    stats = {point: observers[point].stats for point in observers}
    thread_scratch_buffers().clear()  # work buffers sized for the largest activation: not kept after lint
    kernel.release_workspaces()
    if world > 1:
        count = _all_reduce_count(count, group)
        if count > 0:
            stats = {point: all_reduce_stats(stats[point], group) for point in sorted(stats, key=_point_key)}
    if count == 0:
        raise EmptyCalibrationError("calibration data is empty: it yielded no batch "
                                    "(pass a tensor, a list of batches or a non-empty folder)")
    return stats, count, world


def _point_key(point: ObservationPoint) -> tuple:
    return (point.node, point.side, point.index, -99 if point.channel_axis is None else point.channel_axis)


def _reference_percentile(rules: Sequence[Rule]) -> float:
    for rule in rules:
        value = getattr(rule.options, "reference_percentile", None)
        if isinstance(value, float):
            return value
    return DEFAULT_REFERENCE_PERCENTILE


def _new_observer(point: ObservationPoint, reference_percentile: float,
                  needs: Optional[Mapping[ObservationPoint, tuple[bool, bool]]],
                  traced_shape: Optional[Sequence[Any]]) -> StatsObserver:
    """Without ``needs`` an observer computes everything; with it, only what its rules read.
    ``traced_shape``: the observed tensor's shape as shape propagation saw it, if known."""
    percentile, histogram = needs.get(point, (True, True)) if needs is not None else (True, True)
    return StatsObserver(point.channel_axis, reference_percentile, percentile=percentile, histogram=histogram,
                         expected_channels=_traced_channels(traced_shape, point.channel_axis))


def _traced_channels(shape: Optional[Sequence[Any]], channel_axis: Optional[int]) -> Optional[int]:
    """The channel count of a tensor of the traced ``shape`` (None: unknown)."""
    if shape is None:
        return None
    try:
        return channel_count(tuple(int(size) for size in shape), channel_axis)
    except (TypeError, ValueError, IndexError):
        return None  # symbolic sizes, or an axis the traced shape does not have


def _fx_shape(node: fx.Node) -> Optional[Sequence[Any]]:
    return getattr(node.meta.get("tensor_meta"), "shape", None)


def insert_observers(graph_module: fx.GraphModule, points: Sequence[ObservationPoint],
                     reference_percentile: float = DEFAULT_REFERENCE_PERCENTILE,
                     needs: Optional[Mapping[ObservationPoint, tuple[bool, bool]]] = None):
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
            observer = _new_observer(point, reference_percentile, needs, _fx_shape(target))
            observed.add_submodule(name, observer)
            with observed.graph.inserting_after(target):
                observed.graph.call_module(name, (target,))
        else:
            source, replace = _input_slot(target, point.index)
            if source is None:
                skipped.append(point)
                continue
            observer = _new_observer(point, reference_percentile, needs, _fx_shape(source))
            observed.add_submodule(name, observer)
            with observed.graph.inserting_before(target):
                replace(observed.graph.call_module(name, (source,)))
        observers[point] = observer
    observed.graph.lint()
    observed.recompile()
    return_free_heap_to_os()
    return observed, observers, skipped


def insert_hook_observers(model: nn.Module, graph: ModelGraph, points: Sequence[ObservationPoint],
                          reference_percentile: float = DEFAULT_REFERENCE_PERCENTILE,
                          needs: Optional[Mapping[ObservationPoint, tuple[bool, bool]]] = None):
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
        info = node.output if point.side == "output" else (
            node.inputs[point.index] if point.index < len(node.inputs) else None)
        observer = _new_observer(point, reference_percentile, needs, info.shape if info is not None else None)
        observers[point] = observer
        by_module.setdefault(node.module, {}).setdefault(call_index, []).append((point, observer))
    counters = [_attach_hooks(observed.get_submodule(fqn), per_call, handles)
                for fqn, per_call in by_module.items()]

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
        for point, observer in per_call.get(counter["current"], ()):
            if point.side == "output":
                observer(output[0] if isinstance(output, tuple) else output)

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


def run_calibration(model: nn.Module, batches: Iterable[Any], *, quiet: bool = False,
                    total: Optional[int] = None) -> int:
    """Run every batch through ``model`` (eval, no_grad, model's device); the batch count."""
    device = model_device(model)
    model.eval()
    progress = None if quiet else _progress(total)
    return_free_heap = FreeHeapReturner()
    if device.type == "cpu":
        kernel.prepare_parallel()
    count = 0
    try:
        with torch.no_grad():
            for count_before, batch in enumerate(batches):
                args, kwargs = as_call(batch, device, count_before)
                try:
                    model(*args, **kwargs)
                except QlintError:
                    raise
                except Exception as error:
                    message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
                    raise CalibrationError(
                        f"calibration batch {count_before} failed in the model: "
                        f"{type(error).__name__}: {message}"[:400]) from error
                count = count_before + 1
                del args, kwargs, batch
                return_free_heap()
                if progress is not None:
                    progress.advance()
    finally:
        if progress is not None:
            progress.stop()
    return count


# In a log (CI, no terminal) a line this often, so that a long calibration never looks hung.
PROGRESS_LINE_SECONDS = 5.0


def _progress(total: Optional[int]):
    """A live bar on a terminal; in a log, a short line every PROGRESS_LINE_SECONDS."""
    return _ProgressBar(total) if sys.stderr is not None and sys.stderr.isatty() else _ProgressLines(total)


class _ProgressBar:
    def __init__(self, total: Optional[int]) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._bar = Progress(TextColumn("calibrating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                             console=Console(file=sys.stderr), transient=True)
        self._bar.start()
        self._task = self._bar.add_task("calibrating", total=total)

    def advance(self) -> None:
        self._bar.update(self._task, advance=1)

    def stop(self) -> None:
        self._bar.stop()


class _ProgressLines:
    def __init__(self, total: Optional[int]) -> None:
        self._total = total
        self._done = 0
        self._start = time.monotonic()
        self._next = self._start + PROGRESS_LINE_SECONDS

    def advance(self) -> None:
        self._done += 1
        now = time.monotonic()
        if now >= self._next and sys.stderr is not None:
            of = f"/{self._total}" if self._total else ""
            print(f"qlint: calibrating: {self._done}{of} batches, {now - self._start:.0f} s", file=sys.stderr,
                  flush=True)
            self._next = now + PROGRESS_LINE_SECONDS

    def stop(self) -> None:
        pass


def model_device(model: nn.Module) -> torch.device:
    for tensor in model.parameters():
        return tensor.device
    for tensor in model.buffers():
        return tensor.device
    return torch.device("cpu")


def as_call(batch: Any, device: torch.device, number: int = 0) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A batch as (args, kwargs): a tensor, a tuple/list of positional args, or a dict of kwargs."""
    if isinstance(batch, torch.Tensor):
        return (batch.to(device),), {}
    if isinstance(batch, (tuple, list)):
        return tuple(_to(v, device) for v in batch), {}
    if isinstance(batch, Mapping):
        return (), {str(k): _to(v, device) for k, v in batch.items()}
    raise CalibrationError(f"calibration batch {number} is a {type(batch).__name__}; expected a tensor, "
                           "a tuple of tensors (positional inputs) or a dict (keyword inputs)")


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(_to(v, device) for v in value)
    if isinstance(value, Mapping):
        return {k: _to(v, device) for k, v in value.items()}
    return value


def _limit(calibration: Any, num_batches: Optional[int]) -> Iterator[Any]:
    if calibration is None:
        raise EmptyCalibrationError("no calibration data given")
    if isinstance(calibration, (torch.Tensor, Mapping)):
        calibration = [calibration]  # one batch
    try:
        iterator = iter(calibration)
    except TypeError as error:
        raise CalibrationError(f"calibration data must be iterable, got {type(calibration).__name__}") from error
    for number, batch in enumerate(iterator):
        if num_batches is not None and number >= num_batches:
            return
        yield batch


def _length(calibration: Any, num_batches: Optional[int]) -> Optional[int]:
    try:
        total = 1 if isinstance(calibration, (torch.Tensor, Mapping)) else len(calibration)
    except TypeError:
        return num_batches
    return total if num_batches is None else min(total, num_batches)


# --------------------------------------------------------------------------- distributed
def _distributed(options: Mapping[str, Any]) -> tuple[Any, int, int]:
    """(group, rank, world size) when statistics must be merged across ranks."""
    wanted = options.get("distributed")
    if wanted is False:
        return None, 0, 1
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        if wanted:
            raise QlintError("distributed calibration was requested but torch.distributed is not initialized")
        return None, 0, 1
    group = options.get("group")
    return group, dist.get_rank(group), dist.get_world_size(group)


def _all_reduce_count(count: int, group: Any) -> int:
    import torch.distributed as dist

    total = torch.tensor([count], dtype=torch.int64)
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return int(total.item())


# ------------------------------------------------------------------------------ loading
def load_calibration(path: Any) -> list[Any]:
    """Batches from a saved tensor / list of tensors / list of tuples, or a folder of such files."""
    source = Path(path)
    if not source.exists():
        raise LoadError(f"calibration data not found: {source}")
    if source.is_dir():
        files = sorted(p for p in source.iterdir() if p.is_file() and not p.name.startswith("."))
        if not files:
            raise EmptyCalibrationError(f"calibration folder {source} holds no files")
        batches: list[Any] = []
        for file in files:
            batches.extend(_load_file(file))
        return batches
    return _load_file(source)


def _load_file(file: Path) -> list[Any]:
    try:
        data = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as error:  # pickle errors, truncated zip, non-tensor objects
        detail = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise LoadError(f"cannot load calibration file {file}: {detail}"[:400]) from error
    if isinstance(data, torch.Tensor):
        return [data]
    if isinstance(data, Mapping):
        return [dict(data)]
    if isinstance(data, (list, tuple)):
        batches = list(data)
        for number, batch in enumerate(batches):
            if not _is_batch(batch):
                raise LoadError(f"calibration file {file}: item {number} is a {type(batch).__name__}; "
                                "expected a tensor, a tuple of tensors or a dict")
        return batches
    raise LoadError(f"calibration file {file} holds a {type(data).__name__}; expected a tensor or a list of batches")


def _is_batch(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, (list, tuple)):
        return all(isinstance(v, (torch.Tensor, int, float, bool)) or v is None for v in value)
    if isinstance(value, Mapping):
        return True
    return False


def random_calibration(example_inputs: Sequence[Any], n: int, seed: int = 0) -> "RandomBatches":
    """``n`` random batches shaped like ``example_inputs`` (standard normal floats; ints kept in range),
    made one at a time as they are used."""
    if n <= 0:
        raise QlintError(f"--random-calibration needs a positive number of batches, got {n}")
    return RandomBatches(tuple(example_inputs), n, seed)


class RandomBatches(Sequence):
    """A sequence of random batches that holds none of them: batch ``i`` is made from its own
    seed when asked for, so the same index always gives the same batch."""

    def __init__(self, example_inputs: tuple[Any, ...], n: int, seed: int) -> None:
        self._example = example_inputs
        self._n = n
        self._seed = seed

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self._n))]
        if index < 0:
            index += self._n
        if not 0 <= index < self._n:
            raise IndexError(index)
        generator = torch.Generator().manual_seed(self._seed * 1_000_003 + index)
        batch = []
        for value in self._example:
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                batch.append(torch.randn(value.shape, generator=generator, dtype=value.dtype))
            elif isinstance(value, torch.Tensor) and value.dtype != torch.bool and value.numel():
                low, high = int(value.min()), int(value.max()) + 1
                batch.append(torch.randint(low, max(high, low + 1), value.shape, generator=generator,
                                           dtype=value.dtype))
            else:
                batch.append(value)
        return tuple(batch)


# ------------------------------------------------------------------- helpers for rules
def json_float(value: Any) -> Any:
    """A float for JSON: finite values as float, NaN/Inf as "nan"/"inf"/"-inf"."""
    value = float(value)
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return value


def finite_or_none(value: Any) -> Optional[float]:
    value = float(value)
    return value if math.isfinite(value) else None
