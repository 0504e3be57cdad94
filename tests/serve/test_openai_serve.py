"""The OpenAI API through a real Ray Serve app (ingress + LLM servers), driven by the official client.

One app serves two models: ``tiny-llama`` (roomy) and ``tiny-qwen`` (one
running request, one queued at most: the overload cases). Greedy results
are checked against the offline engine on the same checkpoint.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
from ray import serve

from tests.conftest import TINY_VOCAB
from tests.serve.cluster import LOOPBACK, deploy_and_wait, is_loopback, listening_addresses, llm_config, serve_config

LLAMA, QWEN = "tiny-llama", "tiny-qwen"
PROMPT = "The quick brown fox"
# tiny-qwen's decode steps take well under a millisecond natively: 300 tokens could end before a burst of
# 8 requests had all arrived, and nothing would be shed.
QUEUE_TOKENS = 4000
# A second app on the same cluster whose args set a key and a small body limit (the first stays open); its
# one model's LLM servers are its HTTP ingress (separate_ingress: false), which these tests cover too.
GUARDED_KEY = "serve-test-key"
GUARDED_APP = {
    "name": "guarded",
    "route_prefix": "/guarded",
    "import_path": "deployments.app:build_openai_app",
    "args": {
        "api_keys": [GUARDED_KEY],
        "request_limits": {"max_request_body_bytes": 4096},
        "separate_ingress": False,
    },
}


@pytest.fixture(scope="module")
def base_url(ray_head, tiny_checkpoint):
    configs = [
        llm_config(LLAMA, tiny_checkpoint("llama")),
        # Long requests (QUEUE_TOKENS) so that a burst finds the one running and the one queued still there.
        llm_config(QWEN, tiny_checkpoint("qwen2"), max_num_seqs=1, max_num_queued_reqs=1, max_model_len=4096),
    ]
    config = serve_config(ray_head.http_port, configs)
    config["applications"].append(GUARDED_APP | {"args": {**GUARDED_APP["args"], "llm_configs": [configs[0]]}})
    deploy_and_wait(ray_head, config)
    return ray_head.base_url


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline_llama(tiny_checkpoint):
    from engine import LLM

    return LLM(model=tiny_checkpoint("llama"), dtype="float32", max_model_len=512)


def greedy_offline(llm, prompt: str, max_tokens: int) -> str:
    from engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].text


def llama_stats() -> dict:
    return serve.get_deployment_handle(f"LLMServer:{LLAMA}", app_name="llm").stats.remote().result()


def test_every_ray_and_serve_socket_listens_on_loopback(ray_head, base_url):
    """With the app running: the GCS, raylet, dashboard, Serve proxy and every replica's gRPC server."""
    new_listeners = listening_addresses() - ray_head.listeners_before
    assert len(new_listeners) >= 8, f"too few new sockets to be Ray's: {new_listeners}"
    exposed = {(address, port) for address, port in new_listeners if not is_loopback(address)}
    assert not exposed, f"sockets listening beyond loopback: {exposed}"
    assert base_url.startswith(f"http://{LOOPBACK}:")


def test_models_health_and_version(client, base_url):
    assert sorted(model.id for model in client.models.list()) == [LLAMA, QWEN]
    assert httpx.get(f"{base_url}/health").status_code == 200
    version = httpx.get(f"{base_url}/version")
    assert version.status_code == 200 and version.json()["version"]


def test_greedy_completion_equals_the_offline_engine(client, offline_llama):
    response = client.completions.create(
        model=LLAMA, prompt=PROMPT, max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
    )
    choice = response.choices[0]
    assert choice.text == greedy_offline(offline_llama, PROMPT, 24)
    assert choice.finish_reason == "length"
    num_prompt_tokens = len(offline_llama.get_tokenizer().encode(PROMPT))
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (num_prompt_tokens, 24)
    assert response.usage.total_tokens == num_prompt_tokens + 24


