"""Front ends: turn a model into an FX GraphModule, then into a :class:`ModelGraph`.

Order of attempts: an exported program from a ``.pt2`` file is used as is; a
GraphModule (e.g. prepare_fx output) is used as is; otherwise ``symbolic_trace``
with quantizable modules kept as leaves, falling back to
``torch.export.export(strict=False)`` when symbolic tracing fails.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import logging
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.nn.parameter import is_lazy

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
from qlint.core.preserve import cloned, preserved_state, stored_proxies
from qlint.errors import StateError, TraceError

FRONTEND_SYMBOLIC = "fx.symbolic_trace"
FRONTEND_GRAPH_MODULE = "fx.GraphModule"
FRONTEND_EXPORT = "torch.export"
FRONTEND_PT2 = "torch.export (.pt2)"


class LeafTracer(fx.Tracer):
    """symbolic_trace that also keeps observers, fake-quants and stubs as leaves."""

    def is_leaf_module(self, module: nn.Module, qualified_name: str) -> bool:
        if module_kind(module) in ("observer", "quant_stub", "dequant_stub"):
            return True
        if type(module).__module__.startswith("torch.ao.nn."):
            # Fused intrinsic modules are Sequentials, which the default tracer would enter.
            return True
        return super().is_leaf_module(module, qualified_name)


@dataclasses.dataclass(frozen=True)
class Traced:
    graph_module: fx.GraphModule
    frontend: str
    exported: bool  # aten-level graph with nn_module_stack type names as strings
    notes: tuple[str, ...] = ()


def trace(model: nn.Module, example_inputs: Sequence[Any] | None, exported_program: Any = None) -> Traced:
    """Trace ``model`` (borrowed: it is left as it was) to a GraphModule."""
    if exported_program is not None:
        return Traced(exported_program.module(), FRONTEND_PT2, exported=True)
    if isinstance(model, fx.GraphModule):
        return Traced(_own_graph(model), FRONTEND_GRAPH_MODULE, exported=False)
    try:
        return Traced(symbolic_graph(model), FRONTEND_SYMBOLIC, exported=False)
    except TraceError as symbolic_error:  # try the next front end
        first = str(symbolic_error)
    if not example_inputs:
        raise TraceError(
            f"symbolic_trace failed ({first}) and torch.export needs example inputs: "
            "pass --input-shape or --example-inputs"
        )
    try:
        # export runs forward on fake tensors: attributes it writes on the model are undone
        with preserved_state(model), _silenced():
            program = torch.export.export(model, tuple(example_inputs), strict=False)
            # module() generates Python from the graph, which fails on module names no code can spell
            exported_module = program.module()
    except Exception as export_error:  # both front ends failed: report both reasons
        raise TraceError(
            f"cannot trace the model: symbolic_trace failed ({first}); torch.export failed ({_one_line(export_error)})"
        ) from export_error
    note = f"symbolic_trace failed ({first}); used torch.export(strict=False)"
    return Traced(exported_module, FRONTEND_EXPORT, exported=True, notes=(note,))


def symbolic_graph(model: nn.Module) -> fx.GraphModule:
    """``model`` as an FX GraphModule: itself when it is one, else ``symbolic_trace`` with
    quantizable modules, observers and stubs kept as leaves.

    The graph module shares the model's submodules and parameters (tracing copies
    nothing), so hooks on the model see the graph's calls. Raises TraceError with the
    reason on one line when the model cannot be traced symbolically."""
    if isinstance(model, fx.GraphModule):
        return model
    # Tracing runs forward: what it writes on the model (attributes, the tracer's own
    # _tensor_constant attributes) is undone when the attempt ends, whatever its outcome.
    with preserved_state(model):
        try:
            tracer = LeafTracer()
            graph = tracer.trace(model)
            # GraphModule generates Python from the graph, which fails on module names no code can spell
            traced: fx.GraphModule | None = fx.GraphModule(tracer.root, graph, type(model).__name__)
            failure: Exception | None = None
        except Exception as error:  # user code fails symbolic tracing in many ways
            traced, failure, reason = None, error, _one_line(error)
        stored = stored_proxies(model)
    if stored:
        raise StateError(
            f"the model's forward stores a traced value (a torch.fx Proxy) in {stored[0]!r}: state kept "
            "across calls cannot be traced; qlint put the attribute back. Keep such state out of forward"
        )
    if traced is None:
        raise TraceError(reason) from failure
    return traced


def _own_graph(graph_module: fx.GraphModule) -> fx.GraphModule:
    """A GraphModule sharing the user's modules and weights with its own graph, so that the
    metadata qlint writes on nodes (shapes) never lands on the user's graph."""
    # Graph.__deepcopy__ copies nodes with shallow copies of their meta; tensors are not copied.
    own = fx.GraphModule(graph_module, copy.deepcopy(graph_module.graph), type(graph_module).__name__)
    own.meta = dict(getattr(graph_module, "meta", {}))
    return own


