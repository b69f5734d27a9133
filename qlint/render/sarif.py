"""SARIF 2.1.0 output (``qlint MODEL --format sarif``) for code-scanning dashboards.

One run, one tool: the driver lists every rule of the run (``Report.rules``) with its
full documentation as ``help`` (the text of ``qlint rule CODE``; a ``helpUri`` only when
the installed package declares a repository URL), each finding becomes a result with a logical
location (the module fqn or functional node) and, when the model is a file, a
physical location on that file. Skipped rules and run notices become tool
execution notifications of the single invocation.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, metadata
from pathlib import Path
from typing import Any

from qlint.linter.findings import Finding, Report, Severity

SARIF_VERSION = "2.1.0"
SARIF_SCHEMA = "https://docs.oasis-open.org/sarif/sarif/v2.1.0/errata01/os/schemas/sarif-schema-2.1.0.json"
MODEL_SUFFIXES = (".pt2", ".pt", ".pth", ".ep")

_LEVEL = {Severity.ERROR: "error", Severity.WARNING: "warning", Severity.INFO: "note"}


def repository_url() -> str | None:
    """The repository URL the installed qlint declares (``[project.urls]``), else None.

    SARIF viewers link to it; qlint never invents one."""
    try:
        entries = metadata("qlint").get_all("Project-URL") or []
    except PackageNotFoundError:
        return None
    urls = dict(entry.split(", ", 1) for entry in entries if ", " in entry)
    for key in ("Repository", "Source", "Homepage"):
        if urls.get(key, "").startswith("https://"):
            return urls[key].rstrip("/")
    return None


def rule_help_uri(code: str) -> str | None:
    base = repository_url()
    return f"{base}/blob/main/docs/rules/{code}.md" if base else None


def _driver_rules(report: Report) -> list[dict[str, Any]]:
    rules: list[dict[str, Any]] = []
    known: set[str] = set()
    for rule in report.rules:
        known.add(rule.code)
        entry = {
            "id": rule.code,
            "name": rule.name,
            "shortDescription": {"text": f"{rule.code} {rule.name}"},
            "fullDescription": {"text": rule.summary},
            "help": {"text": rule.documentation, "markdown": rule.documentation},
            "defaultConfiguration": {"level": _LEVEL[rule.severity]},
            "properties": {"requires": list(rule.requires)},
        }
        help_uri = rule_help_uri(rule.code)
        if help_uri:
            entry["helpUri"] = help_uri
        rules.append(entry)
    # Findings from rules the report does not describe (e.g. qlint compare's QL301).
    for finding in report.findings:
        if finding.rule not in known:
            known.add(finding.rule)
            rules.append(
                {
                    "id": finding.rule,
                    "name": finding.name,
                    "shortDescription": {"text": f"{finding.rule} {finding.name}"},
                    "fullDescription": {"text": finding.name},
                }
            )
    return rules


def model_artifact_uri(model: str) -> str | None:
    """A relative (to the working directory) or file: URI for a model file, else None."""
    if not model or (":" in model and not Path(model).exists() and not model.lower().endswith(MODEL_SUFFIXES)):
        return None  # package.module:factory has no file
    path = Path(model)
    if not (path.suffix.lower() in MODEL_SUFFIXES or path.is_file()):
        return None
    try:
        resolved = path.resolve()
        relative = resolved.relative_to(Path.cwd().resolve())
        return relative.as_posix()
    except (ValueError, OSError):
        return path.resolve().as_uri() if path.is_absolute() or path.exists() else path.as_posix()


def _functional_names() -> set[str]:
    from qlint.core.op_tables import FUNCTION_KINDS, METHOD_KINDS

    names = set(FUNCTION_KINDS.values()) | set(METHOD_KINDS.values()) | set(METHOD_KINDS)
    names |= {getattr(f, "__name__", str(f)) for f in FUNCTION_KINDS}
    return names


def _logical_kind(finding: Finding) -> str:
    """ "module" for a module fqn, "function" for a functional op's graph node name."""
    op = finding.data.get("op")
    if op in ("function", "method"):
        return "function"
    if op == "module" or any(finding.data.get(k) for k in ("module", "modules", "module_type")):
        return "module"
    base = re.sub(r"_[0-9]+$", "", finding.target)
    if "." not in finding.target and base in _functional_names():
        return "function"
    return "module"


def _result(finding: Finding, rule_index: dict[str, int], artifact: str | None) -> dict[str, Any]:
    location: dict[str, Any] = {
        "logicalLocations": [
            {
                "fullyQualifiedName": finding.target,
                "name": finding.target.rpartition(".")[2],
                "kind": _logical_kind(finding),
            }
        ],
    }
    if artifact is not None:
        location["physicalLocation"] = {"artifactLocation": {"uri": artifact, "index": 0}}
    result: dict[str, Any] = {
        "ruleId": finding.rule,
        "level": _LEVEL[finding.severity],
        "message": {"text": finding.message},
        "locations": [location],
        "partialFingerprints": {"qlintFingerprint/v1": finding.fingerprint()},
        "properties": {"name": finding.name, "severity": finding.severity.value, "data": finding.data},
    }
    if finding.rule in rule_index:
        result["ruleIndex"] = rule_index[finding.rule]
    if finding.suggestion is not None:
        result["properties"]["suggestion"] = finding.suggestion.model_dump(exclude_none=True)
    if finding.impact is not None:
        result["properties"]["impact"] = finding.impact.model_dump()
    return result


def to_sarif(report: Report) -> dict[str, Any]:
    rules = _driver_rules(report)
    rule_index = {rule["id"]: i for i, rule in enumerate(rules)}
    artifact = model_artifact_uri(report.model)
    notifications: list[dict[str, Any]] = []
    for skipped in report.skipped:
        notifications.append(
            {
                "level": "note",
                "message": {"text": f"{skipped.rule} {skipped.name} skipped: {skipped.reason}"},
                "descriptor": {"id": "qlint/skipped-rule"},
                "associatedRule": {
                    "id": skipped.rule,
                    **({"index": rule_index[skipped.rule]} if skipped.rule in rule_index else {}),
                },
            }
        )
    for notice in report.notices:
        notifications.append(
            {"level": _LEVEL[notice.level], "message": {"text": notice.message}, "descriptor": {"id": "qlint/notice"}}
        )
    driver: dict[str, Any] = {
        "name": "qlint",
        "version": report.qlint_version,
        "semanticVersion": report.qlint_version,
        "rules": rules,
    }
    if repository_url():
        driver["informationUri"] = repository_url()
    run: dict[str, Any] = {
        "tool": {"driver": driver},
        "invocations": [
            {
                "executionSuccessful": True,
                "toolExecutionNotifications": notifications,
            }
        ],
        "results": [_result(f, rule_index, artifact) for f in report.findings],
        "properties": {
            "model": report.model,
            "backend": report.backend,
            "frontend": report.frontend,
            "torchVersion": report.torch_version,
        },
    }
    if artifact is not None:
        run["artifacts"] = [{"location": {"uri": artifact}, "roles": ["analysisTarget"]}]
    return {"$schema": SARIF_SCHEMA, "version": SARIF_VERSION, "runs": [run]}


def render_sarif(report: Report) -> str:
    return json.dumps(to_sarif(report), indent=2) + "\n"


def render_sarif_reports(reports: Sequence[Report]) -> str:
    """Several models' reports as one SARIF log: one run per model, in the order linted."""
    runs = [run for report in reports for run in to_sarif(report)["runs"]]
    return json.dumps({"$schema": SARIF_SCHEMA, "version": SARIF_VERSION, "runs": runs}, indent=2) + "\n"
