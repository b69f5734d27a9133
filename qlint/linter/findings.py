"""Typed results of a lint run: findings, skipped rules, timings and the report.

Everything here is a frozen pydantic v2 model so that a report survives a JSON
round trip unchanged (``Report.model_validate_json(r.model_dump_json()) == r``)
and so that reporters never have to guess at the shape of what rules produced.
"""

from __future__ import annotations

import copy
import enum
import hashlib
import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator
from torch.ao.quantization import QConfigMapping
from torch.ao.quantization.backend_config import BackendConfig

from qlint.core import backends
from qlint.core.sqnr import BatchPowers, steady_gain_db
from qlint.linter.fixes import Fix
from qlint.linter.json_values import check_json_able
from qlint.linter.mapping import qconfig_mapping
from qlint.linter.suggestions import Provenance, Suggestions
from qlint.linter.suggestions_from_fixes import collect_suggestions


class Severity(str, enum.Enum):
    ERROR = "error"
    WARNING = "warning"
    INFO = "info"

    @property
    def rank(self) -> int:
        return _SEVERITY_RANK[self]

    def at_least(self, other: Severity) -> bool:
        return self.rank >= other.rank


_SEVERITY_RANK = {Severity.INFO: 0, Severity.WARNING: 1, Severity.ERROR: 2}


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


ImpactBasis = Literal[
    "fix-trial",
    "keep-float-trial",
    "already-float",
    "group-trial",
    "rule-trial",
    "not-executed",
    "stays-float",
    "local-error",
]
# The bases for which a trial applied the finding's own fix and measured what it gains.
FIX_MEASURED_BASES: frozenset[str] = frozenset({"fix-trial", "group-trial", "rule-trial"})


