"""The Responses API (``POST /v1/responses`` and the stored responses' routes) through the official client's
``client.responses.create`` / ``client.responses.stream`` against the session's real AsyncLLM (tiny
random-weight Qwen2, the project's ChatML template) and real xgrammar.

A response is the chat completion its request amounts to: the same greedy text and the same prompt tokens
as ``/v1/chat/completions`` given the equivalent messages. A stream is OpenAI's event sequence, numbered,
and reassembles into exactly the response that is not streamed. ``previous_response_id`` continues a stored
conversation exactly as sending the whole conversation again would. With a reasoning parser, the reasoning is
a ``reasoning`` item before the message. Every bad request is a 4xx in OpenAI's shape that leaves the server
serving.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import openai
import pytest

from engine.entrypoints.openai.response_items import MessageItem, OutputText
from engine.entrypoints.openai.response_object import ResponsesResponse
from engine.entrypoints.openai.response_store import MIB, InMemoryResponseStore, ResponseStoreOptions, StoredResponse
from tests.engine.entrypoints.conftest import MODEL, make_client

pytestmark = pytest.mark.usefixtures("engine_left_idle")

GREEDY = {"model": MODEL, "temperature": 0.0}
LONG = {"ignore_eos": True}  # the random model would stop anywhere: every token up to the limit
INSTRUCTIONS = "Answer in one word."
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "maxLength": 6}},
    "required": ["answer"],
    "additionalProperties": False,
}
JSON_FORMAT = {"format": {"type": "json_schema", "name": "answer", "schema": ANSWER_SCHEMA}}
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1, "maximum": 3}},
        "required": ["city", "days"],
        "additionalProperties": False,
    },
}


def chat_equivalent(client, messages, max_tokens):
    return client.chat.completions.create(
        messages=messages, max_completion_tokens=max_tokens, extra_body=LONG, **GREEDY
    )


def test_create_is_the_chat_completion_of_its_messages(client):
    response = client.responses.create(
        input="What colour is the sky?", instructions=INSTRUCTIONS, max_output_tokens=12, extra_body=LONG, **GREEDY
    )
    chat = chat_equivalent(
        client,
        [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": "What colour is the sky?"}],
        12,
    )
    assert response.output_text == chat.choices[0].message.content
    assert response.id.startswith("resp_") and response.object == "response" and response.model == MODEL
    [message] = response.output
    assert (message.type, message.role, message.status) == ("message", "assistant", "incomplete")
    assert message.id.startswith("msg_") and message.content[0].type == "output_text"
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    usage = response.usage
    assert (usage.input_tokens, usage.output_tokens) == (chat.usage.prompt_tokens, 12)
    assert usage.total_tokens == usage.input_tokens + 12 and usage.output_tokens_details.reasoning_tokens == 0
    assert (response.instructions, response.max_output_tokens, response.temperature) == (INSTRUCTIONS, 12, 0.0)
    assert client.responses.retrieve(response.id) == response  # stored by default


def test_the_stream_is_openais_event_sequence_and_equals_the_whole_response(client, base_url):
    kwargs = dict(input="Say hello.", text=JSON_FORMAT, max_output_tokens=60, extra_body=COMPACT, **GREEDY)
    whole = client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [event.type for event in events]
    num_deltas = types.count("response.output_text.delta")
    assert num_deltas >= 2 and types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * num_deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert final.status == "completed" and whole.status == "completed" and final.completed_at is not None
    assert final.output_text == whole.output_text
    jsonschema.validate(json.loads(final.output_text), ANSWER_SCHEMA)
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert text == final.output_text == events[-4].text
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert {event.response.id for event in events if hasattr(event, "response")} == {final.id}
    cached = {"input_tokens_details": final.usage.input_tokens_details}  # the second run hits the prefix cache
    assert final.usage == whole.usage.model_copy(update=cached)
    stored = client.responses.retrieve(final.id)
    assert (stored.output_text, stored.usage, stored.output[0].id) == (
        final.output_text,
        final.usage,
        events[2].item.id,
    )
    # OpenAI's framing: each event named on its own line, no [DONE] at the end.
    body = {"input": "Say hello.", "text": JSON_FORMAT, "max_output_tokens": 60, "stream": True, **COMPACT, **GREEDY}
    with httpx.stream("POST", f"{base_url}/v1/responses", json=body, timeout=60) as raw:
        assert raw.status_code == 200 and raw.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in raw.iter_lines() if line]
    assert lines[0] == "event: response.created" and lines[-2] == "event: response.completed"
    assert lines[-1].startswith("data: {") and "[DONE]" not in lines[-1]


def test_previous_response_id_continues_the_stored_conversation(client):
    first = client.responses.create(
        input="Hi!", instructions=INSTRUCTIONS, max_output_tokens=6, extra_body=LONG, **GREEDY
    )
    second = client.responses.create(
        input="And then?", previous_response_id=first.id, max_output_tokens=8, extra_body=LONG, **GREEDY
    )
    # The same conversation sent whole (instructions are not carried over, as OpenAI's API has it).
    output = [item.model_dump(exclude_none=True) for item in first.output]
    resent = client.responses.create(
        input=[{"role": "user", "content": "Hi!"}, *output, {"role": "user", "content": "And then?"}],
        store=False,
        max_output_tokens=8,
        extra_body=LONG,
        **GREEDY,
    )
    assert second.output_text == resent.output_text
    assert second.usage.input_tokens == resent.usage.input_tokens
    assert resent.usage.input_tokens_details.cached_tokens > 0  # the same prompt again: its blocks were cached
    assert second.previous_response_id == first.id and second.instructions is None
    third = client.responses.create(
        input="Why?", previous_response_id=second.id, max_output_tokens=4, extra_body=LONG, **GREEDY
    )
    assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens
    with pytest.raises(openai.NotFoundError):  # store: false is not kept
        client.responses.retrieve(resent.id)
    with pytest.raises(openai.NotFoundError, match="not found"):
        client.responses.create(input="x", previous_response_id=resent.id, **GREEDY)


def test_named_tool_choice_makes_one_function_call_and_its_output_continues(client):
    kwargs = dict(
        input="Weather in Paris?", tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"}, **GREEDY
    )
    response = client.responses.create(**kwargs, extra_body=COMPACT)
    [call] = response.output
    assert (call.type, call.name, call.status) == ("function_call", "get_weather", "completed")
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    with client.responses.stream(**kwargs, extra_body=COMPACT) as stream:
        events = list(stream)
        streamed = stream.get_final_response()
    deltas = [event.delta for event in events if event.type == "response.function_call_arguments.delta"]
    [done] = [event for event in events if event.type == "response.function_call_arguments.done"]
    assert "".join(deltas) == done.arguments == streamed.output[0].arguments == call.arguments
    answered = client.responses.create(  # tools are not carried over (OpenAI's API): sent again
        previous_response_id=response.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny."}],
        tools=[WEATHER],
        tool_choice="none",
        max_output_tokens=4,
        **GREEDY,
    )
    assert answered.output[0].type == "message"
    assert answered.usage.input_tokens > response.usage.input_tokens + response.usage.output_tokens


def test_auto_tool_choice_parses_text_and_a_hermes_call_into_items(client):
    regex = r'Sure\. <tool_call>\{"name": "get_weather", "arguments": '
    regex += r'\{"city": "(Paris|Rome)", "days": [1-3]\}\}</tool_call>'
    kwargs = dict(input="Weather?", tools=[WEATHER], extra_body={"structured_outputs": {"regex": regex}}, **GREEDY)
    response = client.responses.create(**kwargs)
    assert [item.type for item in response.output] == ["message", "function_call"]
    assert response.output[0].content[0].text == "Sure."
    assert json.loads(response.output[1].arguments)["city"] in ("Paris", "Rome")
    with client.responses.stream(**kwargs) as stream:
        streamed = stream.get_final_response()
    assert [item.type for item in streamed.output] == ["message", "function_call"]
    assert streamed.output[0].content[0].text == "Sure."
    assert (streamed.output[1].name, streamed.output[1].arguments) == (
        response.output[1].name,
        response.output[1].arguments,
    )


def test_delete_drops_a_stored_response_and_cancel_refuses_a_synchronous_one(client):
    response = client.responses.create(input="Hi", max_output_tokens=2, **GREEDY)
    with pytest.raises(openai.BadRequestError, match="Cannot cancel a synchronous response"):
        client.responses.cancel(response.id)
    client.responses.delete(response.id)
    for call in (client.responses.retrieve, client.responses.delete, client.responses.cancel):
        with pytest.raises(openai.NotFoundError, match=f"Response with id '{response.id}' not found"):
            call(response.id)


@pytest.mark.parametrize(
    "body, param, message",
    [
        ({"input": "x", "background": True}, None, "background=True is not supported"),
        ({"input": "x", "frobnicate": 1}, None, "frobnicate: not a field of the Responses API"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input", "input_image"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input", "'item_reference' are not supported"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools", "only function tools"),
        ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, None, "'nope'"),
        ({"input": "x", "tool_choice": "required"}, None, "needs tools"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "schema": {}}}}, "text", "needs a name"),
        ({"input": "x", "reasoning": {"summary": "auto"}}, "reasoning", "no summary is made"),
        ({"input": "x", "include": ["reasoning.encrypted_content"]}, None, "include"),
        ({"input": "x", "truncation": "auto"}, None, "never truncated"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", "greater than or equal to 1"),
        ({"input": "x", "max_output_tokens": 4000}, None, "maximum context length"),
        ({"input": []}, None, "input must not be empty"),
        ({"input": "x", "previous_response_id": "resp_nope"}, "previous_response_id", "not found"),
        ({"input": "x", "model": "nope"}, "model", "does not exist"),
    ],
)
def test_bad_requests_are_4xx_in_openais_shape_and_the_server_keeps_serving(base_url, body, param, message):
    response = httpx.post(f"{base_url}/v1/responses", json=body, timeout=60)
    assert 400 <= response.status_code < 500, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == response.status_code
    assert message in error["message"] and (param is None or error["param"] == param), error
    served = httpx.post(f"{base_url}/v1/responses", json={"input": "Hi", "max_output_tokens": 2}, timeout=60)
    assert served.status_code == 200 and served.json()["usage"]["output_tokens"] <= 2


@pytest.mark.parametrize(
    "method, path",
    [("GET", "/v1/responses/resp_nope"), ("DELETE", "/v1/responses/resp_nope"), ("GET", "/v1/responses/x?stream=1")],
)
def test_the_stored_responses_routes_refuse_unknown_ids_and_query_parameters(base_url, method, path):
    response = httpx.request(method, f"{base_url}{path}", timeout=60)
    assert response.status_code == (400 if "?" in path else 404), response.text
    assert response.json()["error"]["code"] == response.status_code


# --------------------------------------------------------------------------------------------------- reasoning


@pytest.fixture
def qwen3(qwen3_base_url):
    """The session's qwen3-parser server (a regex forces the whole output, the reasoning included)."""
    with make_client(qwen3_base_url) as client:
        yield client


