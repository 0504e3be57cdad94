"""KVAwareRouter's index and policy without Ray (deployments.kv_index): publications applied in order,
lost batches tolerated and resynced, replicas forgotten, scores, session affinity, options, cost."""

import time

import pytest
from pydantic import ValidationError

from deployments.kv_index import (
    KVIndex,
    KVRouterOptions,
    RoutingHint,
    choose,
    prompt_block_hashes,
    publication,
    session_replica,
)
from engine.sched.kv_events import KVEventBatch, snapshot_batch
from tests.engine.sched.test_kv_cache_manager import make_manager, make_request, run_prefill

OPTIONS = KVRouterOptions(block_size=4)


def hint(tokens, session=None, salt=None):
    return RoutingHint(list(tokens), salt, session)


def test_hashes_are_the_engines_for_the_blocks_a_hit_can_cover():
    manager = make_manager(num_blocks=16, block_size=4)
    tokens = list(range(50, 63))  # 13 tokens: 3 full blocks; a hit never covers the last token
    run_prefill(manager, make_request("a", tokens, salt="s"))
    hashes = prompt_block_hashes(OPTIONS, hint(tokens, salt="s"))
    assert len(hashes) == 3 and set(hashes) <= set(manager.block_pool.cached_blocks)
    assert len(prompt_block_hashes(OPTIONS, hint(tokens[:12]))) == 2  # 12 tokens: block 3 holds the last one
    assert not set(prompt_block_hashes(OPTIONS, hint(tokens))) & set(hashes)  # another salt, other hashes


def test_the_replica_holding_the_prefix_wins_until_its_load_outweighs_it():
    index = KVIndex()
    tokens = list(range(100, 141))
    hashes = prompt_block_hashes(OPTIONS, hint(tokens))
    index.publish("a", publication([(1, KVEventBatch(dict.fromkeys(hashes, True)))], 0, 0))
    index.publish("b", publication([], 0, 0))
    assert choose(OPTIONS, index, ["a", "b"], hint(tokens)).ranked == ["a", "b"]
    assert choose(OPTIONS, index, ["a", "b"], hint(tokens)).reason == "prefix"
    index.replica("a").in_flight = 10  # prefix 3 x 1.0 + load 2 x 0 < prefix 0 + load 2 x 1 is false: a keeps it
    assert choose(OPTIONS, index, ["a", "b"], hint(tokens)).ranked[0] == "a"
    heavy = KVRouterOptions(block_size=4, prefix_weight=1.0, load_weight=2.0)
    assert choose(heavy, index, ["a", "b"], hint(tokens)).ranked[0] == "b"


def test_without_any_cached_prefix_the_least_loaded_wins():
    index = KVIndex()
    index.publish("a", publication([], 3, 2))
    index.publish("b", publication([], 1, 0))
    choice = choose(OPTIONS, index, ["a", "b"], hint(range(100, 200)))
    assert choice.ranked == ["b", "a"] and choice.reason == "load" and choice.predicted_blocks == 0


def test_repeated_and_lost_batches_then_a_snapshot_resyncs():
    index = KVIndex()
    b1, b2, b3 = (KVEventBatch({bytes([i]): True}) for i in (1, 2, 3))
    index.publish("a", publication([(1, b1), (2, b2)], 0, 0))
    index.publish("a", publication([(1, b1), (2, b2)], 0, 0))  # the same publication again: no change
    assert index.replica("a").held == {b"\x01", b"\x02"}
    index.publish("a", publication([(5, KVEventBatch({b"\x01": False}))], 0, 0))  # 3 and 4 lost
    assert index.replica("a").lost_batches == 2 and index.replica("a").held == {b"\x02"}
    index.publish("a", publication([(6, snapshot_batch([b"\x03", b"\x09"]))], 0, 0))
    assert index.replica("a").held == {b"\x03", b"\x09"}
    del b3


def test_replicas_that_go_away_are_forgotten():
    index = KVIndex()
    index.predict("a", [b"x"])
    index.predict("b", [b"y"])
    index.retain({"b"})
    assert set(index.replicas) == {"b"}


def test_session_affinity_is_stable_and_moves_only_the_lost_replicas_sessions():
    replicas = ["r0", "r1", "r2"]
    before = {f"s{i}": session_replica(f"s{i}", replicas) for i in range(200)}
    assert len(set(before.values())) == 3
    after = {s: session_replica(s, ["r0", "r2"]) for s in before}
    assert all(after[s] == r for s, r in before.items() if r != "r1")
    index = KVIndex()
    sticky = session_replica("s0", ["r0", "r1"])
    other = "r1" if sticky == "r0" else "r0"
    tokens = list(range(300, 340))
    index.predict(other, prompt_block_hashes(OPTIONS, hint(tokens)))  # the other holds the prompt ...
    choice = choose(OPTIONS, index, ["r0", "r1"], hint(tokens, session="s0"))
    assert choice.ranked[0] == sticky and choice.reason == "session"  # ... the session stays put
    index.replica(sticky).in_flight = OPTIONS.session_max_extra_load + 1  # until its replica is overloaded
    assert choose(OPTIONS, index, ["r0", "r1"], hint(tokens, session="s0")).ranked[0] == other


def test_unknown_or_bad_options_are_refused():
    with pytest.raises(ValidationError, match="prefix_wieght"):
        KVRouterOptions.model_validate({"prefix_wieght": 3})
    with pytest.raises(ValidationError):
        KVRouterOptions.model_validate({"load_weight": -1})


def test_hashing_and_scoring_a_4k_token_prompt_is_cheap():
    index = KVIndex()
    options = KVRouterOptions()  # 16-token blocks: 255 leading blocks
    tokens = list(range(5, 4101))
    index.predict("a", prompt_block_hashes(options, hint(tokens))[:128])
    index.predict("b", [])
    repeats = 50
    start = time.perf_counter()
    for _ in range(repeats):
        choose(options, index, ["a", "b"], hint(tokens))
    micros = (time.perf_counter() - start) / repeats * 1e6
    print(f"hash + score of a 4,096-token prompt over 2 replicas: {micros:.0f} us")
    assert micros < 5000  # generous: the machine is shared; measured ~200-400 us