class Impact(_Frozen):
    """What a finding costs, in output SQNR (dB) of the trial-quantized model.

    ``fix-trial``: the model was quantized again with the finding's fix applied, and
    ``db`` is the output SQNR it gained. ``keep-float-trial``: the finding's fix is not a
    qconfig change (a rewrite of the float model), so the target was kept float instead:
    ``db`` is what quantizing the target costs, the most any fix of it can recover.
    ``already-float``: the trial already runs the target in float, so keeping it float changes
    nothing (0 dB, no trial); that bounds no fix (one may quantize the target, or act on its
    producer's observer). ``group-trial``: past the budget of single trials, the finding's fix was measured
    together with the fixes of other findings of the same rule (split in halves while the
    group gains enough to matter): ``db`` is what the group gains; the finding's own share
    is at most that when the fixes do not interact. ``rule-trial``: the rule measured it itself (e.g. QL106's dynamic
    quantization). ``not-executed``: the target never runs, so quantizing it cannot
    change the output (0 dB). ``stays-float``: the flow leaves the target float whatever its
    settings (under pt2e: a conv1d, a recurrent op, a conv2d of a custom module class until the
    model is rewritten), so no fix of its quantization changes the int8 model (0 dB; QL106 says
    why it stays float). ``local-error``: no trial can
    express the fix; ``db`` is estimated from the layer's own (shadow) error and the output error
    (docs/architecture.md, "Impact").

    ``kind`` is ``coverage`` for a fix that quantizes what stayed float (QL106): it buys
    int8 speed and size, so ``db`` is the output SQNR it costs (usually negative) and the
    impact threshold does not apply; ``int8_ops_gained`` says what it buys. ``diagnosis``
    is a finding about the model as a whole (QL105's low output SQNR): ``db`` is what the
    best single fix tried recovers, and the finding stands whatever it is.

    ``db`` is always a gain, never an absolute SQNR: for a fix that makes a model that fails as
    intended run (QL105's workaround) there is no SQNR to gain from, so ``db`` and
    ``base_sqnr_db`` are None and ``fixed_sqnr_db`` is the SQNR it runs at ("fails → X dB").
    """

    db: float | None = Field(
        description="Output SQNR recovered by the fix (dB); negative when the fix hurts; null when the model "
        "fails as intended and the fix makes it run (no SQNR to gain from: fixed_sqnr_db is what it runs at)."
    )
    basis: ImpactBasis
    kind: Literal["sqnr-gain", "coverage", "diagnosis"] = "sqnr-gain"
    int8_ops_gained: int = 0
    base_sqnr_db: float | None = Field(default=None, description="Output SQNR of the trial as intended.")
    fixed_sqnr_db: float | None = Field(default=None, description="Output SQNR with the fix applied.")
    steady_db: float | None = Field(
        default=None,
        description="The gain with the evaluation batch that gains most left out (the smallest such gain); "
        "below the threshold, the gain rests on one batch and the finding is info. None with one batch.",
    )
    detail: str = ""

    def ranked_db(self) -> float:
        """``db`` to rank and compare by: a fix that makes a failing model run (``db`` None) ranks
        above any gain, as a plan's provenance credits it (``Provenance.credited_db``)."""
        return math.inf if self.db is None else self.db

    @classmethod
    def measured(
        cls,
        base_sqnr_db: float,
        fixed_sqnr_db: float,
        basis: ImpactBasis,
        detail: str,
        *,
        kind: Literal["sqnr-gain", "coverage", "diagnosis"] = "sqnr-gain",
        int8_ops_gained: int = 0,
        steady_db: float | None = None,
    ) -> Impact:
        """The impact of a fix measured in a trial: the output SQNR it gains (rounded to 1e-3 dB)."""
        return cls(
            db=round(fixed_sqnr_db - base_sqnr_db, 3),
            basis=basis,
            kind=kind,
            int8_ops_gained=int8_ops_gained,
            base_sqnr_db=round(base_sqnr_db, 3),
            fixed_sqnr_db=round(fixed_sqnr_db, 3),
            steady_db=None if steady_db is None else round(steady_db, 3),
            detail=detail,
        )

    @classmethod
    def between(
        cls,
        base: BatchPowers | None,
        fixed: BatchPowers | None,
        basis: ImpactBasis,
        detail: str,
        *,
        kind: Literal["sqnr-gain", "coverage", "diagnosis"] = "sqnr-gain",
        int8_ops_gained: int = 0,
    ) -> Impact | None:
        """The impact between two trials' outputs, per evaluation batch: the gain over all of
        them and without the batch that gains most (``steady_db``); None when either SQNR is undefined."""
        before = base.sqnr_db() if base is not None else None
        after = fixed.sqnr_db() if fixed is not None else None
        if base is None or fixed is None or before is None or after is None:
            return None
        steady = steady_gain_db(base, fixed)
        return cls.measured(before, after, basis, detail, kind=kind, int8_ops_gained=int8_ops_gained, steady_db=steady)

    def rests_on_one_batch(self, threshold: float) -> bool:
        """The gain reaches ``threshold`` over all evaluation batches, but not without the one
        that gains most: noise of that batch, which held-out data does not repeat."""
        return self.ranked_db() >= threshold and self.steady_db is not None and self.steady_db < threshold


