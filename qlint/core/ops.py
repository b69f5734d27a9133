"""Normalization of front-end specific ops to one vocabulary of op kinds.

``nn.Conv2d``, ``F.conv2d``, ``torch.conv2d`` and ``aten.conv2d`` are all the
kind ``conv2d``. Rules only ever see these kinds, so adding a front end means
extending these tables and nothing else.
"""

from __future__ import annotations

import dataclasses
import operator
import re
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

# Quantizable layers whose weight matters; the order of checks below matters only
# for subclasses (ConvReLU2d is a Conv2d subclass in some torch versions).
MODULE_KINDS: list[tuple[type, str]] = [
    (nn.Conv1d, "conv1d"),
    (nn.Conv2d, "conv2d"),
    (nn.Conv3d, "conv3d"),
    (nn.ConvTranspose1d, "conv_transpose1d"),
    (nn.ConvTranspose2d, "conv_transpose2d"),
    (nn.ConvTranspose3d, "conv_transpose3d"),
    (nn.Linear, "linear"),
    (nn.Bilinear, "bilinear"),
    (nn.BatchNorm1d, "batch_norm"),
    (nn.BatchNorm2d, "batch_norm"),
    (nn.BatchNorm3d, "batch_norm"),
    (nn.LayerNorm, "layer_norm"),
    (nn.GroupNorm, "group_norm"),
    (nn.InstanceNorm1d, "instance_norm"),
    (nn.InstanceNorm2d, "instance_norm"),
    (nn.InstanceNorm3d, "instance_norm"),
    (nn.ReLU, "relu"),
    (nn.ReLU6, "relu6"),
    (nn.LeakyReLU, "leaky_relu"),
    (nn.PReLU, "prelu"),
    (nn.ELU, "elu"),
    (nn.GELU, "gelu"),
    (nn.SiLU, "silu"),
    (nn.Hardswish, "hardswish"),
    (nn.Hardsigmoid, "hardsigmoid"),
    (nn.Hardtanh, "hardtanh"),
    (nn.Sigmoid, "sigmoid"),
    (nn.Tanh, "tanh"),
    (nn.Mish, "mish"),
    (nn.CELU, "celu"),
    (nn.Softmax, "softmax"),
    (nn.LogSoftmax, "log_softmax"),
    (nn.LSTM, "lstm"),
    (nn.GRU, "gru"),
    (nn.RNN, "rnn"),
    (nn.LSTMCell, "lstm_cell"),
    (nn.GRUCell, "gru_cell"),
    (nn.RNNCell, "rnn_cell"),
    (nn.Embedding, "embedding"),
    (nn.EmbeddingBag, "embedding_bag"),
    (nn.MultiheadAttention, "multihead_attention"),
    (nn.MaxPool1d, "max_pool"),
    (nn.MaxPool2d, "max_pool"),
    (nn.MaxPool3d, "max_pool"),
    (nn.AvgPool1d, "avg_pool"),
    (nn.AvgPool2d, "avg_pool"),
    (nn.AvgPool3d, "avg_pool"),
    (nn.AdaptiveAvgPool1d, "adaptive_avg_pool"),
    (nn.AdaptiveAvgPool2d, "adaptive_avg_pool"),
    (nn.AdaptiveAvgPool3d, "adaptive_avg_pool"),
    (nn.Dropout, "dropout"),
    (nn.Dropout2d, "dropout"),
    (nn.Identity, "identity"),
    (nn.Flatten, "flatten"),
    (nn.Upsample, "upsample"),
    (nn.PixelShuffle, "pixel_shuffle"),
]

