"""Maps requests to KV cache blocks: allocation, prefix-cache lookups, freeing.

The manager answers with blocks or ``None`` ("does not fit"); what to do
about a ``None`` (preempt, wait) is the scheduler's decision.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import CacheConfig
from engine.sampling_params import RequestKind
from engine.sched.block_hash import LoRAHashKeys, extend_block_hashes, get_hash_function
from engine.sched.block_pool import NULL_BLOCK_ID, BlockPool, KVCacheBlock
from engine.sched.kv_events import KVEventFeed
from engine.sched.request import Request


@dataclass
class PrefixCacheStats:
    """Counters since the manager was created (tokens, not blocks)."""

    num_requests: int = 0
    num_queried_tokens: int = 0
    num_hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0


class KVCacheManager:
    def __init__(self, cache_config: CacheConfig) -> None:
        if cache_config.num_blocks is None:
            raise ValueError("CacheConfig.num_blocks must be set before the KV cache manager is built.")
        self.block_size = cache_config.block_size
        self.enable_caching = cache_config.enable_prefix_caching
        self.hash_fn = get_hash_function(cache_config.prefix_caching_hash_algo)
        self.block_pool = BlockPool(cache_config.num_blocks, self.enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are already registered in the prefix cache.
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()
        self.lora_keys = LoRAHashKeys()  # adapters' blocks keyed by name, as the KV-aware router hashes them

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of ``request``: (blocks, number of tokens they hold).

        Never covers the last token of the request: its logits must be computed.
        Requests that want prompt logprobs skip the cache (every prompt
        position's logits are needed), and so do pooling requests (a cached block holds KV, not the hidden
        states they pool); the blocks either computes are cached for later requests as any prompt's are.
        """
        if not self.enable_caching or request.kind is RequestKind.EMBED:
            return [], 0
        if request.sampling_params.prompt_logprobs is not None:
            return [], 0
        self._update_block_hashes(request)
        max_num_hit_blocks = (request.num_tokens - 1) // self.block_size
        blocks = []
        for block_hash in request.block_hashes[:max_num_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def record_prefix_cache_query(self, request: Request, num_hit_tokens: int) -> None:
        """Counts one admitted request's lookup (retries of a request that did not fit are not counted)."""
        stats = self.prefix_cache_stats
        stats.num_requests += 1
        stats.num_queried_tokens += request.num_tokens
        stats.num_hit_tokens += num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_lookahead_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Makes room for ``num_new_tokens`` more tokens of ``request``, and ``num_lookahead_tokens`` slots
        past them (a draft model's proposals: never hashed into the prefix cache).

        ``new_computed_blocks`` (holding ``num_new_computed_tokens`` tokens) are
        prefix-cache hits from ``get_computed_blocks`` to attach first. Returns
        the newly allocated blocks (possibly empty), or ``None`` if the pool
        cannot hold them; on ``None`` nothing has changed.
        """
        req_blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        num_tokens_after = num_computed_tokens + num_new_tokens
        num_required_blocks = -(-(num_tokens_after + num_lookahead_tokens) // self.block_size)
        new_computed_blocks = new_computed_blocks or []
        num_new_blocks = num_required_blocks - len(req_blocks) - len(new_computed_blocks)
        if num_new_blocks > 0 or new_computed_blocks:
            # Free cached blocks we are about to revive can no longer be handed out as new ones.
            num_revived_blocks = sum(1 for block in new_computed_blocks if block.ref_cnt == 0)
            if num_new_blocks > self.block_pool.num_free_blocks - num_revived_blocks:
                if not req_blocks:
                    del self.req_to_blocks[request.request_id]
                return None
            self.block_pool.touch(new_computed_blocks)
            req_blocks.extend(new_computed_blocks)
        if new_computed_blocks:
            self.num_cached_blocks[request.request_id] = len(req_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks) if num_new_blocks > 0 else []
        req_blocks.extend(new_blocks)
        if self.enable_caching:
            # Only tokens already known can be hashed (the step's new tokens are all known).
            num_full_blocks = min(num_tokens_after, len(request.all_token_ids)) // self.block_size
            if num_full_blocks > self.num_cached_blocks.get(request.request_id, 0):
                self._cache_full_blocks(request, req_blocks, num_full_blocks)
        return new_blocks

    def _cache_full_blocks(self, request: Request, req_blocks: list[KVCacheBlock], num_full_blocks: int) -> None:
        # Registering a block before the step that fills it has run is safe: a later request
        # can only read it in a later step, or in this step's forward, which writes every new
        # token's KV before any attention reads the cache.
        num_cached = self.num_cached_blocks.get(request.request_id, 0)
        self._update_block_hashes(request)
        for index in range(num_cached, num_full_blocks):
            self.block_pool.cache_full_block(req_blocks[index], request.block_hashes[index])
        self.num_cached_blocks[request.request_id] = num_full_blocks

    def _update_block_hashes(self, request: Request) -> None:
        if len(request.block_hashes) < request.num_tokens // self.block_size:
            extend_block_hashes(
                self.hash_fn,
                request.block_hashes,
                request.all_token_ids,
                self.block_size,
                request.cache_salt,
                self.lora_keys.key(request.lora_request),
            )

    def free(self, request: Request) -> None:
        """Drops the request's references; its tail blocks go first in the eviction order."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def kv_event_feed(self) -> KVEventFeed:
        """Starts reporting this manager's prefix-cache changes (``engine.sched.kv_events``); call once."""
        return KVEventFeed(self.block_pool)

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, ())]

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def check_integrity(self) -> None:
        """Raises AssertionError unless every block is accounted for exactly once.

        Free blocks + referenced blocks + the null block == all blocks; no block
        is both free and referenced; each ref_cnt equals the number of requests
        holding the block; the free queue links agree in both directions; every
        cached block is registered under its own hash.
        """
        pool = self.block_pool
        free_ids = [block.block_id for block in pool.free_queue]
        assert free_ids == [block.block_id for block in pool.free_queue.iter_backwards()][::-1], (
            "free queue links disagree"
        )
        assert len(free_ids) == len(set(free_ids)) == pool.num_free_blocks, "free queue count is off"
        holders: dict[int, int] = {}
        for blocks in self.req_to_blocks.values():
            for block in blocks:
                holders[block.block_id] = holders.get(block.block_id, 0) + 1
        free_set = set(free_ids)
        assert NULL_BLOCK_ID not in free_set and NULL_BLOCK_ID not in holders, "null block in use"
        assert not free_set & holders.keys(), f"blocks both free and referenced: {free_set & holders.keys()}"
        assert len(free_set) + len(holders) + 1 == pool.num_blocks, (
            f"{len(free_set)} free + {len(holders)} referenced + 1 null != {pool.num_blocks} blocks"
        )
        for block in pool.blocks[1:]:
            assert block.ref_cnt == holders.get(block.block_id, 0), (
                f"{block} has {holders.get(block.block_id, 0)} holders"
            )
        for block_hash, block in pool.cached_blocks.items():
            assert block.block_hash == block_hash, f"{block} registered under a foreign hash"
        num_hashed = sum(1 for block in pool.blocks if block.block_hash is not None)
        assert num_hashed == len(pool.cached_blocks), "a hashed block is missing from the cache map"


def check_pool_holds_one_sequence(cache_config: CacheConfig, max_model_len: int) -> None:
    """Raises ValueError unless the pool (``num_blocks`` set) holds one sequence of ``max_model_len``.

    Otherwise one long request could preempt everything, then itself, forever.
    """
    num_blocks = cache_config.num_blocks
    if num_blocks is None:
        raise ValueError("CacheConfig.num_blocks must be set before the scheduler is built.")
    capacity = (num_blocks - 1) * cache_config.block_size
    if capacity < max_model_len:
        raise ValueError(
            f"The KV cache holds {capacity} tokens ({num_blocks - 1} usable blocks of "
            f"{cache_config.block_size}), fewer than max_model_len={max_model_len}. "
            "Give the cache more memory or lower max_model_len."
        )
