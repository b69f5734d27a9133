"""How the numeric suite's tables and charts write an SQNR value.

An error-free stream has infinite SQNR, and a stream whose float side is all zeros has
none; reports hold finite numbers, so both are stored at the cap (``+-SQNR_CAP_DB``,
``qlint.core.sqnr``). A capped value was not measured as a number: the text and HTML
tables print it as a word, and the SQNR chart leaves it off its dB scale.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from qlint.core.sqnr import SQNR_CAP_DB
from qlint.linter.findings import CompareRow
from qlint.numeric.badcase_summary import BadCaseMetric, BadCaseSummary, WorstInputsOfMetric

EXACT = "exact"
NO_SIGNAL = "no signal"
EXACT_NOTE = (
    f"{EXACT}: no error (infinite SQNR, stored as the {SQNR_CAP_DB:g} dB cap): weights or a layer kept in "
    "float; as shadow, also an op that passes quantized values through unchanged (max pooling, ReLU), "
    "which adds no error of its own while its propagated value still carries the error of its input"
)
NO_SIGNAL_NOTE = f"{NO_SIGNAL}: the float value is all zeros, so there is no signal to compare the error with"


def sqnr_word(value: float | None) -> str | None:
    """``EXACT`` or ``NO_SIGNAL`` for a value at the cap; None for a measured value (or none)."""
    if value is None:
        return None
    if value >= SQNR_CAP_DB:
        return EXACT
    if value <= -SQNR_CAP_DB:
        return NO_SIGNAL
    return None


def format_sqnr(value: float | None, digits: int = 1) -> str:
    """A table cell: the value in dB, its word at the cap, or "" without a value."""
    if value is None:
        return ""
    return sqnr_word(value) or f"{value:.{digits}f}"


def describe_sqnr(value: float) -> str:
    """An SQNR in prose: its word at the cap, else the value in dB."""
    return sqnr_word(value) or f"{value:.1f} dB"


def sqnr_notes(values: list[float | None]) -> list[str]:
    """The notes explaining the words ``format_sqnr`` printed for these values."""
    words = {sqnr_word(value) for value in values}
    return [note for word, note in ((EXACT, EXACT_NOTE), (NO_SIGNAL, NO_SIGNAL_NOTE)) if word in words]


def call_of(row: CompareRow) -> str | None:
    """Which calls of a module a row measures, when the model calls it more than once: "call 2/3
    of act" for one call, "3 calls pooled" for a row covering them all; None otherwise."""
    if row.module is None or row.calls <= 1:
        return None
    if row.call is None:
        return f"{row.calls} calls pooled"
    return f"call {row.call + 1}/{row.calls} of {row.module}"


def ranked_label(name: str, calls: int) -> str:
    """A sensitivity ranking's layer: a module called several times is ranked once, all calls."""
    return name if calls <= 1 else f"{name} ({calls} calls)"


def layer_label(row: CompareRow) -> str:
    """A row's name as a table or chart shows it: with the call of its module it measures."""
    calls = call_of(row)
    return row.name if calls is None else f"{row.name} ({calls})"


# The SQNR columns of a layer table, as (what it measures, the row's value); a table shows those
# some row has a value in.
SqnrColumn = tuple[str, Callable[[CompareRow], float | None]]
SQNR_COLUMNS: tuple[SqnrColumn, ...] = (
    ("weight", lambda row: row.weight_sqnr),
    ("propagated", lambda row: row.sqnr_propagated),
    ("shadow", lambda row: row.sqnr_shadow),
)
# Marks a cell measured by shadow in a table whose other error cells are propagated.
SHADOW_MARK = "*"


def sqnr_columns(rows: Sequence[CompareRow]) -> list[SqnrColumn]:
    """The SQNR columns some row has a value in: a mode compare did not run (``--modes shadow``)
    gets no column rather than an empty one."""
    return [(heading, value) for heading, value in SQNR_COLUMNS if any(value(row) is not None for row in rows)]


