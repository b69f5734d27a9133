"""QuantPlan: a neutral, versioned description of how to quantize one model.

A plan holds global defaults (backend, activation observer, weight scheme) and
per-module decisions (quantize or keep float, int8/int16, static/dynamic,
per-channel/per-tensor weights, activation observer and its parameters),
equalization pairs and float-preserving rewrites. Every decision records where
it came from (a finding's rule and target, a measurement, the user).

It is a frozen pydantic v2 model that survives a JSON round trip unchanged::

    plan = report.plan()                       # or plan_from_report(report)
    QuantPlan.model_validate_json(plan.model_dump_json()) == plan
    mapping = plan.to_qconfig_mapping()        # torch.ao QConfigMapping for prepare_fx
    source = plan.to_python()                  # a readable .py file that builds it

Deserialising refuses an unknown ``type`` or a newer ``schema_version`` with a
:class:`PlanFormatError` (a ConfigError: one line, CLI exit 2).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Iterable, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from qlint.errors import ConfigError
from qlint.linter.findings import Finding, _check_json_able
from qlint.render.literal import printable

if TYPE_CHECKING:
    from torch.ao.quantization import QConfigMapping

    from qlint.linter.findings import Report

PLAN_TYPE = "qlint.QuantPlan"
SCHEMA_VERSION = 1
BACKENDS = ("x86", "fbgemm", "qnnpack", "onednn")

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


class PlanFormatError(ConfigError):
    """A plan file this qlint cannot read: wrong type, newer schema, or bad content."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Provenance(_Frozen):
    """Why a decision is in the plan."""

    source: Literal["finding", "measurement", "user", "backend-default"] = "finding"
    rule: Optional[str] = Field(default=None, description="Rule code, e.g. QL104, for findings.")
    target: Optional[str] = Field(default=None, description="The finding's target (module fqn or node).")
    fingerprint: Optional[str] = None
    metric: Optional[str] = Field(default=None, description="For measurements: what was measured.")
    value: Optional[float] = None
    detail: Optional[str] = None

    @classmethod
    def of(cls, finding: Finding) -> "Provenance":
        return cls(source="finding", rule=finding.rule, target=finding.target,
                   fingerprint=finding.fingerprint(), detail=finding.name)

    def describe(self) -> str:
        if self.source == "finding":
            return f"{self.rule} on {self.target}"
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
    quant_min: Optional[int] = None
    quant_max: Optional[int] = None
    averaging_constant: Optional[float] = Field(default=None, gt=0, le=1)
    bins: Optional[int] = Field(default=None, gt=0)
    percentile: Optional[float] = Field(default=None, gt=50, le=100)
    scale: Optional[float] = Field(default=None, gt=0)
    zero_point: Optional[int] = None

    @model_validator(mode="after")
    def _params_fit_kind(self) -> "ActivationSpec":
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

    def changed(self, **changes: Any) -> "ActivationSpec":
        """A copy with ``changes``; switching observer kind drops the old kind's parameters."""
        data = self.model_dump()
        if "observer" in changes and changes["observer"] != self.observer:
            for name in _KIND_PARAMS.get(self.observer, ()):
                data[name] = None
        data.update(changes)
        return ActivationSpec(**data)

    def describe(self) -> str:
        parts = [self.observer, self.dtype]
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
    ch_axis: int = 0
    observer: Literal["minmax", "moving_average"] = "minmax"
    quant_min: Optional[int] = None
    quant_max: Optional[int] = None

    @model_validator(mode="after")
    def _range(self) -> "WeightSpec":
        if (self.quant_min is None) != (self.quant_max is None):
            raise ValueError("give both quant_min and quant_max, or neither")
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
    activation: Optional[ActivationSpec] = None
    weight: Optional[WeightSpec] = None
    provenance: list[Provenance] = Field(min_length=1)

    def describe(self) -> str:
        if not self.quantize:
            return "keep float"
        parts = [self.mode]
        if self.activation is not None and self.mode == "static":
            parts.append(f"activation {self.activation.describe()}")
        if self.weight is not None:
            parts.append(f"weight {self.weight.describe()}")
        return ", ".join(parts)


