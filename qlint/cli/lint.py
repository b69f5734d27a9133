"""``qlint MODEL``: merge settings, load the model and inputs, lint, render, exit code."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Optional

from qlint.errors import ConfigError, QlintError
from qlint.linter.findings import Notice, Report, Severity
from qlint.core.exported_batch import fit_calibration
from qlint.core.load import (load_batches, load_example_inputs, load_model, parse_input_shape,
                           resolve_object)
from qlint.linter.settings import FileSettings, Settings, load_settings

EXIT_CLEAN, EXIT_FINDINGS = 0, 1


def _pick(cli_value: Any, file_value: Any, config_value: Any) -> Any:
    for value in (cli_value, file_value, config_value):
        if value is not None:
            return value
    return None


def run_lint(args: argparse.Namespace) -> int:
    """Lint each model; the exit status is the worst of them (2 > 1 > 0)."""
    settings, _ = load_settings(args.config, start=Path.cwd() if args.config is None else None)
    models = list(args.model)
    if len(models) > 1 and args.output:
        raise ConfigError("--output takes one model; lint several models without it")
    worst = EXIT_CLEAN
    for spec in models:
        if len(models) == 1:
            return _lint_one(args, spec, settings)
        try:
            worst = max(worst, _lint_one(args, spec, settings))
        except QlintError as error:
            print(f"qlint: error: {spec}: {str(error).splitlines()[0]}", file=sys.stderr)
            worst = 2
    return worst


def _lint_one(args: argparse.Namespace, model_spec: str, settings: Settings) -> int:
    per_file: Optional[FileSettings] = settings.for_file(model_spec)
    backend = _pick(args.backend, per_file.backend if per_file else None, settings.backend)
    output_format = args.format or settings.format
    if output_format not in ("text", "json", "sarif", "github"):
        raise ConfigError(f"unknown format {output_format!r}")
    fail_on = Severity(_pick(args.fail_on, None, settings.fail_on))

    loaded = load_model(model_spec, weights=_pick(args.weights, per_file.weights if per_file else None, None),
                        trust_pickle=args.trust_pickle)
    example = _example_inputs(args, per_file, settings, loaded.example_inputs)
    mapping_spec = _pick(args.qconfig_mapping, per_file.qconfig_mapping if per_file else None,
                         settings.qconfig_mapping)
    mapping = resolve_object(mapping_spec) if mapping_spec else None
    select = _split(args.select) or settings.select
    ignore = (_split(args.ignore) or []) + list(settings.ignore)
    calibration, calibration_notices = _calibration(args, per_file, settings, example)
    calibration, fitted = fit_calibration(calibration, loaded.exported_program)  # static export batch
    if fitted:
        calibration_notices = [*calibration_notices, Notice(message=fitted)]

    from qlint.linter.engine import lint

    report = lint(loaded.module, example, calibration=calibration, backend=backend,
                  qconfig_mapping=mapping, select=select, ignore=ignore, options=settings.rules,
                  model_name=loaded.name, exported_program=loaded.exported_program,
                  calibration_options={"quiet": args.quiet, "num_batches": _pick(
                      args.num_batches, per_file.num_batches if per_file else None, settings.num_batches)})
    if calibration_notices:
        report = report.model_copy(update={"notices": list(calibration_notices) + list(report.notices)})
    report = _apply_baseline(report, args.baseline or settings.baseline, args.write_baseline)
    if args.emit_plan or args.emit_qconfig:
        from qlint.cli.plan import emit_plan_outputs

        emit_plan_outputs(report, args.emit_plan, args.emit_qconfig)
    _emit(report, output_format, args)
    return EXIT_FINDINGS if report.has_findings_at_least(fail_on) else EXIT_CLEAN


def _split(values):
    from qlint.cli.main import _split_list

    return _split_list(values)


def _example_inputs(args, per_file, settings: Settings, from_file):
    if args.example_inputs:
        return load_example_inputs(args.example_inputs)
    shapes = args.input_shape or (per_file.input_shape if per_file else None) or settings.input_shape
    if shapes:
        return tuple(parse_input_shape(s) for s in shapes)
    if per_file is not None and per_file.example_inputs:
        return load_example_inputs(per_file.example_inputs)
    return from_file


def _calibration(args, per_file, settings: Settings, example):
    source = _pick(args.calibration, per_file.calibration if per_file else None, settings.calibration)
    if source is None and not args.random_calibration:
        return None, []
    try:
        from qlint.linter.calibration import random_calibration
    except ImportError as error:
        raise QlintError(f"calibration support is unavailable: {error}") from error
    if source is not None:
        return load_batches(source), []
    if not example:
        raise ConfigError("--random-calibration needs example inputs (--input-shape or --example-inputs)")
    notice = Notice(level=Severity.WARNING,
                    message=f"calibrating on {args.random_calibration} RANDOM batches: data-rule verdicts "
                            "describe random inputs, not your data")
    return random_calibration(example, args.random_calibration), [notice]


def _apply_baseline(report: Report, baseline: Optional[str], write: bool) -> Report:
    if not baseline:
        if write:
            raise ConfigError("--write-baseline needs --baseline FILE")
        return report
    from qlint.linter.baseline import filter_new, write_baseline

    if write:
        write_baseline(report, baseline)
        return report
    return filter_new(report, baseline)


def _emit(report: Report, output_format: str, args) -> None:
    from qlint.render import FORMATS

    if output_format not in FORMATS:
        try:
            from qlint.render.extra import EXTRA_FORMATS  # sarif, github
        except ImportError as error:
            raise ConfigError(f"format {output_format!r} is unavailable: {error}") from error
        renderer = EXTRA_FORMATS[output_format]
    else:
        renderer = FORMATS[output_format]
    if output_format == "text":
        color = None if args.output is None and sys.stdout.isatty() else False
        text = renderer(report, color=color, show_qconfig=args.show_qconfig)
    else:
        text = renderer(report)
    if args.output:
        try:
            Path(args.output).write_text(text)
        except OSError as error:
            raise QlintError(f"cannot write {args.output}: {error.strerror}") from error
        if output_format == "text" or not args.quiet:
            from qlint.render.text import summary_line

            print(summary_line(report), file=sys.stderr)
    else:
        sys.stdout.write(text)
