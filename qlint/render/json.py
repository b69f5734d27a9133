"""JSON output: exactly the Report model, so it validates back into qlint.Report."""

from __future__ import annotations

from qlint.linter.findings import Report


def render_json(report: Report, **_: object) -> str:
    return report.model_dump_json(indent=2) + "\n"
