"""Building the :class:`ModelGraph` of a traced GraphModule: :class:`GraphBuilder`.

One :class:`OpNode` per module call, function or method call of the graph: its op kind,
the module that owns it (the call's target, or the ``nn_module_stack`` entry of an
exported graph, :func:`sole_layer_scopes` naming a custom class's only conv/linear op by
its module), weight and bias references, tensor shapes, the BN training flag and the
qconfig the caller's ``resolve`` gives it; observers of a prepared graph are folded into
the op they observe. :mod:`qlint.core.trace` makes the GraphModule this reads.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx
import torch.nn as nn

from qlint.core.graph import ModelGraph, ModuleInfo, OpNode, TensorInfo
from qlint.core.intent import CallDescription, NodeQConfig
from qlint.core.op_tables import MODULE_KINDS
from qlint.core.ops import (
    CONV_OR_LINEAR_KINDS,
    TRANSPOSED_CONV_KINDS,
    function_kind,
    kind_of_type_name,
    method_kind,
    module_kind,
)
from qlint.core.trace import Traced


def _tensor_info(node: fx.Node) -> TensorInfo | None:
    meta = node.meta.get("tensor_meta")
    if meta is not None and hasattr(meta, "shape"):
        return TensorInfo(tuple(int(d) for d in meta.shape), str(meta.dtype))
    value = node.meta.get("val")
    if isinstance(value, torch.Tensor):
        try:
            return TensorInfo(tuple(int(d) for d in value.shape), str(value.dtype))
        except (TypeError, RuntimeError):  # symbolic sizes
            return None
    return None


_KIND_TO_MODULE_CLASS: dict[str, type] = {}
for _cls, _kind in MODULE_KINDS:
    _KIND_TO_MODULE_CLASS.setdefault(_kind, _cls)


@dataclasses.dataclass
class _Owner:
    path: str
    type_name: str
    cls: type | None


def _stack(node: fx.Node) -> list[_Owner]:
    stack = node.meta.get("nn_module_stack") or {}
    owners = []
    for value in stack.values():
        path, type_ref = value
        if isinstance(type_ref, type):
            owners.append(_Owner(path, f"{type_ref.__module__}.{type_ref.__qualname__}", type_ref))
        else:
            from qlint.core.intent import import_type

            owners.append(_Owner(path, str(type_ref), import_type(str(type_ref))))
    return owners


LAYER_OP_KINDS = CONV_OR_LINEAR_KINDS | TRANSPOSED_CONV_KINDS


def sole_layer_scopes(graph: fx.Graph) -> frozenset[str]:
    """Module paths (``nn_module_stack`` entries of an exported graph) whose whole subtree holds
    exactly one conv or linear op: such a module is that layer whatever its class (a custom
    ``nn.Conv2d`` subclass with a forward of its own), so the op is named by it; a plan entry
    on the name then reaches that op and nothing else."""
    counts: dict[str, int] = {}
    for node in graph.nodes:
        if node.op != "call_function" or isinstance(node.target, str):
            continue
        stack = node.meta.get("nn_module_stack") or {}
        if stack and function_kind(node.target) in LAYER_OP_KINDS:
            for path in {str(path) for path, _type in stack.values()}:
                counts[path] = counts.get(path, 0) + 1
    return frozenset(path for path, count in counts.items() if path and count == 1)


class GraphBuilder:
    """Builds a ModelGraph from a traced GraphModule; qconfigs come from ``resolve``."""

    def __init__(self, traced: Traced, module_source: nn.Module, resolve) -> None:
        self.traced = traced
        self.gm = traced.graph_module
        self.module_source = module_source  # the model whose module types are real
        self.resolve = resolve  # callable(CallDescription, fx.Node, OpNode) -> NodeQConfig|None
        self._folded: dict[fx.Node, fx.Node] = {}
        self._observer_of: dict[fx.Node, nn.Module] = {}
        self._sole_layers = sole_layer_scopes(self.gm.graph) if traced.exported else frozenset()

    def build(self) -> ModelGraph:
        nodes: list[OpNode] = []
        edges: list[tuple[str, str, int]] = []
        kept: set[str] = set()
        for fx_node in self.gm.graph.nodes:
            op_node = self._convert(fx_node)
            if op_node is None:
                continue
            nodes.append(op_node)
            kept.add(fx_node.name)
            for index, arg in enumerate(_flat_args(fx_node)):
                source = self._resolve_fold(arg)
                if source is not None and source.name in kept:
                    edges.append((source.name, fx_node.name, index))
        modules = self._module_inventory()
        parameters: dict[str, torch.Tensor] = dict(self.module_source.named_parameters(remove_duplicate=False))
        parameters.update(dict(self.gm.named_parameters(remove_duplicate=False)))
        parameters.update({k: v for k, v in self.gm.named_buffers() if k.endswith("running_var")})
        return ModelGraph(nodes, edges, modules, self.traced.frontend, parameters)

    def _resolve_fold(self, arg: fx.Node) -> fx.Node | None:
        seen = 0
        while arg in self._folded and seen < 64:
            arg = self._folded[arg]
            seen += 1
        return arg

    def _convert(self, node: fx.Node) -> OpNode | None:
        if node.op == "placeholder":
            return OpNode(name=node.name, kind="input", op="input", output=_tensor_info(node), target=str(node.target))
        if node.op == "output":
            return OpNode(name=node.name, kind="output", op="output", target="output")
        if node.op == "get_attr":
            return None
        if node.op == "call_module":
            return self._convert_module_call(node)
        if node.op in ("call_function", "call_method"):
            return self._convert_function_call(node)
        return None

    def _convert_module_call(self, node: fx.Node) -> OpNode | None:
        target = str(node.target)
        if target.startswith("_guards"):
            return None
        module = self.gm.get_submodule(target)
        kind = module_kind(module)
        if kind == "observer":
            source = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
            if source is not None:
                self._folded[node] = source
                self._observer_of[source] = module
            return None
        cls = type(module)
        weight, bias = _module_weight_refs(module, target)
        info = OpNode(
            name=node.name,
            kind=kind,
            op="module",
            module=target,
            module_type=f"{cls.__module__}.{cls.__qualname__}",
            scope=target.rpartition(".")[0],
            weight=weight,
            bias=bias,
            inputs=tuple(_tensor_info(a) for a in _flat_args(node)),
            output=_tensor_info(node),
            training=module.training,
            target=target,
        )
        info = dataclasses.replace(info, observed_output=self._observed(node))
        call = CallDescription(True, (cls,), target, None)
        return dataclasses.replace(info, qconfig=self.resolve(call, node, info))

    def _convert_function_call(self, node: fx.Node) -> OpNode:
        raw: object
        if node.op == "call_method":
            kind = method_kind(str(node.target))
            op, raw = "method", str(node.target)
        else:
            if isinstance(node.target, str):
                raise ValueError(f"{node.name}: a {node.op} node names its target instead of calling it")
            kind = function_kind(node.target)
            op, raw = "function", node.target
        owners = _stack(node)
        owner = owners[-1] if owners else None
        owning_module: _Owner | None = None
        if owner is not None and owner.cls is not None and _kind_of_class(owner.cls) == kind:
            owning_module = owner
        elif owner is not None and owner.cls is None and self.traced.exported:
            owner_kind = kind_of_type_name(owner.type_name)
            # a class lint cannot import (the archive's own): the module is this layer when its
            # name says so, or when this is the only conv/linear op it computes
            if owner_kind == kind or (
                owner_kind is None and kind in LAYER_OP_KINDS and owner.path in self._sole_layers
            ):
                owning_module = owner
        weight, bias = self._weight_refs(node, kind)
        training = self._training_flag(node, kind, owning_module)
        info = OpNode(
            name=node.name,
            kind=kind,
            op=op,
            module=owning_module.path if owning_module else None,
            module_type=owning_module.type_name if owning_module else None,
            scope=owner.path if owner else "",
            weight=weight,
            bias=bias,
            inputs=tuple(_tensor_info(a) for a in _flat_args(node)),
            output=_tensor_info(node),
            training=training,
            target=getattr(raw, "__name__", str(raw)),
        )
        from qlint.core.intent import function_candidates

        if owning_module is not None and self.traced.exported and _is_torch_leaf(owning_module):
            # An aten op that an nn leaf module produced: resolve it as that module's call,
            # as symbolic_trace would see it, so both front ends agree.
            cls = owning_module.cls or _KIND_TO_MODULE_CLASS.get(kind)
            call = CallDescription(True, (cls,) if cls else (), owning_module.path, None)
        else:
            scope_owner = owners[-1] if owners else None
            call = CallDescription(
                False,
                function_candidates(kind, raw),
                scope_owner.path if scope_owner else "",
                scope_owner.cls if scope_owner else None,
            )
        info = dataclasses.replace(info, observed_output=self._observed(node))
        return dataclasses.replace(info, qconfig=self.resolve(call, node, info))

    def _observed(self, node: fx.Node) -> NodeQConfig | None:
        observer = None
        for user in node.users:
            if user.op == "call_module":
                candidate = self.gm.get_submodule(str(user.target))
                if module_kind(candidate) == "observer":
                    observer = candidate
                    break
        if observer is None:
            return None
        from qlint.core.intent import describe_observer

        return NodeQConfig(activation=describe_observer(observer), weight=None, source="prepared")

    def _weight_refs(self, node: fx.Node, kind: str) -> tuple[str | None, str | None]:
        from qlint.core.ops import WEIGHTED_KINDS

        if kind not in WEIGHTED_KINDS and kind != "batch_norm":
            return None, None
        refs: list[str | None] = []
        for position in (1, 2):
            arg = node.args[position] if len(node.args) > position else None
            if arg is None:
                name = "weight" if position == 1 else "bias"
                arg = node.kwargs.get(name)
            refs.append(str(arg.target) if isinstance(arg, fx.Node) and arg.op == "get_attr" else None)
        return refs[0], refs[1]

    def _training_flag(self, node: fx.Node, kind: str, owner: _Owner | None) -> bool | None:
        if kind != "batch_norm":
            return None
        if self.traced.exported:
            # aten.batch_norm(input, weight, bias, mean, var, training, ...)
            if "no_training" in str(node.target):
                return False
            if len(node.args) > 5 and isinstance(node.args[5], bool):
                return node.args[5]
            return None
        if owner is not None:
            try:
                return self.module_source.get_submodule(owner.path).training
            except AttributeError:
                return None
        training = node.kwargs.get("training")
        return training if isinstance(training, bool) else None

    def _module_inventory(self) -> dict[str, ModuleInfo]:
        inventory: dict[str, ModuleInfo] = {}
        for fqn, module in self.module_source.named_modules(remove_duplicate=False):
            if not fqn or fqn.startswith("_guards"):
                continue
            inventory[fqn] = ModuleInfo.of(fqn, module)
        return inventory


def _module_weight_refs(module: nn.Module, target: str) -> tuple[str | None, str | None]:
    """Weight and bias fqns; a fused intrinsic module (ConvReLU2d…) keeps them in item 0."""
    owner, prefix = module, target
    if (
        not isinstance(getattr(module, "weight", None), torch.Tensor)
        and isinstance(module, nn.Sequential)
        and type(module).__module__.startswith("torch.ao.nn.intrinsic")
        and len(module) > 0
    ):
        owner, prefix = module[0], f"{target}.0"
    weight = f"{prefix}.weight" if isinstance(getattr(owner, "weight", None), torch.Tensor) else None
    bias = f"{prefix}.bias" if isinstance(getattr(owner, "bias", None), torch.Tensor) else None
    return weight, bias


def _flat_args(node: fx.Node) -> list[fx.Node]:
    from qlint.core.nested import leaves_of_type

    return [n for n in leaves_of_type((node.args, node.kwargs), fx.Node) if n.op != "get_attr"]


def _kind_of_class(cls: type) -> str | None:
    for base, kind in MODULE_KINDS:
        if issubclass(cls, base):
            return kind
    return None


def _is_torch_leaf(owner: _Owner) -> bool:
    return owner.type_name.startswith("torch.nn.") or owner.type_name.startswith("torch.ao.nn.")
