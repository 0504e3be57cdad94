"""The transport interface a KV connector moves blocks with, and its selection by configuration.

``engine/`` never imports Ray: the transports live in ``cluster/kv_transfer/transports.py``
and are found by import path, as executors are.

Blocks travel in one layout whatever the attention backend: one tensor per
block, ``[num_layers, 2, block_size, num_kv_heads, head_dim]`` (2 = keys, values).
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from typing import Any

import torch

from engine.config import KVTransferConfig

TRANSPORT_IMPORT_PATHS = {
    "object_store": "cluster.kv_transfer.transports:ObjectStoreTransport",
    "ray_direct": "cluster.kv_transfer.transports:RayDirectTransport",
}


class KVTransport(ABC):
    """Moves one request's prompt blocks from the worker that computed them to the one that decodes.

    ``save`` runs on the producer's worker, ``load`` on the consumer's; the
    handle data ``save`` returns is picklable and may cross any number of
    processes in between.
    """

    def __init__(self, config: KVTransferConfig, device: torch.device) -> None:
        self.config = config
        self.device = device

    @abstractmethod
    def save(self, kv_id: str, blocks: list[torch.Tensor]) -> Any:
        """Publishes the blocks (each ``[num_layers, 2, block_size, H, D]``, owned by the caller from now on);
        returns the handle data that ``load`` takes."""

    @abstractmethod
    def load(self, req_id: str, data: Any, block_indices: list[int]) -> list[torch.Tensor]:
        """The blocks at ``block_indices`` of a saved request, on this worker's device. Raises on failure
        (the caller then computes the KV itself)."""


def get_transport_class(config: KVTransferConfig) -> type[KVTransport]:
    module_name, _, class_name = TRANSPORT_IMPORT_PATHS[config.kv_connector].partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"KV transport {config.kv_connector!r} is not available: {error}") from error
    return getattr(module, class_name)
