"""Ray code for distributed execution: placement, worker actors and the Ray executor.

``engine/`` never imports this package; it reaches ``cluster.ray_executor``
by import path when ``distributed_executor_backend`` is ``"ray"``.
"""
