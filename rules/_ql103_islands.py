"""Float islands: ops left in float between quantized ops, found on a ModelGraph.

Each island costs a dequantize on the way in and a quantize on the way out. FX flows
find them from resolved qconfigs and the backend's kernels; eager flows from DeQuantStub → … →
QuantStub regions.

An FX island is costly only between ops that really run in int8: a qconfig on an op the backend
has no int8 kernel for (``pow``, ``sqrt``, ``gelu`` on x86) leaves it float, so it is neither
a quantized neighbour nor an island member a qconfig could change. A dynamic op with no static
kernel (a recurrent layer) is as quantized as torch makes it: no island either.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from qlint.core.backends import BackendInfo
from qlint.core.graph import ModelGraph, OpNode
from qlint.core.ops import SHAPE_KINDS

_OPS = ("module", "function", "method")


def unique_nodes(nodes: Iterable[OpNode]) -> list[OpNode]:
    """Nodes in first-seen order, each once."""
    return list({n.name: n for n in nodes}.values())


@dataclasses.dataclass(frozen=True)
class Island:
    nodes: tuple[OpNode, ...]
    producers: tuple[OpNode, ...]
    consumers: tuple[OpNode, ...]
    dequantize_edges: int
    quantize_edges: int


def is_static_quantized(node: OpNode) -> bool:
    qc = node.qconfig
    return (
        qc is not None
        and qc.quantized
        and not qc.is_dynamic
        and qc.activation is not None
        and not qc.activation.is_float
    )


def runs_int8(node: OpNode, backend: BackendInfo) -> bool:
    """Whether prepare_fx gives ``node`` an int8 output: a static quantized qconfig on an op the
    backend quantizes statically (``BackendInfo.quantizes_output``)."""
    return is_static_quantized(node) and backend.quantizes_output(node.kind)


def left_float(node: OpNode, backend: BackendInfo) -> bool:
    """Whether ``node`` runs in float by its qconfig (None, float, or dynamic): the ops a float
    island is made of. A dynamic op with no static kernel (an LSTMCell) is in its intended state,
    not an island member; an op with a static qconfig is not either, even where the backend has
    no int8 kernel for it (``sqrt``: it stays float, but no qconfig left it so); an op with
    qconfig None is a member whatever the backend has for it."""
    if is_static_quantized(node):
        return False
    qc = node.qconfig
    return not (qc is not None and qc.is_dynamic and not backend.quantizes_output(node.kind))


def through_shape_ops(graph: ModelGraph, node: OpNode) -> OpNode:
    """Walk up through shape-only ops (they reuse their input's qparams) to the real producer."""
    while node.op in _OPS and node.kind in SHAPE_KINDS:
        producers = [p for p in graph.producers(node.name) if p.op in _OPS or p.op == "input"]
        if not producers:
            break
        node = producers[0]
    return node


def quantized_downstream(graph: ModelGraph, node: OpNode, backend: BackendInfo) -> list[OpNode]:
    """Int8 computing ops reached from ``node`` through shape-only ops (``node`` included)."""
    found, stack, seen = [], [node], set()
    while stack:
        current = stack.pop()
        if current.name in seen or current.op not in _OPS:
            continue
        seen.add(current.name)
        if current.kind in SHAPE_KINDS:
            stack.extend(graph.consumers(current.name))
        elif runs_int8(current, backend):
            found.append(current)
    return found


def fx_float_islands(graph: ModelGraph, backend: BackendInfo) -> list[Island]:
    floating = {n.name for n in graph.ops() if left_float(n, backend)}
    seen: set[str] = set()
    islands = []
    for start in graph.ops():
        if start.name not in floating or start.name in seen:
            continue
        component, stack = [], [start.name]
        seen.add(start.name)
        while stack:
            name = stack.pop()
            component.append(name)
            neighbours = list(graph.dag.predecessors(name)) + list(graph.dag.successors(name))
            for other in neighbours:
                if other in floating and other not in seen:
                    seen.add(other)
                    stack.append(other)
        members = sorted(component, key=graph.position)
        member_set = set(members)
        producers: list[OpNode] = []
        consumers: list[OpNode] = []
        into = out = 0
        for name in members:
            for producer in graph.producers(name):
                if producer.name in member_set:
                    continue
                source = through_shape_ops(graph, producer)
                if source.op in _OPS and runs_int8(source, backend):
                    producers.append(source)
                    into += 1
            for consumer in graph.consumers(name):
                if consumer.name in member_set:
                    continue
                reached = quantized_downstream(graph, consumer, backend)
                if reached:
                    consumers.extend(reached)
                    out += 1
        if producers and consumers:
            islands.append(
                Island(
                    tuple(graph.node(n) for n in members),
                    tuple(unique_nodes(producers)),
                    tuple(unique_nodes(consumers)),
                    into,
                    out,
                )
            )
    return islands


def eager_float_islands(graph: ModelGraph) -> list[Island]:
    """Eager mode: ops between a DeQuantStub and a QuantStub, with quantized modules around."""
    islands: list[Island] = []
    covered: set[str] = set()
    for stub in graph.ops():
        if stub.kind != "dequant_stub" or stub.name in covered:
            continue
        region, quant_stubs, stack, seen, closed = [], [], list(graph.consumers(stub.name)), set(), True
        while stack:
            node = stack.pop()
            if node.name in seen:
                continue
            seen.add(node.name)
            if node.op == "output":
                closed = False  # reaches the model output: the float part is at the model edge
                break
            if node.kind == "quant_stub":
                quant_stubs.append(node)
                continue
            region.append(node)
            stack.extend(graph.consumers(node.name))
        if not closed or not quant_stubs or not region:
            continue
        entry_stubs = [stub] + [p for n in region for p in graph.producers(n.name) if p.kind == "dequant_stub"]
        covered.update(s.name for s in entry_stubs)
        producers = [
            p
            for s in unique_nodes(entry_stubs)
            for p in graph.producers(s.name)
            if p.op == "module" and p.kind not in ("quant_stub", "dequant_stub") and is_static_quantized(p)
        ]
        consumers = [c for q in unique_nodes(quant_stubs) for c in quantized_modules_after(graph, q)]
        if producers and consumers:
            members = sorted(unique_nodes(region), key=lambda n: graph.position(n.name))
            islands.append(
                Island(
                    tuple(members),
                    tuple(unique_nodes(producers)),
                    tuple(unique_nodes(consumers)),
                    len(unique_nodes(entry_stubs)),
                    len(unique_nodes(quant_stubs)),
                )
            )
    return islands


def quantized_modules_after(graph: ModelGraph, stub: OpNode) -> list[OpNode]:
    found, stack, seen = [], list(graph.consumers(stub.name)), set()
    while stack:
        node = stack.pop()
        if node.name in seen or node.op not in _OPS:
            continue
        seen.add(node.name)
        if (
            node.op == "module"
            and node.kind not in SHAPE_KINDS
            and node.kind != "dequant_stub"
            and is_static_quantized(node)
        ):
            found.append(node)
        elif node.kind in SHAPE_KINDS or node.op != "module":
            stack.extend(graph.consumers(node.name))
    return found


def feeds_cat(graph: ModelGraph, node: OpNode) -> bool:
    stack, seen = list(graph.consumers(node.name)), set()
    while stack:
        current = stack.pop()
        if current.name in seen:
            continue
        seen.add(current.name)
        if current.kind == "cat":
            return True
        if current.kind in SHAPE_KINDS:
            stack.extend(graph.consumers(current.name))
    return False
