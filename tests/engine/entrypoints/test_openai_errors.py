"""Errors as OpenAI clients expect them, and what they must not do to other requests.

400 for malformed JSON, invalid parameters and prompts beyond the context (vLLM's message); 404
for an unknown model; 503 + Retry-After when the engine's queue is full; 500 once the engine is
dead, and a final ``data: {"error": ...}`` event when it dies mid-stream. Bad requests leave a
running stream untouched, and a client that disconnects (streamed or not) aborts its request.
"""

from __future__ import annotations

import concurrent.futures
import json
import time

import httpx
import openai
import pytest

from tests.conftest import wait_until_idle
from tests.engine.entrypoints.conftest import ENGINE_KWARGS, MODEL, make_async_llm, make_client, serve_models

pytestmark = pytest.mark.usefixtures("engine_left_idle")

MAX_MODEL_LEN = ENGINE_KWARGS["max_model_len"]
PROMPT = "The quick brown fox"
SMALL, DOOMED = "small", "doomed"  # one running + one queued at most; shut down by its test


def error_body(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["code"] == response.status_code
    return body["error"]


def post(base_url: str, path: str, **kwargs) -> httpx.Response:
    return httpx.post(f"{base_url}{path}", timeout=60, **kwargs)


def long_stream_body(model: str = MODEL, max_tokens: int = MAX_MODEL_LEN - 100) -> dict:
    return {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }


def sse_payloads(lines) -> list[str]:
    return [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"])
@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", b"\xff\xfe", b""])
def test_malformed_bodies_are_400(base_url, path, content):
    response = post(base_url, path, content=content, headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert error_body(response)["type"] == "BadRequestError"


@pytest.mark.parametrize(
    "params, message",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 2}, "top_p"),
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"logprobs": 30}, "logprobs"),
        ({"suffix": "x"}, "suffix"),
        ({"extra_body": {"top_k": -5}}, "top_k"),
        ({"extra_body": {"min_tokens": 9, "max_tokens": 3}}, "min_tokens"),
        ({"extra_body": {"logit_bias": {"abc": 1}}}, "logit_bias"),
        ({"extra_body": {"stop_token_ids": [100000]}}, "stop_token_ids"),
    ],
)
def test_invalid_parameters_are_400(client, params, message):
    params = {"max_tokens": 4, **params}
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt=PROMPT, **params)
    error = error_body(caught.value.response)
    assert error["type"] == "BadRequestError" and message in error["message"]


def test_a_prompt_beyond_the_context_is_400_with_vllms_message(client, base_url):
    prompt = [5 + i % 500 for i in range(MAX_MODEL_LEN - 8)]
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=100)
    assert error_body(caught.value.response)["message"] == (
        f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, you requested "
        f"{MAX_MODEL_LEN + 92} tokens ({MAX_MODEL_LEN - 8} in the messages, 100 in the completion). "
        "Please reduce the length of the messages or completion."
    )
    whole_context = post(base_url, "/v1/completions", json={"model": MODEL, "prompt": prompt * 2, "max_tokens": None})
    assert whole_context.status_code == 400
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in error_body(whole_context)["message"]
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.chat.completions.create(
            model=MODEL, max_tokens=MAX_MODEL_LEN, messages=[{"role": "user", "content": "Hi"}]
        )


def test_a_bad_prompt_in_a_batch_fails_the_whole_request(client, engine):
    aborted_before = engine.get_stats().num_aborted_reqs_total
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        client.completions.create(
            model=MODEL, prompt=[[5, 6, 7], [5, 999999]], max_tokens=50, extra_body={"ignore_eos": True}
        )
    wait_until_idle(engine)
    assert engine.get_stats().num_aborted_reqs_total <= aborted_before + 1  # the good prompt, if it got in


def test_an_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=2)
    error = error_body(caught.value.response)
    assert (error["type"], error["param"]) == ("NotFoundError", "model")
    assert error["message"] == "The model `no-such-model` does not exist."


def test_bad_requests_do_not_disturb_a_running_stream(base_url, client):
    expected = (
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=200, temperature=0, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
    )
    with httpx.stream(
        "POST", f"{base_url}/v1/completions", json=long_stream_body(max_tokens=200), timeout=60
    ) as stream:
        lines = stream.iter_lines()
        head = [next(lines)]
        bad_requests = [
            {"content": b"{oops"},
            {"json": {"model": MODEL, "prompt": [5] * MAX_MODEL_LEN}},
            {"json": {"model": MODEL, "prompt": [5, 999999]}},
            {"json": {"model": MODEL, "prompt": PROMPT, "temperature": -3}},
            {"json": {"model": "nope", "prompt": PROMPT}},
        ]
        statuses = [post(base_url, "/v1/completions", **request).status_code for request in bad_requests]
        payloads = sse_payloads(head + list(lines))
    assert statuses == [400, 400, 400, 400, 404]
    assert payloads[-1] == "[DONE]"
    assert "".join(json.loads(payload)["choices"][0]["text"] for payload in payloads[:-1]) == expected


