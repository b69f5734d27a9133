"""What each quantized backend can do, read from torch's public BackendConfig objects.

Rules ask questions in op kinds ("can x86 fuse conv2d-batch_norm-relu?", "which
activation dtypes does qnnpack accept for linear?"), never in torch classes.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
import torch.ao.quantization.quantize_fx  # noqa: F401  (loads backend_config helpers torch needs)
from torch.ao.quantization.backend_config import (
    BackendConfig,
    get_fbgemm_backend_config,
    get_onednn_backend_config,
    get_qnnpack_backend_config,
)
from torch.ao.quantization.backend_config.x86 import get_x86_backend_config

from qlint.core.ops import function_kind, method_kind, module_kind

_GETTERS = {
    "x86": get_x86_backend_config,
    "fbgemm": get_fbgemm_backend_config,
    "qnnpack": get_qnnpack_backend_config,
    "onednn": get_onednn_backend_config,
}
BACKENDS = tuple(_GETTERS)

# add-relu is fused at lowering time (quantized::add_relu) rather than by a fuser method.
_LOWERING_FUSIONS = (("add", "relu"),)


@dataclasses.dataclass(frozen=True)
class DTypeSupport:
    """One accepted dtype combination for an op, with the constraints the backend imposes."""

    input_dtype: str | None
    output_dtype: str | None
    weight_dtype: str | None
    is_dynamic: bool
    input_quant_min: int | None = None
    input_quant_max: int | None = None
    weight_quant_min: int | None = None
    weight_quant_max: int | None = None


@dataclasses.dataclass(frozen=True)
class BackendInfo:
    name: str
    fusable: frozenset[tuple[str, ...]]
    dtypes: dict[str, tuple[DTypeSupport, ...]]
    per_channel_kinds: frozenset[str]
    # fbgemm/x86 kernels can overflow 16-bit intermediate sums on CPUs without VNNI,
    # which torch avoids with 7-bit activations (reduce_range=True).
    wants_reduce_range: bool
    # (scale, zero_point) of the fixed-qparams ops' outputs (sigmoid: 1/256, 0): prepare_fx
    # ignores a qconfig that gives those ops other qparams, so their levels are not a choice.
    fixed_qparams: frozenset[tuple[float, int]] = frozenset()

    def can_fuse(self, kinds: tuple[str, ...]) -> bool:
        return kinds in self.fusable

    def supports(self, kind: str) -> bool:
        return kind in self.dtypes

    def dtype_options(self, kind: str) -> tuple[DTypeSupport, ...]:
        return self.dtypes.get(kind, ())

    def quantizes_output(self, kind: str) -> bool:
        """Whether prepare_fx quantizes ``kind`` statically: an int8 output with an observer of
        its own (or shared with its input), made from the op's qconfig."""
        return any(
            not o.is_dynamic and o.output_dtype in ("torch.quint8", "torch.qint8") for o in self.dtype_options(kind)
        )

    def has_dynamic_int8(self, kind: str) -> bool:
        """Whether ``kind`` has a dynamic kernel: quint8 inputs quantized per call, qint8 weights."""
        return any(
            o.is_dynamic and o.input_dtype == "torch.quint8" and o.weight_dtype == "torch.qint8"
            for o in self.dtype_options(kind)
        )


def _kind_of_pattern_element(element: Any) -> str | None:
    if isinstance(element, type) and issubclass(element, torch.nn.Module):
        try:
            return module_kind(element.__new__(element))
        except Exception:  # a class whose __new__ needs arguments: fall back on its name
            return None
    if isinstance(element, str):
        return method_kind(element)
    if callable(element):
        return function_kind(element)
    return None


def _pattern_kinds(pattern: Any) -> tuple[str, ...] | None:
    elements = pattern if isinstance(pattern, tuple) else (pattern,)
    kinds = tuple(_kind_of_pattern_element(e) for e in elements)
    if any(k is None or ":" in k for k in kinds):
        return None
    return kinds  # type: ignore[return-value]