@contextlib.contextmanager
def _silenced():
    """torch.export logs graph dumps on failure; qlint reports one line instead."""
    level = logging.root.manager.disable  # the user's own setting comes back, not NOTSET
    logging.disable(logging.CRITICAL)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(level)


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]


def propagate_shapes(traced: Traced, example_inputs: Sequence[Any] | None) -> str | None:
    """Fill tensor metadata on every node; returns a notice when it could not."""
    if traced.exported or not example_inputs:
        return None if traced.exported else "no example inputs: shapes are unknown"
    module = traced.graph_module
    placeholders = [str(node.target) for node in module.graph.nodes if node.op == "placeholder"]
    if len(example_inputs) > len(placeholders) and not any(name.startswith("*") for name in placeholders):
        # fx.Interpreter ignores inputs beyond the graph's; the model itself would raise
        raise TraceError(
            f"the example inputs do not fit the model: it takes {len(placeholders)} input(s) "
            f"({', '.join(placeholders)}), got {len(example_inputs)}"
        )
    # A forward pass updates BN running stats and observer/fake-quant buffers; calibration
    # and the rules must see them as the user left them.
    with preserved_state(module):
        try:
            # ShapeProp prints a traceback to stderr before re-raising; the user gets one line.
            with torch.no_grad(), contextlib.redirect_stderr(io.StringIO()):
                _ShapeRecorder(module).run(*cloned(tuple(example_inputs)))
        except Exception as error:  # the inputs do not fit the model
            cause = error.__cause__ or error
            raise TraceError(f"the example inputs do not fit the model: {_one_line(cause)}") from error
    return None


class _ShapeRecorder(fx.Interpreter):
    """Runs the graph once and records each tensor-valued node's shape and dtype.

    torch's ShapeProp does the same but imports its symbolic-shape machinery (sympy),
    which costs ~40 MiB of resident memory for nothing here."""

    def run_node(self, node: fx.Node) -> Any:
        result = super().run_node(node)
        if isinstance(result, torch.Tensor):
            node.meta["tensor_meta"] = TensorInfo(tuple(int(d) for d in result.shape), str(result.dtype))
        return result


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
            cls = type(module)
            inventory[fqn] = ModuleInfo(
                fqn=fqn,
                type_name=f"{cls.__module__}.{cls.__qualname__}",
                kind=module_kind(module),
                is_leaf=not any(True for _ in module.children()),
                training=module.training,
                has_parameters=any(True for _ in module.parameters(recurse=False)),
            )
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


def is_lazy_model(model: nn.Module) -> bool:
    """Whether ``model`` has lazy modules (nn.LazyLinear...) that no forward pass initialized yet."""
    return any(is_lazy(tensor) for tensor in [*model.parameters(), *model.buffers()])


def initialized_copy(model: nn.Module, example_inputs: Sequence[Any] | None) -> nn.Module:
    """A copy whose lazy modules took their shapes from one forward pass on the example inputs.

    Initializing the user's model would change it; uninitialized parameters hold no memory,
    so copying a lazy model costs little."""
    if not example_inputs:
        raise TraceError(
            "the model has lazy modules (e.g. nn.LazyLinear) whose shapes come from a first "
            "forward pass: pass --input-shape or --example-inputs"
        )
    working = private_copy(model)
    modes = [(module, module.training) for module in working.modules()]
    working.eval()  # no BN statistics or observer updates: only the shapes are wanted
    try:
        with torch.no_grad():
            working(*cloned(tuple(example_inputs)))
    except Exception as error:  # the inputs do not fit the model
        raise TraceError(f"the example inputs do not fit the model: {_one_line(error)}") from error
    for module, training in modes:
        module.training = training
    return working


def private_copy(model: nn.Module) -> nn.Module:
    """Linting works on a copy so the user's parameters, buffers, mode and hooks stay put."""
    try:
        return copy.deepcopy(model)
    except Exception as error:  # e.g. modules holding un-copyable handles
        raise TraceError(f"cannot copy the model for analysis: {_one_line(error)}") from error
