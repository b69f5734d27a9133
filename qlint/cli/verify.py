"""``qlint verify`` and ``qlint fix`` (``qlint quantize``: :mod:`qlint.cli.quantize`).

    qlint verify MODEL --plan plan.json --calibration DATA --eval-data DATA
                 [--target-sqnr DB] [--backend B] [--format text|json] [-o FILE]
                 [--no-prune] [--no-scheme-search] [--max-scheme-trials N]
    qlint fix MODEL [--plan plan.json] --output out.pt|out.pt2 [--emit-qconfig q.py (.pt output only)]
              [--input-shape SHAPE | --example-inputs FILE] [--calibration DATA]

MODEL is anything qlint.core.load.load_model reads (module:factory [--weights], .pt2,
.pt with --trust-pickle). Data files are loaded with weights_only=True. Every user error
is a QlintError: one line on stderr, exit 2.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from qlint.cli.common import (
    EXIT_FINDINGS,
    Parser,
    check_outputs,
    finite_float,
    fraction,
    non_negative_int,
    terminal_width,
    user_output_to_stderr,
    write_file,
    write_stdout,
)
from qlint.core.backends import BACKENDS
from qlint.errors import ConfigError, QlintError, first_line
from qlint.render.literal import printable


def model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="a .pt2 / .pt file, or package.module:factory")
    parser.add_argument("--weights", metavar="FILE", help="state_dict for a module:factory model")
    parser.add_argument(
        "--trust-pickle", action="store_true", help="trust the model file (.pt or .pt2): allows code from it to run"
    )
    parser.add_argument("--plan", metavar="PLAN.json", help="a qlint plan (default: the backend defaults)")
    parser.add_argument("--backend", choices=BACKENDS)
    parser.add_argument("--debug", action="store_true")


def _example_arguments(parser: argparse.ArgumentParser) -> None:
    """Only fix, which exports the rewritten model, takes example inputs; verify and quantize run
    the model on their calibration batches, so there these flags are unknown (exit 2) rather
    than accepted and ignored."""
    parser.add_argument("--input-shape", action="append", metavar="SHAPE[:DTYPE]")
    parser.add_argument("--example-inputs", metavar="FILE")


def load_model_and_plan(args: argparse.Namespace):
    from qlint.advice.plan import QuantPlan, default_plan
    from qlint.core.load import load_model

    loaded = load_model(args.model, weights=args.weights, trust_pickle=args.trust_pickle)
    plan = QuantPlan.load(args.plan) if args.plan else default_plan(args.backend or "x86", model=loaded.name)
    if args.backend:
        plan = plan.model_copy(update={"backend": args.backend})
    return loaded, plan


def _example(args: argparse.Namespace, loaded: Any) -> tuple[Any, ...] | None:
    """fix's example inputs: from --example-inputs, --input-shape or the model file."""
    from qlint.core.load import load_example_inputs, parse_input_shape

    if args.example_inputs:
        return load_example_inputs(args.example_inputs)
    if args.input_shape:
        return tuple(parse_input_shape(s) for s in args.input_shape)
    return loaded.example_inputs


