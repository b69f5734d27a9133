"""`qlint compare FLOAT QUANT --calibration DATA`: the numeric suite on the command line.

Models and data are loaded by ``load_model_arg``/``load_data_arg`` alone, so that the project's
model loader can replace it in one place.
"""

from __future__ import annotations

import argparse
import io
import sys
import traceback
from collections import Counter
from pathlib import Path
from typing import Any, TextIO

import torch
from rich.console import Console
from rich.table import Table
from rich.text import Text

from qlint.cli.common import (
    check_outputs,
    finite_float,
    non_negative_int,
    positive_int,
    terminal_width,
    user_output_to_stderr,
    write_stdout,
)
from qlint.core.backends import BACKENDS
from qlint.core.batches import batches_of
from qlint.core.exported import is_exported_module, put_in_eval
from qlint.errors import ConfigError, QlintError
from qlint.linter.findings import CompareRow, Notice, Report, Severity
from qlint.numeric.badcase_summary import BadCaseSummary
from qlint.numeric.badcases import compare_badcases, find_badcases
from qlint.numeric.compare import MODES, CompareReport, compare_report
from qlint.numeric.diagnose import DEFAULT_SQNR_THRESHOLD_DB, DEFAULT_WEIGHT_SQNR_THRESHOLD_DB
from qlint.numeric.display import (
    badcase_cells,
    badcase_column,
    badcase_title,
    describe_sqnr,
    error_cell,
    error_heading,
    error_notes,
    error_summary,
    format_sqnr,
    layer_label,
    ranked_label,
    sqnr_columns,
    sqnr_notes,
    worst_inputs_heading,
)
from qlint.numeric.histograms import activation_histograms, worst_layers
from qlint.numeric.html import write_html
from qlint.numeric.next_step import NextStep
from qlint.numeric.sensitivity import SensitivityRow, sensitivity_rows
from qlint.render.literal import printable
from qlint.render.text import literal, make_console

EXIT_CLEAN, EXIT_FINDINGS, EXIT_USAGE = 0, 1, 2


def load_model_arg(spec: str, trust_pickle: bool = False) -> torch.nn.Module:
    """FLOAT or QUANT: anything qlint's safe loader takes (.pt2, .pt, module:factory)."""
    from qlint.core.load import load_model

    return _ready_for_eval(spec, load_model(spec, trust_pickle=trust_pickle).module)


def _ready_for_eval(spec: str, module: Any) -> Any:
    """The model, refused in one line when it is an exported module that runs in training mode
    (compare needs both models as they run in inference; qlint.core.exported)."""
    if isinstance(module, torch.nn.Module):
        put_in_eval(module, spec)
    return module


def load_data_arg(spec: str) -> Any:
    """Batches: a saved tensor/list or folder (weights_only), or package.module:function."""
    from qlint.core.load import load_batches

    return load_batches(spec)


