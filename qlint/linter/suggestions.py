"""Typed suggestions: what a report's findings ask the user to change, module by module.

A finding carries a machine-readable ``suggestion`` (``{"action": "set_weight_observer",
...}``). :func:`qlint.linter.suggestions_from_fixes.collect_suggestions` reads every
suggestion of a report into typed decisions (an :class:`ActivationSpec` and
:class:`WeightSpec` per module, keep-float decisions, equalization pairs, float-preserving
rewrites), each recording its :class:`Provenance`: the models of this module.
:mod:`qlint.linter.mapping` turns them into a QConfigMapping;
:class:`qlint.advice.plan.QuantPlan` is the versioned file built on them.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from qlint.core.backends import BACKENDS
from qlint.core.function_paths import resolve_function
from qlint.errors import ConfigError
from qlint.linter.json_values import check_json_able

ObserverKind = Literal["minmax", "moving_average", "histogram", "percentile", "fixed"]
ActivationDType = Literal["quint8", "qint8", "int16"]
WeightDType = Literal["qint8", "int16"]
# The integers each dtype holds: a quant range outside them is no range torch can store (an
# activation spec with quant_max 1000 over quint8 calibrated without a word and cost 26 dB).
_DTYPE_RANGE = {"quint8": (0, 255), "qint8": (-128, 127), "int16": (-32768, 32767)}


def _check_quant_range(quant_min: int | None, quant_max: int | None, dtype: str) -> None:
    if (quant_min is None) != (quant_max is None):
        raise ValueError("give both quant_min and quant_max, or neither")
    if quant_min is None or quant_max is None:
        return
    if quant_min >= quant_max:
        raise ValueError("quant_min must be below quant_max")
    low, high = _DTYPE_RANGE[dtype]
    if quant_min < low or quant_max > high:
        raise ValueError(f"quant_min..quant_max {quant_min}..{quant_max} is outside {dtype}'s {low}..{high}")


# Parameters that only make sense for one observer kind.
_KIND_PARAMS = {
    "moving_average": ("averaging_constant",),
    "histogram": ("bins",),
    "percentile": ("percentile",),
    "fixed": ("scale", "zero_point"),
}


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Provenance(_Frozen):
    """Why a decision is in the plan."""

    source: Literal["finding", "measurement", "user", "backend-default"] = "finding"
    rule: str | None = Field(default=None, description="Rule code, e.g. QL104, for findings.")
    target: str | None = Field(default=None, description="The finding's target (module fqn or node).")
    fingerprint: str | None = None
    metric: str | None = Field(default=None, description="For measurements: what was measured.")
    value: float | None = None
    gain_db: float | None = Field(
        default=None, description="Output SQNR (dB) the decision was measured to gain, when a trial measured it."
    )
    detail: str | None = None

    def makes_a_failing_model_run(self) -> bool:
        """A finding's fix measured to make an int8 model that failed run (``value``: its SQNR)."""
        return self.source == "finding" and self.gain_db is None and self.value is not None

    def credited_db(self) -> float | None:
        """What a measurement credits the decision with: its gain, infinite for making a failing
        model run, None when nothing measured it."""
        return math.inf if self.makes_a_failing_model_run() else self.gain_db

    def describe(self) -> str:
        if self.source == "finding":
            gain = "" if self.gain_db is None else f", measured {self.gain_db:+.2f} dB"
            if self.makes_a_failing_model_run():
                gain = f", measured fails → {self.value:.2f} dB"
            return f"{self.rule} on {self.target}{gain}"
        if self.source == "measurement":
            value = "" if self.value is None else f" = {self.value:.4g}"
            return f"measured {self.metric or '?'}{value}"
        return self.detail or self.source


