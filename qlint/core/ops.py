"""Normalization of front-end specific ops to one vocabulary of op kinds.

``nn.Conv2d``, ``F.conv2d``, ``torch.conv2d`` and ``aten.conv2d`` are all the
kind ``conv2d``. Rules only ever see these kinds, so adding a front end means
extending the tables (:mod:`qlint.core.op_tables`) and nothing else. This module
classifies a module or call target with them (quantized, QAT and fused variants
included) and names the families of kinds rules test against.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import torch.nn as nn

from qlint.core.op_tables import ATEN_KINDS, FUNCTION_KINDS, FUSED_RELU_MODULES, METHOD_KINDS, MODULE_KINDS

# Kinds whose output is computed from a weight; the layers quantization cares most about.
WEIGHTED_KINDS = frozenset(
    {
        "conv1d",
        "conv2d",
        "conv3d",
        "conv",
        "conv_transpose1d",
        "conv_transpose2d",
        "conv_transpose3d",
        "linear",
        "bilinear",
        "lstm",
        "gru",
        "rnn",
        "lstm_cell",
        "gru_cell",
        "rnn_cell",
        "embedding",
        "embedding_bag",
        "multihead_attention",
    }
)
CONV_KINDS = frozenset({"conv1d", "conv2d", "conv3d", "conv"})
CONV_OR_LINEAR_KINDS = CONV_KINDS | {"linear"}
TRANSPOSED_CONV_KINDS = frozenset({"conv_transpose1d", "conv_transpose2d", "conv_transpose3d"})
NORM_KINDS = frozenset({"batch_norm", "layer_norm", "group_norm", "instance_norm"})
ACTIVATION_KINDS = frozenset(
    {
        "relu",
        "relu6",
        "leaky_relu",
        "prelu",
        "elu",
        "celu",
        "gelu",
        "silu",
        "mish",
        "hardswish",
        "hardsigmoid",
        "hardtanh",
        "sigmoid",
        "tanh",
        "softmax",
    }
)
# What a float model and its quantized twin are compared on, layer by layer.
LAYER_KINDS = (WEIGHTED_KINDS - {"bilinear", "multihead_attention"}) | NORM_KINDS | ACTIVATION_KINDS
# Ops whose output range is fixed by the math; backends quantize them with fixed qparams.
FIXED_QPARAMS_KINDS = frozenset({"sigmoid", "tanh", "hardsigmoid", "softmax"})
# Ops that neither compute nor change values; they never need their own qparams.
SHAPE_KINDS = frozenset(
    {
        "view",
        "reshape",
        "flatten",
        "transpose",
        "permute",
        "contiguous",
        "size",
        "unsqueeze",
        "squeeze",
        "expand",
        "getitem",
        "chunk",
        "split",
        "dropout",
        "identity",
        "to",
    }
)


def module_kind(module: nn.Module) -> str:
    """The op kind a leaf module computes; quantized, QAT and fused variants map to their float kind."""
    cls = type(module)
    if cls.__module__.startswith("torch.ao.nn."):
        kind = _kind_from_class_name(cls.__name__)
        if kind is not None:
            return kind
    float_type = _float_counterpart(cls)
    for base, kind in MODULE_KINDS:
        if issubclass(float_type, base):
            return kind
    name = cls.__name__
    if "Observer" in name or "FakeQuant" in name:
        return "observer"
    if name == "QuantStub":
        return "quant_stub"
    if name == "DeQuantStub":
        return "dequant_stub"
    return "module:" + name


_KIND_OF_CLASS_NAME = {cls.__name__: kind for cls, kind in reversed(MODULE_KINDS)}
# torch.ao.nn names fused modules after their leading op (ConvBnReLU2d, LinearReLU, BNReLU2d).
_FUSED_PREFIXES = (
    ("ConvTranspose", "conv_transpose"),
    ("Conv", "conv"),
    ("Linear", "linear"),
    ("BNReLU", "batch_norm"),
)


def _kind_from_class_name(name: str) -> str | None:
    """The kind of a torch.ao.nn class (quantized, QAT, fused) from its name; None when unknown.

    Names decide because quantized classes do not always derive from their float class
    (quantized ReLU6 derives from ReLU) and fused ones derive from Sequential."""
    if "Packed" in name:
        return None  # LinearPackedParams & co. hold a layer's weights; they compute nothing
    if name in _KIND_OF_CLASS_NAME:
        return _KIND_OF_CLASS_NAME[name]
    for prefix, kind in _FUSED_PREFIXES:
        if name.startswith(prefix):
            if kind == "linear" or kind == "batch_norm":
                return kind
            dims = re.search(r"([123])d$", name)
            return f"{kind}{dims.group(1) if dims else 2}d"
    return None


def kind_of_type_name(type_name: str) -> str | None:
    """The kind of a torch module class from its (dotted) name, as ``nn_module_stack`` records
    it in exported graphs; None when unknown."""
    short = type_name.rpartition(".")[2]
    return next((kind for base, kind in MODULE_KINDS if base.__name__ == short), None)


def _float_counterpart(cls: type) -> type:
    """QAT and quantized modules (torch.ao.nn.*) keep a float base class or a _FLOAT_MODULE."""
    float_module = getattr(cls, "_FLOAT_MODULE", None)
    if isinstance(float_module, type) and float_module.__module__.startswith("torch.nn"):
        return float_module
    return cls


def layer_kind(module: nn.Module) -> str | None:
    """The kind of a torch layer (float, QAT, fused or quantized); None for anything else.

    Containers, observers, stubs, weight holders and the user's own classes are not layers."""
    if not type(module).__module__.startswith("torch."):
        return None
    kind = module_kind(module)
    return kind if kind in LAYER_KINDS else None