FORCED = {"structured_outputs": {"regex": "<think>a b c</think>answer"}}


def test_reasoning_is_a_reasoning_item_before_the_message_streamed_and_not(qwen3):
    response = qwen3.responses.create(input="Think first.", extra_body=FORCED, **GREEDY)
    reasoning, message = response.output
    assert (reasoning.type, reasoning.content[0].type, reasoning.content[0].text) == (
        "reasoning",
        "reasoning_text",
        "a b c",
    )
    assert reasoning.id.startswith("rs_") and reasoning.summary == [] and reasoning.status == "completed"
    assert (message.type, response.output_text, response.status) == ("message", "answer", "completed")
    chat = qwen3.chat.completions.create(
        messages=[{"role": "user", "content": "Think first."}], extra_body=FORCED, **GREEDY
    )
    assert chat.choices[0].message.reasoning_content == "a b c"
    reasoning_tokens = chat.usage.completion_tokens_details.reasoning_tokens
    assert 0 < response.usage.output_tokens_details.reasoning_tokens == reasoning_tokens < response.usage.output_tokens

    with qwen3.responses.stream(input="Think first.", extra_body=FORCED, **GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [event.type for event in events]
    item_types = [(event.type, event.item.type) for event in events if event.type.startswith("response.output_item")]
    assert item_types == [
        ("response.output_item.added", "reasoning"),
        ("response.output_item.done", "reasoning"),
        ("response.output_item.added", "message"),
        ("response.output_item.done", "message"),
    ]
    thought = "".join(event.delta for event in events if event.type == "response.reasoning_text.delta")
    assert thought == "a b c" == next(e.text for e in events if e.type == "response.reasoning_text.done")
    assert types.index("response.reasoning_text.done") < types.index("response.output_text.delta")
    assert final.output_text == "answer"
    cached = {"input_tokens_details": final.usage.input_tokens_details}  # the second run hits the prefix cache
    assert final.usage == response.usage.model_copy(update=cached)


# ------------------------------------------------------------------------------------------------------- store


def stored(number: int, text: str = "x") -> StoredResponse:
    message = MessageItem(id=f"msg_{number}", role="assistant", content=[OutputText(text=text)], status="completed")
    return StoredResponse(
        response=ResponsesResponse(id=f"resp_{number}", status="completed", model=MODEL), conversation=[message]
    )


def test_the_in_memory_store_keeps_its_bounds_and_ttl():
    now = [0.0]
    store = InMemoryResponseStore(ResponseStoreOptions(max_responses=3, ttl_s=10.0), clock=lambda: now[0])
    for number in range(4):
        asyncio.run(store.put(stored(number)))
        now[0] += 1.0
    assert asyncio.run(store.get("resp_0")) is None and len(store) == 3  # the oldest dropped
    assert asyncio.run(store.get("resp_3")).conversation[0].content[0].text == "x"
    now[0] = 11.5  # resp_1 was stored at 1.0: expired; resp_2 (2.0) and resp_3 (3.0) are not
    assert [asyncio.run(store.get(f"resp_{n}")) is not None for n in (1, 2, 3)] == [False, True, True]
    assert asyncio.run(store.delete("resp_2")) and not asyncio.run(store.delete("resp_2"))
    one_size = store.num_bytes
    store.configure(ResponseStoreOptions(max_bytes=MIB, ttl_s=10.0))
    asyncio.run(store.put(stored(9, "y" * (MIB - one_size))))  # together over max_bytes: the older one goes
    assert asyncio.run(store.get("resp_3")) is None and len(store) == 1 and store.num_bytes <= MIB
    asyncio.run(store.put(stored(10, "z" * MIB)))  # alone over max_bytes: not kept
    assert asyncio.run(store.get("resp_10")) is None and len(store) == 1
