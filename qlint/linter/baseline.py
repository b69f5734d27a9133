"""Baselines: accept today's findings, report only new ones (``--baseline FILE``).

    qlint MODEL... --baseline .qlint-baseline.json --write-baseline   # record
    qlint MODEL... --baseline .qlint-baseline.json                    # only new findings

The file is JSON: ``{"version": 2, "tool": "qlint", "models": {MODEL: {"fingerprints": {FP:
{rule, name, target, kind, severity}}}}}``, one entry per model, so one file serves every model
a pre-commit hook lints: recording a model replaces its own entry and keeps the others', and a
model's findings are matched against its own entry only (the same problem at ``conv1`` of two
models is two findings). A model file is named by its path relative to the baseline's folder,
however the command line spelled it (``models/m.pt2``, ``./models/m.pt2`` or, from the
repository root as pre-commit runs, ``proj/models/m.pt2``); a ``module:factory`` model as
written. Identity is :meth:`Finding.fingerprint` (rule, target and the finding's kind), so a
reworded message or a changed number does not make an old finding look new. A version 1 file
(fingerprints not keyed by model) applies to every model without an entry of its own, as it
did.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from qlint.errors import ConfigError, QlintError
from qlint.linter.findings import Notice, Report, Severity

BASELINE_VERSION = 2
_READABLE_VERSIONS = (1, 2)
_EVERY_MODEL = ""  # the entry of a version 1 file: it applies to any model without its own


def model_key(model: str, baseline: str | Path) -> str:
    """The name of ``model``'s entry in the baseline at ``baseline``: a model file's path
    relative to the baseline's folder, a ``module:factory`` spec as written."""
    candidate = Path(model)
    if not candidate.is_file():
        return model
    folder = Path(baseline).resolve().parent
    return Path(os.path.relpath(candidate.resolve(), folder)).as_posix()


def _entries(report: Report) -> dict[str, dict[str, Any]]:
    entries: dict[str, dict[str, Any]] = {}
    for finding in report.findings:
        entries.setdefault(
            finding.fingerprint(),
            {
                "rule": finding.rule,
                "name": finding.name,
                "target": finding.target,
                "kind": str(finding.data.get("kind", "")),
                "severity": finding.severity.value,
            },
        )
    return dict(sorted(entries.items()))


def baseline_payload(
    report: Report, recorded: dict[str, dict[str, Any]] | None = None, key: str | None = None
) -> dict[str, Any]:
    """The file's content: ``recorded`` (the other models' entries) with the entry of this
    report's model (named ``key``, default the report's model) replaced by its findings."""
    models = dict(recorded or {})
    models[key or report.model] = {"fingerprints": _entries(report)}
    return {
        "version": BASELINE_VERSION,
        "tool": "qlint",
        "qlint_version": report.qlint_version,
        "models": dict(sorted(models.items())),
    }


def write_baseline(report: Report, path: str | Path) -> None:
    """Record every current finding of the report's model in ``path``, keeping the other
    models' entries (atomically: a crash leaves the old file). An unreadable old file is replaced."""
    target = Path(path)
    try:
        recorded = _read_models(target) if target.exists() else {}
    except ConfigError:
        recorded = {}
    text = json.dumps(baseline_payload(report, recorded, model_key(report.model, target)), indent=2, ensure_ascii=False)
    text += "\n"
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".qlint-baseline-", dir=target.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                handle.write(text)
            os.chmod(tmp, 0o644)  # mkstemp makes it private; a baseline is a file to commit
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as error:
        raise QlintError(f"cannot write baseline {path}: {error.strerror or error}") from error


def _read_models(source: Path) -> dict[str, dict[str, Any]]:
    """Every model's entry in the file at ``source``; a missing or corrupt file is a ConfigError."""
    path = str(source)
    try:
        text = source.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"baseline {path} does not exist; create it with --write-baseline") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"cannot read baseline {path}: {error}") from error
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise ConfigError(
            f"baseline {path} is not valid JSON (line {error.lineno}): {error.msg}; rewrite it with --write-baseline"
        ) from error
    except RecursionError as error:  # json's decoder recurses once per nesting level
        raise ConfigError(
            f"baseline {path} is nested too deeply to be a qlint baseline; rewrite it with --write-baseline"
        ) from error
    if not isinstance(data, dict):
        raise ConfigError(f"baseline {path} is not a qlint baseline (expected a JSON object)")
    if data.get("version") not in _READABLE_VERSIONS:
        raise ConfigError(
            f"baseline {path} has version {data.get('version')!r}; this qlint reads "
            f"versions {', '.join(map(str, _READABLE_VERSIONS))}: rewrite it with --write-baseline"
        )
    models: Any = data.get("models")
    if data["version"] == 1:  # fingerprints not keyed by model
        models = {_EVERY_MODEL: {"fingerprints": data.get("fingerprints")}}
    elif not isinstance(models, dict):
        raise ConfigError(f"baseline {path} has no 'models' object")
    for model, entry in models.items():
        fingerprints = entry.get("fingerprints") if isinstance(entry, dict) else None
        keys = list(fingerprints) if isinstance(fingerprints, (dict, list)) else None
        if keys is None:
            raise ConfigError(f"baseline {path} has no 'fingerprints' object for model {model!r}")
        if not all(isinstance(k, str) and k for k in keys):
            raise ConfigError(f"baseline {path} holds a fingerprint that is not a string")
    return models


def read_baseline(path: str | Path, model: str) -> set[str]:
    """The fingerprints recorded in ``path`` for ``model`` (none when the file has no entry for
    it); a missing or corrupt file is a ConfigError."""
    entry = _entry(_read_models(Path(path)), model_key(model, path))
    return set(entry["fingerprints"]) if entry is not None else set()


def _entry(models: dict[str, dict[str, Any]], key: str) -> dict[str, Any] | None:
    return models.get(key, models.get(_EVERY_MODEL))


def filter_new(report: Report, path: str | Path) -> Report:
    """``report`` with findings recorded in the baseline removed, plus a notice saying how many."""
    key = model_key(report.model, path)
    entry = _entry(_read_models(Path(path)), key)
    known = set(entry["fingerprints"]) if entry is not None else set()
    kept = [f for f in report.findings if f.fingerprint() not in known]
    suppressed = len(report.findings) - len(kept)
    seen = {f.fingerprint() for f in report.findings}
    stale = len(known - seen)
    message = f"baseline {path}: {suppressed} known finding{'s' if suppressed != 1 else ''} suppressed"
    level = Severity.INFO
    if entry is None:  # every finding of this model is reported as new: -q must say why
        message = f"baseline {path} has no entry for {key}: record one with --write-baseline"
        level = Severity.WARNING
    if stale:
        message += f"; {stale} baseline entr{'ies' if stale != 1 else 'y'} no longer found (fixed?)"
    notice = Notice(level=level, message=message)
    return report.model_copy(update={"findings": kept, "notices": list(report.notices) + [notice]})
