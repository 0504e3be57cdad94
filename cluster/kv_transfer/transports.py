"""KV transports over Ray (the ``engine.kv_transfer.KVTransport`` interface).

* ``ObjectStoreTransport``: the prefill worker puts the blocks in the object
  store, consecutive blocks together up to about 1 MiB an object; the handle is
  the list of references, and the decode worker gets only the objects holding
  blocks it lacks. References are counted by Ray: the
  blocks live while a handle to them does (in a response, a queued request)
  and are freed when the last one is dropped, so an aborted or failed request
  leaks nothing. Any executor, any node.
* ``RayDirectTransport``: Ray Direct Transport. The prefill worker (a Ray
  executor worker actor) keeps the blocks in its outbox; the decode engine's
  executor has them sent straight from that actor to its own worker actor over
  a collective group (gloo on CPU, nccl on GPU), ahead of the step that needs
  them (``cluster.kv_transfer.ray_direct``). Blocks leave the outbox when read, or after
  ``OUTBOX_TTL_S``.
"""

from __future__ import annotations

import bisect
import threading
import time
from dataclasses import dataclass
from typing import Any

import ray
import torch

from engine.config import KVTransferConfig
from engine.kv_transfer.transport import KVTransport

LOAD_TIMEOUT_S = 10.0  # a block that takes longer is lost: the decode side computes it instead
CHUNK_TARGET_BYTES = 1 << 20  # object store: consecutive blocks share an object up to this size
OUTBOX_TTL_S = 120.0  # blocks nobody read by then (the request was aborted, the decode side died) are dropped


@dataclass(frozen=True)
class ObjectStoreKV:
    """A saved request in the object store: ``refs[i]`` holds blocks ``starts[i]`` .. ``starts[i + 1] - 1``."""

    refs: list
    starts: list[int]  # the first block of each object, then the total number of blocks


class ObjectStoreTransport(KVTransport):
    def save(self, kv_id: str, blocks: list[torch.Tensor]) -> ObjectStoreKV:
        # Consecutive blocks share an object up to CHUNK_TARGET_BYTES: a put has a fixed cost
        # whatever its size, and a prompt has hundreds of small blocks (32 KiB each for the tiny model).
        block_bytes = blocks[0].numel() * blocks[0].element_size()
        per_chunk = max(1, CHUNK_TARGET_BYTES // block_bytes)
        starts = list(range(0, len(blocks), per_chunk)) + [len(blocks)]
        refs = [ray.put(torch.stack(blocks[start:end])) for start, end in zip(starts, starts[1:])]
        return ObjectStoreKV(refs, starts)

    def load(self, req_id: str, data: ObjectStoreKV, block_indices: list[int]) -> list[torch.Tensor]:
        chunk_of = [bisect.bisect_right(data.starts, index) - 1 for index in block_indices]
        needed = sorted(set(chunk_of))  # only the objects holding wanted blocks are fetched
        chunks = dict(zip(needed, ray.get([data.refs[chunk] for chunk in needed], timeout=LOAD_TIMEOUT_S)))
        return [chunks[chunk][index - data.starts[chunk]] for index, chunk in zip(block_indices, chunk_of)]


@dataclass(frozen=True)
class DirectKVRef:
    """Where a saved request's blocks wait: the prefill worker actor, and the key in its outbox."""

    worker: Any  # ray.actor.ActorHandle of a cluster.worker_actor.RayWorker
    kv_id: str


class KVOutbox:
    """Blocks saved here until a decode engine pulls them (by key), and blocks delivered here until this
    worker's step loads them (by request id). Thread-safe: pulls run on their own actor thread. Entries
    nobody takes within ``OUTBOX_TTL_S`` (an aborted request, a transfer that timed out) are dropped."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._saved: dict[str, tuple[float, list[torch.Tensor]]] = {}
        self._delivered: dict[str, tuple[float, list[torch.Tensor]]] = {}

    def put(self, kv_id: str, blocks: list[torch.Tensor]) -> None:
        self._add(self._saved, kv_id, blocks)

    def take(self, kv_id: str, block_indices: list[int]) -> list[torch.Tensor]:
        """The blocks at ``block_indices``; the entry is dropped (a request is pulled once)."""
        blocks = self._pop(self._saved, kv_id, "No KV blocks saved under {!r} (expired or already read).")
        return [blocks[index] for index in block_indices]

    def deliver(self, req_id: str, blocks: list[torch.Tensor]) -> None:
        self._add(self._delivered, req_id, blocks)

    def receive(self, req_id: str) -> list[torch.Tensor]:
        return self._pop(self._delivered, req_id, "The KV blocks of {!r} never arrived.")

    def _add(self, entries: dict, key: str, blocks: list[torch.Tensor]) -> None:
        now = time.monotonic()
        with self._lock:
            for stale in [k for k, (added_at, _) in entries.items() if now - added_at > OUTBOX_TTL_S]:
                del entries[stale]
            entries[key] = (now, blocks)

    def _pop(self, entries: dict, key: str, missing: str) -> list[torch.Tensor]:
        with self._lock:
            entry = entries.pop(key, None)
        if entry is None:
            raise KeyError(missing.format(key))
        return entry[1]


_outbox = KVOutbox()  # one per worker process


def get_outbox() -> KVOutbox:
    return _outbox


class RayDirectTransport(KVTransport):
    """Needs Ray executor workers on both sides (the app builder sets that up)."""

    def __init__(self, config: KVTransferConfig, device: torch.device) -> None:
        super().__init__(config, device)
        self._worker = None

    def save(self, kv_id: str, blocks: list[torch.Tensor]) -> DirectKVRef:
        if self._worker is None:
            self._worker = ray.get_runtime_context().current_actor
        get_outbox().put(kv_id, blocks)
        return DirectKVRef(self._worker, kv_id)

    def load(self, req_id: str, data: DirectKVRef, block_indices: list[int]) -> list[torch.Tensor]:
        # The executor had the blocks sent to this worker before the step (cluster.kv_transfer.ray_direct).
        return get_outbox().receive(req_id)
