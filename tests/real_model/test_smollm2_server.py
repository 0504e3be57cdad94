"""The OpenAI server on a real pretrained model, SmolLM2-135M-Instruct (float32): a real AsyncLLM, built as
the servers build it, behind ``build_app(LocalModelRouter(...))`` on uvicorn, called with the official
``openai`` client; transformers is the reference.

* The engine's prompt ids of a chat request (as the engine reports them back through a tracked stream,
  ``CallOptions.track``, the Ray ingress's tracking) are ``apply_chat_template``'s: default and given system
  prompts, several turns, ``add_generation_prompt`` false; ``/tokenize`` agrees.
* Greedy tokens through the serving equal ``generate(do_sample=False)``; the streamed text is their
  decode; ``<|im_end|>`` ends the turn with ``finish_reason: "stop"`` and never shows in the content (not
  with ``skip_special_tokens: false`` either); usage counts the template's ids and every generated token.
* Over HTTP, non-streamed answers equal the streamed ones (text, finish reason, usage).
* ``stop`` strings end the answer before them; a JSON-schema ``response_format`` and a ``choice``
  constraint (``structured_outputs`` and ``guided_choice``) give valid outputs that finish with "stop".
* Sampling defaults: ``temperature: 0`` is deterministic greedy; a request without temperature / top_p
  samples with generation_config.json's (0.2, 0.9), seen through a seed.
* ``/v1/embeddings`` on the same engine equals transformers' last-token hidden state, L2-normalized.

Every KV block is free again after each test.
"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from engine.entrypoints.openai.call_options import CallOptions
from engine.entrypoints.openai.endpoints import Endpoint
from engine.entrypoints.openai.protocol import ChatCompletionRequest
from engine.entrypoints.openai.serving import OpenAIServing
from tests.conftest import make_async_llm
from tests.engine.entrypoints.conftest import make_client, serve_models
from tests.real_model.smollm2 import (
    CAPITAL_ANSWER,
    CONVERSATIONS,
    ENGINE_KWARGS,
    EOS_TOKEN_ID,
    MAX_NEW_TOKENS,
    NAMES,
    hf_decode,
    hf_greedy,
    hf_tokenizer,
    template_ids,
)

pytestmark = pytest.mark.usefixtures("engine_left_idle")

MODEL = "smollm2"
HTTP_NAMES = ("capital", "haiku", "cjk", "emoji")  # the short answer, one ended by <|im_end|>, two multi-byte
CITY_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "country": {"type": "string", "maxLength": 20}},
    "required": ["city", "country"],
    "additionalProperties": False,
}
JSON_QUESTION = [
    {"role": "user", "content": "What is the capital of France? Answer in JSON with the keys city and country."}
]
CITIES = ["Paris", "London", "Berlin"]


@pytest.fixture(scope="module")
def engine(smollm2_path):
    llm = make_async_llm(smollm2_path, like_the_server=True, **ENGINE_KWARGS)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def serving(engine):
    return OpenAIServing(engine, MODEL)


@pytest.fixture(scope="module")
def client(serving):
    with serve_models({MODEL: serving}) as server:
        yield make_client(server.base_url)


@pytest.fixture(scope="module")
def base_url(client) -> str:
    return str(client.base_url).removesuffix("/").removesuffix("/v1")


def sse_events(items: list[str]) -> list[dict]:
    """The JSON events of SSE items (``[DONE]`` checked last and dropped; no error event)."""
    lines = [line[len("data: ") :] for item in items for line in item.split("\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]", lines[-3:]
    events = [json.loads(line) for line in lines[:-1]]
    assert not any("error" in event for event in events), events
    return events


def tracked_chats(serving, requests: dict[str, dict]) -> dict[str, dict]:
    """Streams each request (at once, so the engine batches them) through ``serving.chat`` with a
    tracked ``CallOptions``: name -> the engine's prompt ids and generated ids, the text, finish and usage."""

    async def one(body: dict) -> dict:
        request = ChatCompletionRequest.model_validate(
            {"model": MODEL, "stream": True, "stream_options": {"include_usage": True}, **body}
        )
        streamed = [item async for item in serving.call(Endpoint.CHAT, request, CallOptions(track=True))]
        events = sse_events([item.text for item in streamed])
        finishes = [choice["finish_reason"] for event in events for choice in event["choices"]]
        return {
            "prompt_ids": streamed[0].delta.prompt_token_ids,
            "token_ids": [token_id for item in streamed for token_id in item.delta.token_ids],
            "text": "".join(choice["delta"].get("content") or "" for event in events for choice in event["choices"]),
            "finish_reason": [reason for reason in finishes if reason is not None],
            "usage": events[-1]["usage"],
        }

    async def run() -> list[dict]:
        return await asyncio.gather(*(one(body) for body in requests.values()))

    return dict(zip(requests, asyncio.run(run())))


