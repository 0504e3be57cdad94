"""The worker side of KV transfer for disaggregated prefill (the scheduler side is ``engine.sched.kv_transfer``)."""

from engine.kv_transfer.transport import KVTransport, get_transport_class
from engine.kv_transfer.worker import KVConnectorWorker

__all__ = ["KVConnectorWorker", "KVTransport", "get_transport_class"]
