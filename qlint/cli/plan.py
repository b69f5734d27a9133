"""``qlint plan ...`` commands and the hook behind ``qlint MODEL --emit-plan/--emit-qconfig``.

    qlint plan show PLAN.json [--format text|json]   pretty-print (or re-emit canonical JSON)
    qlint plan qconfig PLAN.json [-o FILE.py]        write the Python file that builds the mapping
    qlint plan check PLAN.json                       validate; exit 0 when the plan is readable

emit_plan_outputs raises QlintError (exit 2) when a file cannot be written.
"""

from __future__ import annotations

import argparse

from qlint.advice.plan import QuantPlan, plan_from_report
from qlint.cli.common import Parser, check_outputs, write_file, write_stdout
from qlint.linter.findings import Report
from qlint.render.literal import printable
from qlint.render.text import counted


def emit_plan_outputs(report: Report, plan_path: str | None, qconfig_path: str | None) -> QuantPlan:
    """Write ``report.plan()`` as JSON to plan_path and/or its Python mapping to qconfig_path."""
    plan = plan_from_report(report)
    if plan_path:
        write_file(plan_path, plan.model_dump_json(indent=2) + "\n")
    if qconfig_path:
        write_file(qconfig_path, plan.to_python())
    return plan


def _parser() -> argparse.ArgumentParser:
    parser = Parser(prog="qlint plan", description="Inspect and export qlint quantization plans.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = parser.add_subparsers(dest="action", required=True, parser_class=Parser)
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
        write_stdout(plan.model_dump_json(indent=2) + "\n" if args.format == "json" else plan.pretty())
    elif args.action == "qconfig":
        text = plan.to_python()
        if args.output:
            check_outputs([("--output", args.output)], [args.plan])
            write_file(args.output, text)
        else:
            write_stdout(text)
    else:
        plan.to_qconfig_mapping()  # also checks backend support (e.g. int16)
        parts = [
            counted(len(plan.modules), "module decision"),
            counted(len(plan.equalization), "equalization pair"),
            counted(len(plan.rewrites), "rewrite"),
            counted(len(plan.float_functions), "float function"),
        ]
        if plan.bias_correction is not None:
            parts.append("bias correction")
        write_stdout(
            f"{printable(args.plan)}: valid qlint plan (schema {plan.schema_version}, backend {plan.backend}: "
            f"{', '.join(parts)})\n"
        )
    return 0
