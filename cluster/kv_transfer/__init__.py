"""KV transfer over Ray for disaggregated prefill: the transports behind ``engine.kv_transfer.KVTransport``.

- ``transports``: ``ObjectStoreTransport`` and ``RayDirectTransport`` (by import path from
  ``engine.kv_transfer.transport``).
- ``ray_direct``: the ``KVDirectCoordinator`` actor and ``KVDirectClient`` that move blocks between worker
  actors over a collective group.

The scheduler side is ``engine.sched.kv_transfer``, the worker side ``engine.kv_transfer``.
"""
