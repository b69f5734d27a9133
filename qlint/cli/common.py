"""What every qlint command shares: its argument parser, exit codes, the stream for the
report, and the rule that outputs never overwrite inputs."""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import shutil
import sys
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from qlint.errors import ConfigError, QlintError

EXIT_CLEAN, EXIT_FINDINGS, EXIT_ERROR = 0, 1, 2


class ParserExit(Exception):
    """argparse finished on its own (``--help``): exit with ``status``.

    Not a SystemExit, so that a SystemExit can only mean user code or a plugin called
    sys.exit(), which the CLI reports as an error."""

    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr and exit 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(f"{message} (see '{self.prog} --help')")

    def exit(self, status: int = 0, message: str | None = None) -> None:  # type: ignore[override]
        if message:
            sys.stderr.write(message)
        raise ParserExit(status)


def _int_at_least(text: str, low: int, wanted: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {wanted}, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"expected {wanted}, got {value}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    return _int_at_least(text, 1, "a positive integer")


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    return _int_at_least(text, 0, "0 or more")


def random_batch_count(text: str) -> int:
    """argparse type of --random-calibration: 1 to MAX_RANDOM_BATCHES (a huge count ran for
    hours, one forward pass per batch, or was an internal OverflowError past sys.maxsize)."""
    from qlint.core.load import MAX_RANDOM_BATCHES

    value = positive_int(text)
    if value > MAX_RANDOM_BATCHES:
        raise argparse.ArgumentTypeError(
            f"expected at most {MAX_RANDOM_BATCHES:,} batches (random data says nothing more after a few "
            f"hundred; calibrate on real data with --calibration), got {value}"
        )
    return value


def finite_float(text: str) -> float:
    """argparse type: a finite number (nan and inf would make every comparison false)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text}")
    return value


def fraction(text: str) -> float:
    """argparse type: a number in [0, 1]."""
    value = finite_float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"expected a fraction between 0 and 1, got {text}")
    return value


def split_list(values: Sequence[str] | None) -> list[str] | None:
    """Repeated and comma-separated flag values as one list (None when none were given)."""
    if not values:
        return None
    return [part.strip() for value in values for part in value.split(",") if part.strip()]


@contextlib.contextmanager
def user_output_to_stderr() -> Iterator[None]:
    """Run the user's code (model loading, forward, factories) with ``print`` going to stderr.

    stdout carries the report (JSON, SARIF, GitHub commands); a print() in a model's
    forward must not end up inside it."""
    with contextlib.redirect_stdout(sys.stderr):
        yield


def write_file(path: str, text: str) -> None:
    """``text`` written to ``path`` (UTF-8); a one-line error when the file cannot be written."""
    try:
        Path(path).write_text(text, encoding="utf-8")
    except OSError as error:
        raise QlintError(f"cannot write {path}: {error.strerror}") from error


def write_stdout(text: str) -> None:
    """Write the report to stdout; a closed or full stdout is a one-line error, not a crash."""
    stream = sys.stdout
    if stream is None:
        raise QlintError("stdout is closed: nowhere to write the report (pass -o FILE)")
    try:
        stream.write(text)
        stream.flush()
    except BrokenPipeError:
        raise  # the reader went away (`| head`): main() ends quietly
    except (OSError, ValueError) as error:  # ENOSPC (/dev/full), EBADF, or a closed file object
        _silence_stdout()
        detail = getattr(error, "strerror", None) or str(error)
        raise QlintError(f"cannot write the report to stdout: {detail} (pass -o FILE)") from error


def _silence_stdout() -> None:
    """Point fd 1 at /dev/null so that the interpreter's final flush cannot fail a second time."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.close(devnull)
    except OSError:
        pass  # fd 1 may not exist at all; there is then nothing left to flush either


def terminal_width(to_stdout: bool = True) -> int | None:
    """The width tables should fit: ``COLUMNS`` when set, else the terminal's when stdout is
    one; None for a pipe or a file (tables then keep their natural width)."""
    columns = os.environ.get("COLUMNS", "").strip()
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    stream = sys.stdout
    if to_stdout and stream is not None and stream.isatty():
        return shutil.get_terminal_size().columns
    return None


def _same_file(a: Path, b: Path) -> bool:
    try:
        if a.exists() and b.exists():
            return os.path.samefile(a, b)
    except OSError:
        return False
    return os.path.normcase(os.path.abspath(a)) == os.path.normcase(os.path.abspath(b))


def _files_of(spec: str) -> list[Path]:
    """The files an input spec reads: a path itself; the .py of 'file.py:function'; for
    'package.module:function', each file that module could be imported from (the working
    directory and sys.path are searched by path, nothing is imported)."""
    from qlint.core.load import is_factory_spec, split_factory_spec

    factory = split_factory_spec(spec) if is_factory_spec(spec) else None
    if factory is None:
        return [Path(spec)]
    module_part = factory[0]
    if module_part.endswith(".py"):
        return [Path(module_part)]
    relative = Path(*module_part.split("."))
    folders = [os.getcwd(), *(entry for entry in sys.path if entry)]
    return [
        Path(folder) / name for folder in folders for name in (relative.with_suffix(".py"), relative / "__init__.py")
    ]


# Outputs whose folder the command creates (a report folder such as out/); the others must exist.
_FOLDER_CREATED = frozenset({"--html", "--badcases-path"})


def check_outputs(outputs: Iterable[tuple[str, str | None]], inputs: Iterable[str | None]) -> None:
    """Before any work: ConfigError when an output flag names a file this run reads (the model,
    its weights, the source of a model or data function...), a file another output flag also
    writes, or a folder that does not exist."""
    input_paths = [(spec, path) for spec in inputs if spec for path in _files_of(spec)]
    written: list[tuple[str, str]] = []
    for flag, output in outputs:
        if not output:
            continue
        folder = Path(output).parent
        if flag not in _FOLDER_CREATED and not folder.is_dir():
            raise ConfigError(f"{flag} {output}: folder {folder} does not exist")
        for source, path in input_paths:
            if _same_file(Path(output), path):
                shown = source if str(path) == source else f"{source}, read from {path}"
                raise ConfigError(
                    f"{flag} {output} is an input of this run ({shown}); refusing to overwrite it: choose another path"
                )
        for other_flag, other in written:
            if _same_file(Path(output), Path(other)):
                raise ConfigError(f"{other_flag} and {flag} both write {output}: choose a path for each")
        written.append((flag, output))
