"""Serval's user-facing top layer: the ``serval`` command line, the benchmarks (``serval bench``) and the
observability tooling (``serval dashboard``). It may import every other layer; none imports it."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("serval")  # the installed distribution's (pyproject's version)
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"
