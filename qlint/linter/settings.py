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
"""

from __future__ import annotations

import fnmatch
import sys
from pathlib import Path
from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from qlint.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib


class _Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)


class FileSettings(_Strict):
    path: str
    input_shape: Optional[list[str]] = Field(None, alias="input-shape")
    example_inputs: Optional[str] = Field(None, alias="example-inputs")
    weights: Optional[str] = None
    calibration: Optional[str] = None
    num_batches: Optional[int] = Field(None, alias="num-batches")
    backend: Optional[str] = None
    qconfig_mapping: Optional[str] = Field(None, alias="qconfig-mapping")


class Settings(_Strict):
    backend: str = "x86"
    select: Optional[list[str]] = None
    ignore: list[str] = Field(default_factory=list)
    fail_on: str = Field("warning", alias="fail-on")
    format: str = "text"
    input_shape: Optional[list[str]] = Field(None, alias="input-shape")
    qconfig_mapping: Optional[str] = Field(None, alias="qconfig-mapping")
    calibration: Optional[str] = None
    num_batches: Optional[int] = Field(None, alias="num-batches")
    baseline: Optional[str] = None
    rules: dict[str, dict[str, Any]] = Field(default_factory=dict)
    files: list[FileSettings] = Field(default_factory=list)

    def for_file(self, model_path: str) -> Optional[FileSettings]:
        """The last [[tool.qlint.files]] entry whose path (or glob) matches the model."""
        candidate = Path(model_path).as_posix()
        match = None
        for entry in self.files:
            pattern = Path(entry.path).as_posix()
            if candidate == pattern or fnmatch.fnmatch(candidate, pattern) or candidate.endswith("/" + pattern):
                match = entry
        return match


def find_pyproject(start: Path) -> Optional[Path]:
    for directory in (start, *start.parents):
        candidate = directory / "pyproject.toml"
        if candidate.is_file():
            return candidate
    return None


def load_settings(config_path: Optional[str] = None, start: Optional[Path] = None) -> tuple[Settings, Optional[Path]]:
    path = Path(config_path) if config_path else find_pyproject((start or Path.cwd()).resolve())
    if path is None:
        return Settings(), None
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"cannot read {path}: {error}") from error
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path} is not valid TOML: {error}") from error
    section = data.get("tool", {}).get("qlint", {})
    try:
        return Settings.model_validate(section), path
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ConfigError(f"{path} [tool.qlint] {where}: {first['msg']}") from error