class Finding(_Frozen):
    """One problem found by one rule, at one place in the model."""

    rule: str = Field(description="Stable rule code, such as QL101.")
    name: str = Field(description="Kebab-case rule name, such as unfused-pattern.")
    severity: Severity
    target: str = Field(description="Module fqn, or node name for functional ops.")
    message: str = Field(description="What is wrong, why it matters, and the fix.")
    data: dict[str, Any] = Field(default_factory=dict, description="JSON-able evidence.")
    suggestion: Fix | None = Field(
        default=None, description="The typed fix (qlint.linter.fixes), consumed when building a plan."
    )
    impact: Impact | None = Field(default=None, description="The measured cost of the finding.")

    @field_validator("data")
    @classmethod
    def _json_able(cls, value: Any) -> Any:
        if value is not None:
            check_json_able(value)
        return value

    def __str__(self) -> str:
        return f"{self.severity.value} {self.rule} {self.target}: {self.message}"

    def fingerprint(self) -> str:
        """A stable identity for baselines: rule, target and the finding's kind."""
        kind = str(self.data.get("kind", ""))
        raw = f"{self.rule}|{self.target}|{kind}"
        return hashlib.sha256(raw.encode()).hexdigest()[:16]

    def provenance(self) -> Provenance:
        """This finding as the reason for a plan decision."""
        return Provenance(
            source="finding",
            rule=self.rule,
            target=self.target,
            fingerprint=self.fingerprint(),
            detail=self.name,
            **self._measured_gain(),
        )

    def _measured_gain(self) -> dict[str, Any]:
        """The provenance fields of what the fix measured: its gain, or, for a fix that makes a
        failing int8 model run, the SQNR it then runs at (there is no SQNR to gain from)."""
        impact = self.impact
        if impact is None or not self.fix_measured():
            return {}
        if impact.base_sqnr_db is None and impact.fixed_sqnr_db is not None:
            return {"metric": "output SQNR of the int8 model the fix makes run", "value": impact.fixed_sqnr_db}
        return {"gain_db": impact.db}

    def fix_measured(self) -> bool:
        """Whether a trial applied this finding's fix (alone or in a group) and measured the gain."""
        return self.impact is not None and self.impact.basis in FIX_MEASURED_BASES

    def recovers_output_sqnr(self) -> bool:
        """A warning or error whose impact is an output-SQNR gain above 0 (measured with its fix, or
        with its target kept float, or estimated where no trial applies), or for a diagnosis (QL105)
        the best single fix it tried. These are the fixes the report applies together."""
        return (
            self.severity is not Severity.INFO
            and self.impact is not None
            and self.impact.kind in ("sqnr-gain", "diagnosis")
            and self.impact.ranked_db() > 0
        )

    def fix_measured_useless(self) -> bool:
        """The fix cannot change the int8 model (its target stays float whatever its settings:
        ``stays-float``), or it gained too little to stay a warning (it was made info) when it
        was applied, when its target was kept float (the most any fix of it recovers), or on the
        estimate that made it info where no trial could apply it (``local-error``)."""
        if self.impact is None:
            return False
        if self.impact.basis == "stays-float":
            return True
        bounded = self.fix_measured() or self.impact.basis in ("keep-float-trial", "local-error")
        return bounded and self.severity == Severity.INFO


class SkippedRule(_Frozen):
    rule: str
    name: str
    reason: str
    crashed: bool = Field(default=False, description="The rule raised an error: the analysis is incomplete.")


class Timing(_Frozen):
    stage: str
    seconds: float


class Notice(_Frozen):
    """Something the user should know about the run itself, not about the model."""

    level: Severity = Severity.INFO
    message: str


class _Row(_Frozen):
    """One row of a per-layer table: a layer (module fqn or node name), its op kind, evidence."""

    name: str
    kind: str | None = None
    extra: dict[str, Any] = Field(default_factory=dict)

    @field_validator("extra")
    @classmethod
    def _json_able(cls, value: Any) -> Any:
        check_json_able(value, "extra")
        return value


class LayerRow(_Row):
    """One row of a data rule's per-layer table: the statistic it measured on one layer."""

    rule: str | None = None
    statistic: str | None = None
    value: float | None = None
    verdict: str | None = None
    table: Literal["lint"] = "lint"


class InputQuantization(_Frozen):
    """How the quantized model quantizes the input of a layer no other layer feeds (the model's
    input), measured by putting the float layer's input on that grid."""

    sqnr: float | None = Field(
        description="SQNR (dB) of the float input after this input quantization: what it alone costs."
    )
    match_sqnr: float | None = Field(
        description="SQNR (dB) of the quantized layer's real input against the float input put on the grid: "
        "exact (or close) when the two models' inputs differ by this input quantization only; low when the "
        "quantized model was fed other values (built from another float model, a rewrite before the layer)."
    )
    low: float = Field(description="The lowest value of the grid.")
    high: float = Field(description="The highest value of the grid.")
    step: float = Field(description="The grid's step (scale).")
    clipped: float = Field(description="Fraction of the input values more than half a step outside [low, high].")
    data_min: float = Field(description="The smallest float input value seen.")
    data_max: float = Field(description="The largest float input value seen.")


