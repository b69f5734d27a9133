"""The torch QConfigMapping that a set of typed suggestions asks for.

Every decision becomes an :class:`ObserverRecipe` (a public torch observer class name
plus keyword arguments) before it becomes a QConfig, so the Python text that
:mod:`qlint.advice.export` writes builds exactly the objects :func:`qconfig_mapping`
returns.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
from torch.ao.quantization import QConfig, QConfigMapping, get_default_qconfig_mapping
from torch.ao.quantization.observer import (
    FixedQParamsObserver,
    HistogramObserver,
    MinMaxObserver,
    MovingAverageMinMaxObserver,
    MovingAveragePerChannelMinMaxObserver,
    PerChannelMinMaxObserver,
    PlaceholderObserver,
)

from qlint.core.backends import backend_info
from qlint.core.function_paths import resolve_function
from qlint.core.intent import default_mapping
from qlint.errors import ConfigError
from qlint.linter.suggestions import ActivationSpec, ModuleDecision, Suggestions, WeightSpec, backend_defaults
from qlint.measure.normalize import helper_modules
from qlint.stats.band import PercentileBand


class PercentileObserver(PercentileBand, MinMaxObserver):
    """MinMaxObserver whose range is the running [100-p, p] percentile band, clipping outliers.

    Each batch contributes its lower and upper percentile; the observer keeps the
    widest of them (like MinMaxObserver keeps min/max), so qparams ignore the
    rare extreme values that would otherwise stretch the int8 step.
    """


OBSERVERS = {
    cls.__name__: cls
    for cls in (
        FixedQParamsObserver,
        HistogramObserver,
        MinMaxObserver,
        MovingAverageMinMaxObserver,
        MovingAveragePerChannelMinMaxObserver,
        PerChannelMinMaxObserver,
        PlaceholderObserver,
        PercentileObserver,
    )
}

_TORCH_DTYPES = {"quint8": torch.quint8, "qint8": torch.qint8, "int16": torch.int16}
_INT16_RANGE = (-(2**15), 2**15 - 1)


@dataclasses.dataclass(frozen=True)
class ObserverRecipe:
    """A public observer class and the keyword arguments of its ``with_args``."""

    cls_name: str
    kwargs: tuple[tuple[str, Any], ...]

    def factory(self) -> Any:
        return OBSERVERS[self.cls_name].with_args(**dict(self.kwargs))

    def source(self) -> str:
        args = ", ".join(f"{k}={_literal(v)}" for k, v in self.kwargs)
        return f"{self.cls_name}.with_args({args})"


def _literal(value: Any) -> str:
    if isinstance(value, torch.dtype) or isinstance(value, torch.qscheme):
        return str(value)  # torch.quint8, torch.per_tensor_affine
    return repr(value)


@dataclasses.dataclass(frozen=True)
class QConfigRecipe:
    activation: ObserverRecipe
    weight: ObserverRecipe

    def build(self) -> QConfig:
        return QConfig(activation=self.activation.factory(), weight=self.weight.factory())

    def source(self) -> str:
        return f"QConfig(\n        activation={self.activation.source()},\n        weight={self.weight.source()})"


def _check_backend_dtype(backend: str, dtype: str, side: str) -> None:
    if dtype != "int16":
        return
    info = backend_info(backend)
    field = "input_dtype" if side == "activation" else "weight_dtype"
    supported = any(
        getattr(o, field) in ("torch.int16", "torch.qint16") for options in info.dtypes.values() for o in options
    )
    if not supported:
        raise ConfigError(
            f"the plan asks for int16 {side}s, but the {backend} backend has no int16 "
            f"{side} kernels; use 8-bit for this backend"
        )


def activation_recipe(spec: ActivationSpec, backend: str) -> ObserverRecipe:
    _check_backend_dtype(backend, spec.dtype, "activation")
    dtype = _TORCH_DTYPES[spec.dtype]
    kwargs: list[tuple[str, Any]] = [("dtype", dtype)]
    if spec.observer == "fixed":
        kwargs += [("scale", float(spec.scale)), ("zero_point", int(spec.zero_point))]  # type: ignore[arg-type]
        if spec.quant_min is not None:
            kwargs += [("quant_min", spec.quant_min), ("quant_max", spec.quant_max)]
        return ObserverRecipe("FixedQParamsObserver", tuple(kwargs))
    qscheme = torch.per_tensor_symmetric if spec.symmetric else torch.per_tensor_affine
    if qscheme != torch.per_tensor_affine:
        kwargs.append(("qscheme", qscheme))
    if spec.reduce_range:
        kwargs.append(("reduce_range", True))
    if spec.quant_min is not None:
        kwargs += [("quant_min", spec.quant_min), ("quant_max", spec.quant_max)]
    elif spec.dtype == "int16":
        kwargs += [("quant_min", _INT16_RANGE[0]), ("quant_max", _INT16_RANGE[1])]
    if spec.observer == "minmax":
        return ObserverRecipe("MinMaxObserver", tuple(kwargs))
    if spec.observer == "moving_average":
        if spec.averaging_constant is not None:
            kwargs.append(("averaging_constant", spec.averaging_constant))
        return ObserverRecipe("MovingAverageMinMaxObserver", tuple(kwargs))
    if spec.observer == "histogram":
        if spec.bins is not None:
            kwargs.append(("bins", spec.bins))
        return ObserverRecipe("HistogramObserver", tuple(kwargs))
    if spec.observer == "percentile":
        if spec.percentile is not None:
            kwargs.append(("percentile", spec.percentile))
        return ObserverRecipe("PercentileObserver", tuple(kwargs))
    raise ConfigError(f"unknown activation observer {spec.observer!r}")


def weight_recipe(spec: WeightSpec, backend: str) -> ObserverRecipe:
    _check_backend_dtype(backend, spec.dtype, "weight")
    kwargs: list[tuple[str, Any]] = [("dtype", _TORCH_DTYPES[spec.dtype])]
    if spec.per_channel:
        kwargs.append(("qscheme", torch.per_channel_symmetric if spec.symmetric else torch.per_channel_affine))
        if spec.ch_axis != 0:
            kwargs.append(("ch_axis", spec.ch_axis))
        name = "PerChannelMinMaxObserver" if spec.observer == "minmax" else "MovingAveragePerChannelMinMaxObserver"
    else:
        kwargs.append(("qscheme", torch.per_tensor_symmetric if spec.symmetric else torch.per_tensor_affine))
        name = "MinMaxObserver" if spec.observer == "minmax" else "MovingAverageMinMaxObserver"
    if spec.quant_min is not None:
        kwargs += [("quant_min", spec.quant_min), ("quant_max", spec.quant_max)]
    elif spec.dtype == "int16":
        kwargs += [("quant_min", _INT16_RANGE[0]), ("quant_max", _INT16_RANGE[1])]
    return ObserverRecipe(name, tuple(kwargs))


_DYNAMIC_ACTIVATION = ObserverRecipe(
    "PlaceholderObserver", (("dtype", torch.quint8), ("quant_min", 0), ("quant_max", 255), ("is_dynamic", True))
)


def global_recipe(suggestions: Suggestions) -> QConfigRecipe | None:
    """The global QConfig, or None when the globals are the backend's defaults."""
    if (suggestions.activation, suggestions.weight) == backend_defaults(suggestions.backend):
        return None
    return QConfigRecipe(
        activation_recipe(suggestions.activation, suggestions.backend),
        weight_recipe(suggestions.weight, suggestions.backend),
    )


