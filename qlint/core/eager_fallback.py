"""The eager front end: a ModelGraph from one real forward pass, for untraceable models.

When ``symbolic_trace`` and ``torch.export`` both fail (typically Python control
flow on tensor values, ``if x.sum() > 0:``), qlint can still lint the model's
*structure* by running it once on the example inputs:

* a forward pre-hook and hook on every module record leaf-module calls in
  execution order, with input/output shapes;
* a ``TorchFunctionMode`` records torch functions and tensor methods called
  outside leaf modules (``torch.cat``, ``x + y``, ``F.relu`` …);
* producer → consumer edges are linked by tensor identity.

Limits, which :func:`eager_notices` spells out in the report: only the path taken
for these inputs is seen; Python control flow itself, Python scalars and
anything computed outside torch (``.item()``, numpy) are invisible, so a tensor
that passes through such code has no recorded producer; ops inside leaf modules
are folded into the module. The run is under ``torch.no_grad()`` on a copy of the example
inputs; ``eager_graph`` works on a private copy of the model, and lint borrows the model
under :func:`qlint.core.preserve.preserved_state` instead, which restores it afterwards.

Use::

    graph = eager_graph(model, example_inputs, resolve)   # ModelGraph, frontend "eager-hooks"
"""

from __future__ import annotations

import dataclasses
import inspect
import operator
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from qlint.core.graph import ModelGraph, ModuleInfo, OpNode, TensorInfo
from qlint.core.intent import CallDescription, function_candidates
from qlint.core.nested import tensors_in
from qlint.core.op_tables import FUNCTION_KINDS
from qlint.core.ops import WEIGHTED_KINDS, function_kind, method_kind, module_kind
from qlint.core.preserve import cloned
from qlint.errors import TraceError, first_line

FRONTEND_EAGER = "eager-hooks"

_DUNDER = {
    "__add__": operator.add,
    "__radd__": operator.add,
    "__iadd__": operator.iadd,
    "__mul__": operator.mul,
    "__rmul__": operator.mul,
    "__imul__": operator.imul,
    "__sub__": operator.sub,
    "__rsub__": operator.sub,
    "__truediv__": operator.truediv,
    "__matmul__": operator.matmul,
    "__getitem__": operator.getitem,
}


def is_leaf(module: nn.Module) -> bool:
    """Leaves as symbolic_trace sees them: torch.nn / torch.ao.nn modules (not containers), or childless."""
    if isinstance(module, (nn.Sequential, nn.ModuleList, nn.ModuleDict)):
        return False
    if module_kind(module) in ("observer", "quant_stub", "dequant_stub"):
        return True
    type_module = type(module).__module__
    if type_module.startswith("torch.nn.") or type_module.startswith("torch.ao.nn."):
        return True
    return not any(True for _ in module.children())


def _info(tensor: torch.Tensor | None) -> TensorInfo | None:
    if tensor is None:
        return None
    return TensorInfo(tuple(int(d) for d in tensor.shape), str(tensor.dtype))


@dataclasses.dataclass
class _Record:
    name: str
    op: str  # "input", "module", "function", "method", "output"
    kind: str
    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor]
    module: str | None = None
    module_obj: nn.Module | None = None
    scope: str = ""
    scope_type: type | None = None
    raw: Any = None
    weight: str | None = None
    bias: str | None = None


