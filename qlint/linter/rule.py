"""The Rule base class, the needs a rule declares, and rule examples.

A rule is one class in one file: stable ``code`` and kebab-case ``name``, a
``summary``, a default ``severity``, a frozen ``Options`` model and one method,
``check(ctx)``. Its docstring has fixed sections (What it does / Why is this bad? /
Example / Use instead / Options / References), from which ``qlint rule CODE``
and docs/rules/ are generated.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from pydantic import BaseModel, ConfigDict

from qlint.linter.findings import Finding, Impact, LayerRow, Severity
from qlint.linter.fixes import Fix, as_fix

if TYPE_CHECKING:
    from qlint.linter.context import LintContext

DOC_SECTIONS = ("What it does", "Why is this bad?", "Example", "Use instead", "Options", "References")
CODE_PATTERN = re.compile(r"^[A-Z]{1,6}[0-9]{3,4}$")
NAME_PATTERN = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")


class Need(str, enum.Enum):
    """What a rule needs from the context; a rule whose needs are unmet is skipped."""

    GRAPH = "graph"
    QCONFIG = "qconfig"
    EXAMPLE_INPUTS = "example inputs"
    STATISTICS = "calibration statistics"
    MODEL = "a runnable copy of the model"
    TRIAL = "a trial quantization"


@dataclasses.dataclass(frozen=True)
class ObservationSpec:
    """A tensor point a data rule needs statistics for, declared on the rule class.

    The engine resolves each spec against the graph (every op whose kind is in
    ``kinds``) and inserts exactly one observer per distinct (node, side, index,
    channel_axis) point, shared by every rule that asks for it.
    ``channel_axis="features"`` means axis 1 for conv inputs and the last axis for
    linear inputs; None means per-tensor statistics only. ``percentile`` and
    ``histogram`` ask for the two costly statistics, ``moments`` for per-channel
    sums and sums of squares (mean, variance); min/max, ranges and NaN/Inf counts
    are always there.
    """

    kinds: frozenset[str]
    side: str  # "input" or "output"
    index: int = 0
    channel_axis: Any = 1
    percentile: bool = False
    histogram: bool = False
    moments: bool = False


class RuleOptions(BaseModel):
    """Base for every rule's Options: immutable, and unknown keys are errors."""

    model_config = ConfigDict(frozen=True, extra="forbid")


@dataclasses.dataclass(frozen=True)
class Example:
    """A small model that a rule must pass (VALID) or flag (INVALID).

    ``flagged`` lists targets an INVALID example must name; empty means "any finding".
    """

    description: str
    build: Callable[[], Any]
    inputs: Callable[[], tuple[Any, ...]]
    qconfig_mapping: Callable[[], Any] | None = None
    backend: str = "x86"
    calibration: Callable[[], Sequence[Any]] | None = None
    flagged: tuple[str, ...] = ()
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def seeded(model_class: Callable[..., Any], *args: Any) -> Callable[[], Any]:
    """An example's ``build``: ``model_class(*args)`` in eval mode, its parameters drawn from seed 0
    without touching the process's random state."""

    def build() -> Any:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            return model_class(*args).eval()

    return build


class Rule:
    """Base class of all rules. Subclasses set the class attributes and implement check."""

    code: ClassVar[str]
    name: ClassVar[str]
    summary: ClassVar[str]
    severity: ClassVar[Severity] = Severity.WARNING
    requires: ClassVar[frozenset[Need]] = frozenset({Need.GRAPH})
    Options: ClassVar[type[RuleOptions]] = RuleOptions
    observes: ClassVar[tuple[ObservationSpec, ...]] = ()
    VALID: ClassVar[Sequence[Example]] = ()
    INVALID: ClassVar[Sequence[Example]] = ()

    def __init__(self, options: RuleOptions | None = None) -> None:
        self.options = options if options is not None else self.Options()

    def check(self, ctx: LintContext) -> Iterable[Finding | LayerRow]:
        """Yield findings. Data rules also yield one ``LayerRow`` per layer they measured
        (whether it fires or not): the report's per-layer table."""
        raise NotImplementedError

    def finding(
        self,
        target: str,
        message: str,
        *,
        data: dict[str, Any] | None = None,
        suggestion: Fix | dict[str, Any] | None = None,
        severity: Severity | None = None,
        impact: Impact | None = None,
    ) -> Finding:
        return Finding(
            rule=self.code,
            name=self.name,
            severity=severity or self.severity,
            target=target,
            message=message,
            data=data or {},
            suggestion=None if suggestion is None else as_fix(suggestion),
            impact=impact,
        )

    @classmethod
    def examples(cls) -> tuple[Sequence[Example], Sequence[Example]]:
        """(VALID, INVALID): class attributes, else the module-level lists in the rule's file."""
        import sys

        module = sys.modules.get(cls.__module__)
        valid = cls.VALID or getattr(module, "VALID", ())
        invalid = cls.INVALID or getattr(module, "INVALID", ())
        return tuple(valid), tuple(invalid)

    @classmethod
    def doc_sections(cls) -> dict[str, str]:
        return parse_doc_sections(cls.__doc__ or "")


def parse_doc_sections(doc: str) -> dict[str, str]:
    """Split a rule docstring into its '## Section' blocks (markdown headings)."""
    import inspect

    text = inspect.cleandoc(doc)
    sections: dict[str, str] = {}
    current: str | None = None
    lines: list[str] = []
    for line in text.splitlines():
        heading = re.match(r"^##\s+(.+?)\s*$", line)
        if heading:
            if current is not None:
                sections[current] = "\n".join(lines).strip()
            current, lines = heading.group(1), []
        elif current is not None:
            lines.append(line)
    if current is not None:
        sections[current] = "\n".join(lines).strip()
    return sections


def validate_rule_class(cls: type) -> list[str]:
    """Problems that make a class unusable as a rule; empty when it is fine."""
    problems = []
    if not (isinstance(cls, type) and issubclass(cls, Rule)):
        return [f"{cls!r} is not a qlint Rule subclass"]
    for attr in ("code", "name", "summary"):
        if not isinstance(getattr(cls, attr, None), str):
            problems.append(f"missing class attribute {attr!r}")
    if problems:
        return problems
    if not CODE_PATTERN.match(cls.code):
        problems.append(f"code {cls.code!r} must look like QL101")
    if not NAME_PATTERN.match(cls.name):
        problems.append(f"name {cls.name!r} must be kebab-case")
    if not isinstance(cls.severity, Severity):
        problems.append("severity must be a qlint Severity")
    options = cls.Options
    if not (isinstance(options, type) and issubclass(options, BaseModel)):
        problems.append("Options must be a pydantic model")
    elif not (options.model_config.get("frozen") and options.model_config.get("extra") == "forbid"):
        problems.append("Options must be frozen with extra='forbid'")
    missing = [s for s in DOC_SECTIONS if s not in cls.doc_sections()]
    if missing:
        problems.append(f"docstring lacks sections: {', '.join(missing)}")
    return problems
