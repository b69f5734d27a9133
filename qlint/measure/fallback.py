"""What stayed float after convert_fx, and why.

convert_fx swaps a float op for its int8 kernel only where prepare_fx saw the op (a
module the tracer did not step into is opaque), the backend config has a static
pattern for it, and the mapping gave it a qconfig. Everything else runs in float,
silently. This module reads the converted graph and names each conv, linear,
recurrent and attention op left in float with its reason.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch.fx as fx
import torch.nn as nn
from torch.ao.quantization import QConfigMapping

from qlint.core.ops import CONV_OR_LINEAR_KINDS, TRANSPOSED_CONV_KINDS, function_op, module_kind, quantized_form

FallbackReason = Literal["tracer-leaf", "recurrent", "functional", "kept-float", "no-static-kernel", "not-annotated"]

RECURRENT_KINDS = frozenset({"lstm", "gru", "rnn", "lstm_cell", "gru_cell", "rnn_cell"})
ATTENTION_KINDS = frozenset({"multihead_attention"})
COUNTED_KINDS = CONV_OR_LINEAR_KINDS | TRANSPOSED_CONV_KINDS | RECURRENT_KINDS | ATTENTION_KINDS


@dataclasses.dataclass(frozen=True)
class FloatLayer:
    """One op the converted model runs in float."""

    target: str  # module fqn, or the node name of a functional op
    kind: str  # "linear", "lstm", "multihead_attention", or "module:TransformerEncoder" for a leaf
    reason: FallbackReason
    inner: tuple[str, ...] = ()  # for a tracer leaf: the conv/linear/attention modules inside it
    called_by: str | None = None  # exported graphs: the class name of the module calling the op

    @property
    def weighted_ops(self) -> int:
        return max(1, len(self.inner))


def asks_float(mapping: QConfigMapping | None, fqn: str, module_type: type | None = None) -> bool:
    """The mapping itself asks for float at ``fqn`` (a None qconfig by name or prefix, by the
    module's type, or as the global default)."""
    if mapping is None:
        return False
    by_name = mapping.module_name_qconfigs
    path = fqn
    while path:
        if path in by_name:
            return by_name[path] is None
        path = path.rpartition(".")[0]
    by_type = mapping.object_type_qconfigs
    if module_type is not None and module_type in by_type:
        return by_type[module_type] is None
    return mapping.global_qconfig is None


def _inner_layers(module: nn.Module) -> tuple[str, ...]:
    return tuple(name for name, inner in module.named_modules() if name and module_kind(inner) in COUNTED_KINDS)


def float_layers(converted: fx.GraphModule, mapping: QConfigMapping | None = None) -> list[FloatLayer]:
    """Every weighted op of ``converted`` that runs in float, in graph order, with its reason."""
    found: list[FloatLayer] = []
    for node in converted.graph.nodes:
        if node.op == "call_module":
            module = converted.get_submodule(str(node.target))
            entry = _module_fallback(str(node.target), module, mapping)
            if entry is not None:
                found.append(entry)
        elif node.op == "call_function":
            op = function_op(node.target)
            if op.kind in CONV_OR_LINEAR_KINDS | TRANSPOSED_CONV_KINDS and not op.quantized:
                found.append(FloatLayer(node.name, op.kind, "functional"))
    return found


def _module_fallback(fqn: str, module: nn.Module, mapping: QConfigMapping | None) -> FloatLayer | None:
    kind = module_kind(module)
    if kind in COUNTED_KINDS:
        if quantized_form(module) is not None:
            return None
        if asks_float(mapping, fqn, type(module)):
            return FloatLayer(fqn, kind, "kept-float")
        if kind in RECURRENT_KINDS:
            return FloatLayer(fqn, kind, "recurrent")
        if kind in ATTENTION_KINDS:
            return FloatLayer(fqn, kind, "tracer-leaf", _inner_layers(module))
        return FloatLayer(fqn, kind, "no-static-kernel")
    if kind.startswith("module:") and type(module).__module__.startswith("torch.nn"):
        inner = _inner_layers(module)
        if inner:  # a torch container the tracer treats as one opaque call (TransformerEncoder)
            reason: FallbackReason = "kept-float" if asks_float(mapping, fqn, type(module)) else "tracer-leaf"
            return FloatLayer(fqn, kind, reason, inner)
    return None


def int8_coverage(converted: fx.GraphModule, fallbacks: list[FloatLayer]) -> tuple[int, int]:
    """(int8 weighted ops, all weighted ops): a tracer leaf counts every layer inside it."""
    int8 = 0
    for node in converted.graph.nodes:
        if node.op == "call_module":
            module = converted.get_submodule(str(node.target))
            if module_kind(module) in COUNTED_KINDS and quantized_form(module) is not None:
                int8 += 1
        elif node.op == "call_function":
            op = function_op(node.target)
            if op.kind in CONV_OR_LINEAR_KINDS | TRANSPOSED_CONV_KINDS and op.quantized:
                int8 += 1
    return int8, int8 + sum(entry.weighted_ops for entry in fallbacks)


def weighted_coverage(converted: fx.GraphModule, mapping: QConfigMapping | None = None) -> tuple[int, int, list[str]]:
    """(int8 weighted ops, all of them, the float ones by name) of a converted model: lint's trial's
    count, which verify and ``qlint quantize`` report too. A tracer leaf's layers are named inside it."""
    fallbacks = float_layers(converted, mapping)
    int8, total = int8_coverage(converted, fallbacks)
    names = [name for entry in fallbacks for name in (entry.target, *(f"{entry.target}.{i}" for i in entry.inner))]
    return int8, total, names
