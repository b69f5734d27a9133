"""The ``qlint`` command line.

qlint MODEL [options]        lint a model (exit 0 clean, 1 findings, 2 usage/load error)
qlint rule CODE              print one rule's documentation
qlint rules [--format json]  list every rule
qlint compare FLOAT QUANT    per-layer float vs quantized comparison
qlint verify MODEL ...       default mapping vs a plan, measured
qlint fix MODEL ...          apply a plan's float-preserving rewrites
qlint plan show|qconfig|check PLAN.json
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

from qlint.cli.common import (
    EXIT_CLEAN,
    EXIT_ERROR,
    EXIT_FINDINGS,
    Parser,
    ParserExit,
    finite_float,
    positive_int,
    random_batch_count,
    terminal_width,
    write_stdout,
)
from qlint.core.backends import BACKENDS
from qlint.errors import QlintError
from qlint.render.literal import printable

__all__ = ["EXIT_CLEAN", "EXIT_ERROR", "EXIT_FINDINGS", "build_lint_parser", "main"]

# Every command, for dispatch and for `qlint --help` (a test checks they match).
COMMAND_SUMMARIES = {
    "rule": "qlint rule CODE: print one rule's documentation",
    "rules": "qlint rules [--format json]: list every rule",
    "compare": "qlint compare FLOAT QUANT --calibration DATA: per-layer float vs quantized comparison",
    "verify": "qlint verify MODEL --plan PLAN --calibration DATA --eval-data DATA: default vs plan, in dB",
    "fix": "qlint fix MODEL --plan PLAN --output OUT.pt2: apply the plan's float-preserving rewrites",
    "quantize": "qlint quantize MODEL --plan PLAN --calibration DATA --output OUT.pt|OUT.pt2: the int8 model verify "
    "measured",
    "plan": "qlint plan show|qconfig|check PLAN.json: inspect and export a plan",
}


def build_lint_parser() -> argparse.ArgumentParser:
    epilog = "other commands (each has --help):\n" + "\n".join(f"  {line}" for line in COMMAND_SUMMARIES.values())
    parser = Parser(
        prog="qlint",
        description="Lint a PyTorch model for quantization problems.",
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("model", nargs="+", help="one or more .pt2 / .pt / .pth files, or package.module:factory")
    parser.add_argument(
        "--input-shape",
        action="append",
        metavar="SHAPE[:DTYPE]",
        help="example input shape such as 1,3,224,224 (repeat for several inputs)",
    )
    parser.add_argument("--example-inputs", metavar="FILE", help="a tensor or tuple of tensors (weights_only)")
    parser.add_argument("--weights", metavar="FILE", help="state_dict for a module:factory model")
    parser.add_argument(
        "--trust-pickle",
        action="store_true",
        help="trust the model file: unpickle a whole .pt module, load a .pt2's pickled or "
        "compiled members (runs code from the file)",
    )
    parser.add_argument(
        "--trust-config",
        action="store_true",
        help="allow [tool.qlint] settings that import and run code from the repository "
        "(qconfig-mapping, module:function calibration)",
    )
    parser.add_argument("--backend", choices=BACKENDS)
    parser.add_argument(
        "--qconfig-mapping", metavar="MODULE:ATTR", help="your QConfigMapping (or a function returning one)"
    )
    parser.add_argument("--select", action="append", metavar="CODES", help="rule codes, prefixes or names")
    parser.add_argument("--ignore", action="append", metavar="CODES", help="rule codes, prefixes or names")
    parser.add_argument("--format", choices=("text", "json", "sarif", "github"))
    parser.add_argument("--output", "-o", metavar="FILE", help="write the report to FILE")
    parser.add_argument("--fail-on", choices=("error", "warning", "info"))
    parser.add_argument("--show-qconfig", action="store_true", help="print the resolved qconfig per node")
    parser.add_argument(
        "--calibration",
        metavar="FILE_OR_DIR",
        help=(
            "calibration batches: a .pt file or a folder of .pt files (read weights_only); in a file a tensor, a "
            "tuple of tensors (the inputs of one call) or a dict is one batch, a list holds batches"
        ),
    )
    parser.add_argument("--num-batches", type=positive_int, metavar="N", help="use at most N calibration batches")
    parser.add_argument(
        "--percentile-every",
        type=positive_int,
        metavar="K",
        help="QL203: select the reference quantile of layers wider than 32 channels on one batch in K (faster; "
        "default 1, every batch, as torch)",
    )
    parser.add_argument(
        "--random-calibration",
        type=random_batch_count,
        metavar="N",
        help="calibrate on N random batches shaped like the example inputs (a warning); at most 10,000: "
        "random statistics settle within a few hundred batches, and each batch is a forward pass",
    )
    parser.add_argument(
        "--no-trial",
        action="store_true",
        help="skip the trial quantization (prepare/calibrate/convert on a copy) that "
        "measures each finding's impact; findings keep their rule's severity",
    )
    parser.add_argument(
        "--min-impact",
        type=finite_float,
        metavar="DB",
        help="a warning whose measured impact is below DB (output SQNR) becomes info (default 0.5)",
    )
    parser.add_argument(
        "--fix-trials",
        type=int,
        metavar="N",
        help="single trials spent measuring findings' fixes, then as many group trials (default 12)",
    )
    parser.add_argument("--baseline", metavar="FILE", help="report only findings not recorded in FILE")
    parser.add_argument(
        "--write-baseline", action="store_true", help="record current findings in --baseline and exit 0"
    )
    parser.add_argument("--emit-plan", metavar="FILE", help="write the quantization plan (JSON)")
    parser.add_argument("--emit-qconfig", metavar="FILE", help="write a Python file building the QConfigMapping")
    parser.add_argument(
        "--config",
        metavar="PYPROJECT",
        help="settings file (default: the nearest pyproject.toml with [tool.qlint], searched from each model's folder)",
    )
    parser.add_argument(
        "--quiet", "-q", action="store_true", help="findings and the summary only: no tables, no progress"
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args_list
    if not debug:
        import warnings

        # torch's deprecation chatter is not about the user's model; --debug shows it.
        warnings.filterwarnings("ignore")
    try:
        return _dispatch(args_list)
    except ParserExit as done:  # --help
        return done.status
    except QlintError as error:
        return _fail(str(error), debug)
    except BrokenPipeError:
        # The reader (e.g. `| head`) went away; that is not an error of ours.
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_CLEAN
    except KeyboardInterrupt:
        return _fail("interrupted", debug)
    except SystemExit as exit_request:
        # qlint itself never raises SystemExit (argparse's exits are ParserExit): the model's
        # code or a rule plugin called sys.exit(), and the analysis did not finish.
        return _fail(
            f"the model's code or a plugin called sys.exit({exit_request.code!r}); the analysis did not finish", debug
        )
    except Exception as error:  # anything else is still reported in one line, not a traceback
        lines = str(error).strip().splitlines()
        return _fail(
            f"internal error: {type(error).__name__}: {lines[0] if lines else ''} (run with --debug for details)", debug
        )


def _fail(message: str, debug: bool) -> int:
    """One line on stderr. qlint's own messages are one line; a newline in one comes from a
    name (a file called "a\nb.pt2") and is shown escaped rather than cutting the message."""
    if debug:
        traceback.print_exc()
    print(f"qlint: error: {printable(message.strip()) or 'error'}", file=sys.stderr)
    return EXIT_ERROR


def _commands() -> dict[str, Callable[[list[str]], int]]:
    from qlint.cli.plan import plan_command
    from qlint.cli.quantize import quantize_command
    from qlint.cli.verify import fix_command, verify_command

    return {
        "rule": _cmd_rule,
        "rules": _cmd_rules,
        "compare": _cmd_compare,
        "verify": verify_command,
        "fix": fix_command,
        "quantize": quantize_command,
        "plan": plan_command,
    }


# Flags without a value that users put before a command (`qlint --debug verify ...`): they
# belong to the command, which gets them after its name.
_LEADING_FLAGS = frozenset({"--debug", "-q", "--quiet", "--trust-pickle", "--trust-config"})


def _dispatch(argv: list[str]) -> int:
    leading = 0
    while leading < len(argv) and argv[leading] in _LEADING_FLAGS:
        leading += 1
    if leading < len(argv) and argv[leading] in COMMAND_SUMMARIES and not Path(argv[leading]).is_file():
        return _commands()[argv[leading]](argv[:leading] + argv[leading + 1 :])
    if argv and argv[0] in ("--version", "-V"):
        from qlint.version import __version__

        write_stdout(f"qlint {__version__}\n")
        return EXIT_CLEAN
    return _cmd_lint(argv)


def _cmd_lint(argv: list[str]) -> int:
    from qlint.cli.lint import run_lint

    args = build_lint_parser().parse_args(argv)
    return run_lint(args)


def _cmd_rule(argv: list[str]) -> int:
    from qlint.linter.docs import rule_markdown
    from qlint.linter.registry import Registry

    parser = Parser(prog="qlint rule", description="Print a rule's documentation.")
    parser.add_argument("code", help="rule code or name, such as QL101 or unfused-pattern")
    parser.add_argument("--debug", action="store_true")
    args = parser.parse_args(argv)
    from qlint.numeric.diagnostic_docs import DIAGNOSTIC_DOCS

    diagnostic = DIAGNOSTIC_DOCS.get(args.code.strip().upper())
    if diagnostic is not None:
        write_stdout(diagnostic)
        return EXIT_CLEAN
    write_stdout(rule_markdown(Registry.default().get(args.code)) + "\n")
    return EXIT_CLEAN


def _cmd_rules(argv: list[str]) -> int:
    import io
    import json

    from qlint.linter.registry import Registry

    parser = Parser(prog="qlint rules", description="List every rule.")
    parser.add_argument("--format", choices=("text", "json"), default="text")
    parser.add_argument("--debug", action="store_true")
    args = parser.parse_args(argv)
    rules = Registry.default().all()
    if args.format == "json":
        payload = [
            {
                "code": r.code,
                "name": r.name,
                "summary": r.summary,
                "severity": r.severity.value,
                "requires": sorted(n.value for n in r.requires),
                "options": r.Options.model_json_schema().get("properties", {}),
            }
            for r in rules
        ]
        write_stdout(json.dumps(payload, indent=2) + "\n")
        return EXIT_CLEAN
    from rich.table import Table

    from qlint.render.text import literal, make_console

    table = Table(title="qlint rules")
    for column in ("Code", "Name", "Severity", "Needs", "Summary"):
        table.add_column(column)
    for rule in rules:
        table.add_row(
            *(
                literal(cell)
                for cell in (
                    rule.code,
                    rule.name,
                    rule.severity.value,
                    ", ".join(sorted(n.value for n in rule.requires)),
                    rule.summary,
                )
            )
        )
    buffer = io.StringIO()
    to_terminal = sys.stdout is not None and sys.stdout.isatty()
    make_console(buffer, color=None if to_terminal else False, width=terminal_width() or 140).print(table)
    write_stdout(buffer.getvalue())
    return EXIT_CLEAN


def _cmd_compare(argv: list[str]) -> int:
    from qlint.cli.compare import add_compare_arguments, run_compare

    parser = Parser(prog="qlint compare", description="Compare a float model with its quantized version.")
    add_compare_arguments(parser)
    parser.add_argument("--debug", action="store_true")
    return run_compare(parser.parse_args(argv))
