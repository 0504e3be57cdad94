import pytest

from engine.sched.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock


def ids(blocks):
    return [block.block_id for block in blocks]


def test_free_queue_removes_from_the_middle_and_keeps_order():
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])
    assert ids(queue) == [0, 1, 3, 4] and ids(queue.iter_backwards()) == [4, 3, 1, 0]
    assert queue.num_free_blocks == 4
    queue.append(blocks[2])
    assert ids(queue) == [0, 1, 3, 4, 2]
    assert queue.popleft() is blocks[0]
    with pytest.raises(ValueError):
        queue.remove(blocks[0])  # not in the queue any more


def test_pool_never_hands_out_the_null_block():
    pool = BlockPool(num_blocks=4, enable_caching=True)
    assert pool.num_free_blocks == 3
    assert ids(pool.get_new_blocks(3)) == [1, 2, 3]
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)


def test_unreferenced_cached_blocks_are_evicted_in_lru_order():
    pool = BlockPool(num_blocks=5, enable_caching=True)
    a, b, c, d = pool.get_new_blocks(4)
    for block, key in zip((a, b, c, d), (b"a", b"b", b"c", b"d")):
        pool.cache_full_block(block, key)
    pool.free_blocks([c, a])  # c freed first: least recently used
    pool.free_blocks([d, b])
    assert ids(pool.free_queue) == [c.block_id, a.block_id, d.block_id, b.block_id]
    pool.touch([a])  # a cache hit revives a from the middle of the queue
    assert a.ref_cnt == 1 and ids(pool.free_queue) == [c.block_id, d.block_id, b.block_id]
    (new,) = pool.get_new_blocks(1)
    assert new is c and c.block_hash is None and pool.get_cached_block(b"c") is None
    assert pool.get_cached_block(b"d") is d  # still cached while free


def test_touch_counts_references_and_free_returns_only_at_zero():
    pool = BlockPool(num_blocks=3, enable_caching=True)
    (block,) = pool.get_new_blocks(1)
    pool.touch([block])
    assert block.ref_cnt == 2
    pool.free_blocks([block])
    assert block.ref_cnt == 1 and pool.num_free_blocks == 1
    pool.free_blocks([block])
    assert pool.num_free_blocks == 2


def test_a_second_block_with_a_known_hash_stays_private():
    pool = BlockPool(num_blocks=3, enable_caching=True)
    first, second = pool.get_new_blocks(2)
    pool.cache_full_block(first, b"h")
    pool.cache_full_block(second, b"h")
    assert pool.get_cached_block(b"h") is first and second.block_hash is None


def test_reset_prefix_cache_only_when_nothing_is_referenced():
    pool = BlockPool(num_blocks=3, enable_caching=True)
    (block,) = pool.get_new_blocks(1)
    pool.cache_full_block(block, b"h")
    assert not pool.reset_prefix_cache()
    pool.free_blocks([block])
    assert pool.reset_prefix_cache() and pool.get_cached_block(b"h") is None
