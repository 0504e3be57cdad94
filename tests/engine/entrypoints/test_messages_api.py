"""Anthropic's Messages API (``POST /v1/messages``): the real ``anthropic`` client against the session's
in-process server. Greedy answers equal the chat completion of the same conversation, token for token;
streamed ones the non-streamed; bad input is a 400 in Anthropic's shape and the server keeps serving."""

from __future__ import annotations

import anthropic
import httpx
import jsonschema
import pytest

from engine.entrypoints.openai.api_server import LocalModelRouter, build_app
from engine.entrypoints.openai.server_options import ServerOptions
from tests.engine.entrypoints.conftest import MODEL, ServerThread

CONVERSATION = [
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": [{"type": "text", "text": "Blue."}]},
    {"role": "user", "content": [{"type": "text", "text": "Another"}, {"type": "text", "text": "one?"}]},
]
SYSTEM = [{"type": "text", "text": "You are terse."}, {"type": "text", "text": "Answer in one word."}]
GREEDY = {"temperature": 0.0}  # Anthropic's current SDK sends sampling fields only as extra_body
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"type": "integer", "maximum": 9}},
        "required": ["city", "days"],
        "additionalProperties": False,
    },
}


def anthropic_client(base_url: str, api_key: str = "unused") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base_url, api_key=api_key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(base_url) -> anthropic.Anthropic:
    return anthropic_client(base_url)


@pytest.fixture(scope="module")
def compact_claude(qwen3_base_url) -> anthropic.Anthropic:
    """The server whose JSON constraints allow no whitespace (the grammar, not luck, ends a forced tool call); its
    qwen3 parser finds no reasoning in an output that does not open with <think>."""
    with anthropic_client(qwen3_base_url) as client:
        yield client


def as_chat(system: list[dict], messages: list[dict]) -> list[dict]:
    """The OpenAI turns the Messages request maps to (system blocks and text blocks joined with newlines)."""
    turns = [{"role": "system", "content": "\n".join(block["text"] for block in system)}]
    for message in messages:
        content = message["content"]
        text = content if isinstance(content, str) else "\n".join(block["text"] for block in content)
        turns.append({"role": message["role"], "content": text})
    return turns


def test_an_answer_is_the_chat_completion_of_the_same_conversation(claude, client):
    message = claude.messages.create(model=MODEL, max_tokens=8, system=SYSTEM, messages=CONVERSATION, extra_body=GREEDY)
    chat = client.chat.completions.create(
        model=MODEL, max_tokens=8, messages=as_chat(SYSTEM, CONVERSATION), temperature=0.0
    )
    [block] = message.content
    assert (block.type, block.text) == ("text", chat.choices[0].message.content)
    assert (message.role, message.model, message.stop_reason, message.stop_sequence) == (
        "assistant",
        MODEL,
        "max_tokens",
        None,
    )
    assert message.id.startswith("msg_")
    assert (message.usage.input_tokens, message.usage.output_tokens) == (chat.usage.prompt_tokens, 8)


def test_a_stream_sends_anthropics_events_and_says_the_same(claude):
    request = dict(model=MODEL, max_tokens=10, messages=CONVERSATION, extra_body=GREEDY)
    whole = claude.messages.create(**request)
    with claude.messages.stream(**request) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [event.type for event in events if event.type not in ("text",)]
    assert kinds[0] == "message_start" and kinds[1] == "content_block_start"
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    text = "".join(event.delta.text for event in events if event.type == "content_block_delta")
    assert text == whole.content[0].text == final.content[0].text
    assert (final.stop_reason, final.usage.output_tokens) == ("max_tokens", 10)


def test_a_stop_sequence_ends_the_answer_and_is_named(claude):
    request = dict(model=MODEL, max_tokens=16, messages=CONVERSATION, extra_body=GREEDY)
    text = claude.messages.create(**request).content[0].text
    stop = text[6:9]
    assert len(stop) == 3 and text.index(stop) == 6, text
    for message in (
        claude.messages.create(**request, stop_sequences=[stop]),
        claude.messages.stream(**request, stop_sequences=[stop]).__enter__().get_final_message(),
    ):
        assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", stop)
        assert message.content[0].text == text[:6]


def test_a_forced_tool_is_a_tool_use_block_and_its_result_goes_back(compact_claude):
    claude = compact_claude
    request = dict(
        model=MODEL,
        max_tokens=60,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        extra_body=GREEDY,
    )
    message = claude.messages.create(**request)
    [call] = message.content
    assert (call.type, call.name, message.stop_reason) == ("tool_use", "get_weather", "tool_use")
    jsonschema.validate(call.input, WEATHER["input_schema"])
    with claude.messages.stream(**request) as stream:
        streamed = stream.get_final_message()
    assert (streamed.content[0].name, streamed.content[0].input) == ("get_weather", call.input)
    follow_up = claude.messages.create(
        model=MODEL,
        max_tokens=4,
        tools=[WEATHER],
        messages=[
            *request["messages"],
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": call.id, "name": call.name, "input": call.input}],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 21 C"}]},
        ],
    )
    assert follow_up.stop_reason in ("max_tokens", "end_turn", "tool_use")


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"messages": [{"role": "user", "content": "hi"}]}, "max_tokens: Field required"),
        (
            {"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "content blocks of type 'image' are not supported",
        ),
        ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "service_tier": "auto"}, "service_tier"),
        ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "temperature": 1.5}, "temperature"),
        (
            {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "tool_choice": {"type": "any"}},
            "needs tools",
        ),
        ({"max_tokens": 5000, "messages": [{"role": "user", "content": "hi"}]}, "maximum context length"),
    ],
)
def test_bad_input_is_a_400_in_anthropics_shape_and_the_server_keeps_serving(base_url, claude, body, message):
    response = httpx.post(f"{base_url}/v1/messages", json={"model": MODEL, **body}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert message in error["error"]["message"]
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(model=MODEL, max_tokens=4, messages=[], extra_body=GREEDY)
    assert claude.messages.create(model=MODEL, max_tokens=2, messages=CONVERSATION).usage.output_tokens == 2


def test_x_api_key_is_a_serval_api_key(serving):
    app = build_app(LocalModelRouter({MODEL: serving}), ServerOptions(api_keys=["sk-right"]))
    with ServerThread(app) as server, anthropic_client(server.base_url, "sk-right") as right:
        assert right.messages.create(model=MODEL, max_tokens=2, messages=CONVERSATION).usage.output_tokens == 2
        with (
            anthropic_client(server.base_url, "sk-wrong") as wrong,
            pytest.raises(anthropic.AuthenticationError) as caught,
        ):
            wrong.messages.create(model=MODEL, max_tokens=2, messages=CONVERSATION)
        assert caught.value.body["error"]["type"] == "authentication_error"
        bearer = httpx.get(f"{server.base_url}/v1/models", headers={"x-api-key": "sk-right"})
        assert bearer.status_code == 200  # x-api-key opens the OpenAI routes as well
