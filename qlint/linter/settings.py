"""Settings from ``[tool.qlint]`` in pyproject.toml; the command line overrides them.

    [tool.qlint]
    backend = "x86"
    select = ["QL1"]
    ignore = ["QL104"]
    fail-on = "warning"
    input-shape = ["1,3,224,224"]

    [tool.qlint.rules.QL203]          # rule options, by code or name
    ratio_threshold = 4.0

    [[tool.qlint.files]]              # per-file settings (pre-commit passes file paths)
    path = "models/detector.pt"
    input-shape = ["1,3,320,320"]
    calibration = "data/calib"

Like ruff, the settings for a model file come from the nearest pyproject.toml that has a
``[tool.qlint]`` table, searched from the model's own folder upwards (from the working
directory for ``module:factory`` models). Paths in it (``files.path`` patterns,
calibration, weights, example inputs, baseline) are relative to that file's folder.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import os
import sys
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PositiveInt, ValidationError, model_validator

from qlint.core.backends import BACKENDS
from qlint.core.load import check_input_shape, is_factory_spec, split_factory_spec
from qlint.errors import ConfigError, validation_problem

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib


class _Strict(BaseModel):
    # strict: TOML has its own booleans and numbers, so trial = "yes" or num-batches = "8" is a
    # mistake to name, not a value to coerce ("no" would read as False, "yes" as True)
    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True, strict=True)


def _input_shapes(values: list[str] | None) -> list[str] | None:
    """Each shape as --input-shape takes it, checked when the settings are read, so that the
    error names the pyproject.toml and the key (nothing is allocated)."""
    for value in values or ():
        check_input_shape(value)
    return values


def _backend(value: str | None) -> str | None:
    if value is not None and value not in BACKENDS:
        raise ValueError(f"unknown backend {value!r}; choose one of {', '.join(BACKENDS)}")
    return value


def _selection(values: list[str] | None) -> list[str] | None:
    if values is not None and not any(value.strip() for value in values):
        raise ValueError("selects no rule: leave select out to run every rule, or name codes, prefixes or rule names")
    return values


InputShapes = Annotated[list[str] | None, AfterValidator(_input_shapes)]


class FileSettings(_Strict):
    path: str
    input_shape: InputShapes = Field(None, alias="input-shape")
    example_inputs: str | None = Field(None, alias="example-inputs")
    weights: str | None = None
    calibration: str | None = None
    num_batches: PositiveInt | None = Field(None, alias="num-batches")
    backend: Annotated[str | None, AfterValidator(_backend)] = None
    qconfig_mapping: str | None = Field(None, alias="qconfig-mapping")

    @model_validator(mode="after")
    def _one_source_of_example_inputs(self) -> FileSettings:
        if self.input_shape is not None and self.example_inputs is not None:
            raise ValueError("input-shape and example-inputs both give the example inputs: keep one")
        return self


class Settings(_Strict):
    backend: Annotated[str, AfterValidator(_backend)] = "x86"
    select: Annotated[list[str] | None, AfterValidator(_selection)] = None
    ignore: list[str] = Field(default_factory=list)
    fail_on: Literal["error", "warning", "info"] = Field("warning", alias="fail-on")
    format: Literal["text", "json", "sarif", "github"] = "text"
    input_shape: InputShapes = Field(None, alias="input-shape")
    qconfig_mapping: str | None = Field(None, alias="qconfig-mapping")
    calibration: str | None = None
    num_batches: PositiveInt | None = Field(None, alias="num-batches")
    percentile_every: PositiveInt | None = Field(None, alias="percentile-every")
    baseline: str | None = None
    trial: bool = True
    min_impact_db: float | None = Field(None, alias="min-impact-db", ge=0, allow_inf_nan=False)
    max_fix_trials: int | None = Field(None, alias="max-fix-trials", ge=0)
    rules: dict[str, dict[str, Any]] = Field(default_factory=dict)
    files: list[FileSettings] = Field(default_factory=list)

    @model_validator(mode="after")
    def _trial_tuned_only_when_run(self) -> Settings:
        if not self.trial:
            tuning = [
                key
                for key, value in (("min-impact-db", self.min_impact_db), ("max-fix-trials", self.max_fix_trials))
                if value is not None
            ]
            if tuning:
                raise ValueError(
                    f"{' and '.join(tuning)} {'tunes' if len(tuning) == 1 else 'tune'} the trial, "
                    "which trial = false skips: set one"
                )
        return self


@dataclasses.dataclass(frozen=True)
class Config:
    """Settings and the pyproject.toml they came from (``source`` None: the defaults)."""

    settings: Settings
    source: Path | None = None

    @property
    def root(self) -> Path:
        """The folder that relative paths in the settings are relative to."""
        return self.source.parent if self.source is not None else Path.cwd()

    def path(self, value: str) -> str:
        """A file or folder named in the settings, relative to :attr:`root`."""
        return str(self.root / value) if self.source is not None and not os.path.isabs(value) else value

    def data_spec(self, value: str) -> str:
        """A data setting: a path, ``file.py:function`` (the file is relative to :attr:`root`),
        or ``package.module:function`` (resolved as on the command line)."""
        if self.source is None:
            return value
        factory = split_factory_spec(value)
        # Code or data is decided where the setting points (under root), not in the working
        # directory: a file there named like the spec must not turn code into data.
        if factory is None or os.path.exists(self.path(value)):
            return self.path(value)
        module_part, attr = factory
        return f"{self.path(module_part)}:{attr}" if module_part.endswith(".py") else value

    def for_file(self, model_spec: str) -> FileSettings | None:
        """The last [[tool.qlint.files]] entry whose path (or glob) matches the model."""
        candidates = [Path(model_spec).as_posix()]
        if self.source is not None and not is_factory_spec(model_spec):
            try:
                relative = Path(os.path.abspath(model_spec)).relative_to(os.path.abspath(self.root))
                candidates.insert(0, relative.as_posix())
            except ValueError:
                pass  # --config names a file outside the model's tree: match the path as given
        match = None
        for entry in self.settings.files:
            pattern = Path(entry.path).as_posix()
            if any(
                candidate == pattern or fnmatch.fnmatch(candidate, pattern) or candidate.endswith("/" + pattern)
                for candidate in candidates
            ):
                match = entry
        return match


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"cannot read {path}: {error}") from error
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path} is not valid TOML: {error}") from error
    except RecursionError as error:  # tomllib recurses once per nesting level
        raise ConfigError(f"{path} is nested too deeply to read") from error


def _qlint_table(data: dict[str, Any]) -> Any | None:
    tool = data.get("tool")
    return tool.get("qlint") if isinstance(tool, dict) else None


def find_config(start: Path) -> Path | None:
    """The nearest pyproject.toml with a ``[tool.qlint]`` table, from ``start`` upwards."""
    start = Path(os.path.abspath(start))
    for directory in (start, *start.parents):
        candidate = directory / "pyproject.toml"
        if candidate.is_file() and _qlint_table(_read_toml(candidate)) is not None:
            return candidate
    return None


def load_config(path: Path | None) -> Config:
    if path is None:
        return Config(Settings())
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    section = _qlint_table(_read_toml(path))
    if section is None:
        section = {}
    if not isinstance(section, dict):
        raise ConfigError(f"{path}: [tool.qlint] must be a table")
    try:
        return Config(Settings.model_validate(section), path)
    except ValidationError as error:
        first = error.errors()[0]
        raise ConfigError(f"{path} {_where(section, first['loc'])}: {validation_problem(first)}") from error


def _where(section: dict[str, Any], loc: tuple[int | str, ...]) -> str:
    """The table and key of a setting: '[tool.qlint] input-shape', or for a per-file entry
    '[[tool.qlint.files]] path = 'm.pt2': input-shape' (its path says which entry)."""
    files = section.get("files")
    if len(loc) > 1 and loc[0] == "files" and isinstance(loc[1], int) and isinstance(files, list):
        entry = files[loc[1]]
        named = entry.get("path") if isinstance(entry, dict) else None
        which = f"path = {named!r}" if isinstance(named, str) else f"entry {loc[1] + 1}"
        key = ".".join(str(p) for p in loc[2:])
        return f"[[tool.qlint.files]] {which}" + (f": {key}" if key else "")
    key = ".".join(str(p) for p in loc)
    return "[tool.qlint]" + (f" {key}" if key else "")


class ConfigFinder:
    """The Config for each model: ``--config FILE`` for all, else discovered per model folder."""

    def __init__(self, explicit: str | None = None) -> None:
        self._explicit = load_config(Path(explicit)) if explicit else None
        self._loaded: dict[Path | None, Config] = {}

    def for_model(self, model_spec: str) -> Config:
        if self._explicit is not None:
            return self._explicit
        start = Path.cwd() if is_factory_spec(model_spec) else Path(os.path.abspath(model_spec)).parent
        source = find_config(start)
        if source not in self._loaded:
            self._loaded[source] = load_config(source)
        return self._loaded[source]
