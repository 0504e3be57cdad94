"""Hostile input at the OpenAI layer: request limits (400 naming the field, 413 for the body), API keys
(401 in OpenAI's shape; ``api_keys`` or ``SERVAL_API_KEY``) and tenant isolation by ``cache_salt``.

Every refusal happens before any engine work (the engine's counters do not move) and leaves a running
stream untouched. The servers are ``build_app`` over the session's real AsyncLLM, with their own options.
"""

from __future__ import annotations

import json
import uuid

import httpx
import openai
import pytest
from starlette.responses import Response

from engine.entrypoints.openai import auth
from engine.entrypoints.openai.api_server import LocalModelRouter, build_app
from engine.entrypoints.openai.limits import RequestLimits
from engine.entrypoints.openai.server_options import ServerOptions
from tests.conftest import wait_until_idle
from tests.engine.entrypoints.conftest import ENGINE_KWARGS, MODEL, ServerThread, make_client

pytestmark = pytest.mark.usefixtures("engine_left_idle")

MAX_MODEL_LEN = ENGINE_KWARGS["max_model_len"]
BLOCK_SIZE = 16  # EngineArgs' default, which ENGINE_KWARGS keeps
PROMPT = "The quick brown fox"
LIMITS = dict(
    max_request_body_bytes=4096,
    max_n=2,
    max_logprobs=2,
    max_stop_strings=2,
    max_stop_string_chars=8,
    max_logit_bias_entries=2,
)
KEYS = ["key-one", "key-two"]


def serve_with(serving, metrics_route: bool = False, **options) -> ServerThread:
    """The in-process server over ``serving`` with ``ServerOptions(**options)``; ``metrics_route`` adds a
    ``GET /metrics`` as the Ray ingress does."""
    app = build_app(LocalModelRouter({MODEL: serving}), ServerOptions(**options))
    if metrics_route:
        app.add_api_route("/metrics", lambda: Response("serval_up 1\n"), methods=["GET"])
    return ServerThread(app)


def engine_counters(engine) -> tuple[int, int, int]:
    """What any request that reached the engine moves: prompt tokens, finished and aborted requests."""
    wait_until_idle(engine)
    stats = engine.get_stats()
    return stats.num_prompt_tokens_total, stats.num_finished_reqs_total, stats.num_aborted_reqs_total


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["code"] == status
    return body["error"]


@pytest.fixture(autouse=True)
def no_api_key_in_the_environment(monkeypatch):
    monkeypatch.delenv(auth.API_KEY_ENV, raising=False)


@pytest.fixture(scope="module")
def limited_url(serving):
    with serve_with(serving, request_limits=LIMITS) as server:
        yield server.base_url


@pytest.fixture(scope="module")
def keyed_url(serving):
    with serve_with(serving, metrics_route=True, api_keys=KEYS) as server:
        yield server.base_url


# ---------------------------------------------------------------------------------------------------- limits


@pytest.mark.parametrize(
    "param, within, beyond",
    [
        ("n", {"n": 2}, {"n": 3}),
        ("logprobs", {"logprobs": 2}, {"logprobs": 3}),
        ("stop", {"stop": ["a", "b"]}, {"stop": ["a", "b", "c"]}),
        ("stop", {"stop": "x" * 8}, {"stop": ["x" * 9]}),
        ("logit_bias", {"logit_bias": {"5": 1, "6": 1}}, {"logit_bias": {"5": 1, "6": 1, "7": 1}}),
    ],
)
def test_each_limit_allows_its_value_and_refuses_one_more_before_the_engine(limited_url, engine, param, within, beyond):
    client = make_client(limited_url)
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, **within).choices
    before = engine_counters(engine)
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, **beyond)
    error = error_of(caught.value.response, 400)
    assert (error["type"], error["param"]) == ("BadRequestError", param)
    assert "request_limits.max_" in error["message"]
    assert engine_counters(engine) == before


def test_chat_top_logprobs_is_limited_too(limited_url):
    client = make_client(limited_url)
    messages = [{"role": "user", "content": "Hi"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, logprobs=True, top_logprobs=2)
    assert all(len(entry.top_logprobs) == 2 for entry in chat.choices[0].logprobs.content)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, logprobs=True, top_logprobs=3)
    assert error_of(caught.value.response, 400)["param"] == "top_logprobs"


def test_responses_are_limited_as_the_chat_request_they_are_served_as(limited_url, engine):
    client = make_client(limited_url)
    assert client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, extra_body={"stop": ["a", "b"]}).output
    before = engine_counters(engine)
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, extra_body={"stop": ["a", "b", "c"]})
    error = error_of(caught.value.response, 400)
    assert error["param"] == "stop" and "request_limits.max_stop_strings" in error["message"]
    assert engine_counters(engine) == before