def test_streamed_chat_equals_the_unstreamed_one_and_reports_usage(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there!"}]
    kwargs = dict(model=LLAMA, messages=messages, max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert whole.choices[0].message.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_stop_strings_n_and_logprobs(client, offline_llama):
    full = greedy_offline(offline_llama, PROMPT, 24)
    stop = full[5:8]
    response = client.completions.create(
        model=LLAMA, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop], extra_body={"ignore_eos": True}
    )
    assert response.choices[0].text == full[: full.index(stop)]
    assert response.choices[0].finish_reason == "stop"

    several = client.completions.create(
        model=LLAMA, prompt=PROMPT, max_tokens=8, n=3, temperature=1.0, seed=7, logprobs=2
    )
    assert sorted(c.index for c in several.choices) == [0, 1, 2]
    assert several.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in several.choices)
    for choice in several.choices:
        assert len(choice.logprobs.token_logprobs) == len(choice.logprobs.tokens) > 0
        # The top 2 plus the sampled token (keyed by text, so tokens that decode alike share an entry).
        for token, top in zip(choice.logprobs.tokens, choice.logprobs.top_logprobs):
            assert token in top and 1 <= len(top) <= 3

    chat = client.chat.completions.create(
        model=LLAMA,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=5,
        logprobs=True,
        top_logprobs=3,
        temperature=0,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(entry.top_logprobs) == 3 and entry.logprob <= 0 for entry in content)


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(client, base_url):
    cases = [
        dict(model=LLAMA, prompt=PROMPT, temperature=-1),
        dict(model=LLAMA, prompt=PROMPT, top_p=2.0),
        dict(model=LLAMA, prompt=PROMPT, max_tokens=600),  # prompt + max_tokens > max_model_len (512)
        dict(model=LLAMA, prompt=[[TINY_VOCAB + 5]]),  # a token id outside the vocabulary
        dict(model=LLAMA, prompt=[[]]),  # an empty prompt
    ]
    for case in cases:
        with pytest.raises(openai.BadRequestError, match=".") as raised:
            client.completions.create(**case)
        assert raised.value.status_code == 400
        assert raised.value.body["message"], case
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=4)
    malformed = httpx.post(
        f"{base_url}/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"}
    )
    assert malformed.status_code == 400
    assert set(malformed.json()["error"]) >= {"message", "type", "param", "code"}
    # ... and a good request still works.
    assert client.completions.create(model=LLAMA, prompt=PROMPT, max_tokens=4).choices[0].text is not None


def test_a_full_queue_answers_503_with_retry_after(base_url):
    """tiny-qwen runs one request and queues one: a burst beyond that is shed with 503, the rest complete."""

    async def one(http: httpx.AsyncClient) -> httpx.Response:
        return await http.post(
            f"{base_url}/v1/completions",
            json={"model": QWEN, "prompt": PROMPT, "max_tokens": QUEUE_TOKENS, "ignore_eos": True},
        )

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as http:
            return await asyncio.gather(*(one(http) for _ in range(8)))

    responses = asyncio.run(burst())
    statuses = sorted(r.status_code for r in responses)
    assert statuses.count(200) >= 1 and 503 in statuses and set(statuses) <= {200, 503}, statuses
    shed = next(r for r in responses if r.status_code == 503)
    assert shed.headers["Retry-After"] and shed.json()["error"]["code"] == 503
    assert all(r.json()["usage"]["completion_tokens"] == QUEUE_TOKENS for r in responses if r.status_code == 200)


def test_64_concurrent_streams_all_complete(base_url):
    async def stream(client: openai.AsyncOpenAI, i: int) -> tuple[str, str, int]:
        chunks = await client.completions.create(
            model=LLAMA,
            prompt=f"{PROMPT} {i}",
            max_tokens=16,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        text, finish_reason, num_tokens = "", None, None
        async for chunk in chunks:
            if chunk.choices:
                text += chunk.choices[0].text
                finish_reason = chunk.choices[0].finish_reason or finish_reason
            if chunk.usage is not None:
                num_tokens = chunk.usage.completion_tokens
        return text, finish_reason, num_tokens

    async def run_all():
        client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=300)
        try:
            return await asyncio.gather(*(stream(client, i) for i in range(64)))
        finally:
            await client.close()

    results = asyncio.run(run_all())
    assert len(results) == 64
    assert all(finish == "length" and num_tokens == 16 and text for text, finish, num_tokens in results)


