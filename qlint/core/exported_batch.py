"""Calibration batches for an exported program whose input shapes are fixed.

``torch.export`` specializes every dimension it was not told is dynamic: a program exported
with a batch of 1 guards ``x.size()[0] == 1`` on every call, and calibration batches of 8 fail
with ``AssertionError: Guard failed``. When the batch dimension is the only difference, the
calibration samples are re-chunked into batches of the exported size (streamed: one batch of
rows is held at a time) and the caller gets a notice saying so. Any other difference is one
clear error naming the dimension the export fixed and how to export it as dynamic.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from qlint.core.batches import BatchError, call_parts
from qlint.errors import LoadError


@dataclasses.dataclass(frozen=True)
class ExportedInput:
    """One tensor input of an exported program: its name and each dimension (None: dynamic)."""

    name: str
    dims: tuple[int | None, ...]


def exported_inputs(program: Any) -> tuple[ExportedInput, ...] | None:
    """The program's user inputs in call order; None unless every one is a tensor."""
    from torch.export.graph_signature import InputKind

    placeholders = {node.name: node for node in program.graph.nodes if node.op == "placeholder"}
    found = []
    for spec in program.graph_signature.input_specs:
        if spec.kind != InputKind.USER_INPUT:
            continue
        node = placeholders.get(getattr(spec.arg, "name", None))
        value = node.meta.get("val") if node is not None else None
        if node is None or not isinstance(value, torch.Tensor):
            return None
        found.append(ExportedInput(node.name, tuple(d if isinstance(d, int) else None for d in value.shape)))
    return tuple(found) or None


def fit_calibration(calibration: Any, program: Any) -> tuple[Any, str | None]:
    """``calibration`` shaped for ``program``: unchanged when it fits, re-chunked to the exported
    batch size when only the batch dimension differs (with the notice text to show), else LoadError."""
    if program is None or calibration is None or isinstance(calibration, Mapping):
        return calibration, None
    inputs = exported_inputs(program)
    if inputs is None:
        return calibration, None
    if isinstance(calibration, torch.Tensor):
        calibration = [calibration]  # one batch, as calibration does
    batch_size = _fixed_batch_size(inputs)
    if isinstance(calibration, Sequence):
        return _fit_sequence(calibration, inputs, batch_size)
    if not isinstance(calibration, Iterable):
        return calibration, None
    iterator = iter(calibration)
    first = next(iterator, _NOTHING)
    if first is _NOTHING:
        return [], None
    stream = itertools.chain([first], iterator)
    rows = _rows_if_rechunked(first, 0, inputs, batch_size)
    notice = None
    if rows is not None:
        notice = (
            f"calibration batches of {rows} samples are re-chunked into batches of {batch_size}: "
            f"{_fixed_text(inputs, batch_size)}; a last partial batch, if any, is left out. "
            + _EXPORT_HINT.format(name=inputs[0].name)
        )
    return _rechunk(stream, inputs, batch_size), notice  # one pass, like the stream it reads


_NOTHING = object()
_EXPORT_HINT = (
    "To calibrate on other batch sizes, export with dynamic_shapes, e.g. "
    "torch.export.export(model, args, dynamic_shapes={{'{name}': {{0: torch.export.Dim('batch')}}}})"
)


