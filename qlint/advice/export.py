"""Export a QuantPlan to torch.ao objects (QConfigMapping) and to readable Python.

Both exporters share one intermediate form, an :class:`ObserverRecipe` (a public
torch observer class name plus keyword arguments), so the Python text that
``to_python`` writes builds exactly the objects ``to_qconfig_mapping`` returns.

Only public torch names are used. torch 2.13 exposes no public input-weight
equalization qconfig (it lives in a private module), so
``to_equalization_mapping`` takes the equalization qconfig object from the caller
(e.g. ``default_equalization_qconfig`` from torch's equalization module) and only
decides *which modules* get it.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Optional

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

from qlint.errors import ConfigError
from qlint.render.literal import printable

if TYPE_CHECKING:
    from qlint.advice.plan import ActivationSpec, ModuleDecision, QuantPlan, WeightSpec


class PercentileObserver(MinMaxObserver):
    """MinMaxObserver whose range is the running [100-p, p] percentile band, clipping outliers.

    Each batch contributes its lower and upper percentile; the observer keeps the
    widest of them (like MinMaxObserver keeps min/max), so qparams ignore the
    rare extreme values that would otherwise stretch the int8 step.
    """

    _MAX_SAMPLES = 1 << 20

    def __init__(self, percentile: float = 99.99, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not 50.0 < percentile <= 100.0:
            raise ValueError(f"percentile must be in (50, 100], got {percentile}")
        self.percentile = float(percentile)

    def forward(self, x_orig: torch.Tensor) -> torch.Tensor:
        if x_orig.numel() == 0:
            return x_orig
        x = x_orig.detach().to(self.min_val.dtype if self.min_val.is_floating_point() else torch.float32)
        flat = x.flatten()
        if flat.numel() > self._MAX_SAMPLES:  # torch.quantile has an input-size limit
            step = (flat.numel() + self._MAX_SAMPLES - 1) // self._MAX_SAMPLES
            flat = flat[::step]
        q = torch.tensor([1.0 - self.percentile / 100.0, self.percentile / 100.0], dtype=flat.dtype)
        low, high = torch.quantile(flat.float(), q.float()).to(flat.dtype)
        self.min_val.copy_(torch.minimum(low, self.min_val) if self.min_val.numel() else low)
        self.max_val.copy_(torch.maximum(high, self.max_val) if self.max_val.numel() else high)
        return x_orig

    def extra_repr(self) -> str:
        return f"percentile={self.percentile}, " + super().extra_repr()


_OBSERVERS = {cls.__name__: cls for cls in (
    FixedQParamsObserver, HistogramObserver, MinMaxObserver, MovingAverageMinMaxObserver,
    MovingAveragePerChannelMinMaxObserver, PerChannelMinMaxObserver, PlaceholderObserver,
    PercentileObserver)}
_MODULE_OF = {name: ("qlint.advice.export" if name == "PercentileObserver" else "torch.ao.quantization.observer")
              for name in _OBSERVERS}

_TORCH_DTYPES = {"quint8": torch.quint8, "qint8": torch.qint8, "int16": torch.int16}
_INT16_RANGE = (-(2 ** 15), 2 ** 15 - 1)


@dataclasses.dataclass(frozen=True)
class ObserverRecipe:
    """A public observer class and the keyword arguments of its ``with_args``."""

    cls_name: str
    kwargs: tuple[tuple[str, Any], ...]

    def factory(self) -> Any:
        return _OBSERVERS[self.cls_name].with_args(**dict(self.kwargs))

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
    from qlint.core.backends import backend_info

    info = backend_info(backend)
    field = "input_dtype" if side == "activation" else "weight_dtype"
    supported = any(getattr(o, field) in ("torch.int16", "torch.qint16")
                    for options in info.dtypes.values() for o in options)
    if not supported:
        raise ConfigError(f"the plan asks for int16 {side}s, but the {backend} backend has no int16 "
                          f"{side} kernels; use 8-bit for this backend")


def activation_recipe(spec: "ActivationSpec", backend: str) -> ObserverRecipe:
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


def weight_recipe(spec: "WeightSpec", backend: str) -> ObserverRecipe:
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
    "PlaceholderObserver",
    (("dtype", torch.quint8), ("quant_min", 0), ("quant_max", 255), ("is_dynamic", True)))


def global_recipe(plan: "QuantPlan") -> Optional[QConfigRecipe]:
    """The global QConfig, or None when the plan's globals are the backend's defaults."""
    from qlint.advice.plan import backend_defaults

    if (plan.activation, plan.weight) == backend_defaults(plan.backend):
        return None
    return QConfigRecipe(activation_recipe(plan.activation, plan.backend), weight_recipe(plan.weight, plan.backend))


def module_recipe(plan: "QuantPlan", decision: "ModuleDecision") -> Optional[QConfigRecipe]:
    """The QConfig for one module; None means keep it float."""
    if not decision.quantize:
        return None
    weight = weight_recipe(decision.weight or plan.weight, plan.backend)
    if decision.mode == "dynamic":
        return QConfigRecipe(_DYNAMIC_ACTIVATION, weight)
    return QConfigRecipe(activation_recipe(decision.activation or plan.activation, plan.backend), weight)


def to_qconfig_mapping(plan: "QuantPlan") -> QConfigMapping:
    """get_default_qconfig_mapping(backend) with the plan's global and module-name decisions applied."""
    mapping = get_default_qconfig_mapping(plan.backend)
    recipe = global_recipe(plan)
    if recipe is not None:
        mapping.set_global(recipe.build())
    for decision in plan.modules:
        module_qconfig = module_recipe(plan, decision)
        mapping.set_module_name(decision.fqn, None if module_qconfig is None else module_qconfig.build())
    return mapping


