"""The calibration run loop: every batch through the observed model, nothing kept between batches."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn as nn

from qlint.core.batches import as_call, batch_count, batches_of, model_device
from qlint.errors import CalibrationError, EmptyCalibrationError, QlintError, first_line


def limited_batches(calibration: Any, num_batches: int | None) -> Iterator[Any]:
    """The batches of ``calibration``, at most ``num_batches`` of them."""
    if calibration is None:
        raise EmptyCalibrationError("no calibration data given")
    for number, batch in enumerate(batches_of(calibration, "calibration data")):
        if num_batches is not None and number >= num_batches:
            return
        yield batch


def batch_total(calibration: Any, num_batches: int | None) -> int | None:
    """How many batches :func:`limited_batches` will yield, when that is known up front."""
    total = batch_count(calibration)
    if total is None:
        return num_batches
    return total if num_batches is None else min(total, num_batches)


def run_calibration(model: nn.Module, batches: Iterable[Any], *, quiet: bool = False, total: int | None = None) -> int:
    """Run every batch through ``model`` (eval, no_grad, model's device); the batch count."""
    device = model_device(model)
    model.eval()
    progress = None if quiet else _progress(total)
    count = 0
    try:
        with torch.no_grad():
            for count_before, batch in enumerate(batches):
                args, kwargs = as_call(batch, device, f"calibration batch {count_before}")
                try:
                    model(*args, **kwargs)
                except QlintError:
                    raise
                except Exception as error:
                    raise CalibrationError(
                        f"calibration batch {count_before} failed in the model: {first_line(error)}"[:400]
                    ) from error
                count = count_before + 1
                del args, kwargs, batch
                if progress is not None:
                    progress.advance()
    finally:
        if progress is not None:
            progress.stop()
    return count


# In a log (CI, no terminal) a line this often, so that a long calibration never looks hung.
PROGRESS_LINE_SECONDS = 5.0


def _progress(total: int | None) -> _ProgressBar | _ProgressLines:
    """A live bar on a terminal; in a log, a short line every PROGRESS_LINE_SECONDS."""
    return _ProgressBar(total) if sys.stderr is not None and sys.stderr.isatty() else _ProgressLines(total)


class _ProgressBar:
    def __init__(self, total: int | None) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._bar = Progress(
            TextColumn("calibrating"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=Console(file=sys.stderr),
            transient=True,
        )
        self._bar.start()
        self._task = self._bar.add_task("calibrating", total=total)

    def advance(self) -> None:
        self._bar.update(self._task, advance=1)

    def stop(self) -> None:
        self._bar.stop()


class _ProgressLines:
    def __init__(self, total: int | None) -> None:
        self._total = total
        self._done = 0
        self._start = time.monotonic()
        self._next = self._start + PROGRESS_LINE_SECONDS

    def advance(self) -> None:
        self._done += 1
        now = time.monotonic()
        if now >= self._next and sys.stderr is not None:
            of = f"/{self._total}" if self._total else ""
            print(
                f"qlint: calibrating: {self._done}{of} batches, {now - self._start:.0f} s", file=sys.stderr, flush=True
            )
            self._next = now + PROGRESS_LINE_SECONDS

    def stop(self) -> None:
        pass