class ActivationSpec(_Frozen):
    """How one activation tensor is observed and quantized."""

    observer: ObserverKind = "histogram"
    dtype: ActivationDType = "quint8"
    symmetric: bool = False
    reduce_range: bool = False
    quant_min: int | None = None
    quant_max: int | None = None
    averaging_constant: float | None = Field(default=None, gt=0, le=1)
    bins: int | None = Field(default=None, gt=0)
    percentile: float | None = Field(default=None, gt=50, le=100)
    scale: float | None = Field(default=None, gt=0)
    zero_point: int | None = None

    @model_validator(mode="after")
    def _params_fit_kind(self) -> ActivationSpec:
        for kind, names in _KIND_PARAMS.items():
            if kind != self.observer:
                stray = [n for n in names if getattr(self, n) is not None]
                if stray:
                    raise ValueError(f"{', '.join(stray)} only apply to the {kind} observer, not {self.observer}")
        if self.observer == "fixed" and (self.scale is None or self.zero_point is None):
            raise ValueError("a fixed observer needs scale and zero_point")
        _check_quant_range(self.quant_min, self.quant_max, self.dtype)
        return self

    def changed(self, **changes: Any) -> ActivationSpec:
        """A copy with ``changes``; switching observer kind drops the old kind's parameters."""
        data = self.model_dump()
        if "observer" in changes and changes["observer"] != self.observer:
            for name in _KIND_PARAMS.get(self.observer, ()):
                data[name] = None
        data.update(changes)
        return ActivationSpec(**data)

    def describe(self) -> str:
        parts: list[str] = [self.observer, self.dtype]
        if self.symmetric:
            parts.append("symmetric")
        if self.reduce_range:
            parts.append("reduce_range")
        for name in ("quant_min", "quant_max", "averaging_constant", "bins", "percentile", "scale", "zero_point"):
            value = getattr(self, name)
            if value is not None:
                parts.append(f"{name}={value:g}" if isinstance(value, float) else f"{name}={value}")
        return " ".join(parts)


class WeightSpec(_Frozen):
    """How a weight is quantized."""

    per_channel: bool = True
    dtype: WeightDType = "qint8"
    symmetric: bool = True
    # 0: the output channels of a conv or linear weight; 1: those of a transposed conv's
    ch_axis: int = Field(0, ge=0, le=1)
    observer: Literal["minmax", "moving_average"] = "minmax"
    quant_min: int | None = None
    quant_max: int | None = None

    @model_validator(mode="after")
    def _range(self) -> WeightSpec:
        _check_quant_range(self.quant_min, self.quant_max, self.dtype)
        return self

    def describe(self) -> str:
        text = f"{'per-channel' if self.per_channel else 'per-tensor'} {self.dtype}"
        text += " symmetric" if self.symmetric else " affine"
        if self.per_channel and self.ch_axis != 0:
            text += f" ch_axis={self.ch_axis}"
        if self.quant_min is not None:
            text += f" [{self.quant_min}, {self.quant_max}]"
        return text


class ModuleDecision(_Frozen):
    """What to do with one module (by fully qualified name); unset fields use the globals."""

    fqn: str = Field(min_length=1)
    quantize: bool = True
    mode: Literal["static", "dynamic"] = "static"
    activation: ActivationSpec | None = None
    weight: WeightSpec | None = None
    provenance: list[Provenance] = Field(min_length=1)

    def describe(self) -> str:
        if not self.quantize:
            return "keep float"
        parts: list[str] = [self.mode]
        if self.activation is not None and self.mode == "static":
            parts.append(f"activation {self.activation.describe()}")
        if self.weight is not None:
            parts.append(f"weight {self.weight.describe()}")
        return ", ".join(parts)


class EqualizationPair(_Frozen):
    """Input-weight equalization of ``module`` (scaling the output of ``previous`` inversely)."""

    module: str = Field(min_length=1)
    previous: str | None = None
    provenance: list[Provenance] = Field(min_length=1)


RewriteKind = Literal[
    "fuse",
    "fold_bn_into_functional_conv",
    "split_module",
    "remove_module",
    "view_to_reshape",
    "observe_input",
    "normalize_input",
    "split_leading_token",
]


class Rewrite(_Frozen):
    """A float-preserving model change to make before quantizing (not applied by the exporter)."""

    kind: RewriteKind
    modules: list[str] = Field(min_length=1)
    params: dict[str, Any] = Field(default_factory=dict)
    provenance: list[Provenance] = Field(min_length=1)

    @field_validator("params")
    @classmethod
    def _json_able(cls, value: Any) -> Any:
        check_json_able(value, "params")
        return value


class FloatFunction(_Frozen):
    """A function kept float wherever the model calls it (``mapping.set_object_type(fn, None)``):
    functional ops have no module name to decide by."""

    function: str = Field(description="Its public path: operator.add, torch.sqrt, torch.nn.functional.relu.")
    provenance: list[Provenance] = Field(min_length=1)

    @field_validator("function")
    @classmethod
    def _known(cls, value: str) -> str:
        resolve_function(value)  # a plan names functions, it never imports them
        return value


