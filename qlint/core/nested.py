"""Walking nested Python containers (args, kwargs, model outputs) for their leaves.

Batches, call arguments and model outputs are tensors nested in tuples, lists and
dicts. Every layer walks them with these functions, so they all agree on the order
of the leaves (depth first, dict values in insertion order).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch

T = TypeVar("T")


def leaves_of_type(value: Any, leaf_type: type[T]) -> list[T]:
    """Every ``leaf_type`` instance in ``value``, depth first, through tuples, lists and dicts."""
    found: list[T] = []
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, leaf_type):
            found.append(item)
        elif isinstance(item, (list, tuple)):
            stack.extend(reversed(item))
        elif isinstance(item, Mapping):
            stack.extend(reversed(list(item.values())))
    return found


def tensors_in(value: Any) -> list[torch.Tensor]:
    """Every tensor in ``value``, in the order of :func:`leaves_of_type`."""
    return leaves_of_type(value, torch.Tensor)


def floats_are_finite(value: Any) -> bool:
    """Whether every floating-point tensor in a nested value holds only finite numbers (data
    with NaN or Inf has no SQNR to measure on: verify and compare refuse it)."""
    return all(bool(tensor.isfinite().all()) for tensor in tensors_in(value) if tensor.is_floating_point())


def first_tensor(value: Any) -> torch.Tensor | None:
    """The first tensor in ``value``: an LSTM's ``(output, (h, c))`` gives ``output``."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            return item
        if isinstance(item, (list, tuple)):
            stack.extend(reversed(item))
        elif isinstance(item, Mapping):
            stack.extend(reversed(list(item.values())))
    return None


def as_float(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """The float values a tensor stands for: dequantized, detached; None for integer tensors."""
    if tensor is None:
        return None
    if tensor.is_quantized:
        tensor = tensor.dequantize()
    return tensor.detach() if tensor.is_floating_point() else None


def first_float(value: Any) -> torch.Tensor | None:
    """The float values of the first tensor in ``value``; None when it is not floating-point.

    A layer's output is compared on its first tensor: an LSTM's sequence output is what
    every consumer sees."""
    return as_float(first_tensor(value))


def float_tensors(value: Any) -> list[torch.Tensor]:
    """The float values of every floating-point (or quantized) tensor in ``value``."""
    found = (as_float(tensor) for tensor in tensors_in(value))
    return [tensor for tensor in found if tensor is not None]


def map_tensors(value: Any, function: Callable[[torch.Tensor], Any]) -> Any:
    """``value`` with every tensor replaced by ``function(tensor)``; containers keep their type."""
    if isinstance(value, torch.Tensor):
        return function(value)
    if isinstance(value, tuple):
        return tuple(map_tensors(item, function) for item in value)
    if isinstance(value, list):
        return [map_tensors(item, function) for item in value]
    if isinstance(value, Mapping):
        return {key: map_tensors(item, function) for key, item in value.items()}
    return value
