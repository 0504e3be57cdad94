"""What a block pool tells the outside about its prefix cache: block-stored and block-removed events.

A KV-aware router keeps, per replica, the set of block hashes that replica's
prefix cache holds. The pool reports each change to an optional
``KVEventSink``; the sink keeps only the net state of each hash since the
last ``take`` (stored, or removed), so a batch is at most one entry per hash
whatever churn happened in between, and applying batches in order rebuilds
the pool's set. ``cleared`` says the whole cache was forgotten before the
batch's entries (``reset_prefix_cache``).

The consumer's copy is a hint: a lost or late batch costs a cache miss on a
routed request, never a wrong answer (the engine always looks up its own cache).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from engine.sched.block_hash import BlockHash


@dataclass
class KVEventBatch:
    """The net change of a prefix cache over an interval: hash -> True (stored) / False (removed)."""

    changes: dict[BlockHash, bool] = field(default_factory=dict)
    cleared: bool = False

    def __bool__(self) -> bool:
        return self.cleared or bool(self.changes)

    def merge(self, later: KVEventBatch) -> None:
        """Folds ``later`` (the next interval) into this batch."""
        if later.cleared:
            self.changes.clear()
            self.cleared = True
        self.changes.update(later.changes)

    def apply_to(self, held: set[BlockHash]) -> None:
        """Applies this batch to a set of held hashes."""
        if self.cleared:
            held.clear()
        for block_hash, stored in self.changes.items():
            if stored:
                held.add(block_hash)
            else:
                held.discard(block_hash)


class KVEventSink:
    """Collects a block pool's events between two ``take`` calls; O(1) per event."""

    __slots__ = ("_batch",)

    def __init__(self) -> None:
        self._batch = KVEventBatch()

    def stored(self, block_hash: BlockHash) -> None:
        self._batch.changes[block_hash] = True

    def removed(self, block_hash: BlockHash) -> None:
        self._batch.changes[block_hash] = False

    def cleared(self) -> None:
        self._batch = KVEventBatch(cleared=True)

    def take(self) -> KVEventBatch:
        """The events since the last call (an empty batch if none)."""
        batch, self._batch = self._batch, KVEventBatch()
        return batch


def snapshot_batch(held: Iterable[BlockHash]) -> KVEventBatch:
    """A batch that resynchronises any consumer to exactly ``held`` (a full snapshot)."""
    return KVEventBatch(dict.fromkeys(held, True), cleared=True)


class KVEventFeed:
    """A block pool's events as batches for the front end: the changes since the last ``take``, or,
    every ``snapshot_interval_s`` (the first ``take`` included), a full snapshot that resynchronises
    consumers that lost a batch."""

    def __init__(self, block_pool, snapshot_interval_s: float = 30.0, clock=time.monotonic) -> None:
        """Attaches a sink to ``block_pool`` (a ``BlockPool``): from now on its cache changes are recorded."""
        self._block_pool = block_pool
        self._sink = KVEventSink()
        block_pool.event_sink = self._sink
        self._snapshot_interval_s = snapshot_interval_s
        self._clock = clock
        self._next_snapshot = clock()

    def take(self) -> KVEventBatch:
        batch = self._sink.take()
        now = self._clock()
        if now < self._next_snapshot:
            return batch
        self._next_snapshot = now + self._snapshot_interval_s
        return snapshot_batch(self._block_pool.cached_blocks)
