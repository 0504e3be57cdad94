"""Ray code for distributed execution: placement, worker actors, the Ray executor, the core actor.

``engine/`` never imports this package; it reaches ``cluster.ray_executor`` (``distributed_executor_backend``
``"ray"``), ``cluster.core_actor`` and ``cluster.kv_transfer`` by import path.

- ``placement``: one placement-group bundle per worker; the replica's own group inside Serve.
- ``worker_actor``: ``RayWorker``, an ``engine.worker.Worker`` inside a Ray actor.
- ``ray_executor``: ``RayExecutor``, the workers started and driven step by step (compiled graph or tasks).
- ``core_actor``: ``EngineCoreActor``, the engine core (``EngineCoreProc``) as a Ray actor; its ``CoreHost``.
- ``kv_transfer``: KV transports over Ray (a package).
"""
