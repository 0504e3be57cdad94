"""A stream cut after any of its items and continued by a serving from what the ingress kept
(``deployments.migration.StreamState`` -> ``Continuation``) sends what the uninterrupted stream sent: the
same text (held-back text for stop strings included, a stop string spanning the cut honoured), the same
token ids, id and exact usage. In process, on the session's engine; the Ray path is tests/serve/test_migration.py."""

from __future__ import annotations

import asyncio
import json

import pytest

from deployments.migration import StreamState
from engine.entrypoints.openai.call_options import CallOptions
from engine.entrypoints.openai.continuation import can_continue
from engine.entrypoints.openai.endpoints import Endpoint
from engine.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from engine.entrypoints.openai.serving_chat import ChatServing
from engine.entrypoints.openai.serving_completion import CompletionServing
from engine.entrypoints.openai.streaming import SSEChunk
from tests.conftest import wait_until_idle
from tests.engine.entrypoints.conftest import MODEL

USAGE = {"include_usage": True}


async def _collect(iterator) -> list:
    return [item async for item in iterator]


def run_tracked(endpoint, request, continuation=None) -> list[SSEChunk]:
    """The stream's items as ``LLMServer.call`` yields them for a tracked call (``CallOptions.track``)."""
    options = CallOptions(continuation=continuation, track=True)

    async def run() -> list[SSEChunk]:
        return [item async for item in endpoint(request, options)]

    items = asyncio.run(run())
    assert all(isinstance(item, SSEChunk) and item.delta is not None for item in items), items
    return items


def events(items: list[str]) -> list:
    parsed = []
    for item in items:
        for line in item.split("\n"):
            if line.startswith("data: "):
                parsed.append("[DONE]" if line == "data: [DONE]" else json.loads(line[len("data: ") :]))
    return parsed


def summary(items: list[str], chat: bool) -> dict:
    """The text, finish reason, ids and usage a client assembles from the SSE items."""
    parsed = events(items)
    assert parsed[-1] == "[DONE]" and not any("error" in e for e in parsed[:-1]), parsed
    text, tokens, finish, usage = "", [], None, None
    for event in parsed[:-1]:
        for choice in event["choices"]:
            text += (choice["delta"].get("content") or "") if chat else choice["text"]
            logprobs = choice.get("logprobs") or {}
            tokens += (
                [entry["token"] for entry in logprobs.get("content") or []] if chat else logprobs.get("tokens", [])
            )
            finish = choice["finish_reason"] or finish
        usage = event.get("usage") or usage
    ids = {e["id"] for e in parsed[:-1]}
    return {"text": text, "tokens": tokens, "finish": finish, "usage": usage, "ids": ids}


def cut_and_continue(endpoint, request, full: list[SSEChunk], cut: int) -> tuple[list[str], list[int]]:
    """The client's items when the stream dies after ``full[:cut]`` and a serving continues it."""
    state = StreamState(is_tracked=True)
    sent = []
    for item in full[:cut]:
        state.advance(item)
        sent.append(item.text)
    for item in run_tracked(endpoint, request, state.continuation()):
        state.advance(item)
        sent.append(item.text)
    return sent, state.token_ids


@pytest.fixture
def servings(engine):
    yield ChatServing(engine, MODEL), CompletionServing(engine, MODEL)
    wait_until_idle(engine)


def check_every_cut(endpoint, request, chat: bool) -> dict:
    full = run_tracked(endpoint, request)
    expected = summary([item.text for item in full], chat)
    expected_ids = [token for item in full for token in item.delta.token_ids]
    assert expected["usage"]["completion_tokens"] == len(expected_ids) == len(expected["tokens"])
    for cut in range(1, len(full)):
        sent, token_ids = cut_and_continue(endpoint, request, full, cut)
        assert summary(sent, chat) == expected, cut
        assert token_ids == expected_ids, cut
    return expected


def test_a_completion_stream_continues_from_any_item(servings):
    _, completion = servings
    request = CompletionRequest(
        model=MODEL,
        prompt="The colours are",
        max_tokens=12,
        temperature=0,
        ignore_eos=True,
        stream=True,
        stream_options=USAGE,
        logprobs=1,
    )
    expected = check_every_cut(completion.completions, request, chat=False)
    assert expected["finish"] == "length" and expected["usage"]["completion_tokens"] == 12


def test_a_chat_stream_with_stop_strings_continues_with_its_held_back_text(servings):
    chat, _ = servings
    base = {"model": MODEL, "messages": [{"role": "user", "content": "Count."}], "temperature": 0, "stream": True}
    base |= {"max_tokens": 16, "ignore_eos": True, "stream_options": USAGE, "logprobs": True}
    plain = summary([i.text for i in run_tracked(chat.chat, ChatCompletionRequest(**base))], chat=True)["text"]
    assert len(plain) > 12, plain
    # A stop string never met: the last 5 characters are held back at every cut.
    check_every_cut(chat.chat, ChatCompletionRequest(**base, stop=["\x00never"]), chat=True)
    # One met mid-way: at some cuts it starts in the held-back text and ends in the continued one.
    stopped = check_every_cut(chat.chat, ChatCompletionRequest(**base, stop=[plain[8:12]]), chat=True)
    assert stopped["finish"] == "stop" and stopped["text"] == plain[: plain.index(plain[8:12])]


def test_which_requests_can_continue():
    stream = {"model": MODEL, "stream": True}
    assert can_continue(Endpoint.COMPLETIONS, CompletionRequest(prompt="a", **stream))
    assert not can_continue(Endpoint.COMPLETIONS, CompletionRequest(prompt=["a", "b"], **stream))
    assert not can_continue(Endpoint.COMPLETIONS, CompletionRequest(prompt="a", n=2, **stream))
    assert not can_continue(Endpoint.COMPLETIONS, CompletionRequest(prompt="a", model=MODEL))  # not streamed
    chat = {"messages": [{"role": "user", "content": "x"}], **stream}
    assert can_continue(Endpoint.CHAT, ChatCompletionRequest(**chat))
    assert not can_continue(Endpoint.CHAT, ChatCompletionRequest(**chat, response_format={"type": "json_object"}))
    assert not can_continue(Endpoint.TOKENIZE, CompletionRequest(prompt="a", **stream))
