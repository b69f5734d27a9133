"""qlint: a rule-based linter for PyTorch quantization problems."""

from importlib.metadata import PackageNotFoundError, version as _version

try:
    __version__ = _version("qlint")
except PackageNotFoundError:  # running from a source checkout that is not installed
    __version__ = "0.1.0"

from qlint.findings import Finding, LayerRow, Notice, QConfigRow, Report, Severity, SkippedRule, Timing  # noqa: E402
from qlint.engine import lint  # noqa: E402
from qlint.verify import verify  # noqa: E402
from qlint.numeric.compare import compare  # noqa: E402
from qlint.numeric.sensitivity import sensitivity  # noqa: E402

__all__ = ["Finding", "LayerRow", "Notice", "QConfigRow", "Report", "Severity", "SkippedRule",
           "Timing", "compare", "lint", "sensitivity", "verify", "__version__"]