def error_summary(row: CompareRow) -> dict[str, Any]:
    """The metric summary behind a row's cosine and error columns: the one of ``row.error_mode``."""
    summary = row.extra.get(row.error_mode) if row.error_mode else None
    return summary if isinstance(summary, dict) else {}


def _one_error_mode(rows: Sequence[CompareRow]) -> str | None:
    modes = {row.error_mode for row in rows if row.error_mode}
    return modes.pop() if len(modes) == 1 else None


def error_heading(metric: str, rows: Sequence[CompareRow], separator: str = " ") -> str:
    """A cosine or error column's heading, naming the comparison its cells measure: propagated by
    default, shadow under ``--modes shadow`` (the same words would otherwise mean other numbers).
    ``separator`` goes between the metric and the comparison (a newline keeps a column narrow)."""
    mode = _one_error_mode(rows)
    if mode is not None or not any(row.error_mode for row in rows):
        return f"{metric}{separator}({mode})" if mode else metric
    return f"{metric}{separator}(propagated; {SHADOW_MARK} shadow)"


def error_notes(rows: Sequence[CompareRow]) -> list[str]:
    """The note explaining ``SHADOW_MARK``, for a table whose error cells measure both comparisons."""
    if _one_error_mode(rows) is not None or not any(row.error_mode for row in rows):
        return []
    return [f"{SHADOW_MARK}: measured by shadow (the float layer run on the quantized model's input)"]


def error_cell(text: str, row: CompareRow, rows: Sequence[CompareRow]) -> str:
    """A cosine or error cell: marked when its row measures shadow in a table of both comparisons."""
    if not text or row.error_mode != "shadow" or _one_error_mode(rows) is not None:
        return text
    return text + SHADOW_MARK


def badcase_value(metric: BadCaseMetric, value: float) -> str:
    """A worst input's value: dB for SQNR, five decimals for a cosine, three digits for an error."""
    if metric == "sqnr":
        return describe_sqnr(value)
    return f"{value:.5f}" if metric == "cosine" else f"{value:.3g}"


def badcase_column(summary: BadCaseSummary) -> str:
    """The heading of the worst samples' column."""
    return "worst samples (#sample: value" + (", output that scored it)" if summary.several_outputs else ")")


def badcase_cells(metric: WorstInputsOfMetric, summary: BadCaseSummary) -> str:
    """One metric's worst samples, "#12: 3.1 dB", with the output that scored worst
    ("#12: 3.1 dB, output[0]") when the model has several."""
    return "; ".join(
        f"#{case.sample}: {badcase_value(metric.metric, case.value)}"
        + (f", {case.output}" if summary.several_outputs and case.output else "")
        for case in metric.cases
    )


def badcase_title(summary: BadCaseSummary) -> str:
    """What the worst-inputs table holds and how a sample with several outputs was scored."""
    title = f"worst inputs of {summary.samples_seen} samples"
    if summary.several_outputs:
        title += f" (every output scored: {', '.join(summary.outputs)}; a sample scores its worst output's value)"
    return title


def worst_inputs_heading(summary: BadCaseSummary) -> str:
    """The heading of the comparison rerun on the worst inputs."""
    return (
        f"On the worst inputs only: the {summary.distinct_samples} distinct samples above, each compared as a "
        "batch of one"
    )


__all__ = [
    "badcase_cells",
    "badcase_column",
    "badcase_title",
    "badcase_value",
    "worst_inputs_heading",
    "SHADOW_MARK",
    "SQNR_COLUMNS",
    "error_cell",
    "error_heading",
    "error_notes",
    "error_summary",
    "sqnr_columns",
    "call_of",
    "layer_label",
    "ranked_label",
    "EXACT",
    "EXACT_NOTE",
    "NO_SIGNAL",
    "NO_SIGNAL_NOTE",
    "describe_sqnr",
    "format_sqnr",
    "sqnr_notes",
    "sqnr_word",
]
