"""GitHub Actions workflow commands (``--format github``): one annotation per finding.

    ::warning file=models/net.pt2,title=QL101 unfused-pattern::stem: conv2d → ...

Escaping follows the runner's rules (actions/toolkit command.ts): in the message
``%``, ``\\r`` and ``\\n``; in property values additionally ``:`` and ``,``. Every other
control character is made visible (``printable``), so a file or module name holding an
ESC sequence cannot recolour or rewrite the log, and none can end the command's line.
"""

from __future__ import annotations

from qlint.linter.findings import Report, Severity
from qlint.render.literal import printable

_COMMAND = {Severity.ERROR: "error", Severity.WARNING: "warning", Severity.INFO: "notice"}


def escape_data(value: str) -> str:
    return printable(value.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A"))


def escape_property(value: str) -> str:
    return escape_data(value).replace(":", "%3A").replace(",", "%2C")


def _file_of(report: Report) -> str | None:
    from qlint.render.sarif import model_artifact_uri

    uri = model_artifact_uri(report.model)
    if uri is None or uri.startswith("file:"):
        return None if uri is None else uri[len("file://") :]
    return uri


def render_github(report: Report) -> str:
    lines = []
    file = _file_of(report)
    for finding in report.findings:
        props = []
        if file is not None:
            props.append(f"file={escape_property(file)}")
        props.append(f"title={escape_property(f'{finding.rule} {finding.name}')}")
        message = f"{finding.target}: {finding.message}"
        lines.append(f"::{_COMMAND[finding.severity]} {','.join(props)}::{escape_data(message)}")
    for skipped in report.skipped:
        lines.append(
            f"::notice title={escape_property(f'{skipped.rule} skipped')}::"
            f"{escape_data(f'{skipped.rule} {skipped.name} was skipped: {skipped.reason}')}"
        )
    for notice in report.notices:
        lines.append(f"::{_COMMAND[notice.level]} title=qlint::{escape_data(notice.message)}")
    return "\n".join(lines) + ("\n" if lines else "")
