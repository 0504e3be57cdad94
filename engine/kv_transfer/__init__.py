"""The worker side of KV transfer for disaggregated prefill (the scheduler side is ``engine.core.kv_connector``)."""

from engine.kv_transfer.transport import KVTransport, get_transport_class
from engine.kv_transfer.worker_connector import KVConnectorWorker

__all__ = ["KVConnectorWorker", "KVTransport", "get_transport_class"]