# Function targets, keyed by the callable itself. Method calls are keyed by name below.
FUNCTION_KINDS: dict[Any, str] = {
    F.conv1d: "conv1d",
    torch.conv1d: "conv1d",
    F.conv2d: "conv2d",
    torch.conv2d: "conv2d",
    F.conv3d: "conv3d",
    torch.conv3d: "conv3d",
    F.conv_transpose1d: "conv_transpose1d",
    F.conv_transpose2d: "conv_transpose2d",
    F.conv_transpose3d: "conv_transpose3d",
    F.linear: "linear",
    F.batch_norm: "batch_norm",
    F.layer_norm: "layer_norm",
    F.group_norm: "group_norm",
    F.instance_norm: "instance_norm",
    F.relu: "relu",
    torch.relu: "relu",
    F.relu_: "relu",
    torch.relu_: "relu",
    F.relu6: "relu6",
    F.leaky_relu: "leaky_relu",
    F.elu: "elu",
    F.gelu: "gelu",
    F.silu: "silu",
    F.hardswish: "hardswish",
    F.hardsigmoid: "hardsigmoid",
    F.hardtanh: "hardtanh",
    F.sigmoid: "sigmoid",
    torch.sigmoid: "sigmoid",
    F.tanh: "tanh",
    torch.tanh: "tanh",
    F.softmax: "softmax",
    torch.softmax: "softmax",
    F.log_softmax: "log_softmax",
    F.embedding: "embedding",
    F.max_pool1d: "max_pool",
    F.max_pool2d: "max_pool",
    F.max_pool3d: "max_pool",
    F.avg_pool1d: "avg_pool",
    F.avg_pool2d: "avg_pool",
    F.avg_pool3d: "avg_pool",
    F.adaptive_avg_pool1d: "adaptive_avg_pool",
    F.adaptive_avg_pool2d: "adaptive_avg_pool",
    F.adaptive_avg_pool3d: "adaptive_avg_pool",
    F.dropout: "dropout",
    F.interpolate: "upsample",
    F.scaled_dot_product_attention: "sdpa",
    torch.add: "add",
    operator.add: "add",
    operator.iadd: "add",
    torch.sub: "sub",
    operator.sub: "sub",
    torch.mul: "mul",
    operator.mul: "mul",
    operator.imul: "mul",
    torch.div: "div",
    operator.truediv: "div",
    torch.matmul: "matmul",
    operator.matmul: "matmul",
    torch.bmm: "matmul",
    torch.mm: "matmul",
    torch.cat: "cat",
    torch.concat: "cat",
    torch.stack: "stack",
    torch.flatten: "flatten",
    torch.reshape: "reshape",
    torch.transpose: "transpose",
    torch.permute: "permute",
    torch.mean: "mean",
    torch.sum: "sum",
    torch.clamp: "clamp",
    operator.getitem: "getitem",
}

METHOD_KINDS: dict[str, str] = {
    "relu": "relu",
    "relu_": "relu",
    "sigmoid": "sigmoid",
    "sigmoid_": "sigmoid",
    "tanh": "tanh",
    "tanh_": "tanh",
    "softmax": "softmax",
    "hardsigmoid": "hardsigmoid",
    "add": "add",
    "add_": "add",
    "mul": "mul",
    "mul_": "mul",
    "sub": "sub",
    "div": "div",
    "matmul": "matmul",
    "bmm": "matmul",
    "view": "view",
    "reshape": "reshape",
    "flatten": "flatten",
    "transpose": "transpose",
    "permute": "permute",
    "contiguous": "contiguous",
    "mean": "mean",
    "sum": "sum",
    "size": "size",
    "clamp": "clamp",
    "chunk": "chunk",
    "split": "split",
    "unsqueeze": "unsqueeze",
    "squeeze": "squeeze",
    "expand": "expand",
    "repeat": "repeat",
    "float": "to",
    "to": "to",
    "dequantize": "dequantize",
}

