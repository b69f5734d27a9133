"""The cli layer: every ``qlint`` command."""

from qlint.cli.main import main

__all__ = ["main"]