def greedy_body(messages: list[dict], max_tokens: int = MAX_NEW_TOKENS, **extra) -> dict:
    return {"messages": messages, "temperature": 0, "max_completion_tokens": max_tokens, **extra}


@pytest.fixture(scope="module")
def tracked(serving) -> dict[str, dict]:
    """Every conversation greedy through the serving, streamed, all at once."""
    return tracked_chats(serving, {name: greedy_body(CONVERSATIONS[name]) for name in NAMES})


@pytest.mark.parametrize("name", NAMES)
def test_the_engine_gets_the_template_ids_and_generates_transformers_tokens(smollm2_path, tracked, name):
    got = tracked[name]
    prompt_ids = template_ids(smollm2_path, CONVERSATIONS[name])
    expected = hf_greedy(smollm2_path, name)
    assert got["prompt_ids"] == prompt_ids
    assert got["token_ids"] == expected
    assert got["text"] == hf_decode(smollm2_path, expected) and "<|im_end|>" not in got["text"]
    assert got["finish_reason"] == ["stop" if expected[-1] == EOS_TOKEN_ID else "length"]
    assert got["usage"] == {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": len(expected),
        "total_tokens": len(prompt_ids) + len(expected),
    }


def test_prompt_ids_without_the_generation_prompt(smollm2_path, serving, base_url):
    import httpx

    names = ("multi_turn", "capital")
    bodies = {name: greedy_body(CONVERSATIONS[name], 1, add_generation_prompt=False) for name in names}
    got = tracked_chats(serving, bodies)
    for name in names:
        expected = template_ids(smollm2_path, CONVERSATIONS[name], add_generation_prompt=False)
        assert got[name]["prompt_ids"] == expected != template_ids(smollm2_path, CONVERSATIONS[name])
        tokenized = httpx.post(
            f"{base_url}/tokenize",
            json={"model": MODEL, "messages": CONVERSATIONS[name], "add_generation_prompt": False},
        ).json()
        assert tokenized["tokens"] == expected


def test_tokenize_renders_the_template(smollm2_path, base_url):
    import httpx

    for name in NAMES:
        tokenized = httpx.post(f"{base_url}/tokenize", json={"model": MODEL, "messages": CONVERSATIONS[name]}).json()
        assert tokenized["tokens"] == template_ids(smollm2_path, CONVERSATIONS[name])
        assert tokenized["count"] == len(tokenized["tokens"])


def concurrently(function, items) -> list:
    with ThreadPoolExecutor(len(items)) as pool:
        return list(pool.map(function, items))


def test_http_answers_equal_the_streamed_ones(client, tracked):
    def ask(name: str):
        body = greedy_body(CONVERSATIONS[name])
        return client.chat.completions.create(model=MODEL, **body)

    for name, response in zip(HTTP_NAMES, concurrently(ask, HTTP_NAMES)):
        [choice] = response.choices
        assert choice.message.content == tracked[name]["text"], name
        assert [choice.finish_reason] == tracked[name]["finish_reason"]
        assert (
            response.usage.model_dump(include={"prompt_tokens", "completion_tokens", "total_tokens"})
            == (tracked[name]["usage"])
        )


def test_http_streams_equal_the_unstreamed_answers(client, tracked):
    def stream(name: str) -> dict:
        chunks = list(
            client.chat.completions.create(
                model=MODEL, stream=True, stream_options={"include_usage": True}, **greedy_body(CONVERSATIONS[name])
            )
        )
        text = "".join(choice.delta.content or "" for chunk in chunks for choice in chunk.choices)
        reasons = [choice.finish_reason for chunk in chunks for choice in chunk.choices if choice.finish_reason]
        return {"text": text, "finish_reason": reasons, "usage": chunks[-1].usage.model_dump()}

    for name, got in zip(HTTP_NAMES, concurrently(stream, HTTP_NAMES)):
        expected = {key: tracked[name][key] for key in ("text", "finish_reason")}
        assert {key: got[key] for key in ("text", "finish_reason")} == expected, name
        assert {key: got["usage"][key] for key in tracked[name]["usage"]} == tracked[name]["usage"]


