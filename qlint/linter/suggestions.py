"""Typed suggestions: what a report's findings ask the user to change, module by module.

A finding carries a machine-readable ``suggestion`` (``{"action": "set_weight_observer",
...}``). :func:`collect_suggestions` reads every suggestion of a report into typed
decisions (an :class:`ActivationSpec` and :class:`WeightSpec` per module, keep-float
decisions, equalization pairs, float-preserving rewrites), each recording its
:class:`Provenance`. :mod:`qlint.linter.mapping` turns them into a QConfigMapping;
:class:`qlint.advice.plan.QuantPlan` is the versioned file built on them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal, NoReturn

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from qlint.core.backends import BACKENDS
from qlint.core.function_paths import resolve_function
from qlint.errors import ConfigError
from qlint.linter.fixes import (
    Equalize,
    Fix,
    Fuse,
    KeepFloat,
    KeepFloatFunction,
    NormalizeInput,
    QuantizeDynamicAfterConvert,
    RemoveModule,
    ReplaceActivation,
    SetActivationObserver,
    SetQConfig,
    SetWeightObserver,
    SplitLeadingToken,
    SplitModule,
    UnifyQConfig,
    ViewToReshape,
)
from qlint.linter.json_values import check_json_able

ObserverKind = Literal["minmax", "moving_average", "histogram", "percentile", "fixed"]
ActivationDType = Literal["quint8", "qint8", "int16"]
WeightDType = Literal["qint8", "int16"]

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

    def describe(self) -> str:
        if self.source == "finding":
            gain = "" if self.gain_db is None else f", measured {self.gain_db:+.2f} dB"
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
        if (self.quant_min is None) != (self.quant_max is None):
            raise ValueError("give both quant_min and quant_max, or neither")
        if self.quant_min is not None and self.quant_min >= self.quant_max:  # type: ignore[operator]
            raise ValueError("quant_min must be below quant_max")
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
        if (self.quant_min is None) != (self.quant_max is None):
            raise ValueError("give both quant_min and quant_max, or neither")
        if self.quant_min is not None and self.quant_min >= self.quant_max:  # type: ignore[operator]
            raise ValueError("quant_min must be below quant_max")
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
        return next((d for d in self.modules if d.fqn == fqn), None)

    def effective_activation(self, fqn: str) -> ActivationSpec:
        d = self.decision(fqn)
        return d.activation if d is not None and d.activation is not None else self.activation

    def effective_weight(self, fqn: str) -> WeightSpec:
        d = self.decision(fqn)
        return d.weight if d is not None and d.weight is not None else self.weight


def backend_defaults(backend: str) -> tuple[ActivationSpec, WeightSpec]:
    """The activation/weight specs equal to get_default_qconfig(backend)."""
    if backend not in BACKENDS:
        raise ConfigError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    activation = ActivationSpec(observer="histogram", reduce_range=backend in ("x86", "fbgemm"))
    weight = WeightSpec(per_channel=backend != "qnnpack", symmetric=True)
    return activation, weight


# --- reading suggestions -----------------------------------------------------------------

_OBSERVER_KINDS = {
    "MinMaxObserver": "minmax",
    "PerChannelMinMaxObserver": "minmax",
    "MovingAverageMinMaxObserver": "moving_average",
    "MovingAveragePerChannelMinMaxObserver": "moving_average",
    "HistogramObserver": "histogram",
    "FixedQParamsObserver": "fixed",
    "PercentileObserver": "percentile",
}


def _observer_kind(name: Any) -> str | None:
    if not isinstance(name, str):
        return None
    return _OBSERVER_KINDS.get(name.rsplit(".", 1)[-1])


def _dtype(name: Any, allowed: Iterable[str]) -> str | None:
    if not isinstance(name, str):
        return None
    short = name.rsplit(".", 1)[-1]
    short = {"qint16": "int16", "quint16": "int16"}.get(short, short)
    return short if short in allowed else None


class _Builder:
    """Collects per-module changes from many suggestions, then freezes them."""

    def __init__(self, backend: str, model: str | None) -> None:
        self.backend, self.model = backend, model
        self.activation, self.weight = backend_defaults(backend)
        self.modules: dict[str, dict[str, Any]] = {}
        self.equalization: dict[str, dict[str, Any]] = {}
        self.rewrites: list[Rewrite] = []
        self.float_functions: dict[str, list[Provenance]] = {}
        self.notes: list[str] = []

    def module(self, fqn: str, source: Provenance) -> dict[str, Any]:
        entry = self.modules.setdefault(fqn, {"fqn": fqn, "activation": {}, "weight": {}, "provenance": []})
        if source not in entry["provenance"]:
            entry["provenance"].append(source)
        return entry

    def note(self, source: Provenance, text: str) -> None:
        self.notes.append(f"{source.describe()}: {text}")

    def build(self) -> Suggestions:
        decisions = []
        for fqn, entry in self.modules.items():
            activation = self.activation.changed(**entry["activation"]) if entry["activation"] else None
            weight = self.weight.model_copy(update=entry["weight"]) if entry["weight"] else None
            if weight is not None:
                weight = WeightSpec(**weight.model_dump())  # re-validate
            decisions.append(
                ModuleDecision(
                    fqn=fqn,
                    quantize=entry.get("quantize", True),
                    mode=entry.get("mode", "static"),
                    activation=activation,
                    weight=weight,
                    provenance=entry["provenance"],
                )
            )
        pairs = [EqualizationPair(**e) for e in self.equalization.values()]
        return Suggestions(
            backend=self.backend,
            model=self.model,
            activation=self.activation,
            weight=self.weight,
            modules=decisions,
            equalization=pairs,
            rewrites=self.rewrites,
            float_functions=[FloatFunction(function=f, provenance=p) for f, p in self.float_functions.items()],
            notes=self.notes,
        )


def _apply_set_qconfig(b: _Builder, source: Provenance, fix: SetQConfig) -> None:
    if fix.by_op_type():
        # a functional op: set_module_name would name nothing (an aten node name does nothing)
        b.note(
            source,
            f"give {fix.object_type} its own qconfig by op type: mapping.set_object_type(...)"
            + (
                f" with {fix.activation} scale={fix.scale:g} zero_point={fix.zero_point}"
                if fix.scale is not None
                else ""
            ),
        )
        return
    if fix.fold_functional:
        _rewrite(b, source, "fold_bn_into_functional_conv", list(fix.fold_functional), {})
    if fix.observe_inputs:
        _rewrite(b, source, "observe_input", list(fix.observe_inputs), {})
    for fqn in fix.target_modules(str(source.target)):
        entry = b.module(fqn, source)
        if fix.mode is not None:
            entry["mode"] = fix.mode
        kind = _observer_kind(fix.activation) or _observer_kind(fix.observer)
        act = entry["activation"]
        if kind == "fixed" and fix.scale is not None and fix.zero_point is not None:
            act.update(
                observer="fixed", scale=fix.scale, zero_point=fix.zero_point, symmetric=False, reduce_range=False
            )
            dtype = _dtype(fix.dtype, ("quint8", "qint8"))
            if dtype:
                act["dtype"] = dtype
            if fix.quant_min is not None and fix.quant_max is not None:
                act.update(quant_min=fix.quant_min, quant_max=fix.quant_max)
            continue
        if kind is not None and kind != "fixed":
            act["observer"] = kind
        dtype = _dtype(fix.activation_dtype, ("quint8", "qint8", "int16"))
        if dtype:
            act["dtype"] = dtype
        if fix.quant_min is not None and fix.quant_max is not None:
            act.update(quant_min=fix.quant_min, quant_max=fix.quant_max)
        if fix.like is not None:
            entry["quantize"] = True


def _apply_set_weight(b: _Builder, source: Provenance, fix: SetWeightObserver) -> None:
    for fqn in fix.target_modules(str(source.target)):
        w = b.module(fqn, source)["weight"]
        observer = fix.observer or ""
        if fix.qscheme is not None:
            w["per_channel"] = "per_channel" in fix.qscheme
            w["symmetric"] = "symmetric" in fix.qscheme
        elif "PerChannel" in observer:
            w["per_channel"] = True
        if "MovingAverage" in observer:
            w["observer"] = "moving_average"
        dtype = _dtype(fix.dtype, ("qint8", "int16"))
        if dtype:
            w["dtype"] = dtype
        if fix.ch_axis is not None:
            w["ch_axis"] = fix.ch_axis
        if fix.quant_min is not None and fix.quant_max is not None:
            w.update(quant_min=fix.quant_min, quant_max=fix.quant_max)


def _apply_set_activation(b: _Builder, source: Provenance, fix: SetActivationObserver | UnifyQConfig) -> None:
    observer = fix.observer if isinstance(fix, SetActivationObserver) else fix.activation
    for fqn in fix.target_modules(str(source.target)):
        act = b.module(fqn, source)["activation"]
        kind = _observer_kind(observer)
        if kind is not None and kind != "fixed":
            act["observer"] = kind
        if isinstance(fix, SetActivationObserver):
            if fix.reduce_range is not None:
                act["reduce_range"] = fix.reduce_range
            if fix.percentile is not None:
                act.update(observer="percentile", percentile=fix.percentile)


def _rewrite(b: _Builder, source: Provenance, kind: RewriteKind, modules: list[str], params: dict[str, Any]) -> None:
    b.rewrites.append(Rewrite(kind=kind, modules=modules, params=params, provenance=[source]))


def _apply(b: _Builder, fix: Fix, source: Provenance) -> None:
    """One fix into the builder; every action is matched, so a new one fails the type checker."""
    target = str(source.target)
    match fix:
        case Fuse():
            functional = "functional-op" in fix.blockers and "batch_norm" in fix.pattern
            _rewrite(
                b,
                source,
                "fold_bn_into_functional_conv" if functional else "fuse",
                list(fix.modules),
                {"pattern": list(fix.pattern), "blockers": list(fix.blockers)},
            )
        case SplitModule():
            _rewrite(b, source, "split_module", [fix.module], {"copies": fix.copies})
        case RemoveModule():
            _rewrite(b, source, "remove_module", [fix.module], {})
        case ViewToReshape():
            _rewrite(b, source, "view_to_reshape", [fix.node], {"node": fix.node})
        case NormalizeInput():
            _rewrite(b, source, "normalize_input", list(fix.modules), {"input": fix.input})
        case SplitLeadingToken():
            _rewrite(b, source, "split_leading_token", list(fix.modules), {})
        case SetQConfig():
            _apply_set_qconfig(b, source, fix)
        case SetWeightObserver():
            _apply_set_weight(b, source, fix)
        case SetActivationObserver() | UnifyQConfig():
            _apply_set_activation(b, source, fix)
        case Equalize():
            entry = b.equalization.setdefault(
                fix.module, {"module": fix.module, "previous": fix.previous, "provenance": []}
            )
            entry["provenance"].append(source)
        case KeepFloat():
            for fqn in fix.target_modules(target):
                b.module(fqn, source)["quantize"] = False
        case KeepFloatFunction():
            for function in (fix.function, *fix.with_functions):
                try:
                    resolve_function(function)
                except ValueError:
                    b.note(source, f"keep {function} float: mapping.set_object_type({function}, None)")
                else:
                    sources = b.float_functions.setdefault(function, [])
                    if source not in sources:
                        sources.append(source)
        case ReplaceActivation():
            b.note(source, f"replace {', '.join(fix.modules)} with nn.ReLU (a change to the float model)")
        case QuantizeDynamicAfterConvert():
            b.note(source, f"after convert_fx, quantize_dynamic({fix.module}, {{{', '.join(fix.types)}}})")
        case _:
            _unmatched(fix)


def _unmatched(fix: NoReturn) -> NoReturn:
    """Reached only if a fix type has no case above: the type checker flags the call."""
    raise TypeError(f"no plan mapping for {type(fix).__name__}")


def collect_suggestions(backend: str, model: str | None, suggested: Iterable[tuple[Fix, Provenance]]) -> Suggestions:
    """Backend defaults plus each (fix, where it came from), in order."""
    builder = _Builder(backend, model)
    for fix, source in suggested:
        _apply(builder, fix, source)
    return builder.build()
