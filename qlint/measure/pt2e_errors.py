"""Float vs int8, layer by layer, in a pt2e-converted graph (torch's reference representation).

convert_pt2e leaves float ops with quantize/dequantize pairs around them, and keeps the
node names of the prepared graph. So the float graph (the prepared one: batch norms
folded, observers passing values through) and the converted one pair up by node name,
and both run node by node with an ``fx.Interpreter``, one batch at a time (nothing is
kept across batches). Measured, with torch NS's definitions:

- per conv/linear op, the propagated SQNR: its output in the converted graph against
  the float graph's, everything upstream quantized;
- per int8 conv/linear op, the shadow (local) SQNR: the op run on the *float* graph's
  input, rounded as the converted graph rounds its input, with its int8 weight, against
  the float op's output: the error this op adds by itself;
- per quantized activation, the SQNR of the float tensor rounded and clipped with the
  qparams the converted graph holds for it (the error its observer's choice costs).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx

from qlint.core.batches import as_call
from qlint.core.graph_builder import sole_layer_scopes
from qlint.core.nested import first_float
from qlint.core.ops import CONV_OR_LINEAR_KINDS, TRANSPOSED_CONV_KINDS, function_op, kind_of_type_name
from qlint.core.sqnr import SqnrSums
from qlint.measure.fallback import RECURRENT_KINDS
from qlint.measure.pt2e_outputs import dequantized, quantizes_per_tensor
from qlint.measure.trial import ActivationError

# aten recurrent ops and the layer kind each computes
_RECURRENT_OPS = {
    "lstm": "lstm",
    "gru": "gru",
    "rnn_tanh": "rnn",
    "rnn_relu": "rnn",
    "lstm_cell": "lstm_cell",
    "gru_cell": "gru_cell",
    "rnn_tanh_cell": "rnn_cell",
    "rnn_relu_cell": "rnn_cell",
}
_OBSERVER_PREFIX = "activation_post_process_"  # prepare_pt2e's name for the observers it inserts


@dataclasses.dataclass(frozen=True)
class WeightedOp:
    node: str  # node name (kept by prepare_pt2e / convert_pt2e)
    target: str  # the owning module's fqn when it is this layer, else the node name
    kind: str
    called_by: str | None = None  # the class name of the innermost module calling it


@dataclasses.dataclass(frozen=True)
class OpError:
    """One weighted op's error in the converted graph (dB)."""

    op: WeightedOp
    shadow_db: float | None  # the error it adds on the float input (int8 ops only)
    propagated_db: float | None  # the error at its output, everything upstream included


@dataclasses.dataclass(frozen=True)
class Pt2eErrors:
    """What :func:`measure_errors` found: per weighted op, per quantized activation."""

    layers: tuple[OpError, ...]
    activations: tuple[ActivationError, ...]


def _owner(node: fx.Node) -> tuple[str, str | None, str] | None:
    """(fqn, kind, class name) of the innermost module that called this node, from
    ``nn_module_stack`` (None at the top level)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return None
    path, type_ref = list(stack.values())[-1]
    if not path:
        return None
    type_name = type_ref if isinstance(type_ref, str) else f"{type_ref.__module__}.{type_ref.__qualname__}"
    return str(path), kind_of_type_name(type_name), type_name


def weighted_ops(graph_module: fx.GraphModule) -> list[WeightedOp]:
    """Conv, linear and recurrent ops of an aten graph, named by their module where they are one."""
    found = []
    sole = sole_layer_scopes(graph_module.graph)
    for node in graph_module.graph.nodes:
        if node.op != "call_function":
            continue
        kind = function_op(node.target).kind
        if kind.startswith("aten:") and kind.removeprefix("aten:") in _RECURRENT_OPS:
            kind = _RECURRENT_OPS[kind.removeprefix("aten:")]
        elif kind not in CONV_OR_LINEAR_KINDS | TRANSPOSED_CONV_KINDS:
            continue
        owner = _owner(node)
        # named as lint's graph names it: by the module when the module is this layer (an
        # nn.Conv2d calling conv2d, or a module of another class whose only conv/linear op it
        # is), else by the node
        target = node.name
        if owner is not None and (
            owner[1] == kind or owner[1] in RECURRENT_KINDS or (owner[1] is None and owner[0] in sole)
        ):
            target = owner[0]
        found.append(WeightedOp(node.name, target, kind, owner[2] if owner is not None else None))
    # a module whose forward holds several weighted ops (a block) is named by node, not by fqn
    targets = [op.target for op in found]
    return [op if targets.count(op.target) == 1 else dataclasses.replace(op, target=op.node) for op in found]


def runs_int8(node: fx.Node) -> bool:
    """A weighted op of a converted graph whose input and weight both come through a dequantize."""
    return len(node.args) >= 2 and dequantized(node.args[0]) and dequantized(node.args[1])


def _literal(value: Any) -> bool:
    return isinstance(value, (int, float, bool, torch.dtype)) or value is None


def _requantizer(dequantize: fx.Node) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The quantize → dequantize pair that produced ``dequantize``'s input, as a function of a
    float tensor; None unless its qparams are literal numbers (per-tensor activations)."""
    quantize = dequantize.args[0]
    if not quantizes_per_tensor(quantize):
        return None
    q_rest, dq_rest = quantize.args[1:], dequantize.args[1:]
    if quantize.kwargs or dequantize.kwargs or not all(_literal(arg) for arg in (*q_rest, *dq_rest)):
        return None
    q_op, dq_op = quantize.target, dequantize.target
    return lambda value: dq_op(q_op(value, *q_rest), *dq_rest)  # type: ignore[operator]


