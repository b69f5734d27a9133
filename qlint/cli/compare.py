"""`qlint compare FLOAT QUANT --calibration DATA`: the numeric suite on the command line.

The lead wires ``add_compare_arguments`` / ``run_compare`` into ``qlint.cli.main``.
Models and data are loaded by ``load_model_arg``/``load_data_arg`` alone, so that the project's
model loader can replace it in one place.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Optional, TextIO

import torch
from rich.console import Console
from rich.table import Table

from qlint.errors import QlintError
from qlint.linter.findings import Notice, Report, Severity
from qlint.numeric.badcases import compare_badcases, find_badcases
from qlint.numeric.compare import MODES, activation_histograms, compare, worst_layers
from qlint.numeric.diagnose import DEFAULT_SQNR_THRESHOLD_DB, DEFAULT_WEIGHT_SQNR_THRESHOLD_DB
from qlint.numeric.html import write_html
from qlint.numeric.sensitivity import sensitivity_rows

EXIT_CLEAN, EXIT_FINDINGS, EXIT_USAGE = 0, 1, 2



def load_model_arg(spec: str, trust_pickle: bool = False) -> torch.nn.Module:
    """FLOAT or QUANT: anything qlint's safe loader takes (.pt2, .pt, module:factory)."""
    from qlint.core.load import load_model

    return load_model(spec, trust_pickle=trust_pickle).module


def load_data_arg(spec: str) -> Any:
    """Batches: a saved tensor/list or folder (weights_only), or package.module:function."""
    from qlint.core.load import load_batches

    return load_batches(spec)


def add_compare_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("float_model", metavar="FLOAT", help="float model: package.module:factory")
    parser.add_argument("quantized_model", metavar="QUANT",
                        help="quantized counterpart (prepared, FX-converted, dynamic or eager): package.module:factory")
    parser.add_argument("--calibration", metavar="DATA", required=True,
                        help="batches to compare on: a .pt file holding a list of batches (or one tensor), "
                             "or package.module:factory returning an iterable of batches")
    parser.add_argument("--html", metavar="PATH", help="also write a self-contained HTML report")
    parser.add_argument("--format", choices=("text", "json"), default="text", help="stdout format")
    parser.add_argument("--badcases", metavar="N", type=int, default=0,
                        help="find the N worst inputs per metric, save them and compare on them alone")
    parser.add_argument("--badcases-path", metavar="PATH", default="badcases.pt", help="where --badcases saves")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated: propagated,shadow")
    parser.add_argument("--sqnr-threshold", type=float, default=DEFAULT_SQNR_THRESHOLD_DB,
                        help="QL301 threshold for a layer's local activation SQNR, dB")
    parser.add_argument("--weight-sqnr-threshold", type=float, default=DEFAULT_WEIGHT_SQNR_THRESHOLD_DB,
                        help="QL301 threshold for weight SQNR, dB")
    parser.add_argument("--sensitivity", action="store_true",
                        help="rank layers by sensitivity (re-quantizes FLOAT with FX PTQ for --backend)")
    parser.add_argument("--backend", default="x86", help="quantization backend for --sensitivity")
    parser.add_argument("--max-batches", type=int, default=None, help="use at most this many batches")
    parser.add_argument("--trust-pickle", action="store_true",
                        help="trust the model files (.pt or .pt2): allows code from them to run")
    return parser


def layer_table(report: Report) -> Table:
    table = Table(title=f"{report.model}: {report.frontend} vs float")
    for column in ("layer", "kind", "weight dB", "propagated dB", "shadow dB", "cosine", "RMSE/scale"):
        table.add_column(column, justify="left" if column in ("layer", "kind") else "right")

    def number(value: Optional[float], digits: int = 1) -> str:
        return "" if value is None else f"{value:.{digits}f}"

    for row in report.layers:
        summary = row.extra.get("propagated") or row.extra.get("shadow") or {}
        table.add_row(row.name, row.kind or "", number(row.weight_sqnr), number(row.sqnr_propagated),
                      number(row.sqnr_shadow), number(row.cosine, 5), number(summary.get("rmse_over_scale"), 2))
    return table


