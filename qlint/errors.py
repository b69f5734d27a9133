"""User-facing errors: the CLI prints their message on one line and exits 2."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class QlintError(Exception):
    """A problem with the user's input (model file, options, data), not a bug in qlint."""


class LoadError(QlintError):
    """The model, weights, example inputs or calibration data could not be loaded."""


class TraceError(QlintError):
    """No front end could turn the model into a graph."""


class ConfigError(QlintError):
    """Bad options: unknown rule codes, bad [tool.qlint] values, bad CLI flags."""


class RuleLoadError(QlintError):
    """A third-party rule package failed to import or defines an invalid rule."""


class EmptyCalibrationError(QlintError):
    """The calibration data held no batch at all."""


class DataError(QlintError):
    """The user's data cannot be measured on (NaN or Inf values, where every SQNR would be
    measured against them)."""


class CalibrationError(QlintError):
    """A calibration batch could not be run through the model."""


class StateError(QlintError):
    """The model's forward keeps state in a way qlint cannot trace, or changed it in a way
    qlint could not undo."""


class ModelRunError(QlintError):
    """The user's float or quantized model raised while qlint ran it on their data."""


def first_line(error: BaseException, limit: int = 300) -> str:
    """``Type: first line of the message``, at most ``limit`` characters: how qlint quotes an
    error it did not raise itself (torch's and the user's messages can run to pages)."""
    text = str(error).strip()
    line = f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__
    if len(line) <= limit:
        return line
    cut = line[: limit - 1]  # cut at a word, and say the rest is left out
    return (cut.rsplit(" ", 1)[0] if " " in cut[limit // 2 :] else cut) + "…"


def validation_problem(problem: Mapping[str, Any]) -> str:
    """One item of a pydantic ValidationError in a user's words: an unknown option named as such,
    a validator's own message without pydantic's 'Value error, ', else pydantic's message."""
    if problem.get("type") == "extra_forbidden":
        return "unknown option"
    raised = (problem.get("ctx") or {}).get("error")
    if problem.get("type") == "value_error" and raised is not None:
        return str(raised)
    return str(problem.get("msg", "invalid"))


def validation_problems(error: Exception) -> str:
    """A pydantic ValidationError as ``name: problem`` per field, without pydantic's type tags and
    input echoes; other errors as their first line."""
    problems = getattr(error, "errors", None)
    if not callable(problems):
        return first_line(error)
    described = [
        f"{'.'.join(str(part) for part in problem.get('loc', ())) or 'value'}: {validation_problem(problem)}"
        for problem in problems()
    ]
    return "; ".join(described) or first_line(error)
