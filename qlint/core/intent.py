"""Quantization intent: which qconfig applies to each op, as prepare_fx would decide.

The user states intent with a QConfigMapping (or the backend's default one), with
``.qconfig`` attributes in an eager flow, or implicitly by handing over a model that
is already prepared. This module resolves one :class:`NodeQConfig` per op using
the precedence prepare_fx uses, reimplemented here on public attributes only:

    global < object_type < module_name_regex < module_name (nearest ancestor)
           < module_name_object_type_order

For function and method calls the function's object_type entry is the starting
point, then the enclosing module's type, regex and name entries override it, as
in prepare_fx.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.ao.quantization import (
    FakeQuantizeBase,
    FixedQParamsFakeQuantize,
    FixedQParamsObserver,
    QConfig,
    QConfigMapping,
    get_default_qconfig_mapping,
)

from qlint.core.backends import BACKENDS
from qlint.core.torch_warnings import quiet_about_qlints_choices


@dataclasses.dataclass(frozen=True)
class ObserverSpec:
    """The facts about an observer that decide how a tensor is quantized."""

    observer: str  # class name, e.g. HistogramObserver
    dtype: str  # e.g. torch.quint8
    qscheme: str | None  # e.g. torch.per_tensor_affine
    quant_min: int | None
    quant_max: int | None
    reduce_range: bool
    ch_axis: int | None
    fixed_scale: float | None = None
    fixed_zero_point: int | None = None

    @property
    def is_float(self) -> bool:
        return self.dtype in ("torch.float32", "torch.float16", "torch.float", "torch.bfloat16")

    @property
    def is_per_channel(self) -> bool:
        return self.qscheme is not None and "per_channel" in self.qscheme

    @property
    def is_fixed_qparams(self) -> bool:
        return self.fixed_scale is not None

    def qparams_key(self) -> tuple[Any, ...]:
        """Two tensors with equal keys get compatible qparams from their observers."""
        return (
            self.observer,
            self.dtype,
            self.qscheme,
            self.quant_min,
            self.quant_max,
            self.reduce_range,
            self.fixed_scale,
            self.fixed_zero_point,
        )


@dataclasses.dataclass(frozen=True)
class NodeQConfig:
    """The resolved intent for one op: its activation and weight observers, or none."""

    activation: ObserverSpec | None
    weight: ObserverSpec | None
    source: str  # where it came from: "global", "object_type", "module_name", ...
    is_dynamic: bool = False
    qconfig: QConfig | None = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def quantized(self) -> bool:
        return (
            self.activation is not None
            and not self.activation.is_float
            or (self.is_dynamic and self.weight is not None)
        )


# Observers whose scale and zero point are fixed in advance (sigmoid, tanh, softmax outputs).
_FIXED_QPARAMS = (FixedQParamsObserver, FixedQParamsFakeQuantize)


def describe_observer(observer_or_factory: Any) -> ObserverSpec | None:
    """Summarise an observer instance or factory (what QConfig stores) without running it."""
    if observer_or_factory is None:
        return None
    observer = observer_or_factory
    if not isinstance(observer, torch.nn.Module):
        try:
            observer = _instantiate(observer_or_factory)
        except Exception as exc:  # a user-supplied factory may fail for any reason
            raise ValueError(f"cannot instantiate observer {observer_or_factory!r}: {exc}") from exc
    inner = getattr(observer, "activation_post_process", None)
    reduce_range = bool(getattr(observer, "reduce_range", getattr(inner, "reduce_range", False)))
    name = type(observer).__name__
    if inner is not None and isinstance(observer, FakeQuantizeBase):
        name = f"{name}({type(inner).__name__})"
    # A FakeQuantize's own scale is a placeholder until calibrated: a fixed one is its observer's.
    fixed = observer if isinstance(observer, _FIXED_QPARAMS) else inner if isinstance(inner, _FIXED_QPARAMS) else None
    qscheme = getattr(observer, "qscheme", None)
    ch_axis = getattr(observer, "ch_axis", None)
    quant_min = getattr(observer, "quant_min", None)
    quant_max = getattr(observer, "quant_max", None)
    return ObserverSpec(
        observer=name,
        dtype=str(getattr(observer, "dtype", "torch.float32")),
        qscheme=None if qscheme is None else str(qscheme),
        quant_min=None if quant_min is None else int(quant_min),
        quant_max=None if quant_max is None else int(quant_max),
        reduce_range=reduce_range,
        ch_axis=int(ch_axis)
        if isinstance(ch_axis, int) and qscheme is not None and "per_channel" in str(qscheme)
        else None,
        fixed_scale=float(fixed.scale.flatten()[0]) if fixed is not None else None,
        fixed_zero_point=int(fixed.zero_point.flatten()[0]) if fixed is not None else None,
    )


def node_qconfig(qconfig: QConfig | None, source: str) -> NodeQConfig | None:
    if qconfig is None:
        return None
    activation = describe_observer(qconfig.activation)
    weight = describe_observer(qconfig.weight)
    is_dynamic = bool(activation is not None and getattr(_instantiate(qconfig.activation), "is_dynamic", False))
    # PlaceholderObserver(dtype=float) activations mean "weight-only / dynamic".
    if activation is not None and activation.is_float and weight is not None and not weight.is_float:
        is_dynamic = True
    return NodeQConfig(activation=activation, weight=weight, source=source, is_dynamic=is_dynamic, qconfig=qconfig)


class NodeQConfigCache:
    """:func:`node_qconfig` once per distinct qconfig object and source.

    Describing a qconfig instantiates its observers (~0.3 ms), while the ops of a model
    share a handful of qconfig objects: one description each keeps graph building linear
    with a small constant. Holding the qconfig keeps its id from being reused."""

    def __init__(self) -> None:
        self._described: dict[tuple[int, str], tuple[QConfig, NodeQConfig | None]] = {}

    def get(self, qconfig: QConfig | None, source: str) -> NodeQConfig | None:
        if qconfig is None:
            return None
        key = (id(qconfig), source)
        entry = self._described.get(key)
        if entry is None:
            entry = (qconfig, node_qconfig(qconfig, source))
            self._described[key] = entry
        return entry[1]


def _instantiate(factory: Any) -> Any:
    """An observer from its factory, to read its settings. torch's default observers warn when
    made (reduce_range "will be deprecated"): a warning the user's process did not cause, and an
    error under ``-W error``, so it is not passed on."""
    if isinstance(factory, torch.nn.Module):
        return factory
    with quiet_about_qlints_choices():
        return factory()


def default_mapping(backend: str) -> QConfigMapping:
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    return get_default_qconfig_mapping(backend)


@dataclasses.dataclass(frozen=True)
class CallDescription:
    """What qconfig resolution needs to know about one op, from any front end."""

    is_module_call: bool
    object_types: tuple[Any, ...]  # module class, or candidate function objects/method names
    module_path: str  # the module's fqn for module calls, the enclosing scope otherwise
    scope_type: type | None  # type of the enclosing module, for function calls


class QConfigResolver:
    """Resolves a QConfig per op from a QConfigMapping with prepare_fx's precedence."""

    def __init__(self, mapping: QConfigMapping) -> None:
        self.mapping = mapping
        self._order_counters: dict[tuple[str, Any], int] = {}

    def resolve(self, call: CallDescription) -> tuple[QConfig | None, str]:
        mapping = self.mapping
        qconfig, source = mapping.global_qconfig, "global"
        if call.is_module_call:
            module_type = call.object_types[0] if call.object_types else None
            return self._adjust_for_module(module_type, call.module_path, qconfig, source)
        for candidate in call.object_types:
            if candidate in mapping.object_type_qconfigs:
                qconfig, source = mapping.object_type_qconfigs[candidate], "object_type"
                break
        qconfig, source = self._adjust_for_module(call.scope_type, call.module_path, qconfig, source)
        for candidate in call.object_types:
            key = (call.module_path, candidate)
            if any(
                k[0] == call.module_path and k[1] is candidate for k in mapping.module_name_object_type_order_qconfigs
            ):
                index = self._order_counters.get(key, 0)
                self._order_counters[key] = index + 1
                full = (call.module_path, candidate, index)
                if full in mapping.module_name_object_type_order_qconfigs:
                    return mapping.module_name_object_type_order_qconfigs[full], "module_name_object_type_order"
        return qconfig, source

    def _adjust_for_module(
        self, module_type: type | None, module_path: str, fallback: QConfig | None, source: str
    ) -> tuple[QConfig | None, str]:
        mapping = self.mapping
        if module_type is not None and module_type in mapping.object_type_qconfigs:
            fallback, source = mapping.object_type_qconfigs[module_type], "object_type"
        for pattern, qconfig in mapping.module_name_regex_qconfigs.items():
            if re.match(pattern, module_path):
                fallback, source = qconfig, "module_name_regex"
                break
        path = module_path
        while path:
            if path in mapping.module_name_qconfigs:
                return mapping.module_name_qconfigs[path], "module_name"
            path = path.rpartition(".")[0]
        return fallback, source