class CompareRow(_Row):
    """One row of ``qlint compare``: the error one matched layer shows, float vs quantized (dB)."""

    weight_sqnr: float | None = None
    weight_off_grid: float | None = Field(
        default=None,
        description="Fraction of the int8 weights more than one step from the rounding of the float weights on the "
        "layer's own grid (above a few percent: made from another float model); None without int8 weight tensors.",
    )
    sqnr_propagated: float | None = None
    sqnr_shadow: float | None = None
    cosine: float | None = Field(
        default=None, description="Cosine similarity of the comparison ``error_mode`` names (the stream as one vector)."
    )
    error_mode: Literal["propagated", "shadow"] | None = Field(
        default=None,
        description="Which comparison ``cosine`` and the error columns of the tables (max |err|, RMSE/scale: "
        "``extra[error_mode]``) measure: propagated when it was run, else shadow; None when neither has values.",
    )
    functional: bool = Field(
        default=False, description="A functional op of the graph (``x * mask``), not a module: no fqn to keep float."
    )
    function: str | None = Field(
        default=None,
        description="A functional op's function by its public path (operator.mul, torch.matmul), as a plan keeps "
        "it float; None for a module or a function without one (a tensor method).",
    )
    input_quantization: InputQuantization | None = Field(
        default=None,
        description="For a layer fed by the model's inputs, the quantized model's quantization of that input; "
        "None for other layers, or where the quantized layer's input is not on a per-tensor grid.",
    )
    module: str | None = Field(
        default=None,
        description="The float module this row measures (its fqn; one call of it when ``call`` is set), which a "
        "keep-float or qconfig fix names: such a fix changes every call of the module. None for a functional op.",
    )
    call: int | None = Field(
        default=None,
        description="For a module the model calls ``calls`` times, which call this row measures (0: the first); "
        "the row is then named by that call's FX node (act, act_1). None: the row covers every call.",
    )
    calls: int = Field(
        default=1,
        description="How many times the float model calls the module; above 1 with ``call`` None, the row pools "
        "every call (a model compare could not follow call by call).",
    )
    table: Literal["compare"] = "compare"


# A report's per-layer rows; ``table`` says which table a row belongs to.
Row = Annotated[LayerRow | CompareRow, Field(discriminator="table")]


class RuleInfo(_Frozen):
    """A rule of the run, described well enough to document it (SARIF lists these)."""

    code: str
    name: str
    summary: str
    severity: Severity
    requires: list[str] = Field(default_factory=list)
    documentation: str = Field(default="", description="The rule's full documentation, markdown.")


class QConfigRow(_Frozen):
    """The resolved quantization intent of one graph node, as check_qat_model prints it."""

    node: str
    target: str
    kind: str
    quantized: bool
    input_dtype: str | None = None
    output_dtype: str | None = None
    weight_dtype: str | None = None
    activation_observer: str | None = None
    weight_observer: str | None = None
    weight_qscheme: str | None = None
    ch_axis: int | None = None


class TrialSummary(_Frozen):
    """The trial quantization of a lint run: what torch builds from the intent, measured."""

    backend: str
    calibrated_on: str
    evaluated_on: str
    converted: bool
    failed_stage: str | None = None
    workaround: str | None = Field(
        default=None, description="How the numbers were measured when the intended model fails (e.g. .view → .reshape)"
    )
    output_sqnr_db: float | None = None
    output_tensor_sqnr_db: list[float | None] | None = Field(
        default=None,
        description="Per floating-point output tensor, when the output holds several: output_sqnr_db pools their "
        "signal and noise powers, so the largest tensor weighs most.",
    )
    int8_ops: int = 0
    weighted_ops: int = 0
    float_layers: list[str] = Field(default_factory=list)
    fixed_sqnr_db: float | None = Field(default=None, description="Output SQNR with every warning's fix.")
    recoverable_db: float | None = Field(default=None, description="fixed_sqnr_db - output_sqnr_db.")
    fix_trials: int = 0
    seconds: float = 0.0


