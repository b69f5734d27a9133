"""The worst inputs of a comparison, as every report shows them (``qlint compare --badcases``).

``qlint.numeric.badcases`` finds them; this module holds what the text, JSON and HTML reports
show of them, so that the three agree and decide nothing: per metric the worst samples, with
the output that scored worst where the model has several, and the comparison rerun on them.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from qlint.linter.findings import Report

BadCaseMetric = Literal["sqnr", "cosine", "l1", "max_abs"]

# metric -> (what it is, True when a larger value is worse). Each is taken per sample on every
# floating-point output of the model, and a sample scores its worst output's value.
METRICS: dict[BadCaseMetric, tuple[str, bool]] = {
    "sqnr": ("output SQNR (lower is worse)", False),
    "cosine": ("output cosine similarity (lower is worse)", False),
    "l1": ("mean absolute output error", True),
    "max_abs": ("largest absolute output error", True),
}


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class WorstInput(_Frozen):
    sample: int = Field(description="The sample's position in the data (batch order, then row).")
    value: float
    output: str | None = Field(
        default=None,
        description="The output that scored worst on this sample (output[1]: the second of a tuple), whose value "
        "this is; None for a file saved before outputs were named.",
    )


class WorstInputsOfMetric(_Frozen):
    metric: BadCaseMetric
    description: str
    cases: list[WorstInput] = Field(default_factory=list, description="Worst first.")


class BadCaseSummary(_Frozen):
    """What ``--badcases`` found and what the comparison on those inputs alone shows."""

    samples_seen: int
    outputs: list[str] = Field(
        default_factory=list,
        description="The floating-point outputs every sample was scored on (each metric per output; a sample "
        "scores its worst output's value).",
    )
    worst: list[WorstInputsOfMetric] = Field(default_factory=list)
    saved_to: str | None = Field(default=None, description="The file the worst inputs were saved to.")
    report: Report = Field(description="compare rerun on the distinct worst inputs, each a batch of one.")

    @property
    def several_outputs(self) -> bool:
        """Whether the model has more than one scored output: the reports then name each case's."""
        return len(self.outputs) > 1

    @property
    def distinct_samples(self) -> int:
        return len({case.sample for metric in self.worst for case in metric.cases})


__all__ = ["METRICS", "BadCaseMetric", "BadCaseSummary", "WorstInput", "WorstInputsOfMetric"]
