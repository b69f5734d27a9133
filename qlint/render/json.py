"""JSON output: exactly the Report model, so it validates back into qlint.Report."""

from __future__ import annotations

from collections.abc import Sequence

from qlint.linter.findings import Report


def render_json(report: Report, **_: object) -> str:
    return report.model_dump_json(indent=2) + "\n"


def render_json_reports(reports: Sequence[Report]) -> str:
    """Several models' reports as one JSON document: an array of Reports, in the order linted."""
    return "[\n" + ",\n".join(report.model_dump_json(indent=2) for report in reports) + "\n]\n"