def fuses_relu(module: nn.Module) -> bool:
    """True for fused layers that apply a ReLU after their op (ConvReLU2d, LinearReLU, BNReLU2d...)."""
    return isinstance(module, FUSED_RELU_MODULES)


def quantized_form(module: nn.Module) -> str | None:
    """ "static" or "dynamic" for torch's quantized modules; None for float, QAT and observed ones."""
    path = type(module).__module__
    if not path.startswith(("torch.ao.nn.quantized", "torch.ao.nn.intrinsic.quantized")):
        return None
    return "dynamic" if ".dynamic" in path else "static"


@dataclasses.dataclass(frozen=True)
class FunctionOp:
    """What a call_function target computes."""

    kind: str
    fused_relu: bool = False  # a quantized kernel that applies a ReLU after its op (quantized::add_relu)
    quantized: bool = False  # a kernel of torch's quantized:: namespace


def function_op(target: Callable[..., Any]) -> FunctionOp:
    """The kind of a function target; quantized kernels map to their float kind."""
    namespace, name = _op_name(target)
    if namespace == "quantized" and name is not None:
        base = name.removesuffix("_dynamic")
        fused = base.endswith("_relu")
        base = base.removesuffix("_relu").removesuffix("_scalar")
        kind = ATEN_KINDS.get(base)
        if kind is not None:
            return FunctionOp(kind, fused_relu=fused, quantized=True)
        return FunctionOp("quantized:" + name, quantized=True)
    kind = FUNCTION_KINDS.get(target)
    if kind is not None:
        return FunctionOp(kind)
    if namespace in _ATEN_NAMESPACES and name is not None:
        return FunctionOp(ATEN_KINDS.get(name, "aten:" + name))
    name = getattr(target, "__name__", None) or str(target)
    return FunctionOp(ATEN_KINDS.get(name, "function:" + name))


def function_kind(target: Callable[..., Any]) -> str:
    return function_op(target).kind


def method_kind(name: str) -> str:
    return METHOD_KINDS.get(name, "method:" + name)


_ATEN_NAMESPACES = ("aten", "quantized_decomposed", "prims")


def is_aten_graph(graph_module: Any) -> bool:
    """An exported (aten-level) graph: prepare_fx cannot quantize it (the pt2e flow can)."""
    nodes = getattr(getattr(graph_module, "graph", None), "nodes", ())
    return any(node.op == "call_function" and _op_name(node.target)[0] == "aten" for node in nodes)


def _op_name(target: Any) -> tuple[str | None, str | None]:
    """(namespace, packet name) of a torch op: aten.conv2d.default → ("aten", "conv2d").

    Duck-typed so that no private torch module is needed: an overload names its
    namespace, a packet (torch.ops.quantized.add) prints as "quantized.add"."""
    namespace = getattr(target, "namespace", None)
    if isinstance(namespace, str):
        return namespace, (getattr(target, "__name__", "").split(".")[0] or None)
    if type(target).__name__ == "OpOverloadPacket":
        namespace, _, name = str(target).partition(".")
        return namespace, name or None
    return None, None