def add_compare_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument(
        "float_model",
        metavar="FLOAT",
        help="float model: package.module:factory, .pt or .pt2 (exported in eval mode; its layers are aten ops, "
        "which pair with the ops of a pt2e-converted QUANT, not with quantized modules)",
    )
    parser.add_argument(
        "quantized_model",
        metavar="QUANT",
        help="quantized counterpart (prepared, FX-converted, dynamic or eager): package.module:factory",
    )
    parser.add_argument(
        "--calibration",
        metavar="DATA",
        required=True,
        help="batches to compare on: a .pt file holding a list of batches (or one tensor), "
        "or package.module:factory returning an iterable of batches",
    )
    parser.add_argument("--html", metavar="PATH", help="also write a self-contained HTML report")
    parser.add_argument("--format", choices=("text", "json"), default="text", help="stdout format")
    parser.add_argument(
        "--badcases",
        metavar="N",
        type=non_negative_int,
        default=0,
        help="find the N worst inputs per metric (output SQNR, cosine, mean and max absolute error; each taken on "
        "every floating-point output, a sample scored by its worst output), save them and compare on them alone; "
        'text: a table and that comparison, JSON: "badcases", HTML: the "Worst inputs" section',
    )
    parser.add_argument("--badcases-path", metavar="PATH", default="badcases.pt", help="where --badcases saves")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated: propagated,shadow")
    parser.add_argument(
        "--sqnr-threshold",
        type=finite_float,
        default=DEFAULT_SQNR_THRESHOLD_DB,
        help="QL301 threshold for a layer's local activation SQNR, dB",
    )
    parser.add_argument(
        "--weight-sqnr-threshold",
        type=finite_float,
        default=DEFAULT_WEIGHT_SQNR_THRESHOLD_DB,
        help="QL301 threshold for weight SQNR, dB",
    )
    parser.add_argument(
        "--sensitivity",
        action="store_true",
        help="rank QUANT's layers by how much of the error each adds reaches the model output (QUANT as given: "
        "nothing is re-quantized); text: the top 10 on one line with the output SQNR measured with only that layer "
        'quantized, JSON: the "sensitivity" list (one entry per '
        "layer, most sensitive first: name, kind, score, output_sqnr_db, local_sqnr_db, flops, "
        "flops_share, params, params_share, calls: a module the model calls several times is ranked once, every "
        "call together; not_measured: why a layer's number could not be measured, that layer ranked last and named "
        "in a warning), HTML: the ranking table",
    )
    parser.add_argument(
        "--backend",
        default="x86",
        choices=BACKENDS,
        help='the backend QUANT was quantized for, a label: it is written in the report (JSON "backend", the '
        "HTML header) and is the default mapping a plan made from the report's keep-float fixes starts from; "
        "compare runs QUANT as given, whatever it says",
    )
    parser.add_argument("--max-batches", type=positive_int, default=None, help="use at most this many batches")
    parser.add_argument(
        "--trust-pickle", action="store_true", help="trust the model files (.pt or .pt2): allows code from them to run"
    )
    return parser


def layer_table(report: Report) -> Table:
    table = Table(title=literal(f"{report.model}: {report.frontend} vs float"))
    rows = report.compare_rows()
    sqnr = sqnr_columns(rows)
    headings = ["layer", "kind", *(f"{mode} dB" for mode, _ in sqnr)]
    headings += [error_heading(metric, rows, separator="\n") for metric in ("cosine", "RMSE/scale")]
    for column in headings:
        table.add_column(column, justify="left" if column in ("layer", "kind") else "right")

    def number(value: float | None, digits: int = 1) -> str:
        return "" if value is None else f"{value:.{digits}f}"

    sqnr_values: list[float | None] = []
    for row in rows:
        sqnr_values += [value(row) for _, value in sqnr]
        table.add_row(
            literal(layer_label(row)),
            literal(row.kind or ""),
            *(format_sqnr(value(row)) for _, value in sqnr),
            error_cell(number(row.cosine, 5), row, rows),
            error_cell(number(error_summary(row).get("rmse_over_scale"), 2), row, rows),
        )
    notes = sqnr_notes(sqnr_values) + error_notes(rows)
    if notes:
        table.caption, table.caption_justify = Text("\n".join(notes), style="dim"), "left"
    return table


def badcase_table(summary: BadCaseSummary) -> Table:
    """Per metric, the worst samples and their values (and the output that scored worst, for a
    model with several outputs)."""
    table = Table(title=literal(badcase_title(summary)))
    table.add_column("metric")
    table.add_column(badcase_column(summary))
    for metric in summary.worst:
        table.add_row(literal(metric.description), literal(badcase_cells(metric, summary)))
    return table


def print_text(report: Report, console: Console) -> None:
    console.print(layer_table(report))
    for notice in report.notices:
        console.print(literal(f"{notice.level.value}: {notice.message}", "dim"))
    for finding in report.findings:
        style = {Severity.ERROR: "bold red", Severity.WARNING: "yellow"}.get(finding.severity, "")
        line = literal(f"{finding.rule} {finding.name}", style)
        line.append(printable(f" {finding.target}: {finding.message}"))
        console.print(line)


def print_next_step(step: NextStep, console: Console) -> None:
    """The next step's reason, then each command on a line of its own (unwrapped: copied as is)."""
    console.print(literal("next step: ", "bold") + literal(f"{step.reason}. Run:"))
    for command in step.commands:
        console.print(literal(f"  {command}"), soft_wrap=True)
    console.print(literal(step.explanation))


