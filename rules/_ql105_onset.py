"""QL105's search for where a low output SQNR comes from, and which ops kept float recover it.

The onset is the first layer whose output SQNR falls below the threshold. The error there may
come from the onset itself, from what rounds its input (the functional ops between it and the
nearest weighted module upstream, and that module's output observer), or from what rounds its
output again: an additive attention mask (``(1 - mask) * -10000``) loses its -10000s in the
mask op's int8 range, and keeping that op float is not enough while the add that applies the
mask quantizes the same values with a range of its own. So besides each candidate alone, the
onset is kept float together with the quantized functional ops downstream of it, up to the
next weighted modules. Each candidate costs one trial quantization.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from qlint.core.graph import OpNode
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
    Last, a functional onset together with the quantized functional ops downstream of it."""
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
    upstream_module = None
    for node in _functional_until_weighted(graph, sites, upstream=True):
        if node.op == "module":
            upstream_module = node.module
            continue
        function = function_of.get(node.name)
        if function is not None and all(function not in kept.functions for kept in found):
            found.append(KeptFloat(node.name, module=False, functions=(function,)))
    if upstream_module is not None and upstream_module != onset:
        found.append(KeptFloat(upstream_module, module=True))
    if onset_function is not None:
        downstream = [onset_function]
        for node in _functional_until_weighted(graph, sites, upstream=False):
            function = function_of.get(node.name)
            if function is not None and function not in downstream:
                downstream.append(function)
        if len(downstream) > 1:
            found.append(KeptFloat(onset, module=False, functions=tuple(downstream)))
    return found


def _functional_until_weighted(graph: Any, sites: list[OpNode], *, upstream: bool) -> list[OpNode]:
    """Breadth first from ``sites`` (producers when ``upstream``, else consumers): the quantized
    functional ops met (at most ``_MAX_FUNCTION_CANDIDATES`` functions) before a weighted module;
    upstream, the first weighted module met closes the list."""
    step = graph.producers if upstream else graph.consumers
    frontier = [n for site in sites for n in step(site.name)]
    seen: set[str] = set()
    functions: set[Any] = set()
    met: list[OpNode] = []
    while frontier:
        node = frontier.pop(0)
        if node.name in seen:
            continue
        seen.add(node.name)
        if node.op == "module" and node.module and node.weight is not None:
            if upstream:
                met.append(node)
                break
            continue
        if node.op == "function" and node.is_quantized and node.target not in functions:
            if len(functions) < _MAX_FUNCTION_CANDIDATES:
                functions.add(node.target)
                met.append(node)
        frontier.extend(step(node.name))
    return met


def best_keep_float(
    ctx: LintContext, trial: TrialResult, candidates: list[KeptFloat]
) -> tuple[KeptFloat | None, Impact | None]:
    """Keep each candidate float in a trial (a module by name; functional ops by their
    functions, with ``set_object_type``); the one recovering the most output SQNR."""
    if ctx.trial_bench is None or ctx.qconfig_mapping is None or trial.output_sqnr_db is None:
        return None, None
    best: tuple[KeptFloat | None, Impact | None] = (None, None)
    for candidate in candidates:
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
        if best[1] is None or impact.db > best[1].db:
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
