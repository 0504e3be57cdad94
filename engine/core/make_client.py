"""``make_core_client``: the one way to start an engine core and get its ``CoreClient``."""

from __future__ import annotations

from engine.config import EngineConfig
from engine.core.core_client import CoreClient, CorePlacement
from engine.core.inproc_client import InprocCoreClient, ThreadCoreClient
from engine.core.proc_client import ProcCoreClient


def make_core_client(
    config: EngineConfig, placement: CorePlacement, executor_class: type | None = None, kv_events: bool = False
) -> CoreClient:
    """Starts ``config``'s core where ``placement`` says; call ``wait_ready`` before using it. ``kv_events``:
    each step reports the prefix cache's changes (``take_kv_events``: a KV-aware router's feed)."""
    if placement is CorePlacement.INLINE:
        return InprocCoreClient(config, executor_class, kv_events)
    if placement is CorePlacement.THREAD:
        return ThreadCoreClient(config, executor_class, kv_events)
    return ProcCoreClient(config, placement, executor_class, kv_events)