def _usage_error(message: object) -> int:
    print(f"qlint compare: {printable(str(message).strip()) or 'error'}", file=sys.stderr)
    return EXIT_USAGE


def _check_outputs(args: argparse.Namespace) -> None:
    if args.html and Path(args.html).is_dir():
        raise ConfigError(f"--html {args.html} is a directory; name the HTML file to write")
    outputs = [("--html", args.html), ("--badcases-path", args.badcases_path if args.badcases else None)]
    check_outputs(outputs, [args.float_model, args.quantized_model, args.calibration])


def run_compare(args: argparse.Namespace, stdout: TextIO | None = None) -> int:
    """Run the comparison; 0 clean, 1 findings, 2 unusable arguments."""
    modes = tuple(mode.strip() for mode in args.modes.split(",") if mode.strip())
    try:
        _check_outputs(args)
        with user_output_to_stderr():
            report = _compare(args, modes)
    except QlintError as error:
        if getattr(args, "debug", False):  # the README's promise: --debug shows the traceback
            traceback.print_exc()
        return _usage_error(error)
    if args.format == "json":
        # without a ranking, bad cases or a next step the document is a plain Report, which Report readers take
        absent = {"sensitivity"} if report.sensitivity is None else set()
        absent |= {"badcases"} if report.badcases is None else set()
        absent |= {"next_step"} if report.next_step is None else set()
        text = report.model_dump_json(indent=2, exclude=absent or None) + "\n"
    else:
        buffer = io.StringIO()
        width = terminal_width(to_stdout=stdout is None)
        to_terminal = stdout is None and sys.stdout is not None and sys.stdout.isatty()
        console = make_console(buffer, color=None if to_terminal else False, width=width or 140)
        print_text(report, console)
        if report.sensitivity:
            console.print(
                literal(
                    "sensitivity (most sensitive first; the output SQNR measured with only that layer quantized): "
                    + ", ".join(
                        f"{ranked_label(row.name, row.calls)} "
                        + ("not measured" if row.output_sqnr_db is None else describe_sqnr(row.output_sqnr_db))
                        for row in report.sensitivity[:10]
                    )
                )
            )
        if report.badcases is not None:
            console.print(badcase_table(report.badcases))
            console.print(literal(worst_inputs_heading(report.badcases), "bold"))
            print_text(report.badcases.report, console)
        if report.next_step is not None:  # last: what to do once the report is read
            print_next_step(report.next_step, console)
        text = buffer.getvalue()
    if stdout is not None:
        stdout.write(text)
    else:
        write_stdout(text)
    return EXIT_FINDINGS if report.findings else EXIT_CLEAN


def _note_layers_without_float(report: Report, spec: str, quantized_model: torch.nn.Module) -> Report:
    """Why QUANT's layers have no rows when FLOAT is an exported program (the report's warning
    names them): its layers are aten ops, which pair with a pt2e model's ops but not with modules."""
    from qlint.measure.matching import quantized_layer_modules

    compared = {row.extra.get("quantized_target") for row in report.compare_rows()}
    if all(fqn in compared for fqn in quantized_layer_modules(quantized_model)):
        return report
    notice = Notice(
        level=Severity.WARNING,
        message=(
            f"{spec} is an exported program, whose layers are aten ops, not modules: for rows of the "
            "quantized model's layer modules, give FLOAT as the nn.Module (package.module:factory)"
        ),
    )
    return report.model_copy(update={"notices": [*report.notices, notice]})


def _note_unranked_functional_layers(report: Report) -> Report:
    """Say which compared layers the sensitivity ranking leaves out: it ranks module layers
    only, and a model whose convs are functional (EfficientNet-Lite0's F.conv2d) would
    otherwise read as if its batch norms were its most sensitive layers."""
    kinds = Counter(row.kind or "op" for row in report.layers if isinstance(row, CompareRow) and row.functional)
    if not kinds:
        return report
    listed = ", ".join(f"{kind} x{count}" if count > 1 else kind for kind, count in kinds.most_common())
    notice = Notice(
        level=Severity.WARNING,
        message=f"the sensitivity ranking covers module layers only: {sum(kinds.values())} functional layers "
        f"compared above are not ranked ({listed}); FLOPs and params shares are of the whole model",
    )
    return report.model_copy(update={"notices": report.notices + [notice]})