def test_a_client_disconnect_frees_its_kv_blocks(base_url):
    idle = llama_stats()
    assert idle["num_running_reqs"] == 0
    with httpx.Client(timeout=60) as http:
        with http.stream(
            "POST",
            f"{base_url}/v1/completions",
            json={"model": LLAMA, "prompt": PROMPT, "max_tokens": 480, "ignore_eos": True, "stream": True},
        ) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            received = [line for _, line in zip(range(6), lines)]
            assert any(line.startswith("data: {") for line in received)
            assert llama_stats()["num_running_reqs"] == 1
    # The connection is closed mid-stream: the request is aborted and its blocks go back to the pool.
    deadline = time.monotonic() + 30
    while (stats := llama_stats())["num_running_reqs"] or stats["num_free_blocks"] != idle["num_free_blocks"]:
        assert time.monotonic() < deadline, f"not freed: {stats}"
        time.sleep(0.2)
    assert stats["num_aborted_reqs_total"] == idle["num_aborted_reqs_total"] + 1


def test_the_ingress_serves_every_route_of_the_in_process_server(base_url):
    from engine.entrypoints.openai.api_server import ROUTES

    paths = httpx.get(f"{base_url}/openapi.json").json()["paths"]
    served = {(method.upper(), path) for path, methods in paths.items() for method in methods}
    assert {(method, path) for method, path, _ in ROUTES} <= served


def test_embeddings_through_the_app_equal_the_offline_engine(client, base_url, offline_llama):
    """The same replicas that generate serve ``/v1/embeddings`` (last token, normalized); a bad one is a 400
    across the Ray boundary, in OpenAI's shape."""
    response = client.embeddings.create(model=LLAMA, input=[PROMPT, "Hello there!"])
    offline = offline_llama.embed([PROMPT, "Hello there!"], use_tqdm=False)
    for item, expected in zip(response.data, offline):
        assert abs(sum(value * value for value in item.embedding) - 1.0) < 1e-5
        assert max(abs(a - b) for a, b in zip(item.embedding, expected.outputs.embedding)) < 1e-6
    num_tokens = sum(len(output.prompt_token_ids) for output in offline)
    assert (response.usage.prompt_tokens, response.usage.total_tokens) == (num_tokens, num_tokens)
    refused = httpx.post(f"{base_url}/v1/embeddings", json={"model": LLAMA, "input": "Hi", "dimensions": 8})
    assert refused.status_code == 400 and "Matryoshka" in refused.json()["error"]["message"]


