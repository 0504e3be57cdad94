"""TP and PP behind the Serve app: each replica drives a TP=2 x PP=2 group of Ray worker actors.

The workers live in the replica's own placement group (bundle 0 holds the
replica, its engine core's actor and rank 0). Greedy completions over HTTP equal the single-device
offline engine. A worker
process or the engine core's actor killed mid-stream ends the stream with an error event (no hang), the
replica reports unhealthy, Serve replaces it (new workers in a new placement
group), and requests succeed again afterwards. Structured outputs (the step's
grammar bitmask reaching the output rank) equal the single-device engine's.
"""

from __future__ import annotations

import json
import os
import signal
import time

import jsonschema
import openai
import pytest

from tests.conftest import wait_until
from tests.serve.cluster import app_status, deploy_and_wait, llm_config, serve_config

MODEL = "tiny-llama-tp2-pp2"
WORLD_SIZE = 4
SERVER = f"LLMServer:{MODEL}"
PROMPTS = ["The quick brown fox", "Once upon a time", "def main():"]


@pytest.fixture(scope="module")
def client(ray_head, tiny_checkpoint):
    config = llm_config(
        MODEL, tiny_checkpoint("llama"), tensor_parallel_size=2, pipeline_parallel_size=2, num_cpus_per_worker=0.25
    )
    config["deployment_config"].update(
        ray_actor_options={"num_cpus": 0.25}, health_check_period_s=1, health_check_timeout_s=10
    )
    deploy_and_wait(ray_head, serve_config(ray_head.http_port, [config]))
    return openai.OpenAI(base_url=f"{ray_head.base_url}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline_texts(tiny_checkpoint) -> list[str]:
    from engine import LLM, SamplingParams

    llm = LLM(model=tiny_checkpoint("llama"), dtype="float32", max_model_len=512)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    texts = [output.outputs[0].text for output in llm.generate(PROMPTS, params, use_tqdm=False)]
    llm.shutdown()
    return texts


def complete(client, prompt: str) -> str:
    response = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
    )
    return response.choices[0].text


def alive_actors(class_name: str) -> list:
    from ray.util.state import list_actors

    return list_actors(filters=[("class_name", "=", class_name), ("state", "=", "ALIVE")], detail=True)


def worker_pids() -> list[int]:
    return sorted(actor.pid for actor in alive_actors("RayWorker"))


def replica_ids(head) -> list[str]:
    replicas = app_status(head).get("deployments", {}).get(SERVER, {}).get("replicas", [])
    return [replica["replica_id"] for replica in replicas if replica["state"] == "RUNNING"]


def test_greedy_completions_equal_the_single_device_engine(client, offline_texts):
    assert [complete(client, prompt) for prompt in PROMPTS] == offline_texts


def test_the_core_and_workers_share_the_replica_placement_group(client):
    """The replica's engine core runs in its own process, an EngineCoreActor beside the replica."""
    replica = next(actor for actor in alive_actors("ServeReplica:llm:" + SERVER))
    workers = alive_actors("RayWorker")
    [core] = alive_actors("EngineCoreActor")
    assert len(workers) == WORLD_SIZE
    assert replica.placement_group_id is not None
    assert {worker.placement_group_id for worker in [*workers, core]} == {replica.placement_group_id}
    assert core.pid != replica.pid and core.node_id == replica.node_id


@pytest.mark.parametrize("victim", ["RayWorker", "EngineCoreActor"])
def test_a_killed_worker_or_core_errors_the_stream_and_serve_replaces_the_replica(
    ray_head, client, offline_texts, victim
):
    # Under a heavily loaded machine Serve's health check may just have replaced the replica: wait for a whole one.
    assert wait_until(lambda: len(worker_pids()) == WORLD_SIZE and len(alive_actors("EngineCoreActor")) == 1, 60)
    pids = worker_pids()
    [core_pid] = [actor.pid for actor in alive_actors("EngineCoreActor")]
    victim_pid = pids[1] if victim == "RayWorker" else core_pid
    replicas_before = replica_ids(ray_head)
    stream = client.completions.create(
        model=MODEL, prompt=PROMPTS[1], max_tokens=400, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    chunks = iter(stream)
    assert next(chunks).choices[0].text is not None
    os.kill(victim_pid, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(openai.APIError):
        for _ in chunks:
            pass
    assert time.monotonic() - started < 30, "the stream took too long to fail"

    deadline = time.monotonic() + 180
    while True:
        replicas = replica_ids(ray_head)
        if replicas and not set(replicas) & set(replicas_before) and app_status(ray_head)["status"] == "RUNNING":
            break
        assert time.monotonic() < deadline, f"Serve did not replace the replica: {app_status(ray_head)}"
        time.sleep(1)
    new_pids = worker_pids()
    assert len(new_pids) == WORLD_SIZE and not set(new_pids) & set(pids)
    # Nothing of the old replica's engine is left running (its core and every worker, survivors included).
    assert wait_until(lambda: not any(os.path.exists(f"/proc/{pid}") for pid in [*pids, core_pid]), 30)
    assert [complete(client, prompt) for prompt in PROMPTS] == offline_texts


ORDER = {
    "type": "object",
    "properties": {"id": {"type": "integer", "maximum": 999}, "paid": {"type": "boolean"}, "tag": {"enum": ["a", "b"]}},
    "required": ["id", "paid", "tag"],
    "additionalProperties": False,
}


def test_structured_outputs_through_the_tp2_pp2_replica_equal_the_single_device_engine(client, tiny_checkpoint):
    from engine import LLM, SamplingParams

    constraint = {"json": ORDER, "disable_any_whitespace": True}
    texts = []
    for prompt in PROMPTS:
        response = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=60, temperature=0, extra_body={"structured_outputs": constraint}
        )
        assert response.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(response.choices[0].text), ORDER)
        texts.append(response.choices[0].text)
    llm = LLM(model=tiny_checkpoint("llama"), dtype="float32", max_model_len=512)
    params = SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=constraint)
    assert texts == [output.outputs[0].text for output in llm.generate(PROMPTS, params, use_tqdm=False)]
    llm.shutdown()