def _note_unmeasured_layers(report: Report, ranking: list[SensitivityRow]) -> Report:
    """Name each layer the sensitivity pass could not measure, and why: the others are ranked."""
    notices = [
        Notice(level=Severity.WARNING, message=f"sensitivity of {row.name} not measured: {row.not_measured}")
        for row in ranking
        if row.not_measured is not None
    ]
    return report.model_copy(update={"notices": report.notices + notices}) if notices else report


def _compare(args: argparse.Namespace, modes: tuple[str, ...]) -> CompareReport:
    """The report, with the sensitivity ranking and the worst inputs when asked for; runs the user's models."""
    float_model = load_model_arg(args.float_model, args.trust_pickle)
    quantized_model = load_model_arg(args.quantized_model, args.trust_pickle)
    data = load_data_arg(args.calibration)
    if not isinstance(float_model, torch.nn.Module) or not isinstance(quantized_model, torch.nn.Module):
        raise ConfigError("FLOAT and QUANT must produce torch.nn.Module objects")
    data = list(batches_of(data, "calibration data"))  # several passes follow (compare, histograms, badcases)
    try:
        report: Report = compare_report(
            float_model,
            quantized_model,
            data,
            modes=modes,
            sqnr_threshold=args.sqnr_threshold,
            weight_sqnr_threshold=args.weight_sqnr_threshold,
            max_batches=args.max_batches,
            model_name=args.float_model,
            backend=args.backend,
            data_name=args.calibration,
            trust_pickle=args.trust_pickle,
        )
    except ValueError as error:
        raise ConfigError(str(error)) from error
    if is_exported_module(float_model):
        report = _note_layers_without_float(report, args.float_model, quantized_model)
    ranking = None
    if args.sensitivity:
        # Rank the layers of the quantized model the user gave: its shadow errors are the real ones.
        ranking = sensitivity_rows(
            float_model, data, args.backend, max_batches=args.max_batches, quantized_model=quantized_model
        )
        report = _note_unmeasured_layers(_note_unranked_functional_layers(report), ranking)
    summary = None
    if args.badcases > 0:
        badcases = find_badcases(float_model, quantized_model, data, top=args.badcases, max_batches=args.max_batches)
        badcase_report = compare_badcases(
            float_model, quantized_model, badcases, modes=modes, sqnr_threshold=args.sqnr_threshold
        )
        try:  # the folder is created, as for --html
            Path(args.badcases_path).parent.mkdir(parents=True, exist_ok=True)
            saved = badcases.save(args.badcases_path)
            # the bad-case comparison also goes next to the samples, a Report of its own
            saved.with_suffix(".report.json").write_text(badcase_report.model_dump_json(indent=2))
        except (OSError, RuntimeError) as error:  # torch.save raises RuntimeError for a bad path
            raise QlintError(f"cannot write --badcases-path {args.badcases_path}: {error}") from error
        summary = badcases.summary(badcase_report, saved)
        notice = Notice(
            message=f"saved the {args.badcases} worst inputs per metric of {badcases.samples_seen} samples to {saved} "
            f"and the comparison on them to {saved.with_suffix('.report.json')}"
        )
        report = report.model_copy(update={"notices": report.notices + [notice]})
    report = CompareReport(**(dict(report) | {"sensitivity": ranking, "badcases": summary}))
    if args.html:
        histograms = activation_histograms(
            float_model, quantized_model, data, report, worst_layers(report, 4), max_batches=args.max_batches
        )
        html = Path(args.html)
        try:
            html.parent.mkdir(parents=True, exist_ok=True)
            write_html(
                report,
                html,
                sensitivity=ranking,
                histograms=histograms,
                sqnr_threshold=args.sqnr_threshold,
                badcases=summary,
                next_step=report.next_step,
            )
        except OSError as error:
            raise QlintError(f"cannot write --html {args.html}: {error.strerror or error}") from error
    return report
