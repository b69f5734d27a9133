"""A module the model calls more than once, measured call by call.

Module hooks see every call of a module; an FX graph has a node per call (``act``, ``act_1``).
Pooled into one layer, a shared module's calls read as one value at the first call's place,
which is neither call's (EfficientNet-Lite0's model-level ``_swish``: 17.1 dB after the stem and
-1.4 dB after the head read as one 14.7 dB row after the stem, and QL302 blamed the head's
``_fc`` for a 14.6 dB drop that is not there). :func:`split_calls` gives such a layer one
:class:`LayerMatch` per call, named by the float FX node of the call; :class:`CallCounter` tells
a capture hook which call of its module is running, so each call's hooks keep only their call.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable, Iterable

import torch.fx

from qlint.core.ops import layer_kind
from qlint.measure.match_result import MODULE_SITE, LayerMatch, Site


def module_calls(graph: torch.fx.GraphModule) -> dict[str, list[torch.fx.Node]]:
    """Each module's call nodes, in graph order (the order a run calls them)."""
    calls: dict[str, list[torch.fx.Node]] = defaultdict(list)
    for node in graph.graph.nodes:
        if node.op == "call_module":
            calls[str(node.target)].append(node)
    return calls


def split_calls(
    layers: Iterable[LayerMatch],
    float_graph: torch.fx.GraphModule,
    quant_graph: torch.fx.GraphModule | None,
    taken: set[str],
    notes: list[str],
    *,
    per_call: bool,
) -> list[LayerMatch]:
    """``layers`` with each module layer's call count set and, with ``per_call``, one layer per
    call of a module the float model calls several times. A layer's fused followers are read
    at the call that follows its own (one ReLU module fused into two convs).

    ``taken``: names a call's layer may not take (module fqns, other layers). A module whose
    calls cannot be told apart keeps one layer for every call, and a note says why."""
    float_calls = module_calls(float_graph)
    quant_calls = module_calls(quant_graph) if quant_graph is not None else None
    all_layers = list(layers)
    fused = _calls_fused_into_other_layers(all_layers, float_graph, float_calls)
    result: list[LayerMatch] = []
    for layer in all_layers:
        every_call = float_calls.get(layer.float_entry.name, []) if layer.module is not None else []
        layer.calls = max(1, len(every_call))
        if len(every_call) == 1:
            layer.float_exit = _call_exit(layer, every_call[0], float_calls) or layer.float_exit
        if len(every_call) <= 1 or not per_call:
            result.append(layer)
            continue
        # A call fused into another layer (a ReLU after a Linear: LinearReLU) is read as that
        # layer's output, and the quantized model no longer calls the module there.
        own = [(index, node) for index, node in enumerate(every_call) if node not in fused]
        nodes = [node for _, node in own]
        exits = [_call_exit(layer, node, float_calls) for node in nodes]
        reason = _pooled_because(layer, nodes, exits, quant_calls, taken)
        if reason is not None:
            notes.append(f"{layer.name} is called {len(every_call)} times; its row pools every call ({reason})")
            result.append(layer)
            continue
        for quant_call, ((index, node), exit_site) in enumerate(zip(own, exits)):
            result.append(
                dataclasses.replace(
                    layer,
                    name=node.name,
                    float_entry=Site(MODULE_SITE, layer.float_entry.name, index),
                    float_exit=exit_site or layer.float_exit,
                    quant_site=Site(MODULE_SITE, layer.quant_site.name, quant_call),
                    absorbed=list(layer.absorbed),
                    float_chain=list(layer.float_chain),
                    predecessors=[],
                )
            )
    return result


def _calls_fused_into_other_layers(
    layers: list[LayerMatch], float_graph: torch.fx.GraphModule, float_calls: dict[str, list[torch.fx.Node]]
) -> set[torch.fx.Node]:
    """The float call nodes that some layer reads as the end of its fused chain (the ReLU call
    after a Linear that the quantized model runs as one LinearReLU)."""
    fused: set[torch.fx.Node] = set()
    for layer in layers:
        if layer.module is None:
            continue
        for node in float_calls.get(layer.float_entry.name, []):
            chain = _chain(layer, node)
            if chain is None:
                continue
            fused.update(chain[1:])
            # A fused ReLU whose module the quantized model still calls elsewhere is applied to
            # the layer's output (float_exit_relu) rather than hooked: that call is fused all the same.
            follower = next(iter(chain[-1].users)) if len(chain[-1].users) == 1 else None
            if layer.float_exit_relu and follower is not None and follower.op == "call_module":
                if layer_kind(float_graph.get_submodule(str(follower.target))) == "relu":
                    fused.add(follower)
    return fused


