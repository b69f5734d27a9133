"""Output formats beyond text and json, looked up by ``qlint.cli.lint``."""

from collections.abc import Callable

from qlint.render.github import render_github
from qlint.render.sarif import render_sarif

EXTRA_FORMATS: dict[str, Callable[..., str]] = {"sarif": render_sarif, "github": render_github}

__all__ = ["EXTRA_FORMATS", "render_github", "render_sarif"]
