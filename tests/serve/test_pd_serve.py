"""Disaggregated prefill and decode through a real Ray Serve app, driven by the official OpenAI client.

Two PD apps run side by side: ``/`` moves KV through the object store and fails a request whose prefill
fails (503); ``/rd`` moves it worker to worker with Ray Direct Transport (gloo) and prefills such a request
on the decode replica instead (``fallback_to_local_prefill``: a fallback moves no KV, so the transport's
app proves it too, and the module starts four engines). The prefill pool's max_model_len (128) is below
the decode pool's (512): a longer prompt is a real prefill failure, with no test hooks. Greedy outputs
equal the colocated engine; both pools end with every KV block free.

configs/serve/pd.yaml, as shipped, is deployed by tests/serve/test_shipped_configs.py (its 1.7 CPUs leave no
room for these apps on the 2-CPU head), where it becomes RUNNING and answers; what an object-store app like it
does is proved here, on ``/``.
"""

from __future__ import annotations

import json
import random
import time

import httpx
import jsonschema
import openai
import pytest
from ray import serve

from tests.conftest import random_token_ids
from tests.serve.cluster import LOOPBACK, deploy_and_wait, llm_config

MODEL = "tiny-llama"
PREFILL_MAX_MODEL_LEN = 128
LENGTHS = (3, 17, 40, 90, 120)
MAX_TOKENS = 16


def pd_app(name: str, route_prefix: str, model_source: str, fallback: bool, kv_connector: str = "object_store") -> dict:
    # ray_direct runs each engine's worker in its own actor: a small CPU share each.
    worker_kwargs = {"num_cpus_per_worker": 0.1} if kv_connector == "ray_direct" else {}
    prefill = llm_config(
        MODEL, model_source, max_model_len=PREFILL_MAX_MODEL_LEN, num_gpu_blocks_override=64, **worker_kwargs
    )
    decode = llm_config(MODEL, model_source, num_gpu_blocks_override=160, **worker_kwargs)
    for config in (prefill, decode):
        config["deployment_config"]["ray_actor_options"]["num_cpus"] = 0.2
    return {
        "name": name,
        "route_prefix": route_prefix,
        "import_path": "deployments.app:build_pd_openai_app",
        "args": {
            "prefill_config": prefill,
            "decode_config": decode,
            "fallback_to_local_prefill": fallback,
            "kv_transfer_config": {"kv_connector": kv_connector},
            "prefill_timeout_s": 30,
            "ingress_deployment_config": {"ray_actor_options": {"num_cpus": 0.05}},
        },
    }


@pytest.fixture(scope="module")
def base_url(ray_head, tiny_checkpoint):
    source = tiny_checkpoint("llama")
    config = {
        "proxy_location": "HeadOnly",
        "http_options": {"host": LOOPBACK, "port": ray_head.http_port},
        "applications": [
            pd_app("llm", "/", source, fallback=False),
            pd_app("rd", "/rd", source, fallback=True, kv_connector="ray_direct"),
        ],
    }
    deploy_and_wait(ray_head, config)
    yield ray_head.base_url
    for client in CLIENTS.values():
        client.close()
    CLIENTS.clear()
    delete_apps([app["name"] for app in config["applications"]])


def delete_apps(names: list[str], timeout_s: float = 60.0) -> None:
    """Deletes the apps at once (Serve stops their replicas side by side) and returns once all are gone."""
    for name in names:
        serve.delete(name, _blocking=False)
    deadline = time.monotonic() + timeout_s
    while left := set(names) & set(serve.status().applications):
        assert time.monotonic() < deadline, f"apps still deleting: {sorted(left)}"
        time.sleep(0.1)


CLIENTS: dict[str, openai.OpenAI] = {}  # by URL, closed before the apps are deleted (``base_url``)


def client_for(base_url: str, prefix: str = "") -> openai.OpenAI:
    """The module's client for ``prefix``. Closed at the end: an idle keep-alive connection holds the
    HAProxy that Serve replaces as the apps go (a soft stop), and the head's drain waits on it up to 60 s."""
    url = f"{base_url}{prefix}/v1"
    if url not in CLIENTS:
        CLIENTS[url] = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=120)
    return CLIENTS[url]