class EqualizationPair(_Frozen):
    """Input-weight equalization of ``module`` (scaling the output of ``previous`` inversely)."""

    module: str = Field(min_length=1)
    previous: Optional[str] = None
    provenance: list[Provenance] = Field(min_length=1)


class Rewrite(_Frozen):
    """A float-preserving model change to make before quantizing (not applied by the exporter)."""

    kind: Literal["fuse", "fold_bn_into_functional_conv", "split_module", "remove_module",
                  "view_to_reshape"]
    modules: list[str] = Field(min_length=1)
    params: dict[str, Any] = Field(default_factory=dict)
    provenance: list[Provenance] = Field(min_length=1)

    @field_validator("params")
    @classmethod
    def _json_able(cls, value: Any) -> Any:
        _check_json_able(value, "params")
        return value


class QuantPlan(_Frozen):
    """The whole plan. Build with :func:`plan_from_report` or by hand; export with ``to_*``."""

    type: Literal["qlint.QuantPlan"] = PLAN_TYPE
    schema_version: int = SCHEMA_VERSION
    backend: Literal["x86", "fbgemm", "qnnpack", "onednn"] = "x86"
    model: Optional[str] = None
    activation: ActivationSpec = Field(default_factory=ActivationSpec)
    weight: WeightSpec = Field(default_factory=WeightSpec)
    modules: list[ModuleDecision] = Field(default_factory=list)
    equalization: list[EqualizationPair] = Field(default_factory=list)
    rewrites: list[Rewrite] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list, description="Suggestions the plan could not express.")

    @model_validator(mode="before")
    @classmethod
    def _check_format(cls, data: Any) -> Any:
        if isinstance(data, dict):
            kind = data.get("type", PLAN_TYPE)
            if kind != PLAN_TYPE:
                raise PlanFormatError(f"not a qlint plan: type is {kind!r}, expected {PLAN_TYPE!r}")
            version = data.get("schema_version", SCHEMA_VERSION)
            if not isinstance(version, int) or isinstance(version, bool) or version < 1:
                raise PlanFormatError(f"bad plan schema_version {version!r}: expected an integer >= 1")
            if version > SCHEMA_VERSION:
                raise PlanFormatError(
                    f"plan schema_version {version} is newer than this qlint reads ({SCHEMA_VERSION}); "
                    "upgrade qlint")
        return data

    @model_validator(mode="after")
    def _unique_modules(self) -> "QuantPlan":
        seen: set[str] = set()
        for decision in self.modules:
            if decision.fqn in seen:
                raise ValueError(f"module {decision.fqn!r} has more than one decision")
            seen.add(decision.fqn)
        return self

    # --- reading ------------------------------------------------------------------------
    @classmethod
    def from_json(cls, text: str) -> "QuantPlan":
        """Parse a plan, turning every problem into a one-line PlanFormatError."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as error:
            raise PlanFormatError(f"plan is not valid JSON: {error}") from error
        except RecursionError as error:  # json's decoder recurses once per nesting level
            raise PlanFormatError("plan is nested too deeply to be a qlint plan") from error
        if not isinstance(raw, dict):
            raise PlanFormatError("plan must be a JSON object")
        cls._check_format(raw)  # type/version first, with their own message
        try:
            return cls.model_validate(raw)
        except ValidationError as error:
            first = error.errors()[0]
            where = ".".join(str(p) for p in first.get("loc", ())) or "plan"
            raise PlanFormatError(f"bad plan at {where}: {first.get('msg')}") from error

    @classmethod
    def load(cls, path: str) -> "QuantPlan":
        from pathlib import Path

        try:
            text = Path(path).read_text()
        except OSError as error:
            raise PlanFormatError(f"cannot read plan {path}: {error.strerror}") from error
        return cls.from_json(text)

    def decision(self, fqn: str) -> Optional[ModuleDecision]:
        return next((d for d in self.modules if d.fqn == fqn), None)

    def effective_activation(self, fqn: str) -> ActivationSpec:
        d = self.decision(fqn)
        return d.activation if d is not None and d.activation is not None else self.activation

    def effective_weight(self, fqn: str) -> WeightSpec:
        d = self.decision(fqn)
        return d.weight if d is not None and d.weight is not None else self.weight

    # --- exporting (qlint.advice.export) -------------------------------------------------
    def to_qconfig_mapping(self) -> "QConfigMapping":
        from qlint.advice.export import to_qconfig_mapping

        return to_qconfig_mapping(self)

    def to_equalization_mapping(self, equalization_qconfig: Any = None) -> "QConfigMapping":
        from qlint.advice.export import to_equalization_mapping

        return to_equalization_mapping(self, equalization_qconfig)

    def to_python(self) -> str:
        from qlint.advice.export import to_python

        return to_python(self)

    def to_pt2e_quantizer(self) -> Any:
        """A torchao pt2e quantizer applying this plan (needs the extra ``qlint[pt2e]``)."""
        from qlint.advice.pt2e import to_pt2e_quantizer

        return to_pt2e_quantizer(self)

    def pretty(self) -> str:
        """A human-readable summary (``qlint plan show``)."""
        lines = [f"QuantPlan (schema {self.schema_version}) for {self.model or 'model'} on {self.backend}",
                 f"  global activation: {self.activation.describe()}",
                 f"  global weight:     {self.weight.describe()}"]
        if self.modules:
            lines.append("  modules:")
            for d in self.modules:
                why = "; ".join(p.describe() for p in d.provenance)
                lines.append(f"    {d.fqn}: {d.describe()}  [{why}]")
        if self.equalization:
            lines.append("  equalization:")
            for pair in self.equalization:
                why = "; ".join(p.describe() for p in pair.provenance)
                prev = f" (after {pair.previous})" if pair.previous else ""
                lines.append(f"    {pair.module}{prev}  [{why}]")
        if self.rewrites:
            lines.append("  rewrites (float-preserving, apply before quantizing):")
            for r in self.rewrites:
                why = "; ".join(p.describe() for p in r.provenance)
                lines.append(f"    {r.kind}: {', '.join(r.modules)}  [{why}]")
        if self.notes:
            lines.append("  notes:")
            lines += [f"    {n}" for n in self.notes]
        return "\n".join(printable(line) for line in lines) + "\n"  # names from the file, shown literally


# --- defaults --------------------------------------------------------------------------

def backend_defaults(backend: str) -> tuple[ActivationSpec, WeightSpec]:
    """The activation/weight specs equal to get_default_qconfig(backend)."""
    if backend not in BACKENDS:
        raise ConfigError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    activation = ActivationSpec(observer="histogram", reduce_range=backend in ("x86", "fbgemm"))
    weight = WeightSpec(per_channel=backend != "qnnpack", symmetric=True)
    return activation, weight


def default_plan(backend: str = "x86", model: Optional[str] = None) -> QuantPlan:
    activation, weight = backend_defaults(backend)
    return QuantPlan(backend=backend, model=model, activation=activation, weight=weight)


# --- from findings ----------------------------------------------------------------------

_OBSERVER_KINDS = {
    "MinMaxObserver": "minmax",
    "PerChannelMinMaxObserver": "minmax",
    "MovingAverageMinMaxObserver": "moving_average",
    "MovingAveragePerChannelMinMaxObserver": "moving_average",
    "HistogramObserver": "histogram",
    "FixedQParamsObserver": "fixed",
    "PercentileObserver": "percentile",
}


def _observer_kind(name: Any) -> Optional[str]:
    if not isinstance(name, str):
        return None
    return _OBSERVER_KINDS.get(name.rsplit(".", 1)[-1])


def _dtype(name: Any, allowed: Iterable[str]) -> Optional[str]:
    if not isinstance(name, str):
        return None
    short = name.rsplit(".", 1)[-1]
    short = {"qint16": "int16", "quint16": "int16"}.get(short, short)
    return short if short in allowed else None


class _Builder:
    """Collects per-module changes from many findings, then freezes them into a plan."""

    def __init__(self, report: "Report") -> None:
        self.report = report
        self.activation, self.weight = backend_defaults(report.backend)
        self.modules: dict[str, dict[str, Any]] = {}
        self.equalization: dict[str, dict[str, Any]] = {}
        self.rewrites: list[Rewrite] = []
        self.notes: list[str] = []

    def module(self, fqn: str, finding: Finding) -> dict[str, Any]:
        entry = self.modules.setdefault(fqn, {"fqn": fqn, "activation": {}, "weight": {}, "provenance": []})
        source = Provenance.of(finding)
        if source not in entry["provenance"]:
            entry["provenance"].append(source)
        return entry

    def note(self, finding: Finding, text: str) -> None:
        self.notes.append(f"{finding.rule} on {finding.target}: {text}")

    def build(self) -> QuantPlan:
        decisions = []
        for fqn, entry in self.modules.items():
            activation = self.activation.changed(**entry["activation"]) if entry["activation"] else None
            weight = self.weight.model_copy(update=entry["weight"]) if entry["weight"] else None
            if weight is not None:
                weight = WeightSpec(**weight.model_dump())  # re-validate
            decisions.append(ModuleDecision(
                fqn=fqn, quantize=entry.get("quantize", True), mode=entry.get("mode", "static"),
                activation=activation, weight=weight, provenance=entry["provenance"]))
        pairs = [EqualizationPair(**e) for e in self.equalization.values()]
        return QuantPlan(backend=self.report.backend, model=self.report.model, activation=self.activation,
                         weight=self.weight, modules=decisions, equalization=pairs,
                         rewrites=self.rewrites, notes=self.notes)


def _targets(s: dict[str, Any], finding: Finding) -> list[str]:
    for key in ("targets", "nodes"):
        if isinstance(s.get(key), list) and s[key]:
            return [str(t) for t in s[key]]
    for key in ("module", "target"):
        if isinstance(s.get(key), str) and s[key]:
            return [s[key]]
    return [finding.target]


def _apply_set_qconfig(b: _Builder, f: Finding, s: dict[str, Any]) -> None:
    for fqn in _targets(s, f):
        entry = b.module(fqn, f)
        if s.get("mode") in ("static", "dynamic"):
            entry["mode"] = s["mode"]
        kind = _observer_kind(s.get("activation")) or _observer_kind(s.get("observer"))
        act = entry["activation"]
        if kind == "fixed":
            act.update(observer="fixed", scale=float(s["scale"]), zero_point=int(s["zero_point"]),
                       symmetric=False, reduce_range=False)
            dtype = _dtype(s.get("dtype"), ("quint8", "qint8"))
            if dtype:
                act["dtype"] = dtype
            if s.get("quant_min") is not None and s.get("quant_max") is not None:
                act.update(quant_min=int(s["quant_min"]), quant_max=int(s["quant_max"]))
            continue
        if kind is not None:
            act["observer"] = kind
        dtype = _dtype(s.get("activation_dtype"), ("quint8", "qint8", "int16"))
        if dtype:
            act["dtype"] = dtype
        if s.get("quant_min") is not None and s.get("quant_max") is not None:
            act.update(quant_min=int(s["quant_min"]), quant_max=int(s["quant_max"]))
        if "like" in s:
            entry["quantize"] = True


def _apply_set_weight(b: _Builder, f: Finding, s: dict[str, Any]) -> None:
    for fqn in _targets(s, f):
        entry = b.module(fqn, f)
        w = entry["weight"]
        qscheme = s.get("qscheme")
        observer = s.get("observer") if isinstance(s.get("observer"), str) else ""
        if isinstance(qscheme, str):
            w["per_channel"] = "per_channel" in qscheme
            w["symmetric"] = "symmetric" in qscheme
        elif "PerChannel" in observer:
            w["per_channel"] = True
        if "MovingAverage" in observer:
            w["observer"] = "moving_average"
        dtype = _dtype(s.get("dtype"), ("qint8", "int16"))
        if dtype:
            w["dtype"] = dtype
        if isinstance(s.get("ch_axis"), int):
            w["ch_axis"] = s["ch_axis"]
        if s.get("quant_min") is not None and s.get("quant_max") is not None:
            w.update(quant_min=int(s["quant_min"]), quant_max=int(s["quant_max"]))


def _apply_set_activation(b: _Builder, f: Finding, s: dict[str, Any]) -> None:
    for fqn in _targets(s, f):
        act = b.module(fqn, f)["activation"]
        kind = _observer_kind(s.get("observer") or s.get("activation"))
        if kind is not None and kind != "fixed":
            act["observer"] = kind
        if isinstance(s.get("reduce_range"), bool):
            act["reduce_range"] = s["reduce_range"]
        if isinstance(s.get("percentile"), (int, float)):
            act.update(observer="percentile", percentile=float(s["percentile"]))


def _apply_finding(b: _Builder, f: Finding) -> None:
    s = f.suggestion or {}
    action = s.get("action")
    if action is None:
        return
    if action == "fuse":
        blockers = s.get("blockers") or []
        pattern = s.get("pattern") or []
        kind = ("fold_bn_into_functional_conv"
                if "functional-op" in blockers and "batch_norm" in pattern else "fuse")
        b.rewrites.append(Rewrite(kind=kind, modules=[str(m) for m in s.get("modules") or [f.target]],
                                  params={"pattern": list(pattern), "blockers": list(blockers)},
                                  provenance=[Provenance.of(f)]))
    elif action in ("split_module", "remove_module"):
        params = {"copies": s["copies"]} if isinstance(s.get("copies"), int) else {}
        b.rewrites.append(Rewrite(kind=action, modules=[str(s.get("module") or f.target)], params=params,
                                  provenance=[Provenance.of(f)]))
    elif action == "rewrite" and s.get("kind") == "view_to_reshape":
        b.rewrites.append(Rewrite(kind="view_to_reshape", modules=[str(s.get("node") or f.target)],
                                  params={"node": str(s.get("node") or f.target)},
                                  provenance=[Provenance.of(f)]))
    elif action == "set_qconfig":
        _apply_set_qconfig(b, f, s)
    elif action == "set_weight_observer":
        _apply_set_weight(b, f, s)
    elif action in ("set_activation_observer", "unify_qconfig", "clip-or-observer"):
        if action == "clip-or-observer":
            s = {**s, "targets": [s.get("module") or f.target]}  # "channels" are not modules
        _apply_set_activation(b, f, s)
    elif action == "equalize":
        fqn = str(s.get("module") or f.target)
        entry = b.equalization.setdefault(fqn, {"module": fqn, "previous": s.get("previous"), "provenance": []})
        entry["provenance"].append(Provenance.of(f))
    elif action == "keep_float":
        for fqn in _targets(s, f):
            b.module(fqn, f)["quantize"] = False
    else:
        b.note(f, f"suggestion {action!r} is not expressible in a plan")


def plan_from_report(report: "Report") -> QuantPlan:
    """The plan that the report's findings call for: backend defaults plus each suggestion."""
    builder = _Builder(report)
    for finding in report.findings:
        _apply_finding(builder, finding)
    return builder.build()
