"""Reporters: they format a Report and never decide what is a problem."""

from collections.abc import Callable

from qlint.render.json import render_json
from qlint.render.text import render_text

FORMATS: dict[str, Callable[..., str]] = {"text": render_text, "json": render_json}

__all__ = ["FORMATS", "render_json", "render_text"]