def print_text(report: Report, console: Console) -> None:
    console.print(layer_table(report))
    for notice in report.notices:
        console.print(f"[dim]{notice.level.value}: {notice.message}[/dim]", markup=True, highlight=False)
    for finding in report.findings:
        style = {Severity.ERROR: "bold red", Severity.WARNING: "yellow"}.get(finding.severity, "")
        console.print(f"[{style}]{finding.rule} {finding.name}[/{style}] {finding.target}: {finding.message}"
                      if style else f"{finding.rule} {finding.name} {finding.target}: {finding.message}",
                      highlight=False)


def run_compare(args: argparse.Namespace, stdout: Optional[TextIO] = None) -> int:
    """Run the comparison; 0 clean, 1 findings, 2 unusable arguments."""
    stream = stdout or sys.stdout
    console = Console(file=stream, width=140, soft_wrap=False)
    errors = Console(file=sys.stderr)
    modes = tuple(mode.strip() for mode in args.modes.split(",") if mode.strip())
    try:
        float_model = load_model_arg(args.float_model, args.trust_pickle)
        quantized_model = load_model_arg(args.quantized_model, args.trust_pickle)
        data = load_data_arg(args.calibration)
    except QlintError as error:
        errors.print(f"qlint compare: {error}", highlight=False)
        return EXIT_USAGE
    if not isinstance(float_model, torch.nn.Module) or not isinstance(quantized_model, torch.nn.Module):
        errors.print("qlint compare: FLOAT and QUANT must produce torch.nn.Module objects", highlight=False)
        return EXIT_USAGE
    if iter(data) is data:
        data = list(data)  # several passes follow (compare, histograms, badcases)
    try:
        report = compare(float_model, quantized_model, data, modes=modes, sqnr_threshold=args.sqnr_threshold,
                         weight_sqnr_threshold=args.weight_sqnr_threshold, max_batches=args.max_batches,
                         model_name=args.float_model, backend=args.backend)
    except ValueError as error:
        errors.print(f"qlint compare: {error}", highlight=False)
        return EXIT_USAGE
    ranking = None
    if args.sensitivity:
        # Rank the layers of the quantized model the user gave: its shadow errors are the real ones.
        ranking = sensitivity_rows(float_model, data, args.backend, max_batches=args.max_batches,
                                   quantized_model=quantized_model)
    badcase_report = None
    if args.badcases > 0:
        badcases = find_badcases(float_model, quantized_model, data, top=args.badcases, max_batches=args.max_batches)
        saved = badcases.save(args.badcases_path)
        badcase_report = compare_badcases(float_model, quantized_model, badcases, modes=modes,
                                          sqnr_threshold=args.sqnr_threshold)
        # JSON stdout carries one Report; the bad-case comparison goes next to the samples.
        saved.with_suffix(".report.json").write_text(badcase_report.model_dump_json(indent=2))
        worst = badcases.worst("cosine")
        report = report.model_copy(update={"notices": report.notices + [Notice(message=(
            f"saved the {args.badcases} worst inputs per metric of {badcases.samples_seen} to {saved}; "
            f"lowest output cosine {worst[0].value:.5f} (sample {worst[0].index})" if worst else
            f"saved bad cases to {saved}"))]})
    if args.html:
        histograms = activation_histograms(float_model, quantized_model, data, report, worst_layers(report, 4),
                                           max_batches=args.max_batches)
        write_html(report, args.html, sensitivity=ranking, histograms=histograms,
                   sqnr_threshold=args.sqnr_threshold)
    if args.format == "json":
        stream.write(report.model_dump_json(indent=2) + "\n")
    else:
        print_text(report, console)
        if ranking:
            console.print("sensitivity (most sensitive first): " + ", ".join(
                f"{row.name} {row.score:.2e}" for row in ranking[:10]), highlight=False)
        if badcase_report is not None:
            console.print("[bold]On the worst inputs only:[/bold]")
            print_text(badcase_report, console)
    return EXIT_FINDINGS if report.findings else EXIT_CLEAN


def main(argv: Optional[list[str]] = None) -> int:
    """Stand-alone entry point until the CLI wires the subcommand in."""
    parser = add_compare_arguments(argparse.ArgumentParser(prog="qlint compare"))
    return run_compare(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
