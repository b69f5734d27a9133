"""Front ends: turn a model into an FX GraphModule (:mod:`qlint.core.graph_builder` then
makes its :class:`ModelGraph`).

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

from qlint.core.graph import TensorInfo
from qlint.core.ops import module_kind
from qlint.core.preserve import cloned, preserved_state, stored_proxies
from qlint.errors import StateError, TraceError, first_line

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
            f"cannot trace the model: symbolic_trace failed ({first}); torch.export failed ({first_line(export_error)})"
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
            traced, failure, reason = None, error, first_line(error)
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


def propagate_shapes(traced: Traced, example_inputs: Sequence[Any] | None) -> str | None:
    """Fill tensor metadata on every node; returns a notice when it could not."""
    if not example_inputs:
        return None if traced.exported else "no example inputs: shapes are unknown"
    module = traced.graph_module
    nodes = [node for node in module.graph.nodes if node.op == "placeholder"]
    placeholders = [str(node.target) for node in nodes]
    required = [str(node.target) for node in nodes if not node.args and not str(node.target).startswith("*")]
    variadic = any(name.startswith("*") for name in placeholders)
    # fx.Interpreter ignores inputs beyond the graph's (the model itself would raise) and raises
    # a bare StopIteration for a missing one
    if (len(example_inputs) > len(placeholders) and not variadic) or len(example_inputs) < len(required):
        optional = len(placeholders) - len(required)
        raise TraceError(
            f"the example inputs do not fit the model: it takes {len(required)} input(s)"
            + (f" and {optional} optional one(s)" if optional else "")
            + f" ({', '.join(placeholders)}), got {len(example_inputs)}"
        )
    if traced.exported:
        # an exported graph carries its own shapes; inputs that do not fit it (another model's)
        # would only fail later, inside the trial, as a finding
        try:
            with preserved_state(module), torch.no_grad(), contextlib.redirect_stderr(io.StringIO()):
                module(*cloned(tuple(example_inputs)))
        except Exception as error:
            raise TraceError(f"the example inputs do not fit the model: {first_line(error)}") from error
        return None
    # A forward pass updates BN running stats and observer/fake-quant buffers; calibration
    # and the rules must see them as the user left them.
    with preserved_state(module):
        try:
            # A failing forward may print to stderr before it raises; the user gets one line.
            with torch.no_grad(), contextlib.redirect_stderr(io.StringIO()):
                _ShapeRecorder(module).run(*cloned(tuple(example_inputs)))
        except Exception as error:  # the inputs do not fit the model
            cause = error.__cause__ or error
            raise TraceError(f"the example inputs do not fit the model: {first_line(cause)}") from error
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
        raise TraceError(f"the example inputs do not fit the model: {first_line(error)}") from error
    for module, training in modes:
        module.training = training
    return working


def private_copy(model: nn.Module) -> nn.Module:
    """Linting works on a copy so the user's parameters, buffers, mode and hooks stay put."""
    try:
        return copy.deepcopy(model)
    except Exception as error:  # e.g. modules holding un-copyable handles
        raise TraceError(f"cannot copy the model for analysis: {first_line(error)}") from error
