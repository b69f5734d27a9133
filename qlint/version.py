"""The installed qlint's version."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("qlint")
except PackageNotFoundError:  # running from a source checkout that is not installed
    __version__ = "0.1.0"
