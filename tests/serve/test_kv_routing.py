"""KVAwareRouter on a real cluster: two tiny-llama replicas behind the ingress (configs/serve/kv_routing.yaml's
shape). Requests sharing a long prefix land on the replica that holds it (its prefix-hit counters say so);
without shared prefixes the load decides; routing never changes greedy tokens; a session stays on its
replica; a killed replica leaves the index. (Bad router options are refused by the app builder, before any
replica starts: tests/deployments/test_kv_router_config.py.)"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import ray
from ray import serve
from ray.serve._private.common import REPLICA_ID_FULL_ID_STR_PREFIX, RequestMetadata
from ray.serve.request_router import PendingRequest, RunningReplica

from deployments.kv_index import KVRouterOptions, RoutingHint, prompt_block_hashes
from tests.conftest import make_llm
from tests.serve.cluster import deploy_and_wait, llm_config, serve_config

# ~76 s alone on the shared 2-core machine at load 4, ~58 s of it the Ray head and two replicas starting.
pytestmark = pytest.mark.slow

LLAMA = "tiny-llama"
SERVER = f"LLMServer:{LLAMA}"
BLOCK_SIZE = 16
PREFIX_TOKENS = 320  # 20 blocks
ROUTER = {
    "request_router_class": "deployments.routing:KVAwareRouter",
    "request_router_kwargs": {"prefix_weight": 3.0, "load_weight": 2.0},
    "request_routing_stats_period_s": 0.5,
}


def kv_llm_config(checkpoint: str) -> dict:
    config = llm_config(LLAMA, checkpoint, num_replicas=2, block_size=BLOCK_SIZE, max_model_len=1024)
    config["deployment_config"]["request_router_config"] = copy.deepcopy(ROUTER)
    config["deployment_config"]["ray_actor_options"] = {"num_cpus": 0.5}
    # Serve learns of a killed replica at its next health check (every 10 s by default): the killed-replica
    # test would mostly wait for it.
    config["deployment_config"]["health_check_period_s"] = 1.0
    return config


@pytest.fixture(scope="module")
def app(ray_head, tiny_checkpoint):
    checkpoint = tiny_checkpoint("llama")
    deploy_and_wait(ray_head, serve_config(ray_head.http_port, [kv_llm_config(checkpoint)]))
    return ray_head, checkpoint


def replica_stats(num_replicas: int = 2, max_calls: int = 40) -> dict[str, dict]:
    """Stats per replica id, asked until every replica answered (the calls carry no hint, so the router spreads
    them by load, ties at random: two replicas answer within a few calls)."""
    handle = serve.get_deployment_handle(SERVER, app_name="llm")
    stats: dict[str, dict] = {}
    for _ in range(max_calls):
        result = handle.stats.remote().result()
        stats[result["replica_id"]] = result
        if len(stats) == num_replicas:
            break
    return stats


def deltas(before: dict, after: dict, key: str) -> dict[str, int]:
    return {rid: s[key] - before.get(rid, {}).get(key, 0) for rid, s in after.items()}


def complete(base_url: str, prompt, max_tokens: int = 8, headers: dict | None = None) -> list[int]:
    """A greedy completion's text."""
    response = httpx.post(
        f"{base_url}/v1/completions",
        json={"model": LLAMA, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
        headers=headers or {},
        timeout=120,
    )
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def driver_router():
    """This process's own handle router, a KVAwareRouter (it learns only from the replicas' publications).
    Reaches into Serve's private router: there is no public accessor."""
    handle = serve.get_deployment_handle(SERVER, app_name="llm")
    handle.stats.remote().result()  # makes sure the handle's router exists
    return handle._router._asyncio_router.request_router


def driver_router_index():
    return driver_router().index


def test_shared_prefix_requests_land_on_the_replica_holding_it(app):
    head, checkpoint = app
    rng = random.Random(1)
    prefix = [rng.randrange(5, 500) for _ in range(PREFIX_TOKENS)]
    prompts = [prefix + [rng.randrange(5, 500) for _ in range(20)] for _ in range(6)]
    before = replica_stats()
    texts = [complete(head.base_url, prompts[0])]
    first_done = time.monotonic()
    hashes = prompt_block_hashes(KVRouterOptions(block_size=BLOCK_SIZE), RoutingHint(prompts[0]))
    index = driver_router_index()
    while not any(set(hashes) <= view.held for view in index.replicas.values()):
        assert time.monotonic() - first_done < 15, "the replica's KV events never reached the router"
        time.sleep(0.05)
    print(f"KV events reached a router {time.monotonic() - first_done:.2f} s after the request ended")
    texts += [complete(head.base_url, prompt) for prompt in prompts[1:]]
    after = replica_stats()
    hits = deltas(before, after, "prefix_cache_hits")
    holder = max(hits, key=hits.get)
    assert hits[holder] >= 5 * PREFIX_TOKENS, hits  # every later request hit the whole prefix there
    assert all(count == 0 for rid, count in hits.items() if rid != holder), hits
    finished = deltas(before, after, "num_finished_reqs_total")
    assert finished[holder] == len(prompts), finished
    # Routing never changes the tokens: the same greedy completions as one engine in this process.
    llm = make_llm(checkpoint, max_model_len=1024, block_size=BLOCK_SIZE)
    from engine import SamplingParams

    reference = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    )
    assert texts == [output.outputs[0].text for output in reference]