class _Recorder(TorchFunctionMode):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.records: list[_Record] = []
        self.producer: dict[int, str] = {}
        self.keep_alive: list[Any] = []  # ids are only unique while the tensors live
        self.leaf_depth = 0
        self.scopes: list[tuple[str, type]] = [("", type(model))]
        self.counts: dict[str, int] = {}
        self.param_names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
        self.unlinked = 0  # op inputs with no recorded producer

    def unique(self, base: str) -> str:
        base = re.sub(r"[^0-9A-Za-z_]", "_", base) or "op"
        count = self.counts.get(base, 0)
        self.counts[base] = count + 1
        return base if count == 0 else f"{base}_{count}"

    def produce(self, record: _Record) -> None:
        self.records.append(record)
        for tensor in record.outputs:
            self.producer[id(tensor)] = record.name
            self.keep_alive.append(tensor)
        self.keep_alive.extend(record.inputs)

    # --- functions and tensor methods -------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.leaf_depth > 0:
            return out
        outputs = tensors_in(out)
        if not outputs:
            return out  # x.shape, x.dim(), bool(x): no tensor flows on
        name = getattr(func, "__name__", None) or str(func)
        if func in FUNCTION_KINDS:
            op, raw, kind = "function", func, function_kind(func)
        elif name in _DUNDER:
            raw = _DUNDER[name]
            op, kind = "function", function_kind(raw)
        elif getattr(torch.Tensor, name, None) is func:
            op, raw, kind = "method", name, method_kind(name)
        else:
            op, raw, kind = "function", func, function_kind(func)
        inputs = tensors_in((args, kwargs))
        scope, scope_type = self.scopes[-1]
        record = _Record(
            self.unique(getattr(raw, "__name__", None) or str(raw)),
            op,
            kind,
            inputs,
            outputs,
            scope=scope,
            scope_type=scope_type,
            raw=raw,
        )
        if kind in WEIGHTED_KINDS or kind == "batch_norm":
            params = [a for a in inputs if id(a) in self.param_names]
            record.weight = self.param_names[id(params[0])] if params else None
            record.bias = self.param_names[id(params[1])] if len(params) > 1 else None
            record.inputs = [a for a in inputs if id(a) not in self.param_names]
        self.produce(record)
        return out

    # --- module hooks -------------------------------------------------------------------
    def hooks_for(self, fqn: str, module: nn.Module):
        leaf = is_leaf(module)

        def pre(mod, args, kwargs):
            if self.leaf_depth > 0:
                self.leaf_depth += 1 if leaf else 0
                return None
            if leaf:
                self.leaf_depth += 1
            else:
                self.scopes.append((fqn, type(mod)))
            return None

        def post(mod, args, kwargs, output):
            if not leaf:
                if self.leaf_depth == 0 and len(self.scopes) > 1:
                    self.scopes.pop()
                return None
            self.leaf_depth -= 1
            if self.leaf_depth > 0:
                return None  # a leaf called inside another leaf is part of it
            cls = type(mod)
            scope, scope_type = self.scopes[-1]
            weight = getattr(mod, "weight", None)
            bias = getattr(mod, "bias", None)
            self.produce(
                _Record(
                    self.unique(fqn.replace(".", "_")),
                    "module",
                    module_kind(mod),
                    tensors_in((args, kwargs)),
                    tensors_in(output),
                    module=fqn,
                    module_obj=mod,
                    scope=fqn.rpartition(".")[0],
                    scope_type=scope_type,
                    weight=f"{fqn}.weight" if isinstance(weight, torch.Tensor) else None,
                    bias=f"{fqn}.bias" if isinstance(bias, torch.Tensor) else None,
                    raw=cls,
                )
            )
            return None

        return pre, post


def _input_names(model: nn.Module, count: int) -> list[str]:
    try:
        params = [
            p.name
            for p in inspect.signature(model.forward).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):
        params = []
    names = params[:count]
    names += [f"input_{i}" for i in range(len(names), count)]
    return names


def _record_run(model: nn.Module, example_inputs: Sequence[Any]) -> _Recorder:
    example_inputs = cloned(tuple(example_inputs))  # the model may write its inputs in place
    recorder = _Recorder(model)
    for name, value in zip(_input_names(model, len(example_inputs)), example_inputs):
        recorder.produce(_Record(recorder.unique(name), "input", "input", [], tensors_in(value)))
    handles = []
    try:
        for fqn, module in model.named_modules():
            if not fqn:
                continue
            pre, post = recorder.hooks_for(fqn, module)
            handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(module.register_forward_hook(post, with_kwargs=True))
        with torch.no_grad(), recorder:
            output = model(*example_inputs)
    except TraceError:
        raise
    except Exception as error:  # the model itself failed on these inputs
        raise TraceError(
            f"eager fallback: the model failed on the example inputs: {first_line(error)}"[:400]
        ) from error
    finally:
        for handle in handles:
            handle.remove()
    recorder.produce(_Record("output", "output", "output", tensors_in(output), []))
    return recorder


def _prune(records: list[_Record], edges: list[tuple[str, str, int]]) -> set[str]:
    """Names to keep: inputs, modules, the output, and functions that feed one of them."""
    preds: dict[str, set[str]] = {}
    for src, dst, _ in edges:
        preds.setdefault(dst, set()).add(src)
    keep = {r.name for r in records if r.op in ("input", "module", "output")}
    stack = list(keep)
    while stack:
        for src in preds.get(stack.pop(), ()):
            if src not in keep:
                keep.add(src)
                stack.append(src)
    return keep


def _module_inventory(model: nn.Module) -> dict[str, ModuleInfo]:
    inventory: dict[str, ModuleInfo] = {}
    for fqn, module in model.named_modules(remove_duplicate=False):
        if not fqn:
            continue
        inventory[fqn] = ModuleInfo.of(fqn, module)
    return inventory


