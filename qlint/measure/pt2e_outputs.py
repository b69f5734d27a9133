"""Where a pt2e-converted graph hands a node's value on: after the node's output quantize/dequantize.

convert_pt2e keeps every op in float and puts a ``quantize_per_tensor`` → ``dequantize_per_tensor``
pair on the values its quantizer annotated. An op annotated with an output spec (the ReLU after a
conv, for X86InductorQuantizer) is rounded by its own pair before the next op reads it, so its raw
aten output is not what the int8 model passes on. Read there, a layer's own output rounding is
charged to the next layer (QA, digit_cnn: ``relu_1`` read 41.5 dB raw, 33.8 dB after its pair;
FX-converted reads the same layer at its quantized output, 34.5 dB). Compare reads a pt2e row at
the dequantize of that pair, as an FX-converted row is read at its layer's quantized output.

The rule, where a node's output has several consumers:

- the first dequantize in graph order whose quantize reads the node's output is the value read;
  the dequantize copies convert_pt2e makes per consumer hold the same value;
- a node whose output one consumer reads raw and another through a pair is read after the pair
  (what it holds once quantized); a second pair with other qparams (a consumer that asked for its
  own input spec) is not the node's output and is left out;
- a node with no such pair (a conv whose ReLU follows, the model's float output) is read raw: that
  is the value its consumers get.
"""

from __future__ import annotations

import dataclasses
from typing import TypeGuard

import torch.fx as fx

# convert_pt2e's q/dq ops, by their registered names (quantized_decomposed.quantize_per_tensor.default,
# .tensor, .tensor2 all count; a dequantize per tensor or per channel)
_QUANTIZE_PER_TENSOR = "quantized_decomposed.quantize_per_tensor"
_DEQUANTIZE = "quantized_decomposed.dequantize_per_"


@dataclasses.dataclass(frozen=True)
class QuantizedOutput:
    """The value a pt2e node passes on once its output is quantized."""

    node: str  # the dequantize node whose output is read
    scale: float | None  # the pair's step, when it is a literal number (per-tensor static)


def _calls(node: object, prefix: str) -> TypeGuard[fx.Node]:
    return isinstance(node, fx.Node) and node.op == "call_function" and str(node.target).startswith(prefix)


def dequantized(value: object) -> TypeGuard[fx.Node]:
    """The value comes through a dequantize op (the int8 side of a q/dq pair)."""
    return _calls(value, _DEQUANTIZE)


def quantizes_per_tensor(value: object) -> TypeGuard[fx.Node]:
    """A per-tensor quantize op of convert_pt2e's graph."""
    return _calls(value, _QUANTIZE_PER_TENSOR)


def quantized_outputs(graph_module: fx.GraphModule) -> dict[str, QuantizedOutput]:
    """Per node name, the dequantize that hands the node's output on (the rule in the module
    docstring); nodes no quantize/dequantize pair reads are left out. One pass over the graph."""
    found: dict[str, QuantizedOutput] = {}
    for node in graph_module.graph.nodes:  # graph order: the first pair of a node wins
        if not dequantized(node) or not node.args:
            continue
        quantize = node.args[0]
        if not quantizes_per_tensor(quantize) or not quantize.args:
            continue
        source = quantize.args[0]
        if not isinstance(source, fx.Node) or source.name in found:
            continue
        scale = quantize.args[1] if len(quantize.args) > 1 else None
        found[source.name] = QuantizedOutput(node.name, float(scale) if isinstance(scale, (int, float)) else None)
    return found


__all__ = ["QuantizedOutput", "dequantized", "quantized_outputs", "quantizes_per_tensor"]