def to_equalization_mapping(plan: "QuantPlan", equalization_qconfig: Any = None) -> QConfigMapping:
    """The ``_equalization_config`` for prepare_fx: ``equalization_qconfig`` on each planned module.

    torch keeps its equalization qconfig and observers in a private module, which
    qlint does not import; pass the object (for instance torch's
    ``default_equalization_qconfig``). With no equalization pairs, an empty mapping is
    returned and no qconfig is needed.
    """
    mapping = QConfigMapping()
    if not plan.equalization:
        return mapping
    if equalization_qconfig is None:
        raise ConfigError(
            "the plan equalizes modules, but torch has no public equalization qconfig: pass "
            "equalization_qconfig= (e.g. default_equalization_qconfig from torch's fx equalization module)")
    for pair in plan.equalization:
        mapping.set_module_name(pair.module, equalization_qconfig)
    return mapping


def to_python(plan: "QuantPlan") -> str:
    """A short Python file defining ``build_qconfig_mapping()`` and ``qconfig_mapping``."""
    recipes: list[tuple[str, Optional[QConfigRecipe], str]] = []
    for decision in plan.modules:
        why = "; ".join(p.describe() for p in decision.provenance)
        recipes.append((decision.fqn, module_recipe(plan, decision), f"{decision.describe()} ({why})"))
    global_qc = global_recipe(plan)
    used = {r.cls_name for qc in [global_qc] + [r for _, r, _ in recipes] if qc is not None
            for r in (qc.activation, qc.weight)}
    # Names, the model field and provenance come from the model and the plan file: strings go
    # in as literals (repr) and comments through printable(), so no value can become code.
    title = (f"QConfigMapping for {plan.model or 'the model'} on {plan.backend}, generated by qlint "
             f"from a QuantPlan (schema {plan.schema_version}).")
    lines = [repr(title), "",
             "import torch", "from torch.ao.quantization import QConfig, get_default_qconfig_mapping"]
    torch_names = sorted(n for n in used if _MODULE_OF[n].startswith("torch"))
    if torch_names:
        lines.append(f"from torch.ao.quantization.observer import {', '.join(torch_names)}")
    if "PercentileObserver" in used:
        lines.append("from qlint.advice.export import PercentileObserver")
    lines += ["", "", "def build_qconfig_mapping():",
              f"    mapping = get_default_qconfig_mapping({plan.backend!r})"]
    if global_qc is not None:
        lines.append(f"    mapping.set_global({global_qc.source()})")
    for fqn, recipe, comment in recipes:
        lines.append(f"    # {printable(comment)}")
        value = "None" if recipe is None else recipe.source()
        lines.append(f"    mapping.set_module_name({fqn!r}, {value})")
    lines += ["    return mapping", ""]
    if plan.equalization:
        lines += ["", "def build_equalization_mapping(equalization_qconfig):",
                  '    """Pass as prepare_fx(..., _equalization_config=build_equalization_mapping(qconfig)).',
                  "",
                  "    torch has no public equalization qconfig: its default_equalization_qconfig lives in",
                  "    the private module torch.ao.quantization.fx._equalize, so the caller chooses it.",
                  '    """',
                  "    from torch.ao.quantization import QConfigMapping",
                  "", "    mapping = QConfigMapping()"]
        for pair in plan.equalization:
            lines.append(f"    mapping.set_module_name({pair.module!r}, equalization_qconfig)")
        lines += ["    return mapping", ""]
    if plan.rewrites:
        lines += ["", "# Float-preserving rewrites to apply to the model before prepare_fx:"]
        lines += [f"#   {printable(r.kind)}: {printable(', '.join(r.modules))}" for r in plan.rewrites]
    lines += ["", "qconfig_mapping = build_qconfig_mapping()", ""]
    return "\n".join(lines)
