"""qlint: a rule-based linter for PyTorch quantization problems.

``import qlint`` loads the lint layers only; ``verify``, ``compare`` and
``sensitivity`` (the advice and numeric layers) load on first use.
"""

from importlib import import_module
from typing import Any

from qlint.linter.engine import lint
from qlint.linter.findings import (
    CompareRow,
    Finding,
    LayerRow,
    Notice,
    QConfigRow,
    Report,
    RuleInfo,
    Severity,
    SkippedRule,
    Timing,
)
from qlint.version import __version__

# Public functions of the higher layers, imported when first used.
_LAZY = {
    "verify": "qlint.advice.verify",
    "compare": "qlint.numeric.compare",
    "sensitivity": "qlint.numeric.sensitivity",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'qlint' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "CompareRow",
    "Finding",
    "LayerRow",
    "Notice",
    "QConfigRow",
    "Report",
    "RuleInfo",
    "Severity",
    "SkippedRule",
    "Timing",
    "compare",
    "lint",
    "sensitivity",
    "verify",
    "__version__",
]
