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

Deserialising refuses an unknown ``type`` or a newer ``schema_version`` with a
:class:`PlanFormatError` (a ConfigError: one line, CLI exit 2).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Final, Literal

import torch.fx as fx
import torch.nn as nn
from pydantic import ValidationError, model_validator
from torch.ao.quantization import QConfigMapping

from qlint.advice.apply import quantize_with_plan
from qlint.advice.export import to_equalization_mapping, to_python
from qlint.advice.pt2e import to_pt2e_quantizer
from qlint.core.batches import batches_of
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
SCHEMA_VERSION = 1


class PlanFormatError(ConfigError):
    """A plan file this qlint cannot read: wrong type, newer schema, or bad content."""


class QuantPlan(Suggestions):
    """The whole plan. Build with :func:`plan_from_report` or by hand; export with ``to_*``."""

    type: Literal["qlint.QuantPlan"] = PLAN_TYPE
    schema_version: int = SCHEMA_VERSION

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
        both steps."""
        return qconfig_mapping(self, rewritten=rewritten)

    def to_equalization_mapping(self, equalization_qconfig: Any = None) -> QConfigMapping:
        return to_equalization_mapping(self, equalization_qconfig)

    def to_python(self) -> str:
        return to_python(self, self.schema_version)

    def quantize(self, model: nn.Module, calibration: Any) -> fx.GraphModule:
        """The int8 model this plan gives ``model``, built exactly as ``qlint verify`` measured it.

        A traced copy of ``model`` gets the plan's float-preserving rewrites and equalization,
        then prepare_fx with :meth:`to_qconfig_mapping`, calibration on every batch of
        ``calibration`` (tensors, tuples of positional tensors, or dicts of keyword tensors),
        convert_fx, and the plan's bias correction. ``model``, the batches and the process state are left as they were.
        Raises a one-line :class:`qlint.advice.apply.QuantizeError` when a torch step fails."""
        batches = list(batches_of(calibration, "calibration data"))
        with preserved_state(model, watch_parameters=False):
            return quantize_with_plan(model, self, batches).converted

    def to_pt2e_quantizer(self) -> Any:
        """A torchao pt2e quantizer applying this plan (needs the extra ``qlint[pt2e]``)."""
        return to_pt2e_quantizer(self)

    def pretty(self) -> str:
        """A human-readable summary (``qlint plan show``)."""
        lines = [
            f"QuantPlan (schema {self.schema_version}) for {self.model or 'model'} on {self.backend}",
            f"  global activation: {self.activation.describe()}",
            f"  global weight:     {self.weight.describe()}",
        ]
        if self.float_by_default:
            lines[1:3] = ["  everything without a module decision stays float (only the modules below are quantized)"]
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


# --- building plans ----------------------------------------------------------------------


def default_plan(backend: str = "x86", model: str | None = None) -> QuantPlan:
    activation, weight = backend_defaults(backend)
    return QuantPlan(backend=backend, model=model, activation=activation, weight=weight)


def plan_from_report(report: Report) -> QuantPlan:
    """The plan that the report's findings call for: backend defaults plus each suggestion."""
    return QuantPlan(**dict(report.suggestions()))


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