def test_a_body_over_the_limit_is_413_declared_or_streamed(limited_url, engine):
    url = f"{limited_url}/v1/completions"
    body = json.dumps({"model": MODEL, "prompt": "x" * 4096, "max_tokens": 2}).encode()
    before = engine_counters(engine)
    declared = httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=60)
    assert error_of(declared, 413)["type"] == "RequestTooLargeError"
    assert "4096 bytes" in declared.json()["error"]["message"]
    chunks = (body[i : i + 1000] for i in range(0, len(body), 1000))  # no Content-Length: chunked
    streamed = httpx.post(url, content=chunks, headers={"content-type": "application/json"}, timeout=60)
    assert error_of(streamed, 413)["type"] == "RequestTooLargeError"
    assert engine_counters(engine) == before
    small = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "padding": "x" * 3990}).encode()
    assert 4000 < len(small) <= 4096
    within = httpx.post(url, content=iter([small]), timeout=60)
    assert within.status_code == 200, within.text


def test_the_defaults_are_openais_caps_and_an_8_mib_body(base_url):
    limits = RequestLimits()
    assert (limits.max_n, limits.max_logprobs, limits.max_request_body_bytes) == (128, 20, 8 * 1024 * 1024)
    oversized = b'{"prompt": "' + b"x" * limits.max_request_body_bytes + b'"}'
    assert error_of(httpx.post(f"{base_url}/v1/completions", content=oversized, timeout=60), 413)
    with pytest.raises(ValueError, match="max_n"):
        RequestLimits(max_n=129)  # beyond the protocol's own cap
    with pytest.raises(ValueError, match="max_stop"):
        RequestLimits(max_stop=3)


def test_prompt_and_max_tokens_beyond_max_model_len_are_refused_before_the_engine(client, engine):
    before = engine_counters(engine)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=MODEL, prompt=[5] * (MAX_MODEL_LEN - 1), max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_MODEL_LEN)
    assert engine_counters(engine) == before


# -------------------------------------------------------------------------------------------------- API keys


@pytest.mark.parametrize(
    "method, path, body",
    [
        ("POST", "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}),
        ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}),
        ("POST", "/v1/responses", {"input": "Hi", "max_output_tokens": 2, "store": False}),
        ("GET", "/v1/models", None),
        ("POST", "/tokenize", {"prompt": PROMPT}),
        ("POST", "/detokenize", {"tokens": [5, 6]}),
    ],
)
@pytest.mark.parametrize("authorization", [None, "Bearer wrong", "Bearer key-on", "Bearer key-one2", "Basic key-one"])
def test_routes_to_a_model_need_a_key(keyed_url, engine, method, path, body, authorization):
    headers = {} if authorization is None else {"Authorization": authorization}
    before = engine_counters(engine)
    response = httpx.request(method, f"{keyed_url}{path}", json=body, headers=headers, timeout=60)
    assert error_of(response, 401)["type"] == "AuthenticationError"
    assert response.headers["WWW-Authenticate"] == "Bearer"
    assert engine_counters(engine) == before
    with_key = httpx.request(method, f"{keyed_url}{path}", json=body, headers={"Authorization": "bearer key-one"})
    assert with_key.status_code == 200, with_key.text


def test_the_openai_client_with_either_key_is_served_and_a_wrong_one_is_refused(keyed_url):
    for key in KEYS:
        client = openai.OpenAI(base_url=f"{keyed_url}/v1", api_key=key, max_retries=0, timeout=60)
        assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2).choices
    wrong = openai.OpenAI(base_url=f"{keyed_url}/v1", api_key="key-three", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError) as caught:
        wrong.models.list()
    assert caught.value.status_code == 401


def test_health_version_and_docs_stay_open_and_metrics_is_configurable(serving, keyed_url):
    for path in ("/health", "/version", "/openapi.json", "/metrics"):
        assert httpx.get(f"{keyed_url}{path}").status_code == 200, path
    with serve_with(serving, metrics_route=True, api_keys=KEYS, metrics_require_api_key=True) as server:
        assert error_of(httpx.get(f"{server.base_url}/metrics"), 401)
        metrics = httpx.get(f"{server.base_url}/metrics", headers={"Authorization": "Bearer key-two"})
        assert metrics.status_code == 200 and metrics.text == "serval_up 1\n"
        assert httpx.get(f"{server.base_url}/health").status_code == 200