def test_a_stream_closed_by_the_client_aborts_its_request(base_url, engine):
    before = engine.get_stats()
    with httpx.stream("POST", f"{base_url}/v1/completions", json=long_stream_body(), timeout=60) as stream:
        assert stream.status_code == 200
        lines = stream.iter_lines()
        next(lines)
    wait_until_idle(engine, timeout_s=10)
    after = engine.get_stats()
    assert after.num_aborted_reqs_total == before.num_aborted_reqs_total + 1
    assert after.num_finished_reqs_total == before.num_finished_reqs_total


def test_a_non_streamed_request_whose_client_left_is_aborted(base_url, engine):
    before = engine.get_stats()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # up to the context length: seconds of work
        httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=httpx.Timeout(60, read=0.3))
    wait_until_idle(engine, timeout_s=10)
    after = engine.get_stats()
    assert after.num_aborted_reqs_total == before.num_aborted_reqs_total + 1
    assert after.num_finished_reqs_total == before.num_finished_reqs_total


# -------------------------------------------------------------- engines of their own: overload, death


@pytest.fixture(scope="module")
def side_engines(model_path):
    engines = {
        SMALL: make_async_llm(model_path, max_num_seqs=1, max_num_queued_reqs=1),
        DOOMED: make_async_llm(model_path),
    }
    yield engines
    for engine in engines.values():
        engine.shutdown()


@pytest.fixture(scope="module")
def side_url(side_engines):
    from engine.entrypoints.openai.serving import OpenAIServing

    with serve_models({name: OpenAIServing(engine, name) for name, engine in side_engines.items()}) as server:
        yield server.base_url


def wait_for_waiting_requests(engine, num_waiting: int) -> None:
    deadline = time.monotonic() + 10
    while engine.get_stats().num_waiting_reqs != num_waiting:
        assert time.monotonic() < deadline, engine.get_stats()
        time.sleep(0.01)


def test_a_full_queue_is_503_with_retry_after(side_url, side_engines):
    small = side_engines[SMALL]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        with httpx.stream("POST", f"{side_url}/v1/completions", json=long_stream_body(SMALL), timeout=60) as running:
            assert running.status_code == 200
            running_lines = running.iter_lines()  # (kept: dropping an httpx line iterator closes the connection)
            next(running_lines)  # the one running request
            queued = pool.submit(
                post, side_url, "/v1/completions", json={"model": SMALL, "prompt": PROMPT, "max_tokens": 3}
            )
            wait_for_waiting_requests(small, 1)
            refused = post(side_url, "/v1/completions", json={"model": SMALL, "prompt": PROMPT, "max_tokens": 3})
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
            assert error_body(refused)["type"] == "ServiceUnavailableError"
            with pytest.raises(openai.InternalServerError) as caught:  # the client's class for 5xx
                make_client(side_url).chat.completions.create(
                    model=SMALL, max_tokens=2, messages=[{"role": "user", "content": "Hi"}]
                )
            assert caught.value.status_code == 503
        assert queued.result().status_code == 200  # it ran once the stream was closed (and aborted)
    wait_until_idle(small)


def test_a_dead_engine_ends_streams_with_an_error_event_then_answers_500(side_url, side_engines):
    doomed = side_engines[DOOMED]
    with httpx.stream("POST", f"{side_url}/v1/completions", json=long_stream_body(DOOMED), timeout=60) as stream:
        lines = stream.iter_lines()
        head = [next(lines)]
        doomed.shutdown()
        payloads = sse_payloads(head + list(lines))
    assert stream.status_code == 200 and payloads[-1] == "[DONE]"
    error = json.loads(payloads[-2])["error"]
    assert error["type"] == "InternalServerError" and "shut down" in error["message"]
    with pytest.raises(openai.InternalServerError) as caught:
        make_client(side_url).completions.create(model=DOOMED, prompt=PROMPT, max_tokens=2)
    assert caught.value.status_code == 500 and "The engine is dead" in error_body(caught.value.response)["message"]
    streamed = post(
        side_url,
        "/v1/chat/completions",
        json={"model": DOOMED, "stream": True, "messages": [{"role": "user", "content": "Hi"}]},
    )
    assert streamed.status_code == 500  # nothing was sent yet: a plain error response, not a stream
    assert httpx.get(f"{side_url}/health").status_code == 503