@pytest.fixture(scope="module")
def offline(tiny_checkpoint):
    from engine import LLM

    return LLM(model=tiny_checkpoint("llama"), dtype="float32", max_model_len=512)


def offline_greedy(llm, token_ids: list[int], max_tokens: int = MAX_TOKENS) -> str:
    from engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": token_ids}], params, use_tqdm=False)[0].outputs[0].text


def completion_text(client: openai.OpenAI, token_ids: list[int]) -> str:
    response = client.completions.create(
        model=MODEL, prompt=[token_ids], max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}
    )
    assert response.usage.completion_tokens == MAX_TOKENS
    return response.choices[0].text


def stats(app: str, deployment: str) -> dict:
    return serve.get_deployment_handle(f"{deployment}:{MODEL}", app_name=app).stats.remote().result()


def wait_all_blocks_free(app: str, timeout_s: float = 30.0) -> None:
    """Every KV block of both pools is free again: nothing leaked on either side."""
    deadline = time.monotonic() + timeout_s
    while True:
        pools = [stats(app, "LLMServer"), stats(app, "PrefillServer")]
        if all(
            s["num_free_blocks"] == s["num_total_blocks"] and s["num_running_reqs"] == s["num_waiting_reqs"] == 0
            for s in pools
        ):
            return
        assert time.monotonic() < deadline, f"blocks still held: {pools}"
        time.sleep(0.5)