def _pooled_because(
    layer: LayerMatch,
    nodes: list[torch.fx.Node],
    exits: list[Site | None],
    quant_calls: dict[str, list[torch.fx.Node]] | None,
    taken: set[str],
) -> str | None:
    """Why the calls of ``layer``'s module cannot be measured one by one; None when they can."""
    if layer.quant_site.kind != MODULE_SITE:
        return "its quantized counterpart is not a module"
    if quant_calls is not None and len(quant_calls.get(layer.quant_site.name, [])) != len(nodes):
        count = len(quant_calls.get(layer.quant_site.name, []))
        return f"the quantized model calls {layer.quant_site.name} {count} times"
    if None in exits:
        return "the ops fused into it do not follow each call"
    clashing = [node.name for node in nodes if node.name in taken - {layer.name}]
    if clashing:
        return f"{', '.join(clashing)} already names another layer or module"
    return None


def _chain(layer: LayerMatch, node: torch.fx.Node) -> list[torch.fx.Node] | None:
    """The call ``node`` of ``layer``'s module and the calls of the modules fused into it that
    follow it; None where the graph does not follow that chain."""
    nodes = [node]
    for name in layer.float_chain:
        follower = next((user for user in nodes[-1].users if user.op == "call_module" and user.target == name), None)
        if follower is None:
            return None
        nodes.append(follower)
    return nodes


def _call_exit(layer: LayerMatch, node: torch.fx.Node, float_calls: dict[str, list[torch.fx.Node]]) -> Site | None:
    """Where ``layer``'s value is read for its module's call ``node``: that call, or the call of
    the last module fused into it that follows (``call`` None for a module called once); None
    where the graph does not follow the fused chain from ``node``."""
    chain = _chain(layer, node)
    if chain is None:
        return None
    exit_calls = float_calls.get(str(chain[-1].target), [])
    call = exit_calls.index(chain[-1]) if len(exit_calls) > 1 else None
    return Site(MODULE_SITE, str(chain[-1].target), call)


def chain_nodes(layer: LayerMatch, float_calls: dict[str, list[torch.fx.Node]]) -> list[torch.fx.Node]:
    """The float FX nodes of a layer read at one call (its module's call and the calls fused into
    it); empty for a layer read at every call of its modules."""
    if layer.module is None or (layer.float_entry.call is None and layer.float_exit.call is None):
        return []
    entry = float_calls[layer.float_entry.name][layer.float_entry.call or 0]
    return _chain(layer, entry) or [entry]


def watched_calls(layers: Iterable[LayerMatch], float_run: str, quant_run: str) -> set[tuple[str, str]]:
    """(run, module fqn) of every module some layer reads at one of its calls: the modules a
    :class:`CallCounter` counts the calls of."""
    return {
        (run, site.name)
        for layer in layers
        for run, site in ((float_run, layer.float_entry), (float_run, layer.float_exit), (quant_run, layer.quant_site))
        if site.kind == MODULE_SITE and site.call is not None
    }


class CallCounter:
    """Which call of a module is running, per model, in the current forward pass: a pre-hook
    counts each watched module's calls, and a hook whose :class:`Site` names a call acts in
    that call only (:meth:`at`)."""

    def __init__(self) -> None:
        self.counts: dict[tuple[str, str], int] = defaultdict(int)

    def counting_hook(self, run: str, name: str, counts: Callable[[], bool]) -> Callable[..., None]:
        """A forward pre-hook (``with_kwargs``) counting the calls of module ``name`` in ``run``
        while ``counts()`` (the runner's own replays of a module are not the model's calls)."""

        def hook(module: object, args: tuple, kwargs: dict) -> None:
            if counts():
                self.counts[(run, name)] += 1

        return hook

    def at(self, run: str, site: Site) -> bool:
        """Whether the call of ``site``'s module running now in ``run`` is the one it names."""
        if site.call is None or site.kind != MODULE_SITE:
            return True
        return self.counts[(run, site.name)] - 1 == site.call

    def clear(self) -> None:
        self.counts.clear()