def test_without_shared_prefixes_the_load_decides(app):
    head, _ = app
    rng = random.Random(2)
    prompts = [[rng.randrange(5, 500) for _ in range(40)] for _ in range(16)]
    before = replica_stats()
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda prompt: complete(head.base_url, prompt, max_tokens=48), prompts))
    finished = deltas(before, replica_stats(), "num_finished_reqs_total")
    views = {rid: (v.reported_load, v.in_flight, v.last_seq) for rid, v in driver_router_index().replicas.items()}
    assert sum(finished.values()) == len(prompts) and all(count >= 3 for count in finished.values()), (finished, views)


def test_a_session_stays_on_its_replica_across_turns(app):
    head, _ = app
    before = replica_stats()
    messages = [{"role": "system", "content": "You are terse."}]
    for turn in range(4):
        messages.append({"role": "user", "content": f"Turn {turn}: tell me more."})
        response = httpx.post(
            f"{head.base_url}/v1/chat/completions",
            json={"model": LLAMA, "messages": messages, "max_tokens": 8, "temperature": 0},
            headers={"x-session-id": "conversation-7"},
            timeout=120,
        )
        assert response.status_code == 200, response.text
        messages.append({"role": "assistant", "content": response.json()["choices"][0]["message"]["content"]})
    finished = deltas(before, replica_stats(), "num_finished_reqs_total")
    assert sorted(finished.values()) == [0, 4], finished


def test_the_router_metrics_reach_rays_endpoint_tagged_by_model_and_replica(app):
    """The series of the dashboard's "KV-aware routing" row (tests/serve/test_observability.py's app has no
    KV-routed deployment), each sample tagged like every serval_* series."""
    head, _ = app
    url = f"http://127.0.0.1:{head.metrics_port}/metrics"
    wanted = [
        "serval_router_decisions",
        "serval_router_prompt_tokens",
        "serval_router_predicted_hit_tokens",
        "serval_router_replica_load",
        "serval_router_indexed_blocks",
        "serval_router_choose_seconds_bucket",
    ]
    deadline = time.monotonic() + 60  # Ray's agent exports every few seconds
    while True:
        lines = [line for line in httpx.get(url, timeout=10).text.splitlines() if "serval_router_" in line]
        missing = [name for name in wanted if not any(name in line and not line.startswith("#") for line in lines)]
        if not missing:
            break
        assert time.monotonic() < deadline, f"router metrics missing from Ray's endpoint: {missing}"
        time.sleep(2)
    samples = [line for line in lines if not line.startswith("#")]
    assert all('model_name="' in line and 'replica="' in line for line in samples), samples[:5]


def test_an_adapter_request_goes_first_to_the_replica_holding_the_adapter(app):
    """KVAwareRouter.choose_replicas over the live replicas, one of them reporting LoRA adapter ``a`` (Serve's
    RunningReplica over its info with that multiplexed id; this app serves no adapters): a request with that
    multiplexed_model_id ranks it first though the other holds the prompt's blocks for ``a``; without the id
    the prefix wins."""
    router = driver_router()
    holder, other = list(router._replicas.values())
    model = f"{LLAMA}:a"
    holding = RunningReplica(dataclasses.replace(holder._replica_info, multiplexed_model_ids=[model]))
    hint = RoutingHint(list(range(1000, 1100)), lora_name="a")
    router.index.predict(other.replica_id.unique_id, prompt_block_hashes(router.options, hint))

    async def first_choices(multiplexed_model_id: str) -> list:
        metadata = RequestMetadata("r", f"r-{multiplexed_model_id}", multiplexed_model_id=multiplexed_model_id)
        pending = PendingRequest([], {"routing_hint": hint}, metadata)
        ranked = await router.choose_replicas([holding, other], pending)
        return [rank[0].replica_id for rank in ranked]

    assert asyncio.run(first_choices(model)) == [holder.replica_id, other.replica_id]
    assert asyncio.run(first_choices(""))[0] == other.replica_id


def test_a_killed_replica_leaves_the_index_and_requests_still_succeed(app):
    head, _ = app
    rng = random.Random(3)
    prefix = [rng.randrange(5, 500) for _ in range(PREFIX_TOKENS)]
    complete(head.base_url, prefix + [7, 8, 9])
    hashes = set(prompt_block_hashes(KVRouterOptions(block_size=BLOCK_SIZE), RoutingHint(prefix + [7, 8, 9])))
    index = driver_router_index()
    deadline = time.monotonic() + 15
    while not (holders := [rid for rid, view in index.replicas.items() if hashes <= view.held]):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    [holder] = holders
    victim = ray.get_actor(f"{REPLICA_ID_FULL_ID_STR_PREFIX}llm#{SERVER}#{holder}", namespace="serve")
    ray.kill(victim, no_restart=True)
    killed = time.monotonic()
    while holder in index.replicas:
        assert time.monotonic() - killed < 30, "the killed replica is still in the router's index"
        time.sleep(0.1)
    print(f"The killed replica left a router's index {time.monotonic() - killed:.2f} s after the kill")
    for suffix in range(4):  # the ingress's router forgets it too: every request is answered
        complete(head.base_url, prefix + [suffix + 20])
    # Serve starts a replacement meanwhile; nothing here waits for it (the module's last test).
