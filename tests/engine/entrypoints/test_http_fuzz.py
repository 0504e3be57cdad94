"""Hostile input over HTTP: schemathesis fuzzes the OpenAI app from its own ``/openapi.json``, and
hypothesis posts raw JSON bodies (wrong types, huge numbers, deep nesting, lone-surrogate escapes,
invalid UTF-8, a 10 MB string). No answer may be a 5xx, and the replica stays healthy: afterwards
the engine is idle with every KV block free and a plain request succeeds.

Bounded for 2 cores: a fixed number of derandomized examples per operation; generations are kept
short (``_keep_generation_short``) since what is fuzzed is the parsing and validation in front of them.
"""

from __future__ import annotations

import json
from collections import Counter

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error

from engine.entrypoints.openai.embeddings import EmbeddingRequest
from engine.entrypoints.openai.messages_protocol import MessagesRequest
from engine.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest
from engine.entrypoints.openai.responses_request import ResponsesRequest
from tests.conftest import wait_until_idle
from tests.engine.entrypoints.conftest import MODEL, ServerThread

MAX_EXAMPLES = 50  # per operation and generation mode
MAX_GENERATED_TOKENS = 8
FUZZ_SETTINGS = settings(
    max_examples=MAX_EXAMPLES,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
OPERATIONS = [
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/messages",
    "/v1/responses",
    "/v1/embeddings",
    "/tokenize",
    "/detokenize",
]
# The keys of each route's error body's "error" object (OpenAI's; Anthropic's on /v1/messages).
ERROR_KEYS = {"/v1/messages": {"type", "message"}}
OPENAI_ERROR_KEYS = {"message", "type", "code"}
MODES = [schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE]
# Every case sent, by (path, schemathesis mode or "raw", status): the figure docs/benchmarks.md reports.
CASE_COUNTS: Counter = Counter()


@pytest.fixture(autouse=True)
def replica_left_healthy(engine, base_url):
    """After each test: no request left, no KV block leaked, healthy, and a plain completion still succeeds."""
    yield
    wait_until_idle(engine)
    assert httpx.get(f"{base_url}/health").status_code == 200
    response = httpx.post(f"{base_url}/v1/completions", timeout=60, json={"prompt": "Hi", "max_tokens": 2})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 2
    wait_until_idle(engine)


@pytest.fixture(scope="module")
def api_schema(base_url):
    return schemathesis.openapi.from_url(f"{base_url}/openapi.json")


def _body_schema(openapi: dict, path: str) -> dict:
    return openapi["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]


def test_openapi_documents_the_real_request_bodies(base_url):
    openapi = httpx.get(f"{base_url}/openapi.json").json()
    for path, model in [
        ("/v1/completions", CompletionRequest),
        ("/v1/chat/completions", ChatCompletionRequest),
        ("/v1/embeddings", EmbeddingRequest),
        ("/v1/responses", ResponsesRequest),
        ("/detokenize", DetokenizeRequest),
    ]:
        schema = _body_schema(openapi, path)
        assert set(schema["properties"]) == set(model.model_fields), path
        assert set(schema["required"]) == {name for name, field in model.model_fields.items() if field.is_required()}
    message = _body_schema(openapi, "/v1/chat/completions")["properties"]["messages"]["items"]
    assert message["properties"]["role"]["enum"] == ["system", "user", "assistant", "tool"]
    assert [set(variant["required"]) for variant in _body_schema(openapi, "/tokenize")["anyOf"]] == [
        {"prompt"},
        {"messages"},
    ]
    assert "$ref" not in json.dumps(openapi)  # the app's components hold no models to point at


def _keep_generation_short(body) -> None:
    """Valid bodies reach the engine: the served model, a prompt that is not empty, few tokens to generate.

    Left to itself hypothesis mostly draws the empty prompt (its simplest string), which the server
    refuses before the engine; a chat request without a limit would generate up to max_model_len
    tokens, which only costs time. Values past what the server accepts are left alone: those must be
    refused (4xx).
    """
    if not isinstance(body, dict):
        return
    if isinstance(body.get("model"), str):
        body["model"] = MODEL
    for key in ("prompt", "input"):
        if body.get(key) in ("", []):
            body[key] = "Hi"
    for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        if type(body.get(key)) is int and MAX_GENERATED_TOKENS < body[key] <= 2**20:
            body[key] = MAX_GENERATED_TOKENS
    if "messages" in body and body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_completion_tokens"] = MAX_GENERATED_TOKENS
    if "input" in body and body.get("max_output_tokens") is None:
        body["max_output_tokens"] = MAX_GENERATED_TOKENS


@pytest.mark.parametrize("mode", MODES, ids=str)
@pytest.mark.parametrize("path", OPERATIONS)
def test_schemathesis_finds_no_server_error(api_schema, base_url, path, mode):
    strategy = api_schema[path]["POST"].as_strategy(generation_mode=mode)

    @FUZZ_SETTINGS
    @given(case=strategy)
    def fuzz(case):
        _keep_generation_short(case.body)
        response = _send(case, base_url)
        CASE_COUNTS[path, str(mode), response.status_code] += 1
        case.validate_response(response, checks=[not_a_server_error])
        assert response.status_code < 500, response.text

    fuzz()
    print(f"\nschemathesis {path} {mode}: {_counts_for(path, str(mode))}")


def _send(case, base_url: str) -> httpx.Response:
    """``case`` sent with httpx (schemathesis's own requests transport fails on this venv's urllib3-future)."""
    kwargs = case.as_transport_kwargs(base_url=base_url)
    content = kwargs.get("data")
    if isinstance(content, str):
        content = content.encode()
    return httpx.request(
        kwargs["method"],
        kwargs["url"],
        headers=kwargs.get("headers"),
        params=kwargs.get("params"),
        json=kwargs.get("json"),
        content=content,
        timeout=120,
    )


def _counts_for(path: str, mode: str) -> dict[int, int]:
    return {status: n for (p, m, status), n in sorted(CASE_COUNTS.items()) if (p, m) == (path, mode)}


# ------------------------------------------------------------------------------------- raw bodies from hypothesis

JSON_SCALARS = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=40)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)
HUGE_NUMBERS = st.sampled_from(["1e308", "-1e309", "1e-400", "NaN", "Infinity", "-Infinity", "9" * 400, "-" + "9" * 40])
FIELDS = sorted(
    set(CompletionRequest.model_fields)
    | set(ChatCompletionRequest.model_fields)
    | set(MessagesRequest.model_fields)
    | set(EmbeddingRequest.model_fields)
    | set(ResponsesRequest.model_fields)
)


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@st.composite
def hostile_bodies(draw) -> bytes:
    """A body with wrong-typed fields, and raw numbers, escapes or bytes spliced in where JSON cannot carry them."""
    fields = draw(st.dictionaries(st.sampled_from(FIELDS), JSON_VALUES, max_size=5))
    if draw(st.booleans()):
        fields.setdefault("prompt", "Hi")
        fields.setdefault("input", "Hi")
        fields.setdefault("messages", [{"role": "user", "content": "Hi"}])
        fields.setdefault("input", "Hi")
    _keep_generation_short(fields)
    text = json.dumps(fields)
    splice = draw(
        st.sampled_from(["none", "number", "surrogate", "bad utf-8", "deep"]),
    )
    key = json.dumps(draw(st.sampled_from(FIELDS)))
    if splice == "number":
        text = text[:-1] + ("," if fields else "") + f"{key}: {draw(HUGE_NUMBERS)}}}"
    elif splice == "surrogate":
        text = text[:-1] + ("," if fields else "") + f'{key}: "\\ud800 \\udfff \\u0000"}}'
    elif splice == "deep":
        text = (
            text[:-1]
            + ("," if fields else "")
            + f"{key}: {_nested(draw(st.sampled_from([50, 500, 900, 5000, 100_000])))}}}"
        )
    body = text.encode()
    if splice == "bad utf-8":
        body = body[:-1] + b', "prompt": "\xff\xfe\xc0\xaf"}'
    return body


