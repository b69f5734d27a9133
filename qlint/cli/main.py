"""The ``qlint`` command line.

    qlint MODEL [options]        lint a model (exit 0 clean, 1 findings, 2 usage/load error)
    qlint rule CODE              print one rule's documentation
    qlint rules [--format json]  list every rule
    qlint compare FLOAT QUANT    per-layer float vs quantized comparison
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path
from typing import Callable, Optional, Sequence

from qlint.errors import ConfigError, QlintError

EXIT_CLEAN, EXIT_FINDINGS, EXIT_ERROR = 0, 1, 2


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr and exit 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(f"{message} (see '{self.prog} --help')")


def _split_list(values: Optional[Sequence[str]]) -> Optional[list[str]]:
    if not values:
        return None
    return [part.strip() for value in values for part in value.split(",") if part.strip()]


def build_lint_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="qlint", description="Lint a PyTorch model for quantization problems.",
                     epilog="Other commands: 'qlint rule CODE', 'qlint rules', 'qlint compare FLOAT QUANT'.")
    parser.add_argument("model", nargs="+",
                        help="one or more .pt2 / .pt / .pth files, or package.module:factory")
    parser.add_argument("--input-shape", action="append", metavar="SHAPE[:DTYPE]",
                        help="example input shape such as 1,3,224,224 (repeat for several inputs)")
    parser.add_argument("--example-inputs", metavar="FILE", help="a tensor or tuple of tensors (weights_only)")
    parser.add_argument("--weights", metavar="FILE", help="state_dict for a module:factory model")
    parser.add_argument("--trust-pickle", action="store_true",
                        help="trust the model file: unpickle a whole .pt module, load a .pt2's pickled or "
                             "compiled members (runs code from the file)")
    parser.add_argument("--backend", choices=("x86", "fbgemm", "qnnpack", "onednn"))
    parser.add_argument("--qconfig-mapping", metavar="MODULE:ATTR",
                        help="your QConfigMapping (or a function returning one)")
    parser.add_argument("--select", action="append", metavar="CODES", help="rule codes, prefixes or names")
    parser.add_argument("--ignore", action="append", metavar="CODES", help="rule codes, prefixes or names")
    parser.add_argument("--format", choices=("text", "json", "sarif", "github"))
    parser.add_argument("--output", "-o", metavar="FILE", help="write the report to FILE")
    parser.add_argument("--fail-on", choices=("error", "warning", "info"))
    parser.add_argument("--show-qconfig", action="store_true", help="print the resolved qconfig per node")
    parser.add_argument("--calibration", metavar="FILE_OR_DIR", help="calibration batches (weights_only)")
    parser.add_argument("--num-batches", type=int, metavar="N", help="use at most N calibration batches")
    parser.add_argument("--random-calibration", type=int, metavar="N",
                        help="calibrate on N random batches shaped like the example inputs (a warning)")
    parser.add_argument("--baseline", metavar="FILE", help="report only findings not recorded in FILE")
    parser.add_argument("--write-baseline", action="store_true", help="record current findings in --baseline")
    parser.add_argument("--emit-plan", metavar="FILE", help="write the quantization plan (JSON)")
    parser.add_argument("--emit-qconfig", metavar="FILE", help="write a Python file building the QConfigMapping")
    parser.add_argument("--config", metavar="PYPROJECT", help="settings file (default: nearest pyproject.toml)")
    parser.add_argument("--quiet", "-q", action="store_true", help="no progress output")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args_list
    if not debug:
        import warnings

        # torch's deprecation chatter is not about the user's model; --debug shows it.
        warnings.filterwarnings("ignore")
    try:
        return _dispatch(args_list)
    except QlintError as error:
        return _fail(str(error), debug)
    except BrokenPipeError:
        # The reader (e.g. `| head`) went away; that is not an error of ours.
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_CLEAN
    except KeyboardInterrupt:
        return _fail("interrupted", debug)
    except Exception as error:  # anything else is still reported in one line, not a traceback
        return _fail(f"internal error: {type(error).__name__}: {error} (run with --debug for details)", debug)


def _fail(message: str, debug: bool) -> int:
    if debug:
        traceback.print_exc()
    first = message.strip().splitlines()[0] if message.strip() else "error"
    print(f"qlint: error: {first}", file=sys.stderr)
    return EXIT_ERROR


def _dispatch(argv: list[str]) -> int:
    commands: dict[str, Callable[[list[str]], int]] = {
        "rule": _cmd_rule, "rules": _cmd_rules, "compare": _cmd_compare,
    }
    for name, command in _extra_commands().items():
        commands.setdefault(name, command)
    if argv and argv[0] in commands and not Path(argv[0]).is_file():
        return commands[argv[0]](argv[1:])
    if argv and argv[0] in ("--version", "-V"):
        from qlint import __version__

        print(f"qlint {__version__}")
        return EXIT_CLEAN
    return _cmd_lint(argv)


def _extra_commands() -> dict[str, Callable[[list[str]], int]]:
    """Commands provided by optional modules (plan, verify, fix) when present."""
    found: dict[str, Callable[[list[str]], int]] = {}
    try:
        from qlint.cli.plan import COMMANDS  # type: ignore[import-not-found]
    except ImportError:
        return found
    found.update(COMMANDS)
    return found


def _cmd_lint(argv: list[str]) -> int:
    from qlint.cli.lint import run_lint

    args = build_lint_parser().parse_args(argv)
    return run_lint(args)


def _cmd_rule(argv: list[str]) -> int:
    from qlint.linter.docs import rule_markdown
    from qlint.linter.registry import Registry

    parser = _Parser(prog="qlint rule", description="Print a rule's documentation.")
    parser.add_argument("code", help="rule code or name, such as QL101 or unfused-pattern")
    parser.add_argument("--debug", action="store_true")
    args = parser.parse_args(argv)
    print(rule_markdown(Registry.default().get(args.code)))
    return EXIT_CLEAN


def _cmd_rules(argv: list[str]) -> int:
    import json

    from qlint.linter.registry import Registry

    parser = _Parser(prog="qlint rules", description="List every rule.")
    parser.add_argument("--format", choices=("text", "json"), default="text")
    parser.add_argument("--debug", action="store_true")
    args = parser.parse_args(argv)
    rules = Registry.default().all()
    if args.format == "json":
        payload = [{"code": r.code, "name": r.name, "summary": r.summary, "severity": r.severity.value,
                    "requires": sorted(n.value for n in r.requires),
                    "options": r.Options.model_json_schema().get("properties", {})} for r in rules]
        print(json.dumps(payload, indent=2))
        return EXIT_CLEAN
    from rich.table import Table

    from qlint.render.text import make_console

    table = Table(title="qlint rules")
    for column in ("Code", "Name", "Severity", "Needs", "Summary"):
        table.add_column(column)
    for rule in rules:
        table.add_row(rule.code, rule.name, rule.severity.value,
                      ", ".join(sorted(n.value for n in rule.requires)), rule.summary)
    make_console(width=140).print(table)
    return EXIT_CLEAN


def _cmd_compare(argv: list[str]) -> int:
    try:
        from qlint.cli.compare import add_compare_arguments, run_compare
    except ImportError as error:
        raise QlintError(f"qlint compare is unavailable: {error}") from error
    parser = _Parser(prog="qlint compare", description="Compare a float model with its quantized version.")
    add_compare_arguments(parser)
    if not any(a.dest == "debug" for a in parser._actions):
        parser.add_argument("--debug", action="store_true")
    return run_compare(parser.parse_args(argv))

