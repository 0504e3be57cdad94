"""Serval's user-facing top layer: the ``serval`` command line, the benchmarks (``serval bench``) and the
observability tooling (``serval dashboard``). It may import every other layer; none imports it."""
