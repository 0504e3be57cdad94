"""Maps requests to KV cache blocks: allocation, prefix-cache lookups, freeing.

The manager answers with blocks or ``None`` ("does not fit"); what to do
about a ``None`` (preempt, wait) is the scheduler's decision.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.config import CacheConfig
from engine.sampling_params import RequestKind
from engine.sched.block_hash import BlockHash, LoRAHashKeys, extend_block_hashes, get_hash_function
from engine.sched.block_pool import NULL_BLOCK_ID, BlockPool, KVCacheBlock
from engine.sched.kv_cache_groups import FULL_ATTENTION, KVCacheGroup
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
    """Every request's blocks in each KV cache group (``engine.sched.kv_cache_groups``), from one pool.

    Blocks are per group: ``req_to_blocks[r][g]`` is request ``r``'s block list in group ``g``, index ``b``
    holding positions ``b * block_size ..``; a sliding group's blocks that no later query of the request
    reads are returned to the pool as the request moves on, their places taken by the null block (the
    index arithmetic stays the same; vLLM's ``SlidingWindowManager``). Block ids go out as one list per
    group. A group's full blocks enter the prefix cache under their hash with the group's index appended
    (group 0: the hash itself, what a KV-aware router matches).
    """

    def __init__(self, cache_config: CacheConfig, groups: Sequence[KVCacheGroup] = FULL_ATTENTION) -> None:
        if cache_config.num_blocks is None:
            raise ValueError("CacheConfig.num_blocks must be set before the KV cache manager is built.")
        self.block_size = cache_config.block_size
        self.enable_caching = cache_config.enable_prefix_caching
        self.hash_fn = get_hash_function(cache_config.prefix_caching_hash_algo)
        self.groups = tuple(groups)
        self.block_pool = BlockPool(cache_config.num_blocks, self.enable_caching)
        self.req_to_blocks: dict[str, tuple[list[KVCacheBlock], ...]] = {}
        # Per request and group: how many leading blocks are already registered in the prefix cache.
        self.num_cached_blocks: dict[str, list[int]] = {}
        self.prefix_cache_stats = PrefixCacheStats()
        self.lora_keys = LoRAHashKeys()  # adapters' blocks keyed by name, as the KV-aware router hashes them

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def no_blocks(self) -> tuple[list[KVCacheBlock], ...]:
        """No blocks, in every group."""
        return tuple([] for _ in self.groups)

    def get_computed_blocks(self, request: Request) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """The longest cached prefix of ``request``: (its blocks in each group, the number of tokens they hold).

        A prefix counts only where every group has what a query right after it reads: all its blocks in a
        full-attention group; in a sliding group the blocks its window reaches (those before may be gone:
        null blocks there; vLLM's ``find_longest_cache_hit``). Never covers the last token of the request:
        its logits must be computed. Requests that want prompt logprobs skip the cache (every prompt
        position's logits are needed), and so do pooling requests (a cached block holds KV, not the hidden
        states they pool); the blocks either computes are cached for later requests as any prompt's are.
        """
        if not self.enable_caching or request.kind is RequestKind.EMBED:
            return self.no_blocks(), 0
        if request.sampling_params.prompt_logprobs is not None:
            return self.no_blocks(), 0
        self._update_block_hashes(request)
        num_blocks = (request.num_tokens - 1) // self.block_size
        while True:  # each group's longest hit within the others' (a sliding group's shrinks non-monotonically)
            hits = tuple(self._longest_hit(g, request.block_hashes, num_blocks) for g in range(len(self.groups)))
            shortest = min(len(blocks) for blocks in hits)
            if shortest == num_blocks:
                return hits, num_blocks * self.block_size
            num_blocks = shortest

    def _longest_hit(self, g: int, block_hashes: list[BlockHash], max_blocks: int) -> list[KVCacheBlock]:
        """Group ``g``'s blocks of the longest cached prefix of at most ``max_blocks`` blocks."""
        window, cached = self.groups[g].window, self.block_pool.get_cached_block
        if window is None:
            blocks = []
            for block_hash in block_hashes[:max_blocks]:
                block = cached(group_key(g, block_hash))
                if block is None:
                    break
                blocks.append(block)
            return blocks
        # The prefix of L blocks needs its last ceil((window - 1) / block_size) blocks (all of them if fewer).
        needed = -(-(window - 1) // self.block_size)
        blocks, run = [self.block_pool.null_block] * max_blocks, 0
        if needed == 0:  # a window of one position reads no earlier block
            return blocks
        for index in range(max_blocks - 1, -1, -1):  # from the longest prefix down
            block = cached(group_key(g, block_hashes[index]))
            run = run + 1 if block is not None else 0
            if block is not None:
                blocks[index] = block
            if run >= needed:
                return blocks[: index + run]
        return blocks[:run]  # the run from block 0, shorter than needed: every block of that prefix

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
        new_computed_blocks: tuple[list[KVCacheBlock], ...] | None = None,
        num_lookahead_tokens: int = 0,
    ) -> tuple[list[KVCacheBlock], ...] | None:
        """Makes room for ``num_new_tokens`` more tokens of ``request``, and ``num_lookahead_tokens`` slots
        past them (a draft model's proposals: never hashed into the prefix cache).

        ``new_computed_blocks`` (per group, holding ``num_new_computed_tokens`` tokens) are prefix-cache hits
        from ``get_computed_blocks`` to attach first. First the request's sliding-group blocks that no query
        from its computed tokens on reads go back to the pool. Returns the newly allocated blocks of each
        group (possibly none), or ``None`` if the pool cannot hold them; on ``None`` nothing else has changed.
        """
        req_id = request.request_id
        req_blocks = self.req_to_blocks.get(req_id) or self.no_blocks()
        num_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        num_tokens_after = num_computed_tokens + num_new_tokens
        num_required_blocks = -(-(num_tokens_after + num_lookahead_tokens) // self.block_size)
        new_computed_blocks = new_computed_blocks or self.no_blocks()
        self._free_skipped_blocks(req_blocks, num_computed_tokens)
        num_new_blocks = [
            max(0, num_required_blocks - len(blocks) - len(hits))
            for blocks, hits in zip(req_blocks, new_computed_blocks)
        ]
        # Free cached blocks we are about to revive can no longer be handed out as new ones.
        null = self.block_pool.null_block
        num_revived = sum(
            1 for hits in new_computed_blocks for block in hits if block.ref_cnt == 0 and block is not null
        )
        if sum(num_new_blocks) > self.block_pool.num_free_blocks - num_revived:
            return None
        self.req_to_blocks[req_id] = req_blocks
        new_blocks = self._attach(req_id, req_blocks, new_computed_blocks, num_new_blocks)
        if self.enable_caching:
            # Only tokens already known can be hashed (the step's new tokens are all known).
            num_full_blocks = min(num_tokens_after, len(request.all_token_ids)) // self.block_size
            self._cache_full_blocks(request, req_blocks, num_full_blocks)
        return new_blocks

    def _attach(
        self,
        req_id: str,
        req_blocks: tuple[list[KVCacheBlock], ...],
        hits: tuple[list[KVCacheBlock], ...],
        num_new_blocks: list[int],
    ) -> tuple[list[KVCacheBlock], ...]:
        """Appends each group's prefix-cache ``hits`` (referenced now) and then its new blocks; returns the new."""
        null, new_blocks = self.block_pool.null_block, []
        for g, (blocks, group_hits) in enumerate(zip(req_blocks, hits)):
            if group_hits:
                self.block_pool.touch(block for block in group_hits if block is not null)
                blocks.extend(group_hits)
                self.num_cached_blocks.setdefault(req_id, [0] * len(self.groups))[g] = len(blocks)
            new_blocks.append(self.block_pool.get_new_blocks(num_new_blocks[g]) if num_new_blocks[g] else [])
            blocks.extend(new_blocks[-1])
        return tuple(new_blocks)

    def _free_skipped_blocks(self, req_blocks: tuple[list[KVCacheBlock], ...], num_computed_tokens: int) -> None:
        """Returns each sliding group's blocks before the window of the query at ``num_computed_tokens`` (and
        so of every later one) to the pool, the earliest first (evicted first); null blocks take their places."""
        null = self.block_pool.null_block
        for group, blocks in zip(self.groups, req_blocks):
            num_skipped = min(group.num_skipped_blocks(num_computed_tokens, self.block_size), len(blocks))
            first = num_skipped
            while first > 0 and blocks[first - 1] is not null:
                first -= 1
            self.block_pool.free_blocks(blocks[first:num_skipped])
            blocks[first:num_skipped] = [null] * (num_skipped - first)

    def _cache_full_blocks(
        self, request: Request, req_blocks: tuple[list[KVCacheBlock], ...], num_full_blocks: int
    ) -> None:
        # Registering a block before the step that fills it has run is safe: a later request
        # can only read it in a later step, or in this step's forward, which writes every new
        # token's KV before any attention reads the cache.
        num_cached = self.num_cached_blocks.setdefault(request.request_id, [0] * len(self.groups))
        if num_full_blocks <= min(num_cached):
            return
        self._update_block_hashes(request)
        null = self.block_pool.null_block
        for g, blocks in enumerate(req_blocks):
            for index in range(num_cached[g], num_full_blocks):
                if blocks[index] is not null:  # a sliding group may have dropped it already
                    self.block_pool.cache_full_block(blocks[index], group_key(g, request.block_hashes[index]))
            num_cached[g] = max(num_cached[g], num_full_blocks)

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
        req_blocks = self.req_to_blocks.pop(request.request_id, ())
        self.num_cached_blocks.pop(request.request_id, None)
        null = self.block_pool.null_block
        for blocks in req_blocks:
            self.block_pool.free_blocks(block for block in reversed(blocks) if block is not null)

    def kv_event_feed(self) -> KVEventFeed:
        """Starts reporting this manager's prefix-cache changes (``engine.sched.kv_events``); call once."""
        return KVEventFeed(self.block_pool)

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block ids, one list per group (0 where a sliding group dropped a block)."""
        req_blocks = self.req_to_blocks.get(request_id) or self.no_blocks()
        return tuple([block.block_id for block in blocks] for blocks in req_blocks)

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
        for req_blocks in self.req_to_blocks.values():
            for block in (block for blocks in req_blocks for block in blocks if block is not pool.null_block):
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


def group_key(g: int, block_hash: BlockHash) -> BlockHash:
    """Group ``g``'s prefix-cache key of a block hash: the hash itself for group 0, else the group appended."""
    return block_hash if g == 0 else block_hash + bytes((g,))


def check_pool_holds_one_sequence(
    cache_config: CacheConfig,
    max_model_len: int,
    groups: Sequence[KVCacheGroup] = FULL_ATTENTION,
    max_step_tokens: int = 0,
) -> None:
    """Raises ValueError unless the pool (``num_blocks`` set) holds one sequence of ``max_model_len``, computed
    ``max_step_tokens`` tokens a step at most, in every group (``KVCacheGroup.max_blocks``).

    Otherwise one long request could preempt everything, then itself, forever.
    """
    num_blocks, block_size = cache_config.num_blocks, cache_config.block_size
    if num_blocks is None:
        raise ValueError("CacheConfig.num_blocks must be set before the scheduler is built.")
    needed = sum(group.max_blocks(max_model_len, max_step_tokens, block_size) for group in groups)
    if num_blocks - 1 < needed:
        raise ValueError(
            f"The KV cache has {num_blocks - 1} usable blocks of {block_size} tokens, fewer than max_model_len="
            f"{max_model_len} needs ({needed} blocks in {len(groups)} KV cache groups). "
            "Give the cache more memory or lower max_model_len."
        )
