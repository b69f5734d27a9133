"""Functions named by their public path, as a plan names the functions it keeps float.

``operator.add``, ``torch.sqrt``, ``torch.nn.functional.relu``: :func:`function_path` gives a
function's path and :func:`resolve_function` the function a path names, looked up as an
attribute of ``operator``, ``torch`` or ``torch.nn.functional`` only, so reading a plan file
never imports or runs anything.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

# Where a plan may name a function to keep float: resolved by attribute lookup in these modules
# only, so a plan file never imports or runs anything.
_FUNCTION_HOMES = {"operator": operator, "torch": torch, "torch.nn.functional": F}
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def function_path(target: Any) -> str | None:
    """``operator.add``, ``torch.sqrt``, ``torch.nn.functional.relu``: the public path of a
    function of those modules, or None."""
    name = getattr(target, "__name__", None)
    if not isinstance(name, str):
        return None
    for home, module in _FUNCTION_HOMES.items():
        if getattr(module, name, None) is target:
            return f"{home}.{name}"
    return None


def resolve_function(path: str) -> Callable[..., Any]:
    """The function a :func:`function_path` names; ValueError for anything else."""
    home, _, name = path.rpartition(".")
    module = _FUNCTION_HOMES.get(home)
    found = getattr(module, name, None) if module is not None and _IDENTIFIER.fullmatch(name) else None
    if not callable(found):
        raise ValueError(f"{path!r} is not a function of {', '.join(_FUNCTION_HOMES)}")
    return found
