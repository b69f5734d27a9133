"""Baselines: accept today's findings, report only new ones (``--baseline FILE``).

    qlint MODEL --baseline .qlint-baseline.json --write-baseline   # record
    qlint MODEL --baseline .qlint-baseline.json                    # only new findings

The file is JSON: ``{"version": 1, "tool": "qlint", "fingerprints": {FP: {rule, name,
target, kind}}}``. Identity is :meth:`Finding.fingerprint` (rule, target and the
finding's kind), so a reworded message or a changed number does not make an old
finding look new, while the same problem at another module does.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from qlint.errors import ConfigError, QlintError
from qlint.linter.findings import Notice, Report, Severity

BASELINE_VERSION = 1


def baseline_payload(report: Report) -> dict[str, Any]:
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
    return {
        "version": BASELINE_VERSION,
        "tool": "qlint",
        "qlint_version": report.qlint_version,
        "model": report.model,
        "fingerprints": dict(sorted(entries.items())),
    }


def write_baseline(report: Report, path: str | Path) -> None:
    """Record every current finding in ``path`` (atomically: a crash leaves the old file)."""
    target = Path(path)
    text = json.dumps(baseline_payload(report), indent=2, ensure_ascii=False) + "\n"
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".qlint-baseline-", dir=target.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                handle.write(text)
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as error:
        raise QlintError(f"cannot write baseline {path}: {error.strerror or error}") from error


def read_baseline(path: str | Path) -> set[str]:
    """The fingerprints recorded in ``path``; a missing or corrupt file is a ConfigError."""
    source = Path(path)
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
    if data.get("version") != BASELINE_VERSION:
        raise ConfigError(
            f"baseline {path} has version {data.get('version')!r}; this qlint reads "
            f"version {BASELINE_VERSION}: rewrite it with --write-baseline"
        )
    fingerprints = data.get("fingerprints")
    if isinstance(fingerprints, list):
        keys = fingerprints
    elif isinstance(fingerprints, dict):
        keys = list(fingerprints)
    else:
        raise ConfigError(f"baseline {path} has no 'fingerprints' object")
    if not all(isinstance(k, str) and k for k in keys):
        raise ConfigError(f"baseline {path} holds a fingerprint that is not a string")
    return set(keys)


def filter_new(report: Report, path: str | Path) -> Report:
    """``report`` with findings recorded in the baseline removed, plus a notice saying how many."""
    known = read_baseline(path)
    kept = [f for f in report.findings if f.fingerprint() not in known]
    suppressed = len(report.findings) - len(kept)
    seen = {f.fingerprint() for f in report.findings}
    stale = len(known - seen)
    message = f"baseline {path}: {suppressed} known finding{'s' if suppressed != 1 else ''} suppressed"
    if stale:
        message += f"; {stale} baseline entr{'ies' if stale != 1 else 'y'} no longer found (fixed?)"
    notice = Notice(level=Severity.INFO, message=message)
    return report.model_copy(update={"findings": kept, "notices": list(report.notices) + [notice]})