def eager_analysis(
    model: nn.Module,
    example_inputs: Sequence[Any] | None,
    resolve: Callable[[CallDescription, Any, OpNode], Any],
    copy_model: bool = True,
) -> tuple[ModelGraph, list[str]]:
    """(graph, notes): the graph of one forward pass and what it could not see."""
    if not example_inputs:
        raise TraceError("the eager fallback needs example inputs: pass --input-shape or --example-inputs")
    if not isinstance(example_inputs, (tuple, list)):
        example_inputs = (example_inputs,)
    if copy_model:
        from qlint.core.trace import private_copy

        model = private_copy(model)
    recorder = _record_run(model, tuple(example_inputs))
    records = recorder.records
    edges: list[tuple[str, str, int]] = []
    unlinked = 0
    for record in records:
        for index, tensor in enumerate(record.inputs):
            source = recorder.producer.get(id(tensor))
            # a tensor written in place by this very op maps to itself; skip self-edges
            if source is not None and source != record.name:
                edges.append((source, record.name, index))
            elif source is None and record.op != "input":
                unlinked += 1
    keep = _prune(records, edges)
    nodes: list[OpNode] = []
    for record in records:
        if record.name not in keep:
            continue
        nodes.append(_op_node(record, resolve))
    edges = [(s, d, i) for s, d, i in edges if s in keep and d in keep]
    parameters: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    parameters.update({k: v for k, v in model.named_buffers() if k.endswith("running_var")})
    graph = ModelGraph(nodes, edges, _module_inventory(model), FRONTEND_EAGER, parameters)
    return graph, eager_notices(unlinked, len(records) - len(keep))


def _op_node(record: _Record, resolve) -> OpNode:
    if record.op == "input":
        return OpNode(
            name=record.name,
            kind="input",
            op="input",
            output=_info(record.outputs[0]) if record.outputs else None,
            target=record.name,
        )
    if record.op == "output":
        return OpNode(name="output", kind="output", op="output", target="output")
    inputs = tuple(_info(t) for t in record.inputs)
    output = _info(record.outputs[0]) if record.outputs else None
    if record.op == "module":
        if record.module_obj is None:
            raise ValueError(f"module record {record.name} lost its module")
        cls = type(record.module_obj)
        info = OpNode(
            name=record.name,
            kind=record.kind,
            op="module",
            module=record.module,
            module_type=f"{cls.__module__}.{cls.__qualname__}",
            scope=record.scope,
            weight=record.weight,
            bias=record.bias,
            inputs=inputs,
            output=output,
            training=record.module_obj.training,
            target=record.module or "",
        )
        call = CallDescription(True, (cls,), record.module or "", None)
    else:
        training = None
        info = OpNode(
            name=record.name,
            kind=record.kind,
            op=record.op,
            scope=record.scope,
            weight=record.weight,
            bias=record.bias,
            inputs=inputs,
            output=output,
            training=training,
            target=getattr(record.raw, "__name__", str(record.raw)),
        )
        call = CallDescription(False, function_candidates(record.kind, record.raw), record.scope, record.scope_type)
    return dataclasses.replace(info, qconfig=resolve(call, None, info))


def eager_notices(unlinked: int = 0, dropped: int = 0) -> list[str]:
    notes = [
        "front end: eager-hooks (symbolic_trace and torch.export both failed): the graph was recorded "
        "from ONE forward pass on the example inputs, so only the branches taken for these inputs "
        "are analysed; Python control flow, Python scalars and code outside torch (.item(), numpy) "
        "are invisible",
    ]
    if unlinked:
        notes.append(
            f"eager-hooks: {unlinked} op input(s) came from code the hooks cannot see "
            "(functional ops outside torch, Python arithmetic, constants): edges into them "
            "are missing, so pattern rules may miss problems there"
        )
    if dropped:
        notes.append(
            f"eager-hooks: {dropped} tensor op(s) that fed only control flow or dead code were left out of the graph"
        )
    return notes


def eager_graph(
    model: nn.Module, example_inputs: Sequence[Any] | None, resolve: Callable[[CallDescription, Any, OpNode], Any]
) -> ModelGraph:
    """A ModelGraph (frontend ``"eager-hooks"``) from one hooked forward pass of a copy of ``model``.

    ``resolve(call, None, op_node)`` gives each op's qconfig, as for GraphBuilder (the fx.Node
    argument is None: there is none). Raises TraceError when the model fails on the inputs.
    """
    return eager_analysis(model, example_inputs, resolve)[0]