# aten overload packets, keyed by packet name ("conv2d" for aten.conv2d.default).
_ATEN_KINDS: dict[str, str] = {
    "conv1d": "conv1d",
    "conv2d": "conv2d",
    "conv3d": "conv3d",
    "conv_transpose1d": "conv_transpose1d",
    "conv_transpose2d": "conv_transpose2d",
    "conv_transpose3d": "conv_transpose3d",
    "convolution": "conv",
    "linear": "linear",
    "addmm": "linear",
    "batch_norm": "batch_norm",
    "_native_batch_norm_legit_no_training": "batch_norm",
    "_native_batch_norm_legit": "batch_norm",
    "native_batch_norm": "batch_norm",
    "_native_batch_norm_legit_functional": "batch_norm",
    "layer_norm": "layer_norm",
    "native_layer_norm": "layer_norm",
    "group_norm": "group_norm",
    "instance_norm": "instance_norm",
    "relu": "relu",
    "relu_": "relu",
    "relu6": "relu6",
    "hardtanh": "hardtanh",
    "hardtanh_": "hardtanh",
    "leaky_relu": "leaky_relu",
    "elu": "elu",
    "gelu": "gelu",
    "silu": "silu",
    "silu_": "silu",
    "hardswish": "hardswish",
    "hardswish_": "hardswish",
    "hardsigmoid": "hardsigmoid",
    "hardsigmoid_": "hardsigmoid",
    "sigmoid": "sigmoid",
    "sigmoid_": "sigmoid",
    "tanh": "tanh",
    "tanh_": "tanh",
    "softmax": "softmax",
    "_softmax": "softmax",
    "log_softmax": "log_softmax",
    "lstm": "lstm",
    "gru": "gru",
    "rnn_tanh": "rnn",
    "rnn_relu": "rnn",
    "embedding": "embedding",
    "embedding_bag": "embedding_bag",
    "max_pool1d": "max_pool",
    "max_pool2d": "max_pool",
    "max_pool3d": "max_pool",
    "max_pool2d_with_indices": "max_pool",
    "avg_pool1d": "avg_pool",
    "avg_pool2d": "avg_pool",
    "avg_pool3d": "avg_pool",
    "adaptive_avg_pool1d": "adaptive_avg_pool",
    "adaptive_avg_pool2d": "adaptive_avg_pool",
    "adaptive_avg_pool3d": "adaptive_avg_pool",
    "mean": "mean",
    "sum": "sum",
    "dropout": "dropout",
    "add": "add",
    "add_": "add",
    "sub": "sub",
    "mul": "mul",
    "mul_": "mul",
    "div": "div",
    "matmul": "matmul",
    "bmm": "matmul",
    "mm": "matmul",
    "cat": "cat",
    "concat": "cat",
    "stack": "stack",
    "flatten": "flatten",
    "view": "view",
    "reshape": "reshape",
    "_unsafe_view": "view",
    "permute": "permute",
    "transpose": "transpose",
    "t": "transpose",
    "clamp": "clamp",
    "getitem": "getitem",
    "scaled_dot_product_attention": "sdpa",
    "upsample_nearest2d": "upsample",
    "upsample_bilinear2d": "upsample",
    "contiguous": "contiguous",
    "size": "size",
    "sym_size": "size",
    "unsqueeze": "unsqueeze",
    "squeeze": "squeeze",
    "expand": "expand",
    "split": "split",
    "chunk": "chunk",
    "dequantize": "dequantize",
}

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
    kind = layer_kind(module)
    return kind is not None and kind not in ACTIVATION_KINDS and "ReLU" in type(module).__name__


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
        kind = _ATEN_KINDS.get(base)
        if kind is not None:
            return FunctionOp(kind, fused_relu=fused, quantized=True)
        return FunctionOp("quantized:" + name, quantized=True)
    kind = FUNCTION_KINDS.get(target)
    if kind is not None:
        return FunctionOp(kind)
    if namespace in _ATEN_NAMESPACES and name is not None:
        return FunctionOp(_ATEN_KINDS.get(name, "aten:" + name))
    name = getattr(target, "__name__", None) or str(target)
    return FunctionOp(_ATEN_KINDS.get(name, "function:" + name))


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


# Where a plan may name a function to keep float: resolved by attribute lookup in these modules
# only, so a plan file never imports or runs anything.
_FUNCTION_HOMES = {"operator": operator, "torch": torch, "torch.nn.functional": F}
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def function_path(target: Any) -> str | None:
    """``operator.add``, ``torch.sqrt``, ``torch.nn.functional.relu``: the public path of a
    function of those modules, or None."""
    name = getattr(target, "__name__", None)
    if not isinstance(name, str):
        return None
    for home, module in _FUNCTION_HOMES.items():
        if getattr(module, name, None) is target:
            return f"{home}.{name}"
    return None


def resolve_function(path: str) -> Callable[..., Any]:
    """The function a :func:`function_path` names; ValueError for anything else."""
    home, _, name = path.rpartition(".")
    module = _FUNCTION_HOMES.get(home)
    found = getattr(module, name, None) if module is not None and _IDENTIFIER.fullmatch(name) else None
    if not callable(found):
        raise ValueError(f"{path!r} is not a function of {', '.join(_FUNCTION_HOMES)}")
    return found