def _fit_sequence(
    batches: Sequence[Any], inputs: tuple[ExportedInput, ...], batch_size: int | None
) -> tuple[Any, str | None]:
    counts = []
    for number, batch in enumerate(batches):
        tensors = _as_tensors(batch, inputs)
        if tensors is None:
            return batches, None  # not positional tensors: calibration and torch report what is wrong
        _rows_if_rechunked(batch, number, inputs, batch_size)  # any other fixed dimension: LoadError here
        counts.append(int(tensors[0].shape[0]) if tensors[0].dim() else 0)
    if batch_size is None or all(rows == batch_size for rows in counts):
        return batches, None
    total = sum(counts)
    if total < batch_size:
        raise _too_few(total, inputs, batch_size)
    left_out = total % batch_size
    sizes = ", ".join(str(size) for size in sorted(set(counts)))
    notice = (
        f"calibration batches of {sizes} samples were re-chunked into {total // batch_size} batches of "
        f"{batch_size}: {_fixed_text(inputs, batch_size)}"
        + (f"; the last {left_out} samples were left out" if left_out else "")
        + ". "
        + _EXPORT_HINT.format(name=inputs[0].name)
    )
    return _Fitted(batches, inputs, batch_size, total // batch_size), notice


class _Fitted:
    """A sequence of batches re-chunked to the exported batch size; re-iterable, with a length."""

    def __init__(self, source: Sequence[Any], inputs: tuple[ExportedInput, ...], batch_size: int, length: int) -> None:
        self._source = source
        self._inputs = inputs
        self._batch_size = batch_size
        self._length = length

    def __iter__(self) -> Iterator[Any]:
        return _rechunk(self._source, self._inputs, self._batch_size)

    def __len__(self) -> int:
        return self._length


def _rechunk(source: Iterable[Any], inputs: tuple[ExportedInput, ...], batch_size: int | None) -> Iterator[Any]:
    pending: list[tuple[torch.Tensor, ...]] = []
    pending_rows = emitted = 0
    for number, batch in enumerate(source):
        rows = _rows_if_rechunked(batch, number, inputs, batch_size)
        tensors = _as_tensors(batch, inputs)
        if (rows is None and not pending) or tensors is None or batch_size is None:
            emitted += 1
            yield batch  # it fits as it is (or is not made of tensors: calibration and torch will say)
            continue
        pending.append(tensors)
        pending_rows += tensors[0].shape[0]
        while pending_rows >= batch_size:
            joined = [torch.cat(parts) if len(parts) > 1 else parts[0] for parts in zip(*pending)]
            chunk = tuple(t[:batch_size] for t in joined)
            rest = tuple(t[batch_size:] for t in joined)
            pending_rows -= batch_size
            pending = [rest] if pending_rows else []
            emitted += 1
            yield chunk if len(chunk) > 1 else chunk[0]
    if pending_rows and not emitted and batch_size is not None:
        raise _too_few(pending_rows, inputs, batch_size)


def _too_few(total: int, inputs: tuple[ExportedInput, ...], batch_size: int) -> LoadError:
    return LoadError(
        f"calibration holds {total} samples, fewer than the batch size the exported program "
        f"fixed ({_fixed_text(inputs, batch_size)}); " + _EXPORT_HINT.format(name=inputs[0].name)
    )


def _rows_if_rechunked(
    batch: Any, number: int, inputs: tuple[ExportedInput, ...], batch_size: int | None
) -> int | None:
    """None when ``batch`` fits (or is not a tuple of tensors); its row count when only the batch
    dimension differs and can be re-chunked; LoadError for any other fixed dimension."""
    tensors = _as_tensors(batch, inputs)
    if tensors is None:
        return None
    mismatched = []
    for tensor, spec in zip(tensors, inputs):
        if tensor.dim() != len(spec.dims):
            raise LoadError(
                f"calibration batch {number}: input '{spec.name}' has {tensor.dim()} dimensions "
                f"(shape {tuple(tensor.shape)}), the exported program takes {len(spec.dims)} "
                f"(shape {_dims_text(spec.dims)})"
            )
        for dim, (got, fixed) in enumerate(zip(tensor.shape, spec.dims)):
            if fixed is not None and got != fixed:
                mismatched.append((spec, dim, fixed, got))
    if not mismatched:
        return None
    other = [m for m in mismatched if m[1] != 0]
    if other or batch_size is None or len({t.shape[0] for t in tensors}) != 1:
        spec, dim, fixed, got = (other or mismatched)[0]
        raise LoadError(
            f"calibration batch {number} does not fit the exported program: the export fixed dimension {dim} "
            f"of input '{spec.name}' to {fixed}, the batch has {got} (shape {_dims_text(spec.dims)} expected). "
            f"Export with dynamic_shapes to accept other sizes, e.g. torch.export.export(model, args, "
            f"dynamic_shapes={{'{spec.name}': {{{dim}: torch.export.Dim.AUTO}}}})"
        )
    return int(tensors[0].shape[0])


def _as_tensors(batch: Any, inputs: tuple[ExportedInput, ...]) -> tuple[torch.Tensor, ...] | None:
    """The batch's positional tensors, one per input of the program; None for any other batch
    (keyword inputs, another count, a non-tensor), which the program's own call then judges."""
    try:
        tensors, keywords = call_parts(batch)
    except BatchError:
        return None
    if keywords or len(tensors) != len(inputs) or not all(isinstance(t, torch.Tensor) for t in tensors):
        return None
    return tensors


def _fixed_batch_size(inputs: tuple[ExportedInput, ...]) -> int | None:
    """The batch size every input fixed, when they all fixed the same one."""
    sizes = {spec.dims[0] if spec.dims else None for spec in inputs}
    if len(sizes) != 1:
        return None
    (size,) = sizes
    return size


def _fixed_text(inputs: tuple[ExportedInput, ...], batch_size: int | None) -> str:
    names = ", ".join(f"'{spec.name}'" for spec in inputs)
    return f"the exported program fixes dimension 0 of {names} to {batch_size}"


def _dims_text(dims: tuple[int | None, ...]) -> str:
    return "(" + ", ".join("*" if d is None else str(d) for d in dims) + ")"
