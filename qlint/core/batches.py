"""Batches of data as call arguments: the one convention lint, verify and compare share.

A batch is a tensor (one positional input), a tuple or list (positional inputs) or a
mapping (keyword inputs). Data is an iterable of batches; a lone tensor or mapping is
one batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.nn as nn

from qlint.core.nested import first_tensor, map_tensors
from qlint.errors import QlintError


class BatchError(QlintError):
    """A batch is not a tensor, a tuple of inputs or a mapping of keyword inputs."""


def as_call(
    batch: Any, device: torch.device | None = None, what: str = "a batch"
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``batch`` as ``(args, kwargs)`` holding copies of its tensors, on ``device`` when one is given.

    The copies are the model's own: one that writes its input in place (``x.mul_(2)``,
    ``relu_``) changes neither the caller's data nor what the next forward pass sees.
    ``what`` names the batch in the error, e.g. "calibration batch 3"."""
    args, kwargs = call_parts(batch, what)

    def own(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.clone() if device is None else tensor.to(device, copy=True)

    return map_tensors(args, own), map_tensors(kwargs, own)


def call_parts(batch: Any, what: str = "a batch") -> tuple[tuple[Any, ...], dict[str, Any]]:
    """How a batch calls a model, uncopied: a tensor is the one positional input, a tuple or
    list the positional inputs, a mapping the keyword inputs."""
    if isinstance(batch, torch.Tensor):
        return (batch,), {}
    if isinstance(batch, (tuple, list)):
        return tuple(batch), {}
    if isinstance(batch, Mapping):
        return (), {str(key): value for key, value in batch.items()}
    raise BatchError(
        f"{what} is a {type(batch).__name__}; expected a tensor, a tuple of tensors "
        "(positional inputs) or a dict (keyword inputs)"
    )


def call_model(model: Callable[..., Any], batch: Any) -> Any:
    """``model`` called on one batch."""
    args, kwargs = as_call(batch)
    return model(*args, **kwargs)


def first_batch_as_example(calibration: Any) -> tuple[Any, ...] | None:
    """The first calibration batch as positional example inputs; None where reading it would
    use it up (a one-shot iterator), or it is not a batch of positional inputs."""
    try:
        if not isinstance(calibration, (torch.Tensor, Mapping)) and iter(calibration) is calibration:
            return None
        first = next(batches_of(calibration, "calibration data"), None)
        args, kwargs = as_call(first) if first is not None else ((), {})
    except (TypeError, QlintError):  # not iterable, or not a batch: calibration says so in its own words
        return None
    return args if args and not kwargs else None


def batch_size(batch: Any) -> int:
    """Samples in a batch: the leading dimension of its first tensor (1 for a scalar, 0 for none)."""
    first = first_tensor(batch)
    if first is None:
        return 0
    return int(first.shape[0]) if first.dim() else 1


def batches_of(data: Any, what: str = "data") -> Iterator[Any]:
    """The batches of ``data``, one at a time; a lone tensor or mapping is one batch."""
    if isinstance(data, (torch.Tensor, Mapping)):
        yield data
        return
    try:
        iterator = iter(data)
    except TypeError as error:
        raise BatchError(f"{what} must be iterable, got {type(data).__name__}") from error
    while True:
        try:
            batch = next(iterator)
        except StopIteration:
            return
        except QlintError:
            raise
        except Exception as error:  # the user's generator or DataLoader raised
            raise BatchError(f"{what}: producing a batch raised {type(error).__name__}: {error}"[:400]) from error
        yield batch


def batch_count(data: Any) -> int | None:
    """How many batches ``data`` holds, when it can say without being read."""
    if isinstance(data, (torch.Tensor, Mapping)):
        return 1
    try:
        return len(data)
    except TypeError:
        return None


def model_device(model: nn.Module) -> torch.device:
    """Where the model's parameters (else buffers) live; CPU for a model with neither."""
    for tensor in model.parameters():
        return tensor.device
    for buffer in model.buffers():
        return buffer.device
    return torch.device("cpu")


def reiterable(data: Iterable[Any], purpose: str) -> Iterable[Any]:
    """Reject one-shot iterators where the data must be read more than once."""
    if iter(data) is data:
        raise TypeError(f"{purpose} reads the data more than once; pass a list or a DataLoader, not an iterator")
    return data
