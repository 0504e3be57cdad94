"""Executors: how the engine core reaches its workers (in-process, or Ray actors from cluster/).

- ``base``: the ``Executor`` interface the engine core drives, and its selection by configuration (``"ray"``
  resolves to ``cluster.ray_executor`` by import path).
- ``uniproc``: ``UniProcExecutor``, one worker in the engine's own process.
"""
