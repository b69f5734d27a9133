"""QuantPlan: a neutral, versioned description of how to quantize one model.

A plan holds global defaults (backend, activation observer, weight scheme) and
per-module decisions (quantize or keep float, int8/int16, static/dynamic,
per-channel/per-tensor weights, activation observer and its parameters),
equalization pairs and float-preserving rewrites: the typed suggestions of
:mod:`qlint.linter.suggestions`, under a file type and a schema version. Every
decision records where it came from (a finding's rule and target, a measurement,
the user).

It is a frozen pydantic v2 model that survives a JSON round trip unchanged::

    plan = plan_from_report(report)
    QuantPlan.model_validate_json(plan.model_dump_json()) == plan
    mapping = plan.to_qconfig_mapping()        # torch.ao QConfigMapping for prepare_fx
    int8_model = plan.quantize(model, calibration)   # what qlint verify measured, in one step
    source = plan.to_python()                  # a readable .py file that builds it

A plan says which flow it is for (``flow``): ``"fx"`` (prepare_fx with its QConfigMapping) or
``"pt2e"`` (an exported program, such as a ``.pt2``, quantized with prepare_pt2e and
:meth:`QuantPlan.to_pt2e_quantizer`). A pt2e plan's number format is the pt2e quantizer's own,
not the plan's global specs, and it has no QConfigMapping: ``to_qconfig_mapping`` and
``to_python`` refuse it in one line.

Deserialising refuses an unknown ``type`` or a newer ``schema_version`` with a
:class:`PlanFormatError` (a ConfigError: one line, CLI exit 2). Schema 2 added ``flow``: a
schema-1 file reads as an fx plan of schema 2 (a qlint that reads only schema 1 refuses the
new files with "upgrade qlint" instead of misreading a pt2e plan as an fx one).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Final, Literal

import torch.fx as fx
import torch.nn as nn
from pydantic import Field, ValidationError, model_validator
from torch.ao.quantization import QConfigMapping

from qlint.advice.apply import quantize_with_plan, refuse_unapplied
from qlint.advice.export import to_equalization_mapping, to_python
from qlint.advice.pt2e import pt2e_global_specs, to_pt2e_quantizer
from qlint.core.batches import batches_of
from qlint.core.graph import exported_frontend
from qlint.core.preserve import preserved_state
from qlint.errors import ConfigError, validation_problem
from qlint.linter.findings import Report
from qlint.linter.mapping import qconfig_mapping
from qlint.linter.suggestions import (
    ActivationSpec,
    BiasCorrection,
    EqualizationPair,
    FloatFunction,
    ModuleDecision,
    Provenance,
    Rewrite,
    Suggestions,
    WeightSpec,
    backend_defaults,
)
from qlint.render.literal import printable

PLAN_TYPE: Final = "qlint.QuantPlan"
SCHEMA_VERSION = 2  # 2: the flow field; a schema-1 plan is an fx plan
Flow = Literal["fx", "pt2e"]


class PlanFormatError(ConfigError):
    """A plan file this qlint cannot read: wrong type, newer schema, or bad content."""


class QuantPlan(Suggestions):
    """The whole plan. Build with :func:`plan_from_report` or by hand; export with ``to_*``."""

    type: Literal["qlint.QuantPlan"] = PLAN_TYPE
    schema_version: int = SCHEMA_VERSION
    flow: Flow = Field(
        default="fx",
        description="The flow the plan is for: fx (prepare_fx with to_qconfig_mapping) or pt2e (an exported "
        "program, prepare_pt2e with to_pt2e_quantizer, in the quantizer's own number format).",
    )

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
                    f"plan schema_version {version} is newer than this qlint reads ({SCHEMA_VERSION}); upgrade qlint"
                )
            if version < SCHEMA_VERSION:  # schema 1 had no flow: every such plan was for prepare_fx
                data = {**data, "schema_version": SCHEMA_VERSION, "flow": data.get("flow", "fx")}
        return data

    # --- reading ------------------------------------------------------------------------
    @classmethod
    def from_json(cls, text: str) -> QuantPlan:
        """Parse a plan, turning every problem into a one-line PlanFormatError."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as error:
            raise PlanFormatError(f"plan is not valid JSON: {error}") from error
        except RecursionError as error:  # json's decoder recurses once per nesting level
            raise PlanFormatError("plan is nested too deeply to be a qlint plan") from error
        if not isinstance(raw, dict):
            raise PlanFormatError("plan must be a JSON object")
        cls._check_format(raw)  # type: ignore[operator]  # type/version first, with their own message
        try:
            return cls.model_validate(raw)
        except ValidationError as error:
            first = error.errors()[0]
            where = ".".join(str(p) for p in first.get("loc", ())) or "plan"
            raise PlanFormatError(f"bad plan at {where}: {validation_problem(first)}") from error

    @classmethod
    def load(cls, path: str) -> QuantPlan:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as error:
            raise PlanFormatError(f"cannot read plan {path}: {error.strerror}") from error
        except UnicodeDecodeError as error:
            raise PlanFormatError(f"{path} is not a qlint plan: not UTF-8 text (a plan is JSON)") from error
        try:
            return cls.from_json(text)
        except PlanFormatError as error:  # the same problem, said of the file the user named
            raise PlanFormatError(f"{printable(str(path))}: {error}") from error

    # --- exporting ------------------------------------------------------------------------
    def to_qconfig_mapping(self, *, rewritten: bool = False) -> QConfigMapping:
        """The plan's QConfigMapping for the model as given; ``rewritten=True`` for the model
        its rewrites made (``qlint fix --plan``), which also gets the decisions made for it
        (QL101's fixed ranges on convs whose BN a rewrite folds in). :meth:`quantize` does
        both steps. A pt2e plan has none: ConfigError."""
        self._refuse_pt2e("QConfigMapping")
        return qconfig_mapping(self, rewritten=rewritten)

    def _refuse_pt2e(self, what: str) -> None:
        if self.flow == "pt2e":
            raise ConfigError(
                f"this plan is for the pt2e flow (made for an exported program): it has no {what} for prepare_fx; "
                "its quantizer is QuantPlan.to_pt2e_quantizer() (qlint quantize and qlint verify of the .pt2 use it)"
            )

    def to_equalization_mapping(self, equalization_qconfig: Any = None) -> QConfigMapping:
        return to_equalization_mapping(self, equalization_qconfig)

    def to_python(self) -> str:
        """The Python file building :meth:`to_qconfig_mapping` (``qlint plan qconfig``)."""
        self._refuse_pt2e("QConfigMapping file")
        return to_python(self, self.schema_version)

    def quantize(self, model: nn.Module, calibration: Any) -> fx.GraphModule:
        """The int8 model this plan gives ``model``, built exactly as ``qlint verify`` measured it.

        A traced copy of ``model`` gets the plan's float-preserving rewrites and equalization,
        then prepare_fx with :meth:`to_qconfig_mapping`, calibration on every batch of
        ``calibration`` (tensors, tuples of positional tensors, or dicts of keyword tensors),
        convert_fx, and the plan's bias correction. ``model``, the batches and the process state are left as they were.
        Raises a one-line :class:`qlint.advice.apply.QuantizeError` when a torch step fails, or when
        a rewrite or equalization pair of the plan cannot be applied to ``model``."""
        batches = list(batches_of(calibration, "calibration data"))
        with preserved_state(model, watch_parameters=False):
            quantized = quantize_with_plan(model, self, batches)
        refuse_unapplied(quantized.rewrites)
        return quantized.converted

    def to_pt2e_quantizer(self) -> Any:
        """A torchao pt2e quantizer applying this plan (needs the extra ``qlint[pt2e]``)."""
        return to_pt2e_quantizer(self)

    def pretty(self) -> str:
        """A human-readable summary (``qlint plan show``)."""
        lines = [f"QuantPlan (schema {self.schema_version}) for {self.model or 'model'} on {self.backend}"]
        if self.flow == "pt2e":
            lines[0] += ", for the pt2e flow (prepare_pt2e with QuantPlan.to_pt2e_quantizer())"
        if self.float_by_default:
            lines.append("  everything without a module decision stays float (only the modules below are quantized)")
        else:
            lines += self._global_lines()
        if self.modules:
            lines.append("  modules:")
            for d in self.modules:
                why = "; ".join(p.describe() for p in d.provenance)
                # pt2e keeps its quantizer's number format and takes a decision's observer only
                # (a decision in another format is left out, so it is shown in full)
                observer_only = self.flow == "pt2e" and (
                    d.activation is None or d.activation.same_number_format(self.activation)
                )
                lines.append(f"    {d.fqn}: {d.describe(observer_only=observer_only)}  [{why}]")
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
                only = " (where the plan runs them dynamic)" if r.only_dynamic() else ""
                lines.append(f"    {r.kind}{only}: {', '.join(r.modules)}  [{why}]")
        if self.float_functions:
            lines.append("  functions kept float (everywhere the model calls them):")
            for kept in self.float_functions:
                why = "; ".join(p.describe() for p in kept.provenance)
                lines.append(f"    {kept.function}  [{why}]")
        if self.bias_correction is not None:
            why = "; ".join(p.describe() for p in self.bias_correction.provenance)
            lines.append(f"  bias correction after calibration  [{why}]")
        if self.notes:
            lines.append("  notes:")
            lines += [f"    {n}" for n in self.notes]
        return "\n".join(printable(line) for line in lines) + "\n"  # names from the file, shown literally

    def _global_lines(self) -> list[str]:
        """The global activation and weight specs the plan's flow quantizes with: a pt2e plan's are
        its quantizer's (torchao's X86InductorQuantizer), not the plan's prepare_fx ones."""
        if self.flow == "fx":
            activation, weight = self.activation.describe(), self.weight.describe()
        else:
            try:
                activation, weight = pt2e_global_specs(self)
            except ConfigError as error:
                return [f"  global: the pt2e quantizer's own number format (not shown: {error})"]
        return [f"  global activation: {activation}", f"  global weight:     {weight}"]


# --- building plans ----------------------------------------------------------------------


def default_plan(backend: str = "x86", model: str | None = None) -> QuantPlan:
    activation, weight = backend_defaults(backend)
    return QuantPlan(backend=backend, model=model, activation=activation, weight=weight)


def plan_from_report(report: Report) -> QuantPlan:
    """The plan that the report's findings call for: backend defaults plus each suggestion, for the
    pt2e flow when the model was an exported program (its findings were measured with it)."""
    flow: Flow = "pt2e" if exported_frontend(report.frontend) else "fx"
    return QuantPlan(**dict(report.suggestions()), flow=flow)


__all__ = [
    "ActivationSpec",
    "BiasCorrection",
    "EqualizationPair",
    "FloatFunction",
    "ModuleDecision",
    "PlanFormatError",
    "Provenance",
    "QuantPlan",
    "Rewrite",
    "WeightSpec",
    "default_plan",
    "plan_from_report",
]
