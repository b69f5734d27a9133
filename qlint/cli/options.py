"""What one ``qlint MODEL`` run uses: command-line flags over per-file settings over
``[tool.qlint]``, with paths made relative to the pyproject.toml they came from.

Flags are the user's own intent. Settings come from a file that arrived with a cloned
repository, so a setting that would import and run code (``qconfig-mapping``, a
``module:function`` or ``file.py:function`` calibration) is refused unless the user
passes ``--trust-config``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from pydantic import ValidationError

from qlint.cli.common import split_list
from qlint.core.load import is_factory_spec
from qlint.errors import ConfigError, validation_problems
from qlint.linter.findings import Severity
from qlint.linter.registry import Registry
from qlint.linter.settings import Config, FileSettings
from qlint.stats.selection import PERCENTILE_EVERY


@dataclasses.dataclass(frozen=True)
class ModelOptions:
    """Everything ``qlint MODEL`` needs for one model, after merging flags and settings."""

    spec: str
    config: Config
    backend: str
    output_format: str
    fail_on: Severity
    weights: str | None
    example_inputs_file: str | None
    input_shapes: list[str] | None
    qconfig_mapping: str | None
    select: list[str] | None
    ignore: list[str]
    rule_options: dict[str, dict[str, Any]]
    calibration: str | None
    num_batches: int | None
    percentile_every: int
    baseline: str | None
    trial: dict[str, Any] = dataclasses.field(default_factory=dict)  # TrialOptions fields

    def input_files(self) -> list[str]:
        """Every file this run reads, but the baseline (outputs must not overwrite them)."""
        candidates = [
            self.spec,
            self.weights,
            self.example_inputs_file,
            self.calibration,
            self.qconfig_mapping,
            str(self.config.source) if self.config.source else None,
        ]
        return [c for c in candidates if c]


def _first(*values: Any) -> Any:
    return next((value for value in values if value is not None), None)


def _refuse_code(config: Config, key: str, value: str, entry: FileSettings | None) -> None:
    where = f"[[tool.qlint.files]] path = {entry.path!r}:" if entry is not None else "[tool.qlint]"
    raise ConfigError(
        f"{config.source}: {where} {key} = {value!r} would import and run code from this repository; "
        f"if you trust it, pass --trust-config (in pre-commit: args: [--trust-config]), "
        f"or give --{key} on the command line"
    )


def _code_setting(
    config: Config, key: str, value: str | None, entry: FileSettings | None, trusted: bool, always_code: bool
) -> str | None:
    """A setting that may name code: refused unless trusted; a file.py path made relative."""
    if value is None:
        return None
    spec = config.data_spec(value)
    if (always_code or is_factory_spec(spec)) and not trusted:  # judged on what load_batches gets
        _refuse_code(config, key, value, entry)
    return spec


def check_rule_options(config: Config, registry: Registry) -> None:
    """Options for a rule that does not exist are an error (a typo would silently do nothing),
    and so is a select or ignore entry that names no rule; both errors name the file."""
    for key, selectors in (("select", config.settings.select), ("ignore", config.settings.ignore)):
        for selector in selectors or ():
            try:
                registry.select([selector])
            except ConfigError as error:
                raise ConfigError(f"{config.source} [tool.qlint] {key}: {error}") from error
    known = {cls.code: cls for cls in registry.all()} | {cls.name: cls for cls in registry.all()}
    for key, values in config.settings.rules.items():
        if key not in known:
            # The engine looks options up by the exact code or name, so "ql101" would be ignored.
            hint = f"; did you mean {key.upper()}?" if key.upper() in known else "; run 'qlint rules' to list them"
            raise ConfigError(f"{config.source}: [tool.qlint.rules.{key}]: unknown rule {key!r}{hint}")
        try:
            # strict, as every other setting: TOML has its own booleans and numbers, so a string
            # such as "off" is a mistake to name, not a value to coerce. Read as JSON is: a TOML
            # array is then a valid tuple.
            known[key].Options.model_validate_json(json.dumps(values, default=str), strict=True)
        except ValidationError as error:
            raise ConfigError(f"{config.source}: [tool.qlint.rules.{key}]: {validation_problems(error)}") from error


def check_flags(args: argparse.Namespace) -> None:
    """Flags that contradict each other or cannot mean anything: a usage error before any work
    (the settings of [tool.qlint] are project defaults, which flags override, and are not judged here)."""
    if args.input_shape and args.example_inputs:
        raise ConfigError("--input-shape and --example-inputs both give the example inputs: pass one")
    if args.select is not None and not split_list(args.select):
        raise ConfigError(
            "--select names no rule: leave it out to run every rule, or name codes, prefixes or rule names (QL1, QL203)"
        )
    if args.no_trial:
        for flag, value in (("--min-impact", args.min_impact), ("--fix-trials", args.fix_trials)):
            if value is not None:
                raise ConfigError(f"{flag} tunes the trial, which --no-trial skips: pass one")


def check_calibration_flags(args: argparse.Namespace, calibration: str | None) -> None:
    """--num-batches and --percentile-every shape the calibration: without any data (no
    --calibration, --random-calibration or calibration setting) they would do nothing."""
    if calibration is not None or args.random_calibration:
        return
    for flag, value in (("--num-batches", args.num_batches), ("--percentile-every", args.percentile_every)):
        if value is not None:
            raise ConfigError(
                f"{flag} {value} applies to calibration data, and this run has none: "
                "pass --calibration DATA (or --random-calibration N), or leave it out"
            )


def resolve_options(args: argparse.Namespace, spec: str, config: Config) -> ModelOptions:
    settings = config.settings
    entry = config.for_file(spec)
    trusted = bool(args.trust_config)

    def per_file(name: str) -> Any:
        return getattr(entry, name) if entry is not None else None

    if args.qconfig_mapping is not None:
        mapping = args.qconfig_mapping
    else:
        key_entry = entry if per_file("qconfig_mapping") is not None else None
        mapping = _code_setting(
            config,
            "qconfig-mapping",
            _first(per_file("qconfig_mapping"), settings.qconfig_mapping),
            key_entry,
            trusted,
            always_code=True,
        )
    if args.calibration is not None:
        calibration = args.calibration
    else:
        key_entry = entry if per_file("calibration") is not None else None
        calibration = _code_setting(
            config,
            "calibration",
            _first(per_file("calibration"), settings.calibration),
            key_entry,
            trusted,
            always_code=False,
        )

    check_calibration_flags(args, calibration)
    file_weights = per_file("weights")
    file_examples = per_file("example_inputs")
    example_file = args.example_inputs
    shapes = args.input_shape
    if example_file is None and shapes is None:
        shapes = per_file("input_shape")
        if shapes is None and file_examples is not None:
            example_file = config.path(file_examples)
        elif shapes is None:
            shapes = settings.input_shape
    baseline = args.baseline or (config.path(settings.baseline) if settings.baseline else None)
    return ModelOptions(
        spec=spec,
        config=config,
        backend=_first(args.backend, per_file("backend"), settings.backend),
        output_format=args.format or settings.format,
        fail_on=Severity(args.fail_on or settings.fail_on),
        weights=_first(args.weights, config.path(file_weights) if file_weights else None),
        example_inputs_file=example_file,
        input_shapes=shapes,
        qconfig_mapping=mapping,
        select=split_list(args.select) or settings.select,
        ignore=(split_list(args.ignore) or []) + list(settings.ignore),
        rule_options=dict(settings.rules),
        calibration=calibration,
        num_batches=_first(args.num_batches, per_file("num_batches"), settings.num_batches),
        percentile_every=_first(args.percentile_every, settings.percentile_every, PERCENTILE_EVERY),
        baseline=baseline,
        trial=_trial_options(args, config),
    )


def _trial_options(args: argparse.Namespace, config: Config) -> dict[str, Any]:
    """Flags over [tool.qlint]: --no-trial / trial = false, --min-impact, --fix-trials."""
    settings = config.settings
    options: dict[str, Any] = {"enabled": settings.trial and not getattr(args, "no_trial", False)}
    min_impact = _first(getattr(args, "min_impact", None), settings.min_impact_db)
    if min_impact is not None:
        if min_impact < 0:
            raise ConfigError(f"--min-impact must be 0 or more dB, got {min_impact:g}")
        options["min_impact_db"] = min_impact
    fix_trials = _first(getattr(args, "fix_trials", None), settings.max_fix_trials)
    if fix_trials is not None:
        if fix_trials < 0:
            raise ConfigError(f"--fix-trials must be 0 or more, got {fix_trials}")
        options["max_fix_trials"] = fix_trials
    return options
