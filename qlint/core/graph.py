"""ModelGraph: the front-end independent DAG of normalized ops that rules read.

Each node is an :class:`OpNode`; edges run from producer to consumer and carry
the argument position. Observer and fake-quant nodes of prepared models are
folded away: the observer is recorded on the op whose output it watches, so a
prepared model and its float original give the same graph.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import networkx as nx
import torch.nn as nn

from qlint.core.intent import NodeQConfig
from qlint.core.ops import module_kind

_COMPUTING = ("module", "function", "method")  # OpNode.op values that compute something


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: str


@dataclasses.dataclass(frozen=True)
class ModuleInfo:
    """One submodule of the model, called or not."""

    fqn: str
    type_name: str  # qualified class name, e.g. torch.nn.modules.conv.Conv2d
    kind: str
    is_leaf: bool
    training: bool
    has_parameters: bool

    @classmethod
    def of(cls, fqn: str, module: nn.Module) -> ModuleInfo:
        kind = type(module)
        return cls(
            fqn=fqn,
            type_name=f"{kind.__module__}.{kind.__qualname__}",
            kind=module_kind(module),
            is_leaf=not any(True for _ in module.children()),
            training=module.training,
            has_parameters=any(True for _ in module.parameters(recurse=False)),
        )


@dataclasses.dataclass(frozen=True)
class OpNode:
    name: str
    kind: str
    op: str  # "module", "function", "method", "input", "output", "constant"
    module: str | None = None  # fqn of the module that computes this op
    module_type: str | None = None
    scope: str = ""  # fqn of the module whose forward contains the call
    weight: str | None = None  # fqn of the weight parameter
    bias: str | None = None
    inputs: tuple[TensorInfo | None, ...] = ()
    output: TensorInfo | None = None
    training: bool | None = None
    qconfig: NodeQConfig | None = None
    observed_output: NodeQConfig | None = None  # from an inserted observer, if prepared
    target: str = ""  # the raw target, for messages

    @property
    def display(self) -> str:
        """What a user recognises: the module fqn, else the node name."""
        return self.module if self.module is not None else self.name

    @property
    def is_quantized(self) -> bool:
        return self.qconfig is not None and self.qconfig.quantized


def exported_frontend(frontend: str) -> bool:
    """Whether a graph of this front end (a report's ``frontend``) is an aten graph from
    torch.export, a .pt2's or the fallback's: the pt2e flow quantizes it, not prepare_fx."""
    return frontend.startswith("torch.export")


class ModelGraph:
    """A read-only networkx DAG of :class:`OpNode` plus the model's module inventory."""

    def __init__(
        self,
        nodes: Sequence[OpNode],
        edges: Iterable[tuple[str, str, int]],
        modules: Mapping[str, ModuleInfo],
        frontend: str,
        parameters: Mapping[str, Any],
    ) -> None:
        dag = nx.DiGraph()
        for position, node in enumerate(nodes):
            dag.add_node(node.name, op=node, position=position)
        for src, dst, index in edges:
            if dag.has_edge(src, dst):
                dag.edges[src, dst]["indices"] += (index,)
            else:
                dag.add_edge(src, dst, indices=(index,))
        if not nx.is_directed_acyclic_graph(dag):
            raise ValueError("the traced graph has a cycle")
        self._dag = nx.freeze(dag)
        self._order = [n.name for n in nodes]
        # Read-only views, built once: rules query them per node, so every query stays O(1).
        self._modules = types.MappingProxyType(dict(modules))
        self._parameters = dict(parameters)
        self._call_sites: dict[str, list[OpNode]] = {}
        for node in nodes:
            if node.module is not None and node.op in _COMPUTING:
                self._call_sites.setdefault(node.module, []).append(node)
        self._eager_stubs = any(m.kind in ("quant_stub", "dequant_stub") for m in self._modules.values())
        self.frontend = frontend

    # --- structure ---------------------------------------------------------------
    @property
    def exported(self) -> bool:
        """An aten graph from torch.export (every such front end's name starts so): its users
        quantize it with the pt2e flow, not prepare_fx."""
        return exported_frontend(self.frontend)

    @property
    def dag(self) -> nx.DiGraph:
        """The frozen networkx graph; node attribute ``op`` holds the OpNode."""
        return self._dag

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, name: object) -> bool:
        return name in self._dag

    def node(self, name: str) -> OpNode:
        return self._dag.nodes[name]["op"]

    def nodes(self) -> Iterator[OpNode]:
        """All nodes in execution order."""
        for name in self._order:
            yield self._dag.nodes[name]["op"]

    def ops(self) -> Iterator[OpNode]:
        """Computing nodes only: no inputs, outputs or constants."""
        return (n for n in self.nodes() if n.op in _COMPUTING)

    def by_kind(self, *kinds: str) -> list[OpNode]:
        wanted = set(kinds)
        return [n for n in self.ops() if n.kind in wanted]

    def producers(self, name: str) -> list[OpNode]:
        """Input nodes of ``name``, ordered by argument position."""
        preds = sorted(self._dag.predecessors(name), key=lambda p: min(self._dag.edges[p, name]["indices"]))
        return [self.node(p) for p in preds]

    def consumers(self, name: str) -> list[OpNode]:
        succ = sorted(self._dag.successors(name), key=lambda s: self._dag.nodes[s]["position"])
        return [self.node(s) for s in succ]

    def position(self, name: str) -> int:
        return self._dag.nodes[name]["position"]

    # --- modules and parameters --------------------------------------------------
    @property
    def modules(self) -> Mapping[str, ModuleInfo]:
        """Every submodule by fqn (a read-only view, not a copy)."""
        return self._modules

    def call_sites(self, fqn: str) -> list[OpNode]:
        """Every op that a call of module ``fqn`` produced, in execution order."""
        return list(self._call_sites.get(fqn, ()))

    def parameter(self, fqn: str) -> Any | None:
        """A detached view of a weight or bias tensor; rules must not modify it."""
        tensor = self._parameters.get(fqn)
        return None if tensor is None else tensor.detach()

    def uses_eager_stubs(self) -> bool:
        return self._eager_stubs