@pytest.mark.parametrize("path", OPERATIONS)
def test_hostile_raw_bodies_get_no_server_error(base_url, path):
    @FUZZ_SETTINGS
    @given(body=hostile_bodies())
    @example(body=b'{"prompt": "' + b"a" * 10_000_000 + b'", "messages": [{"role": "user", "content": "x"}]}')
    @example(body=_nested(1_000_000).encode())
    @example(
        body=b'{"prompt": "\\ud800 \\udfff", "messages": [{"role": "user", "content": "\\udc80"}], "max_tokens": 2}'
    )
    @example(
        body=b'{"prompt": "Hi", "messages": [{"role": "user", "content": "Hi"}], "temperature": NaN, "top_p": Infinity}'
    )
    @example(
        body=b'{"prompt": [' + b"9" * 4000 + b'], "tokens": [-1], "max_tokens": 1e308, "seed": ' + b"9" * 30 + b"}"
    )
    def fuzz(body):
        response = httpx.post(
            f"{base_url}{path}", content=body, headers={"content-type": "application/json"}, timeout=120
        )
        CASE_COUNTS[path, "raw", response.status_code] += 1
        assert response.status_code < 500, response.text[:2000]
        if response.status_code >= 400:
            assert set(response.json()["error"]) >= ERROR_KEYS.get(path, OPENAI_ERROR_KEYS)

    fuzz()
    print(f"\nhypothesis raw bodies {path}: {_counts_for(path, 'raw')}")