class Report(_Frozen):
    qlint_version: str
    torch_version: str
    model: str
    backend: str
    frontend: str
    findings: list[Finding] = Field(default_factory=list)
    skipped: list[SkippedRule] = Field(default_factory=list)
    notices: list[Notice] = Field(default_factory=list)
    timings: list[Timing] = Field(default_factory=list)
    layers: list[Row] = Field(default_factory=list)
    qconfig_table: list[QConfigRow] = Field(default_factory=list)
    rules: list[RuleInfo] = Field(default_factory=list, description="The rules of this run, ran or skipped.")
    trial: TrialSummary | None = Field(default=None, description="The trial quantization, when one ran.")
    # The QConfigMapping the model was linted with, when the caller gave one: the fixes were
    # measured on top of it. Held in this process only (a mapping holds code, not JSON).
    _linted_mapping: QConfigMapping | None = PrivateAttr(default=None)

    def __eq__(self, other: object) -> bool:
        """Equal fields (the report JSON holds); the mapping kept in this process is not compared."""
        if not isinstance(other, Report):
            return NotImplemented
        return self.__dict__ == other.__dict__

    __hash__ = None  # type: ignore[assignment]  # a report holds lists: it was never hashable

    def linted_with(self, mapping: QConfigMapping | None) -> Report:
        """This report, remembering (a copy of) the mapping it was linted with (see :meth:`qconfig_mapping`)."""
        report = self.model_copy()
        report._linted_mapping = copy.deepcopy(mapping)
        return report

    # print(report) and a notebook's echo: pydantic's field-by-field repr of a report runs to pages.
    def __repr__(self) -> str:
        counts = ", ".join(f"{sum(f.severity is s for f in self.findings)} {s.value}" for s in Severity)
        return f"Report(model={self.model!r}, backend={self.backend!r}, findings: {counts}, layers: {len(self.layers)})"

    def __str__(self) -> str:
        """One line per finding, worst first (the CLI's tables and the JSON are qlint.render's)."""
        ordered = sorted(self.findings, key=lambda f: -f.severity.rank)
        return "\n".join([repr(self), *(f"  {finding}" for finding in ordered)])

    def lint_rows(self) -> list[LayerRow]:
        return [row for row in self.layers if isinstance(row, LayerRow)]

    def compare_rows(self) -> list[CompareRow]:
        return [row for row in self.layers if isinstance(row, CompareRow)]

    def suggestions(self) -> Suggestions:
        """What the findings ask for, as typed decisions (qlint.advice.plan makes a plan file of them).

        A fix that a trial measured and found to gain less than the impact threshold (its
        finding was made info) is left out: it would only cost verify a trial to drop it. So is
        a fix of a target the flow leaves float whatever its settings: it changes nothing. A fix
        that changes a Linear only where the plan runs it dynamic stays: it changes nothing
        under the mapping linted with, and its rule offers it for verify's scheme search, which
        makes Linears dynamic (QL205's token split: +3.4 dB on MiniLM once they are)."""
        return collect_suggestions(
            self.backend,
            self.model,
            (
                (f.suggestion, f.provenance())
                for f in self.findings
                if f.suggestion and (not f.fix_measured_useless() or f.suggestion.applies_only_when_dynamic())
            ),
        )

    def qconfig_mapping(self, *, rewritten: bool = False) -> QConfigMapping:
        """The QConfigMapping the findings call for: their suggestions applied to the mapping the
        model was linted with (``qlint.lint(..., qconfig_mapping=...)``, whose settings the fixes
        were measured on), or to the backend default without one and for a report read back
        from JSON, which cannot hold a mapping. Rewrites and equalization are not expressible in
        a QConfigMapping: ``qlint.advice.plan.plan_from_report(report).quantize(...)`` applies them.

        It is for the model as linted: a fix that needs a rewrite first (QL101's fixed range on
        a functional conv whose BN it folds in) is left out, since on the model as given its
        module name reaches other values. ``rewritten=True`` gives the mapping for the model
        the rewrites made (``qlint fix MODEL --plan PLAN``), those fixes included.

        Pass :meth:`backend_config` to prepare_fx with it: the fixes were measured with it."""
        return qconfig_mapping(self.suggestions(), base=self._linted_mapping, rewritten=rewritten)

    def backend_config(self) -> BackendConfig:
        """torch's BackendConfig for the report's backend, which the trial and every fix trial
        quantized with: ``prepare_fx(model, report.qconfig_mapping(), example_inputs,
        backend_config=report.backend_config())`` builds what was measured. prepare_fx's own
        default, the native config, fuses and quantizes other patterns (MiniLM's QL105 fix gains
        +5.5 dB with the x86 config, +1.3 dB without)."""
        return backends.backend_config(self.backend)

    def by_rule(self, code: str) -> list[Finding]:
        return [f for f in self.findings if f.rule == code or f.name == code]

    def worst_severity(self) -> Severity | None:
        if not self.findings:
            return None
        return max((f.severity for f in self.findings), key=lambda s: s.rank)

    def has_findings_at_least(self, threshold: Severity) -> bool:
        return any(f.severity.at_least(threshold) for f in self.findings)
