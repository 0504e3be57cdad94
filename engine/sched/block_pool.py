"""The pool of KV cache blocks: reference counts, a free queue, the prefix cache.

Every block is in exactly one of two places: referenced by one or more
requests (``ref_cnt > 0``), or in the free queue (``ref_cnt == 0``). A block
in the free queue may still hold a cached prefix (``block_hash`` set): it can
be revived by a cache hit until it is evicted, which happens when it reaches
the head of the queue and is handed out as a new block. Freed blocks go to the
tail, so eviction is least-recently-used. Block 0 is the null block: never
handed out, used as padding in block tables.
"""

from __future__ import annotations

from collections.abc import Iterable

from engine.sched.block_hash import BlockHash
from engine.sched.kv_events import KVEventSink

NULL_BLOCK_ID = 0


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        # Links of the doubly linked free queue; None when not in the queue.
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        cached = "cached" if self.block_hash is not None else "uncached"
        return f"KVCacheBlock({self.block_id}, ref_cnt={self.ref_cnt}, {cached})"


class FreeBlockQueue:
    """A doubly linked list of free blocks with O(1) removal from the middle.

    Sentinel head and tail nodes keep every operation branch-free.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-2)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail:
            raise ValueError("No free blocks left.")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev_block, next_block = block.prev_free, block.next_free
        if prev_block is None or next_block is None:
            raise ValueError(f"{block} is not in the free queue.")
        prev_block.next_free = next_block
        next_block.prev_free = prev_block
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def __iter__(self):
        block = self._head.next_free
        while block is not self._tail:
            yield block
            block = block.next_free

    def iter_backwards(self):
        block = self._tail.prev_free
        while block is not self._head:
            yield block
            block = block.prev_free


class BlockPool:
    """Hands out blocks, takes them back, and keeps the hash -> block map."""

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be at least 2 (one is the null block), got {num_blocks}.")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        self.cached_blocks: dict[BlockHash, KVCacheBlock] = {}
        # Told of every hash that enters or leaves the prefix cache (a KV-aware router's feed); None: nobody asks.
        self.event_sink: KVEventSink | None = None

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    def get_usage(self) -> float:
        """The fraction of usable blocks referenced by requests."""
        num_usable = self.num_blocks - 1
        return (num_usable - self.num_free_blocks) / num_usable

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_blocks.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Takes ``num_blocks`` blocks from the head of the free queue, evicting cached ones."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"Cannot get {num_blocks} blocks: only {self.num_free_blocks} are free.")
        blocks = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Adds a reference to each block (cache hits), reviving free cached ones."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drops a reference to each block; unreferenced ones join the free queue's tail in order."""
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache_full_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Registers a full block under its hash (keeps the first block seen for a hash)."""
        if block.block_hash is not None:
            return
        if block_hash in self.cached_blocks:
            # Another request filled an identical block in the same step; this copy stays private.
            return
        block.block_hash = block_hash
        self.cached_blocks[block_hash] = block
        if self.event_sink is not None:
            self.event_sink.stored(block_hash)

    def _evict(self, block: KVCacheBlock) -> None:
        del self.cached_blocks[block.block_hash]
        if self.event_sink is not None:
            self.event_sink.removed(block.block_hash)
        block.block_hash = None

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix; only possible when no block is referenced."""
        if self.num_free_blocks != self.num_blocks - 1:
            return False
        for block in self.cached_blocks.values():
            block.block_hash = None
        self.cached_blocks.clear()
        if self.event_sink is not None:
            self.event_sink.cleared()
        return True