@pytest.mark.parametrize("path", OPERATIONS)
def test_a_body_nested_past_the_recursion_limit_is_a_400(base_url, path):
    # json.loads raised RecursionError (not a ValueError) here, which used to be answered 500.
    body = b'{"prompt": "Hi", "logit_bias": ' + _nested(100_000).encode() + b"}"
    response = httpx.post(f"{base_url}{path}", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "The request body is nested too deeply."


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", rb'{"prompt": "Hi \ud800", "max_tokens": 2}'),
        ("/v1/chat/completions", rb'{"messages": [{"role": "user", "content": "\uDFFF"}], "max_tokens": 2}'),
        ("/v1/responses", rb'{"input": [{"role": "user", "content": "\ud800"}], "max_output_tokens": 2}'),
        ("/tokenize", rb'{"prompt": "\udc80"}'),
        ("/v1/embeddings", rb'{"input": ["Hi", "\ud800"]}'),
    ],
)
def test_a_lone_surrogate_escape_is_a_400(base_url, path, body):
    # It decoded to a str no tokenizer takes: Hugging Face's TypeError used to be answered 500.
    response = httpx.post(f"{base_url}{path}", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert "not valid Unicode" in response.json()["error"]["message"]


def test_an_escaped_surrogate_pair_is_still_text(base_url):
    response = httpx.post(f"{base_url}/tokenize", content=rb'{"prompt": "\ud83e\udd8a"}')
    assert (
        response.status_code == 200
        and response.json()["tokens"] == httpx.post(f"{base_url}/tokenize", json={"prompt": "🦊"}).json()["tokens"]
    )


@pytest.mark.slow
def test_a_10_mb_prompt_under_a_raised_body_limit_is_a_400(serving, engine):
    # The default body limit answers 413 before parsing; raised, the string reaches the tokenizer (~15 s).
    from engine.entrypoints.openai.api_server import LocalModelRouter, build_app
    from engine.entrypoints.openai.limits import RequestLimits
    from engine.entrypoints.openai.server_options import ServerOptions

    options = ServerOptions(request_limits=RequestLimits(max_request_body_bytes=16 * 2**20))
    with ServerThread(build_app(LocalModelRouter({MODEL: serving}), options)) as server:
        body = {"prompt": "ab c" * 2_500_000, "max_tokens": 2}
        response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=300)
        assert response.status_code == 400 and "maximum context length" in response.json()["error"]["message"]
    wait_until_idle(engine)
