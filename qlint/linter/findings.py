"""Typed results of a lint run: findings, skipped rules, timings and the report.

Everything here is a frozen pydantic v2 model so that a report survives a JSON
round trip unchanged (``Report.model_validate_json(r.model_dump_json()) == r``)
and so that reporters never have to guess at the shape of what rules produced.
"""

from __future__ import annotations

import enum
from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator


class Severity(str, enum.Enum):
    ERROR = "error"
    WARNING = "warning"
    INFO = "info"

    @property
    def rank(self) -> int:
        return _SEVERITY_RANK[self]

    def at_least(self, other: "Severity") -> bool:
        return self.rank >= other.rank


_SEVERITY_RANK = {Severity.INFO: 0, Severity.WARNING: 1, Severity.ERROR: 2}


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


def _check_json_able(value: Any, path: str = "data") -> None:
    """Reject values that would not survive a JSON round trip unchanged."""
    if value is None or isinstance(value, (str, bool, int)):
        return
    if isinstance(value, float):
        # NaN and Inf are not JSON; rules encode them as strings ("nan", "inf").
        if value != value or value in (float("inf"), float("-inf")):
            raise ValueError(f"{path} holds a non-finite float; store it as a string")
        return
    if isinstance(value, list):
        for i, item in enumerate(value):
            _check_json_able(item, f"{path}[{i}]")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ValueError(f"{path} has a non-string key {key!r}")
            _check_json_able(item, f"{path}.{key}")
        return
    raise ValueError(f"{path} holds {type(value).__name__}, which is not JSON-able")


class Finding(_Frozen):
    """One problem found by one rule, at one place in the model."""

    rule: str = Field(description="Stable rule code, such as QL101.")
    name: str = Field(description="Kebab-case rule name, such as unfused-pattern.")
    severity: Severity
    target: str = Field(description="Module fqn, or node name for functional ops.")
    message: str = Field(description="What is wrong, why it matters, and the fix.")
    data: dict[str, Any] = Field(default_factory=dict, description="JSON-able evidence.")
    suggestion: Optional[dict[str, Any]] = Field(
        default=None, description="Machine-readable fix, consumed when building a plan."
    )

    @field_validator("data", "suggestion")
    @classmethod
    def _json_able(cls, value: Any) -> Any:
        if value is not None:
            _check_json_able(value)
        return value

    def fingerprint(self) -> str:
        """A stable identity for baselines: rule, target and the finding's kind."""
        import hashlib

        kind = str(self.data.get("kind", ""))
        raw = f"{self.rule}|{self.target}|{kind}"
        return hashlib.sha256(raw.encode()).hexdigest()[:16]


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


class LayerRow(_Frozen):
    """One row of a per-layer table (data rules, compare)."""

    name: str
    kind: Optional[str] = None
    rule: Optional[str] = None
    statistic: Optional[str] = None
    value: Optional[float] = None
    verdict: Optional[str] = None
    weight_sqnr: Optional[float] = None
    sqnr_propagated: Optional[float] = None
    sqnr_shadow: Optional[float] = None
    cosine: Optional[float] = None
    extra: dict[str, Any] = Field(default_factory=dict)

    @field_validator("extra")
    @classmethod
    def _json_able(cls, value: Any) -> Any:
        _check_json_able(value, "extra")
        return value


class QConfigRow(_Frozen):
    """The resolved quantization intent of one graph node, as check_qat_model prints it."""

    node: str
    target: str
    kind: str
    quantized: bool
    input_dtype: Optional[str] = None
    output_dtype: Optional[str] = None
    weight_dtype: Optional[str] = None
    activation_observer: Optional[str] = None
    weight_observer: Optional[str] = None
    weight_qscheme: Optional[str] = None
    ch_axis: Optional[int] = None


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
    layers: list[LayerRow] = Field(default_factory=list)
    qconfig_table: list[QConfigRow] = Field(default_factory=list)

    def plan(self):
        """The quantization plan these findings call for (see qlint.advice.plan)."""
        from qlint.advice.plan import plan_from_report

        return plan_from_report(self)

    def qconfig_mapping(self):
        """Shortcut: ``report.plan().to_qconfig_mapping()``."""
        return self.plan().to_qconfig_mapping()

    def by_rule(self, code: str) -> list[Finding]:
        return [f for f in self.findings if f.rule == code or f.name == code]

    def worst_severity(self) -> Optional[Severity]:
        if not self.findings:
            return None
        return max((f.severity for f in self.findings), key=lambda s: s.rank)

    def has_findings_at_least(self, threshold: Severity) -> bool:
        return any(f.severity.at_least(threshold) for f in self.findings)
