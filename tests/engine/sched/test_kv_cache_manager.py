import pytest

from engine.config import CacheConfig
from engine.sampling_params import SamplingParams
from engine.sched.block_hash import ROOT_HASH, get_hash_function, hash_block_tokens
from engine.sched.kv_cache_groups import KVCacheGroup, kv_cache_groups, layer_slots
from engine.sched.kv_cache_manager import KVCacheManager
from engine.sched.request import Request


def make_manager(num_blocks=16, block_size=4, caching=True, algo="sha256"):
    return KVCacheManager(
        CacheConfig(
            block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=caching, prefix_caching_hash_algo=algo
        )
    )


def make_request(request_id, tokens, salt=None, **params):
    return Request(request_id, tokens, SamplingParams(**params), eos_token_id=None, cache_salt=salt)


def run_prefill(manager, request):
    blocks, num_hit = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, request.num_tokens - num_hit, num_hit, blocks) is not None
    request.num_computed_tokens = request.num_tokens
    return num_hit


@pytest.mark.parametrize("algo", ["sha256", "blake2b"])
def test_repeated_prompt_hits_all_but_the_last_partial_block(algo):
    manager = make_manager(algo=algo)
    first = make_request("a", list(range(10)))
    assert run_prefill(manager, first) == 0
    manager.free(first)
    assert run_prefill(manager, make_request("b", list(range(10)))) == 8  # 2 full blocks of 4
    manager.check_integrity()


def test_hit_never_covers_the_last_token():
    manager = make_manager()
    first = make_request("a", list(range(8)))  # exactly two full blocks
    run_prefill(manager, first)
    manager.free(first)
    blocks, num_hit = manager.get_computed_blocks(make_request("b", list(range(8))))
    assert num_hit == 4 and [len(group) for group in blocks] == [1]


def test_salts_keep_tenants_apart():
    manager = make_manager()
    run_prefill(manager, make_request("a", list(range(10)), salt="tenant-1"))
    assert manager.get_computed_blocks(make_request("b", list(range(10)), salt="tenant-2"))[1] == 0
    assert manager.get_computed_blocks(make_request("c", list(range(10))))[1] == 0
    assert manager.get_computed_blocks(make_request("d", list(range(10)), salt="tenant-1"))[1] == 8


def test_hashes_chain_over_the_prefix():
    hash_fn = get_hash_function("sha256")
    first = hash_block_tokens(hash_fn, ROOT_HASH, [1, 2])
    assert hash_block_tokens(hash_fn, first, [3, 4]) != hash_block_tokens(hash_fn, ROOT_HASH, [3, 4])
    with pytest.raises(ValueError, match="Unknown prefix-caching hash"):
        get_hash_function("md5")


def test_allocation_that_does_not_fit_changes_nothing():
    manager = make_manager(num_blocks=4)  # 3 usable blocks of 4 tokens
    request = make_request("a", list(range(13)))
    assert manager.allocate_slots(request, 13) is None
    assert manager.block_pool.num_free_blocks == 3 and manager.req_to_blocks == {}
    manager.check_integrity()


def test_revived_free_blocks_count_against_capacity():
    manager = make_manager(num_blocks=4)
    first = make_request("a", list(range(9)))
    run_prefill(manager, first)  # 3 blocks, 2 of them full and cached
    manager.free(first)
    second = make_request("b", list(range(8)) + [99, 98, 97, 96, 95])  # hits 2 blocks, needs 2 more
    blocks, num_hit = manager.get_computed_blocks(second)
    assert num_hit == 8
    assert manager.allocate_slots(second, 5, num_hit, blocks) is None  # 2 revived + 2 new > 3 usable
    manager.check_integrity()


def test_prompt_logprobs_requests_skip_the_cache():
    manager = make_manager()
    run_prefill(manager, make_request("a", list(range(10))))
    assert manager.get_computed_blocks(make_request("b", list(range(10)), prompt_logprobs=1))[1] == 0


def test_shared_blocks_are_reference_counted_and_integrity_detects_corruption():
    manager = make_manager()
    first, second = make_request("a", list(range(10))), make_request("b", list(range(10)))
    run_prefill(manager, first)
    run_prefill(manager, second)
    shared = manager.req_to_blocks["a"][0][0]  # group 0's first block
    assert shared is manager.req_to_blocks["b"][0][0] and shared.ref_cnt == 2
    manager.check_integrity()
    shared.ref_cnt = 1
    with pytest.raises(AssertionError):
        manager.check_integrity()
    shared.ref_cnt = 2
    manager.free(first)
    manager.free(second)
    manager.check_integrity()
    assert manager.block_pool.num_free_blocks == 15


def test_caching_disabled_never_hits():
    manager = make_manager(caching=False)
    run_prefill(manager, make_request("a", list(range(10))))
    assert manager.get_computed_blocks(make_request("b", list(range(10)))) == (([],), 0)