def test_serval_api_key_applies_unless_api_keys_are_given(serving, monkeypatch):
    monkeypatch.setenv(auth.API_KEY_ENV, "from-env")
    with serve_with(serving) as server:
        assert error_of(httpx.get(f"{server.base_url}/v1/models"), 401)
        assert httpx.get(f"{server.base_url}/v1/models", headers={"Authorization": "Bearer from-env"}).is_success
    with serve_with(serving, api_keys=["from-args"]) as server:
        assert error_of(httpx.get(f"{server.base_url}/v1/models", headers={"Authorization": "Bearer from-env"}), 401)
        assert httpx.get(f"{server.base_url}/v1/models", headers={"Authorization": "Bearer from-args"}).is_success
    monkeypatch.setenv(auth.API_KEY_ENV, "")
    with serve_with(serving) as server:
        assert httpx.get(f"{server.base_url}/v1/models").is_success  # no key anywhere: none asked


def test_every_key_is_compared_in_constant_time_whatever_matches(monkeypatch):
    compared = []

    def compare_digest(a, b):
        compared.append((len(a), len(b)))
        return a == b

    monkeypatch.setattr(auth.hmac, "compare_digest", compare_digest)
    middleware = auth.ApiKeyMiddleware(None, ["a", "bb", "a-much-longer-key"], metrics_require_api_key=False)
    for presented, expected in [(b"a", True), (b"a-much-longer-key", True), (b"nope", False), (b"", False)]:
        compared.clear()
        scope = {"type": "http", "path": "/v1/models", "headers": [(b"authorization", b"Bearer " + presented)]}
        assert middleware._has_key(scope) is expected
        assert compared == [(32, 32)] * 3  # SHA-256 digests: equal lengths, every key, no early exit


def test_a_route_prefix_is_taken_off_before_the_open_paths_are_matched():
    middleware = auth.ApiKeyMiddleware(None, KEYS, metrics_require_api_key=False)
    scope = {"type": "http", "path": "/guarded/health", "root_path": "/guarded", "headers": []}
    assert auth._route_path(scope) == "/health" and auth._route_path({**scope, "path": "/guarded"}) == "/"
    assert auth._route_path({"path": "/v1/models"}) == "/v1/models"
    assert not middleware._has_key(scope)


# ------------------------------------------------------------------------------------------- refusals in flight


def test_refused_requests_leave_a_running_stream_untouched(serving):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 64, "temperature": 0, "ignore_eos": True}
    key = {"Authorization": "Bearer key-one"}
    with serve_with(serving, api_keys=KEYS, request_limits=LIMITS) as server:
        url = f"{server.base_url}/v1/completions"
        expected = httpx.post(url, json=body, headers=key, timeout=60).json()["choices"][0]["text"]
        with httpx.stream("POST", url, json={**body, "stream": True}, headers=key, timeout=60) as stream:
            lines = stream.iter_lines()
            received = [next(lines)]
            assert error_of(httpx.post(url, json=body, timeout=60), 401)
            assert error_of(httpx.post(url, json={**body, "prompt": "x" * 5000}, headers=key, timeout=60), 413)
            assert error_of(httpx.post(url, json={**body, "n": 3}, headers=key, timeout=60), 400)
            received += list(lines)
    events = [line.removeprefix("data: ") for line in received if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert "".join(json.loads(event)["choices"][0]["text"] for event in events[:-1]) == expected


# ------------------------------------------------------------------------------------------- tenant isolation


def test_different_cache_salts_never_share_prefix_cache_blocks_and_the_same_salt_does(client, engine):
    """Four full blocks of a prompt no other test sends; the prefix-cache hit counter (tokens) tells."""
    prompt = [400 + i for i in range(4 * BLOCK_SIZE)]
    salt_a, salt_b = f"tenant-a-{uuid.uuid4().hex}", f"tenant-b-{uuid.uuid4().hex}"

    def hits_and_queries(**extra_body) -> tuple[int, int]:
        before = engine.get_stats()
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, extra_body=extra_body)
        wait_until_idle(engine)
        after = engine.get_stats()
        return (
            after.prefix_cache_hits - before.prefix_cache_hits,
            after.prefix_cache_queries - before.prefix_cache_queries,
        )

    first_a = hits_and_queries(cache_salt=salt_a)
    assert first_a[0] == 0 and first_a[1] > 0
    assert hits_and_queries(cache_salt=salt_b)[0] == 0  # same tokens, another tenant
    assert hits_and_queries()[0] == 0  # no salt is a tenant of its own
    assert hits_and_queries(cache_salt=salt_a)[0] >= 3 * BLOCK_SIZE  # all but the block holding the last token
    assert hits_and_queries(cache_salt=salt_b)[0] >= 3 * BLOCK_SIZE