def _describe(dtype_config: Any) -> DTypeSupport:
    def bounds(constraint: Any) -> tuple[int | None, int | None]:
        if constraint is None:
            return None, None
        return (getattr(constraint, "quant_min_lower_bound", None), getattr(constraint, "quant_max_upper_bound", None))

    in_min, in_max = bounds(getattr(dtype_config, "input_dtype_with_constraints", None))
    w_min, w_max = bounds(getattr(dtype_config, "weight_dtype_with_constraints", None))
    as_text = lambda d: None if d is None else str(d)  # noqa: E731
    return DTypeSupport(
        input_dtype=as_text(dtype_config.input_dtype),
        output_dtype=as_text(dtype_config.output_dtype),
        weight_dtype=as_text(dtype_config.weight_dtype),
        is_dynamic=bool(dtype_config.is_dynamic),
        input_quant_min=in_min,
        input_quant_max=in_max,
        weight_quant_min=w_min,
        weight_quant_max=w_max,
    )


# CPU flags of the integer dot-product instructions that accumulate u8*s8 products in 32
# bits: with one of them, fbgemm/x86 kernels cannot saturate on 8-bit activations.
_VNNI_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")


@functools.cache
def host_vnni() -> str | None:
    """The VNNI flag of this machine's CPU (Linux /proc/cpuinfo), or None where it has none or
    cannot tell: then 8-bit activations are not known to be safe on fbgemm/x86 here."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info:
            for line in info:
                if line.startswith("flags"):
                    flags = set(line.partition(":")[2].split())
                    return next((flag for flag in _VNNI_FLAGS if flag in flags), None)
    except OSError:
        return None
    return None


def backend_config(name: str) -> BackendConfig:
    """torch's BackendConfig for ``name``, a fresh object for every call (prepare_fx keeps it)."""
    if name not in _GETTERS:
        raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    return _GETTERS[name]()


def backend_config_source(name: str) -> tuple[str, str]:
    """The module to import and the call that build :func:`backend_config` (for files qlint writes)."""
    backend_config(name)  # the name check
    getter = _GETTERS[name]
    return getter.__module__, f"{getter.__module__}.{getter.__name__}()"


@functools.cache
def backend_info(name: str) -> BackendInfo:
    config = backend_config(name)
    fusable: set[tuple[str, ...]] = set(_LOWERING_FUSIONS)
    dtypes: dict[str, list[DTypeSupport]] = {}
    fixed: set[tuple[float, int]] = set()
    for pattern_config in config.configs:
        for dtype_config in pattern_config.dtype_configs:
            output = getattr(dtype_config, "output_dtype_with_constraints", None)
            scale = getattr(output, "scale_exact_match", None)
            if scale is not None:
                fixed.add((float(scale), int(getattr(output, "zero_point_exact_match", 0) or 0)))
        kinds = _pattern_kinds(pattern_config.pattern)
        if kinds is None:
            continue
        if pattern_config.fuser_method is not None and len(kinds) > 1:
            fusable.add(kinds)
        if len(kinds) == 1:
            bucket = dtypes.setdefault(kinds[0], [])
            for dtype_config in pattern_config.dtype_configs:
                described = _describe(dtype_config)
                if described not in bucket:
                    bucket.append(described)
    weighted_static = frozenset(
        kind
        for kind, options in dtypes.items()
        if kind in ("conv1d", "conv2d", "conv3d", "linear") and any(o.weight_dtype == "torch.qint8" for o in options)
    )
    return BackendInfo(
        name=name,
        fusable=frozenset(fusable),
        dtypes={k: tuple(v) for k, v in dtypes.items()},
        per_channel_kinds=weighted_static,
        wants_reduce_range=name in ("x86", "fbgemm"),
        fixed_qparams=frozenset(fixed),
    )