class BiasCorrection(_Frozen):
    """After calibration, each int8 conv/linear layer's bias loses the mean output shift its
    rounded weights cause, measured on the calibration data (:mod:`qlint.measure.bias_correction`).
    A QConfigMapping cannot say this: ``QuantPlan.quantize`` and ``qlint quantize`` apply it."""

    provenance: list[Provenance] = Field(min_length=1)


class Suggestions(_Frozen):
    """Global defaults plus per-module decisions, equalization pairs, rewrites and bias correction."""

    backend: Literal["x86", "fbgemm", "qnnpack", "onednn"] = "x86"
    model: str | None = None
    activation: ActivationSpec = Field(default_factory=ActivationSpec)
    weight: WeightSpec = Field(default_factory=WeightSpec)
    modules: list[ModuleDecision] = Field(default_factory=list)
    equalization: list[EqualizationPair] = Field(default_factory=list)
    rewrites: list[Rewrite] = Field(default_factory=list)
    float_functions: list[FloatFunction] = Field(default_factory=list)
    bias_correction: BiasCorrection | None = None
    float_by_default: bool = Field(
        default=False,
        description="Only the modules with a decision are quantized; everything else stays float "
        "(torch's quantize_dynamic recipe). The global specs apply to listed modules without their own.",
    )
    notes: list[str] = Field(default_factory=list, description="Suggestions the plan could not express.")

    @model_validator(mode="after")
    def _unique_modules(self) -> Suggestions:
        seen: set[str] = set()
        for decision in self.modules:
            if decision.fqn in seen:
                raise ValueError(f"module {decision.fqn!r} has more than one decision")
            seen.add(decision.fqn)
        return self

    def decision(self, fqn: str) -> ModuleDecision | None:
        """The decision listed for module ``fqn`` itself (see :meth:`governing_decision`)."""
        return next((d for d in self.modules if d.fqn == fqn), None)

    def governing_decision(self, fqn: str) -> ModuleDecision | None:
        """The decision that applies to module ``fqn``: its own, else that of its nearest ancestor
        with one (a QConfigMapping's module name covers the module's submodules)."""
        listed = {d.fqn: d for d in self.modules}
        name = fqn
        while name not in listed:
            if "." not in name:
                return None
            name = name.rpartition(".")[0]
        return listed[name]

    def needs_rewrites(self, decision: ModuleDecision) -> bool:
        """Whether ``decision`` was made for the model as the plan's rewrites change it: every
        finding it comes from also rewrites the model (QL101's fixed range on a conv that its BN
        is folded into first). On the model as given, the same module name reaches other values
        (the conv's raw output, before the BN), so a mapping for that model leaves it out."""
        rewriting = {_finding_key(p) for rewrite in self.rewrites for p in rewrite.provenance if p.source == "finding"}
        sources = [_finding_key(p) for p in decision.provenance if p.source == "finding"]
        return bool(sources) and all(key in rewriting for key in sources)

    def dynamic_equalized_modules(self) -> list[str]:
        """The equalized modules that run dynamic int8 (their own decision or an ancestor's): their
        input is quantized on each call's own range, not on one fixed by calibration."""
        modules = [pair.module for pair in self.equalization]
        decisions = [self.governing_decision(module) for module in modules]
        return [m for m, d in zip(modules, decisions) if d is not None and d.quantize and d.mode == "dynamic"]

    def effective_activation(self, fqn: str) -> ActivationSpec:
        d = self.governing_decision(fqn)
        return d.activation if d is not None and d.activation is not None else self.activation

    def effective_weight(self, fqn: str) -> WeightSpec:
        d = self.governing_decision(fqn)
        return d.weight if d is not None and d.weight is not None else self.weight


def _finding_key(provenance: Provenance) -> tuple[str | None, str | None, str | None]:
    """The finding a provenance names: its rule, target and fingerprint."""
    return provenance.rule, provenance.target, provenance.fingerprint


def backend_defaults(backend: str) -> tuple[ActivationSpec, WeightSpec]:
    """The activation/weight specs equal to get_default_qconfig(backend)."""
    if backend not in BACKENDS:
        raise ConfigError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    activation = ActivationSpec(observer="histogram", reduce_range=backend in ("x86", "fbgemm"))
    weight = WeightSpec(per_channel=backend != "qnnpack", symmetric=True)
    return activation, weight
