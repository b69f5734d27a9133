"""``qlint plan ...`` commands and the hook behind ``qlint MODEL --emit-plan/--emit-qconfig``.

    qlint plan show PLAN.json [--format text|json]   pretty-print (or re-emit canonical JSON)
    qlint plan qconfig PLAN.json [-o FILE.py]        write the Python file that builds the mapping (fx plans)
    qlint plan check PLAN.json                       validate; exit 0 when the plan is readable

emit_plan_outputs raises QlintError (exit 2) when a file cannot be written.
"""

from __future__ import annotations

import argparse
import sys

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
        _note_decisions_for_the_rewritten_model(plan, printable(qconfig_path))
    return plan


def _note_decisions_for_the_rewritten_model(plan: QuantPlan, where: str) -> None:
    """Say on stderr that the file's default mapping leaves out the decisions made for the model
    the plan's rewrites make: otherwise a fix that lint measured is silently not applied."""
    for_rewritten = [decision.fqn for decision in plan.modules if plan.needs_rewrites(decision)]
    if not for_rewritten:
        return
    listed = printable(for_rewritten[0]) + (", ..." if len(for_rewritten) > 1 else "")
    verb = "is" if len(for_rewritten) == 1 else "are"
    print(
        f"qlint: note: {counted(len(for_rewritten), 'decision')} of the plan ({listed}) {verb} for the model its "
        f"rewrites make: {where}'s build_qconfig_mapping() is for the model as given and leaves them out; "
        "build_qconfig_mapping(rewritten=True) has them, for the model `qlint fix MODEL --plan PLAN` writes",
        file=sys.stderr,
    )


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
        _note_decisions_for_the_rewritten_model(plan, printable(args.output) if args.output else "the file")
    else:
        if plan.flow == "fx":  # a pt2e plan has no mapping; its quantizer leaves out what it cannot express
            plan.to_qconfig_mapping(rewritten=True)  # also checks backend support (e.g. int16) of every decision
        parts = [
            counted(len(plan.modules), "module decision"),
            counted(len(plan.equalization), "equalization pair"),
            counted(len(plan.rewrites), "rewrite"),
            counted(len(plan.float_functions), "float function"),
        ]
        if plan.bias_correction is not None:
            parts.append("bias correction")
        write_stdout(
            f"{printable(args.plan)}: valid qlint plan (schema {plan.schema_version}, {plan.flow} flow, "
            f"backend {plan.backend}: "
            f"{', '.join(parts)})\n"
        )
    return 0
