"""How the numeric suite's tables and charts write an SQNR value.

An error-free stream has infinite SQNR, and a stream whose float side is all zeros has
none; reports hold finite numbers, so both are stored at the cap (``+-SQNR_CAP_DB``,
``qlint.core.sqnr``). A capped value was not measured as a number: the text and HTML
tables print it as a word, and the SQNR chart leaves it off its dB scale.
"""

from __future__ import annotations

from qlint.core.sqnr import SQNR_CAP_DB
from qlint.linter.findings import CompareRow

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


__all__ = [
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
