"""Executors: how the engine core reaches its workers (in-process, or Ray actors from cluster/)."""
