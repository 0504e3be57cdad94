import pytest

from engine.config import CacheConfig
from engine.sampling_params import SamplingParams
from engine.sched.block_hash import ROOT_HASH, get_hash_function, hash_block_tokens
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
    assert num_hit == 4 and len(blocks) == 1


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
    shared = manager.req_to_blocks["a"][0]
    assert shared is manager.req_to_blocks["b"][0] and shared.ref_cnt == 2
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
    assert manager.get_computed_blocks(make_request("b", list(range(10)))) == ([], 0)


def test_lookahead_slots_are_allocated_but_never_hashed():
    # A chunk of a long prompt with a draft model's lookahead: blocks for the chunk and the lookahead, and only
    # the blocks this step fills with known tokens enter the prefix cache (the rest are computed later).
    manager = KVCacheManager(CacheConfig(block_size=4, num_blocks=20))
    request = make_request("a", list(range(40)))
    new_blocks = manager.allocate_slots(request, 8, num_lookahead_tokens=4)
    assert len(new_blocks) == 3  # 8 tokens + 4 lookahead slots
    assert manager.num_cached_blocks["a"] == 2  # the two blocks the chunk fills, not the third
    assert len(manager.block_pool.cached_blocks) == 2
    manager.check_integrity()