def module_recipe(suggestions: Suggestions, decision: ModuleDecision) -> QConfigRecipe | None:
    """The QConfig for one module; None means keep it float."""
    if not decision.quantize:
        return None
    weight = weight_recipe(decision.weight or suggestions.weight, suggestions.backend)
    if decision.mode == "dynamic":
        return QConfigRecipe(_DYNAMIC_ACTIVATION, weight)
    return QConfigRecipe(activation_recipe(decision.activation or suggestions.activation, suggestions.backend), weight)


def qconfig_mapping(
    suggestions: Suggestions, base: QConfigMapping | None = None, *, rewritten: bool = False
) -> QConfigMapping:
    """get_default_qconfig_mapping(backend) (or a copy of ``base``, the mapping the user linted
    with) with the global and module-name decisions applied; an empty mapping plus the module
    decisions when the plan is float by default.

    ``rewritten``: for the model the suggestions' rewrites made (``qlint fix``,
    ``QuantPlan.quantize``); without it, for the model as given, decisions made for the
    rewritten model (:meth:`Suggestions.needs_rewrites`) are left out: there their module
    names reach other values."""
    if suggestions.float_by_default:
        mapping = QConfigMapping()
    else:
        mapping = copy.deepcopy(base) if base is not None else get_default_qconfig_mapping(suggestions.backend)
        recipe = global_recipe(suggestions)
        if recipe is not None:
            mapping.set_global(recipe.build())
    return with_decisions(mapping, suggestions, rewritten=rewritten)


def with_decisions(mapping: QConfigMapping, suggestions: Suggestions, *, rewritten: bool = True) -> QConfigMapping:
    """``mapping`` (changed in place, and returned) with the suggestions' module and function
    decisions, and the modules their rewrites add kept float as the plan keeps them
    (``rewritten=False``: for the model as given, see :func:`qconfig_mapping`)."""
    # Decisions made for the rewritten model go last, as the exported file sets them.
    for_rewritten = [d for d in suggestions.modules if suggestions.needs_rewrites(d)]
    for_either = [d for d in suggestions.modules if d not in for_rewritten]
    for decision in for_either + (for_rewritten if rewritten else []):
        module_qconfig = module_recipe(suggestions, decision)
        mapping.set_module_name(decision.fqn, None if module_qconfig is None else module_qconfig.build())
    for helper in rewrite_float_modules(suggestions):
        mapping.set_module_name(helper, None)
    for kept in suggestions.float_functions:
        mapping.set_object_type(resolve_function(kept.function), None)
    return mapping


def restore_type_default(mapping: QConfigMapping, backend: str, op_name: str) -> bool:
    """Give every spelling of the op ``op_name`` (``torch.sigmoid``, the ``"sigmoid"`` method, ...)
    the qconfig ``get_default_qconfig_mapping(backend)`` sets for it by type, in place; False when
    the default sets none for that name."""
    restored = False
    for kind, qconfig in default_mapping(backend).object_type_qconfigs.items():
        if (kind if isinstance(kind, str) else getattr(kind, "__name__", None)) == op_name:
            mapping.set_object_type(kind, qconfig)
            restored = True
    return restored


def rewrite_float_modules(suggestions: Suggestions) -> list[str]:
    """Modules the plan's rewrites add whose arithmetic must stay float (normalize_input's)."""
    return [
        helper
        for rewrite in suggestions.rewrites
        if rewrite.kind == "normalize_input"
        for helper in helper_modules(str(rewrite.params.get("input")), list(rewrite.modules))
    ]
