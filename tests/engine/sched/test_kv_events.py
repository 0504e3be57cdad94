"""Block-stored / block-removed events: a consumer applying the feed's batches holds exactly the pool's
cached hashes, through eviction, churn inside one batch, lost batches (a snapshot resyncs) and resets."""

import random

from engine.sched.block_hash import extend_block_hashes, get_hash_function
from engine.sched.kv_events import KVEventBatch, KVEventFeed
from tests.engine.sched.test_kv_cache_manager import make_manager, make_request, run_prefill


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def cached_hashes(manager) -> set:
    return set(manager.block_pool.cached_blocks)


def test_first_take_is_a_snapshot_then_deltas_track_the_pool():
    manager = make_manager(num_blocks=9, block_size=4)
    run_prefill(manager, make_request("warm", list(range(9))))  # cached before the feed starts
    clock = FakeClock()
    feed = KVEventFeed(manager.block_pool, snapshot_interval_s=30.0, clock=clock)
    held: set = set()
    first = feed.take()
    assert first.cleared and len(first.changes) == 2
    first.apply_to(held)
    rng = random.Random(0)
    live = []
    for step in range(200):
        if live and (rng.random() < 0.5 or manager.block_pool.num_free_blocks < 4):
            manager.free(live.pop(rng.randrange(len(live))))
        else:
            prefix = rng.randrange(3) * 100  # three shared prefixes, so hits, stores and evictions all happen
            request = make_request(f"r{step}", [prefix + i for i in range(rng.randrange(5, 13))])
            blocks, num_hit = manager.get_computed_blocks(request)
            if manager.allocate_slots(request, request.num_tokens - num_hit, num_hit, blocks) is not None:
                live.append(request)
        batch = feed.take()
        assert not batch.cleared  # no snapshot before the interval
        batch.apply_to(held)
        assert held == cached_hashes(manager)
    manager.check_integrity()


def test_net_state_within_one_batch_and_a_lost_batch_resynced_by_the_snapshot():
    manager = make_manager(num_blocks=3, block_size=4)  # two usable blocks: every new prompt evicts
    clock = FakeClock()
    feed = KVEventFeed(manager.block_pool, snapshot_interval_s=10.0, clock=clock)
    held: set = set()
    feed.take().apply_to(held)
    for tokens in ([1, 2, 3, 4, 9], [5, 6, 7, 8, 9], [1, 2, 3, 4, 9]):  # stored, evicted, stored again
        request = make_request(str(tokens[0]), tokens)
        run_prefill(manager, request)
        manager.free(request)
    batch = feed.take()
    assert len(batch.changes) == 2  # one entry per hash, whatever happened in between
    batch.apply_to(held)
    assert held == cached_hashes(manager)
    run_prefill(manager, make_request("lost", [7, 7, 7, 7, 7]))
    feed.take()  # this batch never reaches the consumer
    assert held != cached_hashes(manager)
    clock.now = 10.0
    snapshot = feed.take()
    assert snapshot.cleared
    snapshot.apply_to(held)
    assert held == cached_hashes(manager)


def test_reset_prefix_cache_clears_the_consumer():
    manager = make_manager(num_blocks=8, block_size=4)
    feed = KVEventFeed(manager.block_pool, clock=FakeClock())
    held: set = set()
    request = make_request("a", list(range(9)))
    run_prefill(manager, request)
    feed.take().apply_to(held)
    assert len(held) == 2
    manager.free(request)
    assert manager.reset_prefix_cache()
    batch = feed.take()
    assert batch.cleared and not batch.changes
    batch.apply_to(held)
    assert held == set()


def test_merge_keeps_the_later_state_and_a_clear():
    earlier = KVEventBatch({b"a": True, b"b": True})
    earlier.merge(KVEventBatch({b"a": False, b"c": True}))
    assert earlier.changes == {b"a": False, b"b": True, b"c": True} and not earlier.cleared
    earlier.merge(KVEventBatch({b"d": True}, cleared=True))
    assert earlier.changes == {b"d": True} and earlier.cleared


def test_event_hashes_are_the_hashes_a_router_computes_from_the_tokens():
    manager = make_manager(num_blocks=8, block_size=4)
    feed = KVEventFeed(manager.block_pool, clock=FakeClock())
    tokens = list(range(100, 111))
    run_prefill(manager, make_request("a", tokens, salt="tenant"))
    expected: list = []
    extend_block_hashes(get_hash_function("sha256"), expected, tokens, 4, "tenant")
    assert set(feed.take().changes) == set(expected)