def test_lookahead_slots_are_allocated_but_never_hashed():
    # A chunk of a long prompt with a draft model's lookahead: blocks for the chunk and the lookahead, and only
    # the blocks this step fills with known tokens enter the prefix cache (the rest are computed later).
    manager = KVCacheManager(CacheConfig(block_size=4, num_blocks=20))
    request = make_request("a", list(range(40)))
    (new_blocks,) = manager.allocate_slots(request, 8, num_lookahead_tokens=4)
    assert len(new_blocks) == 3  # 8 tokens + 4 lookahead slots
    assert manager.num_cached_blocks["a"] == [2]  # the two blocks the chunk fills, not the third
    assert len(manager.block_pool.cached_blocks) == 2
    manager.check_integrity()


def test_layers_group_by_window_in_groups_of_equal_size():
    # Gemma 3's pattern: five sliding layers per full one (here 12 layers: 2 full, 10 sliding).
    windows = [None if (i + 1) % 6 == 0 else 512 for i in range(12)]
    groups = kv_cache_groups(windows)
    assert [(g.window, g.layers) for g in groups] == [
        (None, (5, 11)),
        (512, (0, 1)),
        (512, (2, 3)),
        (512, (4, 6)),
        (512, (7, 8)),
        (512, (9, 10)),
    ]
    assert layer_slots(groups)[6] == (3, 1)  # layer 6: the fourth group's second slot
    assert kv_cache_groups([None] * 4) == (KVCacheGroup(None, (0, 1, 2, 3)),)  # one group: no grouping at all


def sliding_manager(num_blocks=40, caching=True):
    """Blocks of 4 tokens; group 0 full attention, group 1 a window of 8 positions."""
    groups = (KVCacheGroup(None, (0,)), KVCacheGroup(8, (1,)))
    return KVCacheManager(CacheConfig(block_size=4, num_blocks=num_blocks, enable_prefix_caching=caching), groups)


def run_in_chunks(manager, request, chunk):
    blocks, num_hit = manager.get_computed_blocks(request)
    request.num_computed_tokens = 0
    assert manager.allocate_slots(request, min(chunk, request.num_tokens - num_hit), num_hit, blocks) is not None
    request.num_computed_tokens = min(num_hit + chunk, request.num_tokens)
    held = []
    while request.num_computed_tokens < request.num_tokens:
        num_new = min(chunk, request.num_tokens - request.num_computed_tokens)
        assert manager.allocate_slots(request, num_new) is not None
        request.num_computed_tokens += num_new
        held.append(
            [
                sum(1 for b in blocks if b is not manager.block_pool.null_block)
                for blocks in manager.req_to_blocks[request.request_id]
            ]
        )
        manager.check_integrity()
    return num_hit, held


def test_a_sliding_group_returns_the_blocks_its_window_left_behind():
    manager = sliding_manager()
    request = make_request("a", list(range(40)))
    _, held = run_in_chunks(manager, request, chunk=3)
    # The full group keeps every block; the sliding one the window's (7 keys back) and the chunk's: at most 4.
    assert [full for full, _ in held] == [-(-n // 4) for n in range(6, 40, 3)] + [10]
    assert max(sliding for _, sliding in held) == 4 and held[-1][1] <= 4
    full_ids, sliding_ids = manager.get_block_ids("a")
    assert 0 not in full_ids and sliding_ids[:6] == [0] * 6  # freed: the null block in their places
    manager.free(request)
    manager.check_integrity()
    assert manager.block_pool.num_free_blocks == 39


def finished_sliding_prompt(manager):
    """A 30-token prompt run in chunks of 4 and freed: 8 blocks per group, all cached, in the free queue from
    its head: sliding blocks 0-4 (dropped as it ran), full blocks 7..0, then sliding blocks 7..5."""
    first = make_request("a", list(range(30)))
    run_in_chunks(manager, first, chunk=4)
    full, sliding = manager.req_to_blocks["a"]
    manager.free(first)
    return full, sliding


def test_a_prefix_hit_needs_only_the_sliding_blocks_its_window_reads():
    manager = sliding_manager(num_blocks=17)  # just what the prompt held
    full, sliding = finished_sliding_prompt(manager)
    manager.allocate_slots(make_request("x", list(range(100, 104))), 4)  # a block per group: evicts two
    blocks, num_hit = manager.get_computed_blocks(make_request("c", list(range(30))))
    assert num_hit == 28  # 7 blocks: the last token's logits are computed
    null = manager.block_pool.null_block
    assert blocks[0] == full[:7]
    assert blocks[1] == [null] * 5 + sliding[5:7]  # the window (7 keys back) reads blocks 5 and 6 only


def test_a_prefix_hit_counts_only_where_every_group_has_what_its_window_reads():
    manager = sliding_manager(num_blocks=17)
    full, _ = finished_sliding_prompt(manager)
    manager.allocate_slots(make_request("x", list(range(100, 116))), 16)  # 4 blocks per group: evicts eight
    assert [manager.block_pool.get_cached_block(b.block_hash) for b in full[:5]] == full[:5]  # full blocks 0-4
    blocks, num_hit = manager.get_computed_blocks(make_request("c", list(range(30))))
    assert num_hit == 0 and blocks == ([], [])  # no prefix has its sliding blocks: none counts
    manager.check_integrity()