def import_type(qualified_name: str) -> type | None:
    """Resolve 'torch.nn.modules.conv.Conv2d' to the class; only torch's own classes, and only
    from modules already imported: the name may come from an untrusted archive."""
    if not qualified_name.startswith("torch."):
        return None
    from qlint.core.pt2_program import resolve_loaded_name

    found = resolve_loaded_name(qualified_name)
    return found if isinstance(found, type) else None


def function_candidates(kind: str, raw_target: Any) -> tuple[Any, ...]:
    """Objects a QConfigMapping may key a functional op by.

    prepare_fx matches the exact callable (or method name), so a torch-level target is
    its own only candidate. An aten target from torch.export has no torch-level callable,
    so every function and method name of the same kind stands in for it.
    """
    from qlint.core.op_tables import FUNCTION_KINDS, METHOD_KINDS

    if isinstance(raw_target, str) or (raw_target is not None and raw_target in FUNCTION_KINDS):
        return (raw_target,)
    found: list[Any] = []
    for fn, fn_kind in FUNCTION_KINDS.items():
        if fn_kind == kind and fn not in found:
            found.append(fn)
    for method, method_kind in METHOD_KINDS.items():
        if method_kind == kind and method not in found:
            found.append(method)
    return tuple(found)


def load_mapping_object(obj: Any, backend: str) -> QConfigMapping:
    """Accept a QConfigMapping, a callable returning one, or a dict (QConfigMapping.from_dict)."""
    if isinstance(obj, QConfigMapping):
        return obj
    if callable(obj) and not isinstance(obj, type):
        try:
            produced = obj(backend)
        except TypeError:
            produced = obj()
        return load_mapping_object(produced, backend)
    if isinstance(obj, dict):
        return QConfigMapping.from_dict(obj)
    raise TypeError(f"expected a QConfigMapping, got {type(obj).__name__}")


def iter_mapping_qconfigs(mapping: QConfigMapping) -> Iterable[tuple[str, QConfig | None]]:
    yield "global", mapping.global_qconfig
    for key, qc in mapping.object_type_qconfigs.items():
        yield f"object_type {getattr(key, '__name__', key)}", qc
    for key, qc in mapping.module_name_regex_qconfigs.items():
        yield f"module_name_regex {key}", qc
    for key, qc in mapping.module_name_qconfigs.items():
        yield f"module_name {key}", qc


ObserverFactory = Callable[[], torch.nn.Module]
