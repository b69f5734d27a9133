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
from fractions import Fraction
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from qlint.core.backends import BACKENDS, backend_info
from qlint.core.function_paths import resolve_function
from qlint.errors import ConfigError
from qlint.linter.json_values import check_json_able

ObserverKind = Literal["minmax", "moving_average", "histogram", "percentile", "fixed"]
ActivationDType = Literal["quint8", "qint8", "int16"]
WeightDType = Literal["qint8", "int16"]
# The integers each dtype holds: a quant range outside them is no range torch can store (an
# activation spec with quant_max 1000 over quint8 calibrated without a word and cost 26 dB).
_DTYPE_RANGE = {"quint8": (0, 255), "qint8": (-128, 127), "int16": (-32768, 32767)}


def _range_of_levels(dtype: str, levels: int) -> tuple[int, int]:
    """The integers of ``levels`` levels in ``dtype`` as torch's observers place them: from 0
    for an unsigned dtype, centred on 0 for a signed one (reduce_range's 0..127 and -64..63)."""
    low, _ = _DTYPE_RANGE[dtype]
    return (0, levels - 1) if low == 0 else (-(levels // 2), levels // 2 - 1)


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


# The fields of an activation spec that set the integers it quantizes to, not how it observes.
_NUMBER_FORMAT = ("dtype", "symmetric", "reduce_range", "quant_min", "quant_max")


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

    def quant_range(self) -> tuple[int, int]:
        """The integers the observer built from this spec quantizes to: its own range, else a
        FixedQParamsObserver's default (0..255) or its dtype's; reduce_range halves an observed
        one as torch's observers do (a FixedQParamsObserver has no reduce_range)."""
        if self.quant_min is not None and self.quant_max is not None:
            low, high = self.quant_min, self.quant_max
        elif self.observer == "fixed":
            return 0, 255
        else:
            low, high = _DTYPE_RANGE[self.dtype]
        if self.reduce_range and self.observer != "fixed":
            return low // 2, high // 2
        return low, high

    def levels(self) -> int:
        low, high = self.quant_range()
        return high - low + 1

    def with_levels(self, levels: int) -> ActivationSpec:
        """This fixed range with ``levels`` integer levels over the same real interval: it still
        saturates where it did (QL101's clip), only its step changes."""
        if self.observer != "fixed" or self.scale is None or self.zero_point is None:
            raise ValueError("only a fixed range has levels to change: an observer's come from calibration")
        low, high = self.quant_range()
        new_low, new_high = _range_of_levels(self.dtype, levels)
        ratio = Fraction(new_high - new_low, high - low)
        # the real interval's lower edge, (low - zero_point) * scale, in the new step; exact
        zero_point = new_low - round((low - self.zero_point) * ratio)
        scale = self.scale * (high - low) / (new_high - new_low)
        return self.changed(quant_min=new_low, quant_max=new_high, scale=scale, zero_point=zero_point)

    def same_number_format(self, other: ActivationSpec) -> bool:
        """Whether both quantize to the same integers (dtype, scheme and range): they differ at most
        in how they observe."""
        return all(getattr(self, name) == getattr(other, name) for name in _NUMBER_FORMAT)

    def describe(self, *, observer_only: bool = False) -> str:
        """``observer_only``: the observer and its parameters, without the number format (the pt2e
        flow observes with them and quantizes to its quantizer's own format)."""
        parts: list[str] = [self.observer] if observer_only else [self.observer, self.dtype]
        if self.symmetric and not observer_only:
            parts.append("symmetric")
        if self.reduce_range and not observer_only:
            parts.append("reduce_range")
        for name in ("quant_min", "quant_max", "averaging_constant", "bins", "percentile", "scale", "zero_point"):
            if observer_only and name in _NUMBER_FORMAT:
                continue
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

    def describe(self, *, observer_only: bool = False) -> str:
        """``observer_only``: its activation's observer without the number format (see
        :meth:`ActivationSpec.describe`)."""
        if not self.quantize:
            return "keep float"
        parts: list[str] = [self.mode]
        if self.activation is not None and self.mode == "static":
            parts.append(f"activation {self.activation.describe(observer_only=observer_only)}")
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
    "remove_module",  # written by plans before lint made it a note; tracing satisfies it (see Rewrite)
    "view_to_reshape",
    "observe_input",
    "normalize_input",
    "split_leading_token",
]


# A split_leading_token rewrite's parameter: split only the Linears the plan runs dynamic.
ONLY_DYNAMIC = "only_dynamic"


class Rewrite(_Frozen):
    """A float-preserving model change to make before quantizing (not applied by the exporter)."""

    kind: RewriteKind
    modules: list[str] = Field(min_length=1)
    params: dict[str, Any] = Field(default_factory=dict)
    provenance: list[Provenance] = Field(min_length=1)

    def satisfied_by_tracing(self) -> bool:
        """A rewrite the traced graph already has: an unused module (``remove_module``) is not
        in a graph that never calls it. Only plans written before lint made it a note list it."""
        return self.kind == "remove_module"

    def only_dynamic(self) -> bool:
        """A token split for the Linears the plan runs dynamic only (``params["only_dynamic"]``):
        it leaves the others as they are. Under a static range both parts read one observer, so
        the split gains nothing there (on MiniLM, -1.98 -> -2.02 dB under static x86 against
        9.81 -> 13.17 dB with every Linear dynamic), and that observer, shared with its input,
        also sees the first token alone."""
        return self.kind == "split_leading_token" and self.params.get(ONLY_DYNAMIC) is True

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

    def token_split_linears(self) -> list[str]:
        """The Linears the plan's token splits apply to: each split's modules, those of a split
        for dynamic Linears only (:meth:`Rewrite.only_dynamic`) where the plan runs them dynamic."""
        split: list[str] = []
        for rewrite in self.rewrites:
            if rewrite.kind != "split_leading_token":
                continue
            for fqn in rewrite.modules:
                decision = self.governing_decision(fqn)
                dynamic = decision is not None and decision.quantize and decision.mode == "dynamic"
                if (dynamic or not rewrite.only_dynamic()) and fqn not in split:
                    split.append(fqn)
        return split

    def waiting_rewrites(self) -> list[Rewrite]:
        """The rewrites this plan keeps but does not apply: a split for dynamic Linears only whose
        Linears the plan runs otherwise (it applies once a decision makes one dynamic)."""
        split = set(self.token_split_linears())
        return [r for r in self.rewrites if r.only_dynamic() and not split.intersection(r.modules)]

    def dynamic_equalized_modules(self) -> list[str]:
        """The equalized modules that run dynamic int8 (their own decision or an ancestor's): their
        input is quantized on each call's own range, not on one fixed by calibration."""
        modules = [pair.module for pair in self.equalization]
        decisions = [self.governing_decision(module) for module in modules]
        return [m for m, d in zip(modules, decisions) if d is not None and d.quantize and d.mode == "dynamic"]

    def with_fixed_ranges_at_activation_bits(self: _Plan) -> _Plan:
        """This plan with each fixed range whose levels are a choice (QL101's saturating [0, 6])
        at the bits of the plan's activations: narrowed where it has more levels than they have,
        and widened from 7 bits (half its dtype's levels: reduce_range's width, which QL101 took
        on x86) to 8 where they have 8. Fixed qparams that the backend demands of an op
        (sigmoid's 1/256) stay as they are: prepare_fx would ignore other ones.

        The levels decide the same thing for both: x86 reduces activations to 7 bits so that
        fbgemm's 16-bit pair sums cannot saturate on CPUs without VNNI, and a fixed range
        feeds the next conv like any activation; with 8-bit activations it has no reason to keep
        half its levels (EfficientNet-Lite0's 33 ReLU6 ranges: 16.6 -> 21.4 dB held-out)."""
        allowed = self.activation.levels()
        demanded = backend_info(self.backend).fixed_qparams

        def following(spec: ActivationSpec | None) -> ActivationSpec | None:
            if spec is None or spec.observer != "fixed" or (spec.scale, spec.zero_point) in demanded:
                return spec
            low, high = _DTYPE_RANGE[spec.dtype]
            full = high - low + 1
            target, have = min(allowed, full), spec.levels()
            if have > target or (have == full // 2 and target == full):
                return spec.with_levels(target)
            return spec

        modules = [d.model_copy(update={"activation": following(d.activation)}) for d in self.modules]
        return self if modules == self.modules else self.model_copy(update={"modules": modules})

    def effective_activation(self, fqn: str) -> ActivationSpec:
        d = self.governing_decision(fqn)
        return d.activation if d is not None and d.activation is not None else self.activation

    def effective_weight(self, fqn: str) -> WeightSpec:
        d = self.governing_decision(fqn)
        return d.weight if d is not None and d.weight is not None else self.weight


_Plan = TypeVar("_Plan", bound=Suggestions)


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