# ------------------------------------------------------------------------------ verify
@contextlib.contextmanager
def trial_progress() -> Iterator[Callable[[str, int, int], None]]:
    """What verify is quantizing: a live line naming the trial on a terminal, a log line
    per quantization otherwise (each one takes about a PTQ run, so a log never looks hung)."""
    stream = sys.stderr
    if stream is None:
        yield lambda label, done, budget: None
        return
    if not stream.isatty():

        def log(label: str, done: int, budget: int) -> None:
            # the count is of the trial budget spent so far: measuring the default, the plan as given
            # and the verified plan spends none
            print(printable(f"qlint verify: {label} ({done} of {budget} trials used)"), file=stream, flush=True)

        yield log
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(
        TextColumn("verify"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        console=Console(file=stream),
        transient=True,
    )
    task = bar.add_task("", total=None)

    def show(label: str, done: int, budget: int) -> None:
        bar.update(task, completed=done, total=budget, description=printable(label))

    with bar:
        yield show


def _verify_parser() -> argparse.ArgumentParser:
    from qlint.advice.verify import DEFAULT_MAX_TRIALS, DEFAULT_SCHEME_TRIALS
    from qlint.advice.verify_search import ACTIVATION_BITS_TRIALS

    parser = Parser(
        prog="qlint verify",
        description="Quantize with the backend default and with a plan; "
        "compare SQNR, int8 coverage and size side by side.",
    )
    model_arguments(parser)
    parser.add_argument(
        "--calibration",
        required=True,
        metavar="DATA",
        help="FILE_OR_DIR of saved batches, or module:function returning them",
    )
    parser.add_argument(
        "--eval-data",
        required=True,
        metavar="DATA",
        help="held-out batches (same forms): the reported numbers come from them, and they decide nothing",
    )
    parser.add_argument(
        "--selection-data",
        metavar="DATA",
        help="batches that choose between plans (default: the last 4 calibration batches)",
    )
    parser.add_argument(
        "--max-trials",
        type=non_negative_int,
        default=DEFAULT_MAX_TRIALS,
        metavar="N",
        help=f"at most N trial quantizations in all (default {DEFAULT_MAX_TRIALS}), taken in order: 1 for bias "
        f"correction, up to {ACTIVATION_BITS_TRIALS} for 8-bit activations (VNNI CPUs), half of what is left for "
        "pruning (all of it when no later step runs), up to --max-scheme-trials for the scheme search, the rest for "
        "the --target-sqnr fallback; each costs about one prepare + calibrate + convert",
    )
    parser.add_argument("--target-sqnr", type=finite_float, metavar="DB")
    parser.add_argument(
        "--max-float-fraction",
        type=fraction,
        default=0.1,
        metavar="F",
        help="at most this fraction of conv+linear layers kept float (default 0.1)",
    )
    parser.add_argument("--no-prune", action="store_true", help="keep every plan decision")
    parser.add_argument(
        "--no-scheme-search", action="store_true", help="do not try Linear layers static <-> dynamic (on by default)"
    )
    parser.add_argument(
        "--no-bias-correction",
        action="store_true",
        help="do not try bias correction (on by default; a plan that has it needs qlint quantize)",
    )
    parser.add_argument(
        "--max-scheme-trials",
        type=non_negative_int,
        default=DEFAULT_SCHEME_TRIALS,
        metavar="N",
        help=f"at most N trial quantizations in the scheme search (default {DEFAULT_SCHEME_TRIALS})",
    )
    parser.add_argument("--format", choices=("text", "json"), default="text")
    parser.add_argument("--output", "-o", metavar="FILE", help="write the report to FILE")
    parser.add_argument("--emit-plan", metavar="FILE", help="write the verified plan (JSON)")
    return parser


def _fmt(value: float | None, suffix: str = " dB") -> str:
    return "-" if value is None else f"{value:.2f}{suffix}"


def render_verify(report: Any, width: int | None = 120) -> str:
    from rich.table import Table

    from qlint.render.text import literal, make_console

    buffer = io.StringIO()
    console = make_console(buffer, color=False, width=width or 120)
    table = Table(
        title=literal(f"qlint verify: {report.model} on {report.backend} ({report.eval_batches} eval batches)")
    )
    for column in ("", "default mapping", "plan as given", "verified plan"):
        table.add_column(column, justify="right" if column else "left")
    rows = [
        ("output SQNR", lambda r: "FAILED" if r.failure else _fmt(r.sqnr_db)),
        # a failed run built no model: nothing to count
        (
            "int8 conv/linear/recurrent/attention ops",
            lambda r: "-" if r.failure else f"{r.int8_layers}/{r.total_layers} ({r.int8_fraction:.0%})",
        ),
        ("size", lambda r: "-" if r.failure else f"{r.size_bytes / 1024:.1f} KiB"),
    ]
    if report.default.metric is not None:
        rows.append(("metric", lambda r: "-" if r.metric is None else f"{r.metric:.4g}"))
    for label, get in rows:
        table.add_row(label, *(literal(get(r)) for r in (report.default, report.requested, report.plan)))
    layers = Table(title="per layer (activation SQNR)")
    for column in ("layer", "kind", "default", "plan", "plan int8"):
        layers.add_column(column)
    for row in report.layers:
        layers.add_row(
            literal(row.fqn),
            literal(row.kind),
            _fmt(row.default_sqnr_db),
            _fmt(row.plan_sqnr_db),
            "yes" if row.plan_int8 else "FLOAT",
        )
    console.print(table)
    if report.layers:
        console.print(layers)
    lines = [buffer.getvalue().rstrip("\n")]
    for run in (report.default, report.requested, report.plan):
        if run.failure:
            lines.append(printable(f"{run.label} failed: {run.failure}"))
    gain = report.sqnr_gain_db
    if gain is not None:
        lines.append(f"SQNR gain over default: {gain:+.2f} dB")
    lines.append(
        printable(
            f"decisions selected on {report.selected_on} ({report.trials} of {report.max_trials} trials); "
            f"numbers above from {report.eval_batches} eval batches not used for selection"
        )
    )
    for rewrite in report.left_out_rewrites:
        line = f"plan rewrite {rewrite.kind} {'+'.join(rewrite.modules)} NOT applied ({rewrite.reason}): left out"
        lines += textwrap.wrap(printable(line), width=width or 120, subsequent_indent="    ")
    for rewrite in report.rewrites:
        if rewrite.applied and rewrite.note:  # e.g. channels an equalization drops in int8 by design
            note = f"{rewrite.kind} {' -> '.join(rewrite.modules)}: {rewrite.note}"
            lines += textwrap.wrap(printable(note), width=width or 120, subsequent_indent="    ")
    if report.target_sqnr_db is not None:
        lines.append(f"target {report.target_sqnr_db:g} dB: {'met' if report.target_met else 'NOT met'}")
    for d in report.decisions:
        if d.kind == "scheme":  # a trial: "with" is the SQNR after the flip, "without" before it
            line = (
                f"{'kept    ' if d.kept else 'rejected'} scheme {d.target} ({d.detail}): "
                f"{_fmt(d.sqnr_with_db)} after, {_fmt(d.sqnr_without_db)} before"
            )
        else:
            line = (
                f"{'kept   ' if d.kept else 'dropped'} {d.kind} {d.target}: {_fmt(d.sqnr_with_db)} with, "
                f"{_fmt(d.sqnr_without_db)} without ({d.why()})" + (f"; {d.detail}" if d.detail else "")
            )
        lines += textwrap.wrap(printable(line), width=width or 120, initial_indent="  ", subsequent_indent="      ")
    for note in report.notes:
        lines += textwrap.wrap(printable(f"note: {note}"), width=width or 120, subsequent_indent="    ")
    return "\n".join(lines) + "\n"


def verify_command(argv: list[str]) -> int:
    args = _verify_parser().parse_args(argv)
    check_outputs(
        [("--output", args.output), ("--emit-plan", args.emit_plan)],
        [
            args.model,
            args.weights,
            args.plan,
            args.calibration,
            args.eval_data,
            args.selection_data,
        ],
    )
    from qlint.advice.verify import verify
    from qlint.core.load import load_batches

    with user_output_to_stderr():
        loaded, plan = load_model_and_plan(args)
        calibration = load_batches(args.calibration)
        eval_data = load_batches(args.eval_data)
        selection = load_batches(args.selection_data) if args.selection_data else None
        with trial_progress() as progress:
            report = verify(
                loaded.module,
                plan,
                calibration,
                eval_data,
                selection_data=selection,
                target_sqnr=args.target_sqnr,
                bias_correction=not args.no_bias_correction,
                prune=not args.no_prune,
                max_trials=args.max_trials,
                max_float_fraction=args.max_float_fraction,
                search_schemes=not args.no_scheme_search,
                max_scheme_trials=args.max_scheme_trials,
                model_name=loaded.name,
                progress=progress,
            )
    text = (
        report.model_dump_json(indent=2) + "\n"
        if args.format == "json"
        else render_verify(report, width=terminal_width(to_stdout=args.output is None))
    )
    if args.emit_plan:
        write_file(args.emit_plan, report.verified_plan.model_dump_json(indent=2) + "\n")
    if args.output:
        write_file(args.output, text)
    else:
        write_stdout(text)
    return 0


# --------------------------------------------------------------------------------- fix
def _fix_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="qlint fix",
        description="Apply a plan's float-preserving rewrites (and, with --calibration, its equalization) "
        "and save the model.",
    )
    model_arguments(parser)
    _example_arguments(parser)
    parser.add_argument(
        "--calibration",
        metavar="DATA",
        help="FILE_OR_DIR of saved batches, or module:function returning them: the batches the plan's "
        "equalization rescale reads its ranges from (calibrate the fixed model on the same ones)",
    )
    parser.add_argument(
        "--output",
        "-o",
        required=True,
        metavar="OUT.pt|OUT.pt2",
        help=".pt: the GraphModule (torch.load(path, weights_only=False)), for prepare_fx and --emit-qconfig; "
        ".pt2: torch.export",
    )
    parser.add_argument(
        "--emit-qconfig",
        metavar="FILE.py",
        help="write the Python file building the plan's prepare_fx mapping (needs a .pt --output)",
    )
    return parser


