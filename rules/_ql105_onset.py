"""QL105's search for where a low output SQNR comes from, and which ops kept float recover it.

The onset is the first layer whose output SQNR falls below the threshold. The error there may
come from the onset itself, from what rounds its input (the functional ops between it and the
nearest weighted module upstream, and that module's output observer), or from what rounds its
output again: an additive attention mask (``(1 - mask) * -10000``) loses its -10000s in the
mask op's int8 range, and keeping that op float is not enough while the add that applies the
mask quantizes the same values with a range of its own. So besides each candidate alone, a
functional onset (not itself a conv or linear) is kept float together with the quantized
functional ops downstream of it, never past a weighted layer. Each candidate costs one trial
quantization.
"""

from __future__ import annotations

import copy
from collections import deque
from dataclasses import dataclass
from typing import Any

from qlint.core.graph import ModelGraph, OpNode
from qlint.core.ops import WEIGHTED_KINDS
from qlint.linter.context import LintContext
from qlint.linter.findings import Impact
from qlint.measure.trial import LayerError, TrialResult

_MAX_FUNCTION_CANDIDATES = 3  # each one costs a trial quantization


@dataclass(frozen=True)
class KeptFloat:
    """What a candidate fix keeps float: one module, or functional ops by their functions."""

    node: str  # the module fqn, or the first functional op's node name
    module: bool
    functions: tuple[Any, ...] = ()  # the functions kept float everywhere (set_object_type)


def error_onset(trial: TrialResult, threshold_db: float) -> LayerError | None:
    """Where the output error starts: the first layer, in forward order, whose output SQNR
    (propagated) is below ``threshold_db``; when error only builds up gradually, the layer
    adding the most error itself (lowest shadow SQNR)."""
    for layer in trial.layers:
        if layer.propagated_db is not None and layer.propagated_db < threshold_db:
            return layer
    own = [layer for layer in trial.layers if layer.shadow_db is not None]
    return min(own, key=lambda layer: layer.shadow_db or 0.0) if own else None


def candidates(ctx: LintContext, onset: str) -> list[KeptFloat]:
    """The onset layer (a module, or a functional op), the quantized functional ops between it
    and the nearest weighted module upstream (one per function: a function is kept float
    everywhere at once), and that module: its output observer sets the onset's input range,
    and the ops between round the values again, so the error may arrive from any of them.
    Last, a functional onset that is not a conv or linear, together with the quantized
    functional ops downstream of it up to the next weighted layers."""
    graph = ctx.graph
    function_of = _functions(ctx)
    found: list[KeptFloat] = []
    onset_function = None
    if onset in graph.modules:
        found.append(KeptFloat(onset, module=True))
        sites = graph.call_sites(onset)
    elif onset in graph:
        onset_function = function_of.get(onset)
        if onset_function is not None:
            found.append(KeptFloat(onset, module=False, functions=(onset_function,)))
        sites = [graph.node(onset)]
    else:
        return []
    met, upstream_layer = _functional_until_weighted(graph, sites, function_of, upstream=True)
    for node in met:
        function = function_of[node.name]
        if all(function not in kept.functions for kept in found):
            found.append(KeptFloat(node.name, module=False, functions=(function,)))
    if upstream_layer is not None and upstream_layer.op == "module" and upstream_layer.module not in (None, onset):
        found.append(KeptFloat(str(upstream_layer.module), module=True))
    if onset_function is not None and graph.node(onset).kind not in WEIGHTED_KINDS:
        downstream, _ = _functional_until_weighted(graph, sites, function_of, upstream=False, skip=(onset_function,))
        if downstream:
            functions = (onset_function, *(function_of[node.name] for node in downstream))
            found.append(KeptFloat(onset, module=False, functions=functions))
    return found


def _functional_until_weighted(
    graph: ModelGraph,
    sites: list[OpNode],
    function_of: dict[str, Any],
    *,
    upstream: bool,
    skip: tuple[Any, ...] = (),
) -> tuple[list[OpNode], OpNode | None]:
    """Breadth first from ``sites`` (producers when ``upstream``, else consumers), never past a
    weighted layer (a module or a functional conv/linear): the quantized functional ops met, one
    per function not in ``skip`` and at most ``_MAX_FUNCTION_CANDIDATES``; and upstream, the
    first weighted layer met (its output observer sets the sites' input range)."""
    step = graph.producers if upstream else graph.consumers
    frontier = deque(n for site in sites for n in step(site.name))
    seen: set[str] = set()
    functions: list[Any] = []
    met: list[OpNode] = []
    while frontier:
        if not upstream and len(functions) >= _MAX_FUNCTION_CANDIDATES:
            break
        node = frontier.popleft()
        if node.name in seen:
            continue
        seen.add(node.name)
        if node.weight is not None and node.kind in WEIGHTED_KINDS:
            if upstream:
                return met, node
            continue
        function = function_of.get(node.name) if node.is_quantized else None
        if (
            function is not None
            and function not in functions
            and function not in skip
            and len(functions) < _MAX_FUNCTION_CANDIDATES
        ):
            functions.append(function)
            met.append(node)
        frontier.extend(step(node.name))
    return met, None


def best_keep_float(
    ctx: LintContext, trial: TrialResult, tried: list[KeptFloat]
) -> tuple[KeptFloat | None, Impact | None]:
    """Keep each candidate float in a trial (a module by name; functional ops by their
    functions, with ``set_object_type``); the one recovering the most output SQNR."""
    if ctx.trial_bench is None or ctx.qconfig_mapping is None or trial.output_sqnr_db is None:
        return None, None
    best: tuple[KeptFloat | None, Impact | None] = (None, None)
    for candidate in tried:
        mapping = copy.deepcopy(ctx.qconfig_mapping)
        if candidate.module:
            mapping.set_module_name(candidate.node, None)
        for function in candidate.functions:
            mapping.set_object_type(function, None)
        fixed = ctx.trial_bench.output_sqnr(mapping)
        if fixed is None:
            continue
        impact = Impact.measured(
            trial.output_sqnr_db, fixed, "rule-trial", f"{describe(candidate)} kept float in a trial", kind="diagnosis"
        )
        if best[1] is None or impact.ranked_db() > best[1].ranked_db():
            best = (candidate, impact)
    return best


def describe(candidate: KeptFloat) -> str:
    if candidate.module:
        return candidate.node
    names = ", ".join(getattr(function, "__name__", str(function)) for function in candidate.functions)
    return f"{candidate.node} ({names})"


def _functions(ctx: LintContext) -> dict[str, Any]:
    """The function each call_function node of the traced model calls, by node name."""
    graph_module = ctx.traced_model()
    if graph_module is None:
        return {}
    return {
        node.name: node.target
        for node in graph_module.graph.nodes
        if node.op == "call_function" and callable(node.target) and node.name in ctx.graph
    }