def test_im_end_ends_the_turn_and_never_shows(client, tracked):
    """Shown special tokens or not, the turn's ``<|im_end|>`` is no content: vLLM leaves stop tokens out."""
    for skip in (True, False):
        response = client.chat.completions.create(
            model=MODEL, **greedy_body(CONVERSATIONS["capital"]), extra_body={"skip_special_tokens": skip}
        )
        [choice] = response.choices
        assert (choice.message.content, choice.finish_reason) == (CAPITAL_ANSWER, "stop")
        assert response.usage.completion_tokens == len(tracked["capital"]["token_ids"])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_stop_strings_end_the_answer_before_them(client, stream):
    request = dict(model=MODEL, **greedy_body(CONVERSATIONS["capital"]), stop=["Paris", "Madrid"])
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **request))
        text = "".join(choice.delta.content or "" for chunk in chunks for choice in chunk.choices)
        [reason] = [choice.finish_reason for chunk in chunks for choice in chunk.choices if choice.finish_reason]
    else:
        [choice] = client.chat.completions.create(**request).choices
        text, reason = choice.message.content, choice.finish_reason
    assert (text, reason) == ("The capital of France is ", "stop")


def test_a_json_schema_response_format_gives_valid_json(client):
    import jsonschema

    response = client.chat.completions.create(
        model=MODEL,
        **greedy_body(JSON_QUESTION, 48),
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY_SCHEMA}},
    )
    [choice] = response.choices
    answer = json.loads(choice.message.content)
    jsonschema.validate(answer, CITY_SCHEMA)
    assert answer["city"] == "Paris" and choice.finish_reason == "stop"


@pytest.mark.parametrize(
    "extra_body", [{"structured_outputs": {"choice": CITIES}}, {"guided_choice": CITIES}], ids=["choice", "guided"]
)
def test_a_choice_constraint_answers_one_of_the_choices(client, extra_body):
    response = client.chat.completions.create(model=MODEL, **greedy_body(JSON_QUESTION, 8), extra_body=extra_body)
    [choice] = response.choices
    assert (choice.message.content, choice.finish_reason) == ("Paris", "stop")


def test_temperature_0_is_greedy_and_deterministic(client, tracked):
    def ask(_) -> str:
        return (
            client.chat.completions.create(model=MODEL, **greedy_body(CONVERSATIONS["haiku"]))
            .choices[0]
            .message.content
        )

    answers = set(concurrently(ask, range(2)))
    assert answers == {tracked["haiku"]["text"]}


def test_omitted_temperature_and_top_p_come_from_the_generation_config(client):
    """generation_config.json says temperature 0.2, top_p 0.9: with one seed, a request that omits them
    samples what one giving them samples, and not what one giving OpenAI's defaults (1.0, 1.0) samples."""

    def sample(params: dict) -> str:
        response = client.chat.completions.create(
            model=MODEL, messages=CONVERSATIONS["haiku"], max_completion_tokens=16, seed=1234, **params
        )
        return response.choices[0].message.content

    omitted, explicit, openai_defaults = concurrently(
        sample, [{}, {"temperature": 0.2, "top_p": 0.9}, {"temperature": 1.0, "top_p": 1.0}]
    )
    assert omitted == explicit != openai_defaults


def test_embeddings_equal_transformers_hidden_states_pooled_by_last_token(smollm2_path, client):
    """The served model's ``/v1/embeddings`` (the same replica that chats): transformers' final hidden state of
    each input's last token, L2-normalized, float32; a batch equals its inputs one by one."""
    import torch
    from transformers import AutoModel

    texts = ["What is the capital of France?", "Le renard brun saute par-dessus le chien paresseux. 🦊"]
    batch = client.embeddings.create(model=MODEL, input=texts)
    model = AutoModel.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    tokenizer = hf_tokenizer(smollm2_path)
    for text, item in zip(texts, batch.data):
        with torch.no_grad():
            hidden = model(torch.tensor([tokenizer.encode(text)])).last_hidden_state[0]
        expected = torch.nn.functional.normalize(hidden[-1], dim=-1)
        vector = torch.tensor(item.embedding)
        assert vector.shape == (576,) and torch.nn.functional.cosine_similarity(vector, expected, dim=0) > 0.9999
        [alone] = client.embeddings.create(model=MODEL, input=text).data
        torch.testing.assert_close(torch.tensor(alone.embedding), vector, atol=1e-6, rtol=0)
    assert batch.usage.prompt_tokens == sum(len(tokenizer.encode(text)) for text in texts)