def activation_qparams(converted: fx.GraphModule) -> dict[str, tuple[float, int, int, int]]:
    """(scale, zero point, quant_min, quant_max) of every activation the converted graph
    quantizes per tensor with literal qparams, keyed by the node producing the float value."""
    found: dict[str, tuple[float, int, int, int]] = {}
    for node in converted.graph.nodes:
        if not quantizes_per_tensor(node) or len(node.args) < 5:
            continue
        source, scale, zero_point, low, high = node.args[:5]
        if not isinstance(source, fx.Node) or source.op == "get_attr":  # a weight quantized at run time
            continue
        if isinstance(scale, float) and isinstance(zero_point, int) and isinstance(low, int) and isinstance(high, int):
            found.setdefault(source.name, (scale, zero_point, low, high))
    return found


class _FloatRun(fx.Interpreter):
    """Runs the float graph: keeps each weighted op's input and output for this batch, and
    folds each quantized activation's rounding error into its sums."""

    def __init__(
        self,
        graph_module: fx.GraphModule,
        ops: frozenset[str],
        qparams: dict[str, tuple[float, int, int, int]],
        activation_sums: dict[str, SqnrSums],
    ) -> None:
        super().__init__(graph_module)
        self.ops, self.qparams, self.activation_sums = ops, qparams, activation_sums
        self.inputs: dict[str, torch.Tensor | None] = {}
        self.outputs: dict[str, torch.Tensor | None] = {}

    def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
        if str(target).startswith(_OBSERVER_PREFIX):
            return args[0]  # the calibrated observers pass values through; they need not observe these
        return super().call_module(target, args, kwargs)

    def run_node(self, node: fx.Node) -> Any:
        if node.name in self.ops:
            args, _ = self.fetch_args_kwargs_from_env(node)
            self.inputs[node.name] = first_float(args[0]) if args else None
        value = super().run_node(node)
        if node.name in self.ops:
            self.outputs[node.name] = first_float(value)
        if node.name in self.qparams:
            tensor = first_float(value)
            if tensor is not None and tensor.is_floating_point():
                scale, zero_point, low, high = self.qparams[node.name]
                rounded = torch.fake_quantize_per_tensor_affine(tensor.float(), scale, zero_point, low, high)
                self.activation_sums[node.name].add(tensor, rounded)
        return value


class _ConvertedRun(fx.Interpreter):
    """Runs the converted graph: compares each weighted op's output with the float run's
    (propagated), and re-runs each int8 op on the float run's input (shadow)."""

    def __init__(self, graph_module: fx.GraphModule, reference: _FloatRun, sums: dict[str, tuple[SqnrSums, SqnrSums]]):
        super().__init__(graph_module)
        self.reference, self.sums = reference, sums

    def run_node(self, node: fx.Node) -> Any:
        value = super().run_node(node)
        if node.name not in self.sums:
            return value
        shadow_sums, propagated_sums = self.sums[node.name]
        expected = self.reference.outputs.pop(node.name, None)
        float_input = self.reference.inputs.pop(node.name, None)
        actual = first_float(value)
        if expected is None or actual is None:
            return value
        propagated_sums.add(expected, actual)
        requantize = _requantizer(node.args[0]) if runs_int8(node) else None  # type: ignore[arg-type]
        if requantize is not None and float_input is not None:
            args, kwargs = self.fetch_args_kwargs_from_env(node)
            shadow = node.target(requantize(float_input), *args[1:], **kwargs)  # type: ignore[operator]
            shadow_sums.add(expected, first_float(shadow))
        return value


def measure_errors(float_model: fx.GraphModule, converted: fx.GraphModule, batches: Sequence[Any]) -> Pt2eErrors:
    """Shadow and propagated SQNR per weighted op, and SQNR per quantized activation, of
    ``converted`` against ``float_model`` (the prepared graph it was converted from) on
    ``batches``: positional tensors only, as the graphs run on their flat inputs."""
    ops = weighted_ops(converted)
    sums = {op.node: (SqnrSums(), SqnrSums()) for op in ops}
    qparams = activation_qparams(converted)
    activation_sums = {name: SqnrSums() for name in qparams}
    for batch in batches:
        args, kwargs = as_call(batch)
        if kwargs:  # the graphs run on flat positional inputs (nested ones are flattened by the interpreter)
            return Pt2eErrors((), ())
        reference = _FloatRun(float_model, frozenset(sums), qparams, activation_sums)
        with torch.no_grad():
            reference.run(*args)
            _ConvertedRun(converted, reference, sums).run(*args)
    layers = tuple(
        OpError(op, sums[op.node][0].sqnr_db(), sums[op.node][1].sqnr_db())
        for op in ops
        if sums[op.node][1].sqnr_db() is not None
    )
    activations = []
    for name, activation in activation_sums.items():
        measured = activation.sqnr_db()
        if measured is not None:
            _scale, _zero_point, low, high = qparams[name]
            activations.append(ActivationError(name, round(measured, 4), high - low + 1))
    return Pt2eErrors(layers, tuple(activations))
