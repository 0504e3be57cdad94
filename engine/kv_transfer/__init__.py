"""The worker side of KV transfer for disaggregated prefill (the scheduler side is ``engine.sched.kv_transfer``).

- ``worker``: ``KVConnectorWorker``, blocks between the paged cache and a transport (loads before the
  forward, saves after it, a failed load's tokens computed again).
- ``transport``: the ``KVTransport`` interface and its selection (transports live in ``cluster/kv_transfer/``,
  by import path).
- ``handle_stash``: KV handles across the engine-core pipe (they ride Ray calls; the pipe carries a key).
"""

from engine.kv_transfer.transport import KVTransport, get_transport_class
from engine.kv_transfer.worker import KVConnectorWorker

__all__ = ["KVConnectorWorker", "KVTransport", "get_transport_class"]
