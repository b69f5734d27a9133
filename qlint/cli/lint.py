"""``qlint MODEL``: merge settings, load the model and inputs, lint, render, exit code."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from qlint.cli.common import (
    EXIT_CLEAN,
    EXIT_ERROR,
    EXIT_FINDINGS,
    check_outputs,
    terminal_width,
    user_output_to_stderr,
    write_file,
    write_stdout,
)
from qlint.cli.options import ModelOptions, check_flags, check_rule_options, resolve_options
from qlint.core.exported_batch import fit_calibration
from qlint.core.load import (
    load_batches,
    load_example_inputs,
    load_model,
    parse_input_shape,
    random_calibration,
    resolve_object,
)
from qlint.errors import ConfigError, QlintError
from qlint.linter.findings import Notice, Report, Severity
from qlint.linter.settings import ConfigFinder
from qlint.render.literal import printable


def run_lint(args: argparse.Namespace) -> int:
    """Lint each model; the exit status is the worst of them (2 > 1 > 0)."""
    models = list(args.model)
    if len(models) > 1:
        for flag, value in (
            ("--output", args.output),
            ("--emit-plan", args.emit_plan),
            ("--emit-qconfig", args.emit_qconfig),
        ):
            if value:  # each model would overwrite the file the one before wrote
                raise ConfigError(f"{flag} takes one model; lint several models without it")
    check_flags(args)
    finder = ConfigFinder(args.config)
    resolved: list[ModelOptions | QlintError] = []
    for spec in models:  # each model's settings once, before any lint
        try:
            resolved.append(resolve_options(args, spec, finder.for_model(spec)))
        except QlintError as error:
            if len(models) == 1:
                raise
            resolved.append(error)
    # JSON and SARIF of several models go out as one document once every model is linted
    # (documents one after another on stdout are not JSON), even when some or all fail
    document = _one_document_format(resolved) if len(models) > 1 else None
    reports: list[Report] = []
    worst = EXIT_CLEAN
    for spec, options in zip(models, resolved):
        try:
            if isinstance(options, QlintError):
                raise options
            status = _lint_one(args, options, reports if document else None)
        except QlintError as error:
            if len(models) == 1:
                raise
            print(f"qlint: error: {printable(spec)}: {printable(str(error).strip()) or 'error'}", file=sys.stderr)
            status = EXIT_ERROR
        worst = max(worst, status)
    if document:
        _emit_document(document, reports)
    return worst


def _one_document_format(resolved: list[ModelOptions | QlintError]) -> str | None:
    """ "json" or "sarif" when several models print one document; None for text or github,
    which print per model. Formats that cannot share one stdout are refused before any lint."""
    formats = {options.output_format for options in resolved if not isinstance(options, QlintError)}
    structured = formats & {"json", "sarif"}
    if structured and len(formats) > 1:
        raise ConfigError(
            f"these models ask for several output formats ({', '.join(sorted(formats))}) on one stdout: "
            "give them one --format"
        )
    return next(iter(structured), None)


def _emit_document(output_format: str, reports: list[Report]) -> None:
    if output_format == "json":
        from qlint.render.json import render_json_reports

        write_stdout(render_json_reports(reports))
    else:
        from qlint.render.sarif import render_sarif_reports

        write_stdout(render_sarif_reports(reports))


def _lint_one(args: argparse.Namespace, options: ModelOptions, document: list[Report] | None = None) -> int:
    """Lint one model and print its report; its report goes into ``document`` instead when
    several models print one JSON or SARIF document."""
    if options.output_format not in ("text", "json", "sarif", "github"):
        raise ConfigError(f"unknown format {options.output_format!r}")
    check_outputs(
        [("--output", args.output), ("--emit-plan", args.emit_plan), ("--emit-qconfig", args.emit_qconfig)],
        options.input_files() + [options.baseline],
    )
    check_outputs([("--write-baseline", options.baseline if args.write_baseline else None)], options.input_files())
    if args.write_baseline and not options.baseline:
        raise ConfigError("--write-baseline needs --baseline FILE")
    from qlint.linter.engine import lint
    from qlint.linter.registry import Registry

    with user_output_to_stderr():
        registry = Registry.default()
        check_rule_options(options.config, registry)
        loaded = load_model(options.spec, weights=options.weights, trust_pickle=args.trust_pickle)
        if args.emit_qconfig and loaded.exported_program is not None:  # refused before linting, not after
            raise ConfigError(
                f"--emit-qconfig: {printable(options.spec)} is an exported program, whose plan is for the pt2e flow "
                "and has no QConfigMapping for prepare_fx; write the plan with --emit-plan (its quantizer is "
                "QuantPlan.to_pt2e_quantizer())"
            )
        example = _example_inputs(options, loaded.example_inputs)
        mapping = resolve_object(options.qconfig_mapping) if options.qconfig_mapping else None
        calibration, calibration_notices = _calibration(args, options, example)
        calibration, fitted = fit_calibration(calibration, loaded.exported_program)  # static export batch
        if fitted:
            calibration_notices = [*calibration_notices, Notice(message=fitted)]
        report = lint(
            loaded.module,
            example,
            calibration=calibration,
            backend=options.backend,
            qconfig_mapping=mapping,
            select=options.select,
            ignore=options.ignore,
            options=options.rule_options,
            model_name=options.spec,
            registry=registry,
            exported_program=loaded.exported_program,
            calibration_options={
                "quiet": args.quiet,
                "num_batches": options.num_batches,
                "percentile_every": options.percentile_every,
            },
            trial_options=options.trial,
        )
    if calibration_notices:
        report = report.model_copy(update={"notices": list(calibration_notices) + list(report.notices)})
    report = _apply_baseline(report, options.baseline, args.write_baseline)
    if args.emit_plan or args.emit_qconfig:
        from qlint.cli.plan import emit_plan_outputs

        emit_plan_outputs(report, args.emit_plan, args.emit_qconfig)
        if options.qconfig_mapping:
            # a plan file holds decisions, not code: it cannot name the user's mapping as its base
            print(
                f"qlint: note: the plan starts from the {options.backend} default, not from --qconfig-mapping "
                f"{printable(options.qconfig_mapping)}: apply its decisions to your mapping (in Python, "
                "report.qconfig_mapping() does)",
                file=sys.stderr,
            )
    if document is not None:
        document.append(report)
    else:
        _emit(report, options.output_format, args)
    crashed = [s for s in report.skipped if s.crashed]
    if crashed:
        # The other rules' findings are out; the run still failed: the analysis is incomplete.
        first = crashed[0]
        more = f" (and {len(crashed) - 1} more)" if len(crashed) > 1 else ""
        print(
            f"qlint: error: {printable(options.spec)}: analysis incomplete: {first.rule} {first.name} "
            f"{printable(first.reason)}{more}",
            file=sys.stderr,
        )
        return EXIT_ERROR
    if args.write_baseline:
        return EXIT_CLEAN  # the findings were just accepted
    return EXIT_FINDINGS if report.has_findings_at_least(options.fail_on) else EXIT_CLEAN


def _example_inputs(options: ModelOptions, from_file: Any) -> Any:
    if options.example_inputs_file:
        return load_example_inputs(options.example_inputs_file)
    if options.input_shapes:
        return tuple(parse_input_shape(s) for s in options.input_shapes)
    return from_file


def _calibration(args: argparse.Namespace, options: ModelOptions, example: Any):
    if args.random_calibration and args.calibration:
        raise ConfigError("--random-calibration and --calibration both give calibration data: pass one")
    if options.calibration is not None and not args.random_calibration:  # the flag beats [tool.qlint]
        return load_batches(options.calibration), []
    if not args.random_calibration:
        return None, []
    if not example:
        raise ConfigError("--random-calibration needs example inputs (--input-shape or --example-inputs)")
    notice = Notice(
        level=Severity.WARNING,
        message=f"calibrating on {args.random_calibration} RANDOM batches: data-rule verdicts "
        "describe random inputs, not your data",
    )
    return random_calibration(example, args.random_calibration), [notice]


def _apply_baseline(report: Report, baseline: str | None, write: bool) -> Report:
    if not baseline:
        return report
    from qlint.linter.baseline import filter_new, write_baseline

    if write:
        write_baseline(report, baseline)
        count = len(report.findings)
        print(
            f"qlint: recorded {count} finding{'s' if count != 1 else ''} in baseline {printable(baseline)}",
            file=sys.stderr,
        )
        return report
    return filter_new(report, baseline)


def _emit(report: Report, output_format: str, args: argparse.Namespace) -> None:
    from qlint.render import FORMATS
    from qlint.render.extra import EXTRA_FORMATS

    renderer = FORMATS.get(output_format) or EXTRA_FORMATS[output_format]
    if output_format == "text":
        to_terminal = args.output is None and sys.stdout is not None and sys.stdout.isatty()
        text = renderer(
            report,
            color=None if to_terminal else False,
            show_qconfig=args.show_qconfig,
            quiet=args.quiet,
            width=terminal_width(to_stdout=args.output is None),
        )
    else:
        text = renderer(report)
    if args.output:
        write_file(args.output, text)
        if output_format == "text" or not args.quiet:
            from qlint.render.text import summary_line

            print(summary_line(report), file=sys.stderr)
    else:
        write_stdout(text)
