"""Walking nested Python containers (args, kwargs, model outputs) for their leaves."""

from __future__ import annotations

from typing import Any, TypeVar

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
        elif isinstance(item, dict):
            stack.extend(reversed(list(item.values())))
    return found
