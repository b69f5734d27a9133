"""``qlint plan ...`` commands and the hook behind ``qlint MODEL --emit-plan/--emit-qconfig``.

    qlint plan show PLAN.json [--format text|json]   pretty-print (or re-emit canonical JSON)
    qlint plan qconfig PLAN.json [-o FILE.py]        write the Python file that builds the mapping
    qlint plan check PLAN.json                       validate; exit 0 when the plan is readable

``qlint MODEL --emit-plan FILE --emit-qconfig FILE.py`` writes the plan of a lint
report through :func:`emit_plan_outputs`; a file that cannot be written is exit 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable, Optional

from qlint.errors import ConfigError, QlintError
from qlint.linter.findings import Report
from qlint.advice.plan import QuantPlan, plan_from_report


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(f"{message} (see '{self.prog} --help')")


def _write(path: str, text: str) -> None:
    try:
        Path(path).write_text(text)
    except OSError as error:
        raise QlintError(f"cannot write {path}: {error.strerror}") from error


def emit_plan_outputs(report: Report, plan_path: Optional[str], qconfig_path: Optional[str]) -> QuantPlan:
    """Write the report's plan as JSON to plan_path and/or its Python mapping to qconfig_path."""
    plan = plan_from_report(report)
    if plan_path:
        _write(plan_path, plan.model_dump_json(indent=2) + "\n")
    if qconfig_path:
        _write(qconfig_path, plan.to_python())
    return plan


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="qlint plan", description="Inspect and export qlint quantization plans.")
    sub = parser.add_subparsers(dest="action", required=True, parser_class=_Parser)
    show = sub.add_parser("show", help="pretty-print a plan")
    show.add_argument("plan")
    show.add_argument("--format", choices=("text", "json"), default="text")
    qconfig = sub.add_parser("qconfig", help="write the Python file that builds the plan's QConfigMapping")
    qconfig.add_argument("plan")
    qconfig.add_argument("--output", "-o", metavar="FILE")
    check = sub.add_parser("check", help="validate a plan file")
    check.add_argument("plan")
    return parser


def plan_command(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    plan = QuantPlan.load(args.plan)
    if args.action == "show":
        sys.stdout.write(plan.model_dump_json(indent=2) + "\n" if args.format == "json" else plan.pretty())
    elif args.action == "qconfig":
        text = plan.to_python()
        if args.output:
            _write(args.output, text)
        else:
            sys.stdout.write(text)
    else:
        plan.to_qconfig_mapping()  # also checks backend support (e.g. int16)
        print(f"{args.plan}: valid qlint plan (schema {plan.schema_version}, backend {plan.backend}, "
              f"{len(plan.modules)} module decisions)")
    return 0


def _verify_command(argv: list[str]) -> int:
    from qlint.cli.verify import verify_command

    return verify_command(argv)


def _fix_command(argv: list[str]) -> int:
    from qlint.cli.verify import fix_command

    return fix_command(argv)


COMMANDS: dict[str, Callable[[list[str]], int]] = {
    "plan": plan_command,
    "verify": _verify_command,
    "fix": _fix_command,
}