def test_replica_metrics_reach_rays_prometheus_endpoint(ray_head, client):
    """Every LLM-server replica exports serval_* metrics through Ray's pipeline, tagged by model and replica;
    the ingress counts the calls it routes by endpoint."""
    client.completions.create(model=LLAMA, prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    client.embeddings.create(model=LLAMA, input=PROMPT)
    url = f"http://{LOOPBACK}:{ray_head.metrics_port}/metrics"
    wanted = [
        "serval_time_to_first_token_seconds_bucket",
        "serval_inter_token_latency_seconds_bucket",
        "serval_e2e_request_latency_seconds_count",
        "serval_generation_tokens",
        "serval_prompt_tokens",
        "serval_request_success",
        "serval_num_requests_running",
        "serval_kv_cache_usage_perc",
        "serval_endpoint_requests",
    ]
    deadline = time.monotonic() + 120  # Ray's agent exports every few seconds
    while True:
        lines = [
            line
            for line in httpx.get(url, timeout=10).text.splitlines()
            if "serval_" in line and f'model_name="{LLAMA}"' in line
        ]
        missing = [name for name in wanted if not any(name in line for line in lines)]
        # Each endpoint's series waited for too: the two calls' counts may reach the agent in different exports.
        endpoints = ('endpoint="completions"', 'endpoint="embeddings"')
        missing += [e for e in endpoints if not any("serval_endpoint_requests" in x and e in x for x in lines)]
        if not missing:
            break
        assert time.monotonic() < deadline, f"metrics missing from Ray's endpoint: {missing}; got {lines[:20]}"
        time.sleep(2)
    assert any('finished_reason="length"' in line for line in lines)
    assert all('replica="' in line for line in lines)


def test_the_app_args_api_keys_and_body_limit_reach_the_deployed_app(base_url):
    url, body = f"{base_url}/guarded", {"model": LLAMA, "prompt": PROMPT, "max_tokens": 2}
    refused = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert refused.status_code == 401 and refused.json()["error"]["type"] == "AuthenticationError"
    for open_path in ("/health", "/metrics"):  # open (metrics_require_api_key is off), under the route prefix too
        assert httpx.get(f"{url}{open_path}", timeout=60).status_code == 200, open_path
    key = {"Authorization": f"Bearer {GUARDED_KEY}"}
    assert httpx.post(f"{url}/v1/completions", json=body, headers=key, timeout=60).status_code == 200
    too_large = httpx.post(f"{url}/v1/completions", json={**body, "padding": "x" * 5000}, headers=key, timeout=60)
    assert too_large.status_code == 413 and too_large.json()["error"]["code"] == 413


def test_the_messages_api_through_the_ingress_and_x_api_key(base_url, client):
    """Anthropic's client through the ingress (a Messages call crosses it as the chat request it maps to):
    the chat completion's greedy text, streamed and not; a 400 in Anthropic's shape; x-api-key as the key."""
    import anthropic

    messages = [{"role": "user", "content": "Hello there!"}]
    chat = client.chat.completions.create(model=LLAMA, messages=messages, max_tokens=12, temperature=0)
    claude = anthropic.Anthropic(base_url=base_url, api_key="none", max_retries=0, timeout=120)
    request = dict(model=LLAMA, max_tokens=12, messages=messages, extra_body={"temperature": 0})
    whole = claude.messages.create(**request)
    with claude.messages.stream(**request) as stream:
        streamed = stream.get_final_message()
    for message in (whole, streamed):
        assert "".join(block.text for block in message.content) == chat.choices[0].message.content
        assert message.usage.output_tokens == chat.usage.completion_tokens
    bad = httpx.post(f"{base_url}/v1/messages", json={"model": LLAMA, "messages": messages}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    guarded = anthropic.Anthropic(base_url=f"{base_url}/guarded", api_key=GUARDED_KEY, max_retries=0, timeout=120)
    assert guarded.messages.create(**request).usage.output_tokens == chat.usage.completion_tokens
    refused = httpx.post(f"{base_url}/guarded/v1/messages", json={**request, "extra_body": None}, timeout=60)
    assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"


def qwen_stats() -> dict:
    return serve.get_deployment_handle(f"LLMServer:{QWEN}", app_name="llm").stats.remote().result()


def test_a_killed_engine_core_fails_its_stream_and_serve_replaces_the_replica(base_url):
    """Last in this module: it takes tiny-qwen's replica down. The replica's engine core is a child
    process; SIGKILLed mid-stream, the stream ends with an error event at once (never cut or hung),
    the replica turns unhealthy, Serve replaces it, and the old core is gone with its replica."""
    import json
    import os
    import signal

    before = qwen_stats()
    core_pid = before["engine_core_pid"]
    assert core_pid is not None and core_pid != os.getpid()
    body = {"model": QWEN, "prompt": PROMPT, "max_tokens": 480, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as http, http.stream("POST", f"{base_url}/v1/completions", json=body) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))
        os.kill(core_pid, signal.SIGKILL)
        killed_at = time.monotonic()
        rest = [line for line in lines if line.startswith("data: ")]
    assert time.monotonic() - killed_at < 10
    events = [json.loads(line.removeprefix("data: ")) for line in rest if line != "data: [DONE]"]
    assert "error" in events[-1], rest[-3:]
    deadline = time.monotonic() + 180
    while True:  # Serve's health check fails the replica and starts another
        try:
            after = qwen_stats()
            if after["replica_id"] != before["replica_id"]:
                break
        except Exception:
            pass  # the dead replica may answer with an error until it is replaced
        assert time.monotonic() < deadline, "the replica was not replaced"
        time.sleep(1.0)
    assert after["engine_core_pid"] not in (None, core_pid)
    done = httpx.post(f"{base_url}/v1/completions", json={**body, "stream": False, "max_tokens": 3}, timeout=120)
    assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 3
    assert not os.path.exists(f"/proc/{core_pid}/cmdline") or not open(f"/proc/{core_pid}/cmdline").read()