def test_greedy_outputs_equal_colocated_for_mixed_lengths(base_url, offline):
    client = client_for(base_url)
    rng = random.Random(11)
    prompts = [random_token_ids(rng, length) for length in LENGTHS]
    for token_ids in prompts:
        assert completion_text(client, token_ids) == offline_greedy(offline, token_ids)
    kv = stats("llm", "LLMServer")["kv_transfer"]
    assert kv["num_loads"] == len(prompts) and kv["num_failed_loads"] == 0
    assert kv["num_loaded_blocks"] == sum(-(-(length - 1) // 16) for length in LENGTHS)
    assert stats("llm", "PrefillServer")["kv_transfer"]["num_saves"] == len(prompts)
    wait_all_blocks_free("llm")


def test_prefix_hits_on_the_decode_side_skip_transfers(base_url, offline):
    client = client_for(base_url)
    token_ids = random_token_ids(random.Random(5), 97)  # 6 full blocks, one partial
    before = stats("llm", "LLMServer")["kv_transfer"]
    assert completion_text(client, token_ids) == offline_greedy(offline, token_ids)
    assert completion_text(client, token_ids) == offline_greedy(offline, token_ids)
    after = stats("llm", "LLMServer")["kv_transfer"]
    # First time: blocks 0-5 (tokens 0..95; the 97th is recomputed). Again: all 6 are in the prefix cache.
    assert after["num_loaded_blocks"] - before["num_loaded_blocks"] == 6
    assert after["num_loads"] - before["num_loads"] == 1
    assert after["num_skipped_blocks"] - before["num_skipped_blocks"] == 0
    wait_all_blocks_free("llm")


def test_ray_direct_transport_between_the_pools(base_url, offline):
    import ray

    from cluster.kv_transfer.ray_direct import COORDINATOR_NAME, COORDINATOR_NAMESPACE

    client = client_for(base_url, "/rd")
    rng = random.Random(12)
    prompts = [random_token_ids(rng, length) for length in LENGTHS]
    for token_ids in prompts:
        assert completion_text(client, token_ids) == offline_greedy(offline, token_ids)
    coordinator = ray.get_actor(COORDINATOR_NAME, namespace=COORDINATOR_NAMESPACE)
    assert ray.get(coordinator.stats.remote()) == {
        "num_registered": 2,
        "group_size": 2,
        "num_transfers": {"direct": len(prompts), "object_store": 0},
    }
    assert stats("rd", "LLMServer")["kv_transfer"]["num_failed_loads"] == 0
    wait_all_blocks_free("rd")


def test_streaming_equals_unstreamed_chat(base_url):
    client = client_for(base_url)
    kwargs = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Tell me about foxes."}],
        max_tokens=20,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 20


def test_an_aborted_stream_frees_blocks_on_both_sides(base_url):
    with httpx.stream(
        "POST",
        f"{base_url}/v1/completions",
        timeout=60,
        json={"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "stream": True, "ignore_eos": True},
    ) as response:
        assert response.status_code == 200
        for index, _ in enumerate(response.iter_lines()):
            if index >= 3:
                break  # leave mid-stream: the decode request is aborted
    wait_all_blocks_free("llm")


def test_a_failed_prefill_is_a_503_and_disturbs_nothing(base_url, offline):
    long_prompt = random_token_ids(random.Random(9), 200)  # above the prefill pool's max_model_len
    with pytest.raises(openai.InternalServerError) as raised:
        client_for(base_url).completions.create(model=MODEL, prompt=[long_prompt], max_tokens=4)
    assert raised.value.status_code == 503 and "prefill pool failed" in str(raised.value)
    short = random_token_ids(random.Random(10), 30)
    assert completion_text(client_for(base_url), short) == offline_greedy(offline, short)
    wait_all_blocks_free("llm")


def test_a_failed_prefill_falls_back_to_local_prefill_when_configured(base_url, offline):
    """On ``/rd`` (configured so): the decode replica prefills the prompt itself, loading no KV."""
    long_prompt = random_token_ids(random.Random(9), 200)
    before = stats("rd", "LLMServer")["kv_transfer"]
    assert completion_text(client_for(base_url, "/rd"), long_prompt) == offline_greedy(offline, long_prompt)
    after = stats("rd", "LLMServer")["kv_transfer"]
    assert after["num_loads"] == before["num_loads"] and after["num_loaded_blocks"] == before["num_loaded_blocks"]
    wait_all_blocks_free("rd")


def test_the_dashboard_row_reads_series_the_apps_export(base_url):
    """Every series the dashboard's disaggregated-prefill row queries is on the app's /metrics (as
    serval_*), except the two that only appear once their event happens (a skipped block needs a
    partial prefix hit, a failed load a lost transfer)."""
    import re

    from serval.dashboard import load_dashboard, panel_queries_by_row

    queries = panel_queries_by_row(load_dashboard())["Disaggregated prefill"]
    series = {name for _, expr in queries for name in re.findall(r"ray_(serval_\w+?)(?:_total|_bucket)?\{", expr)}
    wanted = series - {"serval_kv_transfer_skipped_blocks", "serval_kv_transfer_failed_loads"}
    assert len(wanted) == 7, series
    deadline = time.monotonic() + 60
    while True:
        text = httpx.get(f"{base_url}/metrics", timeout=30).text
        missing = sorted(name for name in wanted if name not in text)
        if not missing:
            break
        assert time.monotonic() < deadline, f"series missing from /metrics: {missing}"
        time.sleep(0.5)
    assert f'model_name="{MODEL}:prefill"' in text


def test_structured_outputs_are_decoded_on_the_decode_side(base_url, offline):
    """The prefill pool runs its own unconstrained one-token prefill; the decode side owns the grammar:
    the response validates, and equals the colocated engine's greedy constrained output."""
    from engine import SamplingParams

    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}},
        "required": ["n", "ok"],
        "additionalProperties": False,
    }
    token_ids = list(range(10, 63))  # several KV blocks cross over
    response = client_for(base_url).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "As JSON please."}],
        max_tokens=40,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
        extra_body={"structured_outputs": {"disable_any_whitespace": True}, "guided_decoding_backend": "xgrammar"},
    )
    assert response.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(response.choices[0].message.content), schema)
    completion = client_for(base_url).completions.create(
        model=MODEL,
        prompt=[token_ids],
        max_tokens=40,
        temperature=0,
        extra_body={"structured_outputs": {"json": schema, "disable_any_whitespace": True}},
    )
    constraint = {"json": schema, "disable_any_whitespace": True}
    params = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=constraint)
    expected = offline.generate([{"prompt_token_ids": token_ids}], params, use_tqdm=False)[0].outputs[0].text
    assert completion.choices[0].text == expected
    jsonschema.validate(json.loads(expected), schema)
    wait_all_blocks_free("llm")
