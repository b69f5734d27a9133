"""Values that survive a JSON round trip unchanged: what findings, rows and plans may hold."""

from __future__ import annotations

import math
from typing import Any


def check_json_able(value: Any, path: str = "data") -> None:
    """Reject values that would not survive a JSON round trip unchanged."""
    if value is None or isinstance(value, (str, bool, int)):
        return
    if isinstance(value, float):
        # NaN and Inf are not JSON; rules encode them as strings ("nan", "inf").
        if value != value or value in (float("inf"), float("-inf")):
            raise ValueError(f"{path} holds a non-finite float; store it as a string")
        return
    if isinstance(value, list):
        for i, item in enumerate(value):
            check_json_able(item, f"{path}[{i}]")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ValueError(f"{path} has a non-string key {key!r}")
            check_json_able(item, f"{path}.{key}")
        return
    raise ValueError(f"{path} holds {type(value).__name__}, which is not JSON-able")


def json_float(value: Any) -> Any:
    """A float for JSON: finite values as float, NaN/Inf as "nan"/"inf"/"-inf"."""
    value = float(value)
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return value


def finite_or_none(value: Any) -> float | None:
    """``value`` as a float when finite, else None."""
    value = float(value)
    return value if math.isfinite(value) else None
