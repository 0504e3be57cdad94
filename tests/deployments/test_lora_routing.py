"""LoRA adapters and the KV-aware router agree on prefix-cache block hashes (issues 22 and 23), without Ray:
the engine keys an adapter's blocks by its name, not the int id each replica gives it; the router hashes an
adapter request's prompt with that name (read from the request's model, either form) and so predicts hits only
on that adapter's blocks, from the real KV events of a block pool that served it; a request for an adapter goes
first to the replicas holding it (Serve's multiplexing order), the prefix score ranking within each tier."""

from __future__ import annotations

from deployments.kv_index import KVIndex, KVRouterOptions, adapter_tiers, choose, prompt_block_hashes, publication
from deployments.routing_hints import PromptTokenizer, make_hint
from engine.entrypoints.openai.endpoints import Endpoint
from engine.entrypoints.openai.protocol import CompletionRequest
from engine.lora_request import LoRARequest
from engine.sampling_params import SamplingParams
from engine.sched.request import Request
from tests.engine.sched.test_kv_cache_manager import make_manager, run_prefill

BLOCK_SIZE = 4
OPTIONS = KVRouterOptions(block_size=BLOCK_SIZE)
PROMPT = list(range(200, 213))  # 13 tokens: the 3 full blocks a hit can cover


def request(request_id: str, lora: LoRARequest | None, tokens=PROMPT) -> Request:
    return Request(request_id, tokens, SamplingParams(max_tokens=1), eos_token_id=None, lora_request=lora)


def served(*loras: LoRARequest | None):
    """A replica's KV cache manager after prefilling ``PROMPT`` once per adapter, and its KV events."""
    manager = make_manager(num_blocks=32, block_size=BLOCK_SIZE)
    feed = manager.kv_event_feed()
    feed.take()  # the first take is a snapshot of the (empty) pool
    for number, lora in enumerate(loras):
        run_prefill(manager, request(f"r{number}", lora))
    return manager, feed.take()


def test_one_adapter_name_hashes_alike_whatever_each_replica_numbers_it():
    one, two = make_manager(block_size=BLOCK_SIZE), make_manager(block_size=BLOCK_SIZE)
    first, second = request("x", LoRARequest("a", 1, "/adapters/a")), request("y", LoRARequest("a", 7, "/adapters/a"))
    run_prefill(one, first)
    run_prefill(two, second)
    assert len(first.block_hashes) == 3 and first.block_hashes == second.block_hashes
    other, base = request("z", LoRARequest("b", 1, "/adapters/b")), request("w", None)
    assert run_prefill(one, other) == 0 and run_prefill(one, base) == 0  # another name, or none: a miss
    assert not {*other.block_hashes, *base.block_hashes} & set(first.block_hashes)
    assert run_prefill(one, request("v", LoRARequest("a", 9, "/adapters/a"))) == 12  # the same name hits


def test_a_name_loaded_again_from_another_path_never_hits_the_old_adapters_blocks():
    manager = make_manager(block_size=BLOCK_SIZE)
    run_prefill(manager, request("old", LoRARequest("a", 1, "/adapters/a-v1")))
    reloaded = request("new", LoRARequest("a", 2, "/adapters/a-v2"))  # unloaded, then loaded from elsewhere
    assert run_prefill(manager, reloaded) == 0
    assert run_prefill(manager, request("again", LoRARequest("a", 2, "/adapters/a-v2"))) == 12


def test_a_name_loaded_again_with_other_contents_at_the_same_path_never_hits_the_old_blocks():
    manager = make_manager(block_size=BLOCK_SIZE)
    run_prefill(manager, request("old", LoRARequest("a", 1, "/adapters/a", content_digest="v1")))
    rewritten = request("new", LoRARequest("a", 2, "/adapters/a", content_digest="v2"))  # copied over in place
    assert run_prefill(manager, rewritten) == 0
    assert run_prefill(manager, request("again", LoRARequest("a", 2, "/adapters/a", content_digest="v2"))) == 12


def test_the_router_predicts_an_adapter_request_hits_only_that_adapters_blocks():
    lora_a = LoRARequest("a", 3, "/adapters/a")  # the replica's own id: the router never knows it
    _, events_a = served(lora_a)
    _, events_base = served(None)
    index = KVIndex()
    index.publish("holds-a", publication([(1, events_a)], 0, 0))
    index.publish("holds-base", publication([(1, events_base)], 0, 0))
    tokenizer = PromptTokenizer(None)  # token-id prompts need no tokenizer
    hints = {
        model: make_hint(tokenizer, Endpoint.COMPLETIONS, CompletionRequest(model=model, prompt=PROMPT), None, "m")
        for model in ("m:a", "a", "m", "m:b")
    }
    assert hints["m:a"].lora_name == hints["a"].lora_name == "a" and hints["m"].lora_name is None
    for model, holder in (("m:a", "holds-a"), ("a", "holds-a"), ("m", "holds-base")):
        hashes = prompt_block_hashes(OPTIONS, hints[model])
        assert {r: index.replica(r).matched_blocks(hashes) for r in index.replicas} == {
            holder: 3,
            ({"holds-a", "holds-base"} - {holder}).pop(): 0,
        }
        choice = choose(OPTIONS, index, ["holds-base", "holds-a"], hints[model])
        assert choice.ranked[0] == holder and choice.reason == "prefix" and choice.predicted_blocks == 3
    unseen = prompt_block_hashes(OPTIONS, hints["m:b"])
    assert all(view.matched_blocks(unseen) == 0 for view in index.replicas.values())


def test_replicas_holding_the_adapter_come_first_then_the_prefix_score_ranks():
    held = {"r1": {"m:a"}, "r2": {"m:a", "m:b"}, "r3": {"m:b"}, "r4": set()}
    assert adapter_tiers(list(held), held, "m:a") == [["r1", "r2"], ["r4"], ["r3"]]
    assert adapter_tiers(list(held), held, "m:c") == [["r4"], ["r1", "r2", "r3"]]  # none holds it: fewest first
    assert adapter_tiers(list(held), held, "") == [list(held)]
    lora_a = LoRARequest("a", 1, "/adapters/a")
    _, events = served(lora_a)
    index = KVIndex()
    index.publish("r2", publication([(1, events)], 0, 0))  # r2 holds the prompt's blocks for adapter a
    index.publish("r3", publication([(1, events)], 0, 0))  # r3 too, but not the adapter
    for replica_id in ("r1", "r4"):
        index.publish(replica_id, publication([], 0, 0))
    hint = make_hint(
        PromptTokenizer(None), Endpoint.COMPLETIONS, CompletionRequest(model="m:a", prompt=PROMPT), None, "m"
    )
    choice = choose(OPTIONS, index, list(held), hint, tiers=adapter_tiers(list(held), held, "m:a"))
    assert choice.ranked == ["r2", "r1", "r4", "r3"] and choice.reason == "prefix"
    index.replica("r2").in_flight = 50  # loaded: within the holders, load now outweighs the prefix ...
    heavy = KVRouterOptions(block_size=BLOCK_SIZE, prefix_weight=1.0)
    choice = choose(heavy, index, list(held), hint, tiers=adapter_tiers(list(held), held, "m:a"))
    assert choice.ranked[:2] == ["r1", "r2"] and choice.reason == "load"  # ... but r3 never leads
