"""qlint: a rule-based linter for PyTorch quantization problems.

``import qlint`` loads the lint layers only; ``verify``, ``compare`` and
``sensitivity`` (the advice and numeric layers) load on first use.
"""

from importlib import import_module
from importlib.metadata import PackageNotFoundError, version as _version
from typing import Any

try:
    __version__ = _version("qlint")
except PackageNotFoundError:  # running from a source checkout that is not installed
    __version__ = "0.1.0"

from qlint.linter.engine import lint  # noqa: E402
from qlint.linter.findings import (Finding, LayerRow, Notice, QConfigRow, Report, Severity,  # noqa: E402
                                   SkippedRule, Timing)

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


__all__ = ["Finding", "LayerRow", "Notice", "QConfigRow", "Report", "Severity", "SkippedRule",
           "Timing", "compare", "lint", "sensitivity", "verify", "__version__"]