def _refuse_aten_mapping(model: str, aten_model: bool) -> None:
    """prepare_fx quantizes no op of an exported (aten) graph: a .pt2's ``.module()`` quantized
    with the emitted mapping came out as the float model (silero_vad: 127.9 dB output SQNR, against
    18.18 dB for the same mapping on the .pt), and nothing said so. ``aten_model``: the model
    itself is one (then a .pt output is no better), else only the .pt2 output would be."""
    if not aten_model:
        raise ConfigError(
            "--emit-qconfig writes a prepare_fx mapping, and prepare_fx quantizes nothing in a .pt2's exported "
            "graph: save the fixed model with --output FIXED.pt, or build the int8 model in one step with "
            "qlint quantize MODEL --plan PLAN --calibration DATA --output int8.pt"
        )
    raise ConfigError(
        f"--emit-qconfig: {printable(model)} is an exported (aten) graph, in which prepare_fx quantizes nothing: "
        "quantize it with the pt2e flow (qlint quantize MODEL --plan PLAN --calibration DATA --output int8.pt2), "
        "or run qlint fix on the nn.Module (module:factory)"
    )


def fix_command(argv: list[str]) -> int:
    args = _fix_parser().parse_args(argv)
    from qlint.advice.apply import fixed_model

    out = Path(args.output)
    if out.suffix not in (".pt2", ".pt"):
        raise ConfigError(f"--output must end in .pt2 (torch.export) or .pt (GraphModule state), got {out.name}")
    check_outputs(
        [("--output", args.output), ("--emit-qconfig", args.emit_qconfig)],
        [args.model, args.weights, args.plan, args.example_inputs, args.calibration],
    )
    if args.input_shape and args.example_inputs:
        raise ConfigError("--input-shape and --example-inputs both give the example inputs: pass one")
    from qlint.advice.verify_session import batch_list
    from qlint.core.batches import first_batch_as_example
    from qlint.core.load import load_batches
    from qlint.core.ops import is_aten_graph

    with user_output_to_stderr():
        loaded, plan = load_model_and_plan(args)
        if args.emit_qconfig and (is_aten_graph(loaded.module) or out.suffix == ".pt2"):
            _refuse_aten_mapping(args.model, aten_model=is_aten_graph(loaded.module))
        # a plan with no QConfigMapping (pt2e) is refused here, before any file is written
        mapping_file = plan.to_python() if args.emit_qconfig else None
        calibration = batch_list(load_batches(args.calibration), "calibration") if args.calibration else []
        example = _example(args, loaded)
        if not example and calibration:
            example = first_batch_as_example(calibration)  # as lint, verify and quantize take it
            if example:
                print(
                    "note: example inputs: the first calibration batch (pass --example-inputs to choose others)",
                    file=sys.stderr,
                )
        if not example:
            raise ConfigError(
                "qlint fix needs example inputs: pass --input-shape, --example-inputs or --calibration (whose first "
                "batch, if it holds positional inputs, serves as them)"
            )
        # with --plan, exactly the plan's rewrites (what QuantPlan.quantize applies), and its equalization
        # when there are batches to read the ranges from; else every rewrite the graph allows
        gm, applied, folded = fixed_model(loaded.module, plan if args.plan else None, example, calibration)
        _save_fixed(gm, example, out)
    done = [r for r in applied if r.applied]
    if args.emit_qconfig and mapping_file is not None:
        write_file(args.emit_qconfig, mapping_file)
    for r in applied:
        state = "applied" if r.applied else f"refused ({r.reason})"
        print(printable(f"{r.kind} {'+'.join(r.modules)}: {state}"), file=sys.stderr)
    if plan.equalization and not calibration:
        # the rescale's per-channel scales come from calibration ranges: without data the saved model
        # lacks it, and quantizing it with the plan's mapping misses the gain lint and verify measured
        print(
            printable(
                f"note: the plan's equalization ({', '.join(pair.module for pair in plan.equalization)}) was not "
                "applied: its rescale reads per-channel ranges from calibration data; pass --calibration DATA "
                "(the batches you will calibrate on), or build the int8 model with qlint quantize"
            ),
            file=sys.stderr,
        )
    if plan.bias_correction is not None:
        print(
            "note: the plan's bias correction happens after calibration, so neither the saved model nor "
            "its mapping has it: qlint quantize builds the int8 model with it",
            file=sys.stderr,
        )
    # with a plan, a rewrite it asks for that was not applied means the saved model is not the plan's:
    # exit 1, as lint exits 1 on findings (the file is written; each one is named above)
    missed = [r for r in applied if not r.applied] if args.plan else []
    if missed and is_aten_graph(loaded.module):
        print(
            "note: this model is an exported (aten) graph: qlint's rewrites and equalization change an "
            "nn.Module's graph; run qlint fix on the nn.Module (module:factory) before torch.export",
            file=sys.stderr,
        )
    folds = ", BatchNorms folded into their conv/linear" if folded else ""
    lacking = f"; {len(missed)} of the plan's NOT applied, named on stderr" if missed else ""
    write_stdout(f"wrote {printable(out)} ({len(done)} rewrite(s) applied{folds}{lacking})\n")
    return EXIT_FINDINGS if missed else 0


def _save_fixed(gm: Any, example: Any, out: Path) -> None:
    """A .pt2 (torch.export) or a .pt holding the whole GraphModule: ``torch.load(path,
    weights_only=False)`` or ``qlint out.pt --trust-pickle`` reads it (it is your own file)."""
    import torch

    if out.suffix == ".pt2":
        try:
            program = torch.export.export(gm, tuple(example))
            torch.export.save(program, str(out))
        except Exception as error:  # export failures come in many types
            raise QlintError(f"cannot export the rewritten model: {first_line(error)}") from error
        return
    try:
        torch.save(gm, str(out))
    except OSError as error:
        raise QlintError(f"cannot write {out}: {error.strerror}") from error


__all__ = ["verify_command", "fix_command", "render_verify"]
