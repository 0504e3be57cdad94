"""Tool calling through ``/v1/chat/completions``: the official client against the session's real AsyncLLM
(tiny random-weight Qwen2, the project's ChatML template with tools) and real xgrammar.

Named and required ``tool_choice`` are enforced by JSON-schema constraints (``disable_any_whitespace`` per
request, so compact arguments end the output); ``auto`` parses Hermes ``<tool_call>`` blocks, which a regex
constraint makes this random model emit. Streamed ``delta.tool_calls`` reassemble into exactly the
non-streamed calls for the same seed. The template renders tools, assistant tool calls and tool results,
and every bad tool request is a 400 that leaves the server serving.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.engine.entrypoints.conftest import MODEL

pytestmark = pytest.mark.usefixtures("engine_left_idle")

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 3},
        "metric": {"type": "boolean"},
    },
    "required": ["city", "days", "metric"],
    "additionalProperties": False,
}
NOTE_PARAMETERS = {
    "type": "object",
    "properties": {"text": {"type": "string", "maxLength": 5}},
    "required": ["text"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather.", "parameters": WEATHER_PARAMETERS},
    },
    {"type": "function", "function": {"name": "take_note", "parameters": NOTE_PARAMETERS}},
]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
# auto: a regex makes the random model write a Hermes block (the parser, not the constraint, is under test).
HERMES_REGEX = (
    r'Sure\. <tool_call>\{"name": "get_weather", "arguments": '
    r'\{"city": "(Paris|Rome)", "days": [1-3], "metric": (true|false)\}\}</tool_call>'
)

# The same through xgrammar's structural tag (vLLM's response_format type): the tag around a call's JSON.
# ``max_whitespace_cnt`` 1 bounds that JSON (the engine's disable_any_whitespace is for JSON constraints only).
HERMES_TAG = {
    "type": "structural_tag",
    "format": {
        "type": "tag",
        "begin": "<tool_call>",
        "content": {
            "type": "json_schema",
            "json_schema": {
                "type": "object",
                "properties": {"name": {"const": "get_weather"}, "arguments": WEATHER_PARAMETERS},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            },
            "max_whitespace_cnt": 1,
        },
        "end": "</tool_call>",
    },
}


def create(client, stream=False, messages=MESSAGES, **kwargs):
    kwargs = {"tools": TOOLS, "max_completion_tokens": 300, "temperature": 1.0, "seed": 7, **kwargs}
    return client.chat.completions.create(model=MODEL, messages=messages, stream=stream, **kwargs)


def calls_of(message) -> list[tuple[str, str]]:
    return [(call.function.name, call.function.arguments) for call in message.tool_calls or []]


def streamed_message(chunks) -> tuple[str | None, list[tuple[str, str]], str | None]:
    """Content, calls and finish reason of a stream, checking each tool-call delta's shape on the way."""
    content, calls, finish_reason = "", [], None
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for piece in delta.tool_calls or []:
                if piece.id is not None:  # a call's first delta: id, type, name and empty arguments
                    assert piece.id.startswith("call_") and piece.type == "function"
                    assert (piece.index, piece.function.arguments) == (len(calls), "")
                    calls.append([piece.function.name, ""])
                else:
                    assert piece.function.name is None and piece.type is None
                calls[piece.index][1] += piece.function.arguments or ""
            finish_reason = choice.finish_reason or finish_reason
    return content or None, [tuple(call) for call in calls], finish_reason


def assert_calls_valid(calls):
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])
        assert json.dumps(json.loads(arguments), separators=(",", ":")) == arguments  # compact


def test_named_tool_choice_calls_that_tool_with_valid_arguments(client):
    response = create(client, tool_choice=NAMED, extra_body=COMPACT)
    [choice] = response.choices
    assert choice.message.content is None and choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "get_weather"
    assert_calls_valid(calls_of(choice.message))


def test_required_tool_choice_makes_one_call_to_one_of_the_tools(client):
    for seed in range(3):
        response = create(client, tool_choice="required", parallel_tool_calls=False, seed=seed, extra_body=COMPACT)
        [choice] = response.choices
        assert choice.message.content is None and choice.finish_reason == "tool_calls"
        calls = calls_of(choice.message)
        assert len(calls) == 1
        assert_calls_valid(calls)


def test_auto_parses_hermes_blocks_and_keeps_the_text_before_them(client):
    response = create(client, tool_choice="auto", extra_body={"structured_outputs": {"regex": HERMES_REGEX}})
    [choice] = response.choices
    assert choice.message.content == "Sure." and choice.finish_reason == "tool_calls"
    [(name, arguments)] = calls_of(choice.message)
    assert name == "get_weather"
    jsonschema.validate(json.loads(arguments), WEATHER_PARAMETERS)


@pytest.mark.parametrize(
    "extra_body",
    [{"response_format": HERMES_TAG}, {"structured_outputs": {"structural_tag": HERMES_TAG}}],
    ids=["response_format", "structured_outputs"],
)
def test_auto_parses_a_block_a_structural_tag_forces(client, extra_body):
    response = create(client, extra_body=extra_body)
    [choice] = response.choices
    assert choice.message.content is None and choice.finish_reason == "tool_calls"
    [(name, arguments)] = calls_of(choice.message)
    assert name == "get_weather"
    jsonschema.validate(json.loads(arguments), WEATHER_PARAMETERS)


def test_auto_leaves_a_malformed_block_and_plain_text_as_content(client):
    malformed = create(client, extra_body={"structured_outputs": {"regex": r"<tool_call>\{bad\}</tool_call>"}})
    assert malformed.choices[0].message.content == "<tool_call>{bad}</tool_call>"
    assert not malformed.choices[0].message.tool_calls
    assert malformed.choices[0].finish_reason == "stop"
    none = create(client, tool_choice="none", extra_body={"structured_outputs": {"regex": HERMES_REGEX}})
    assert none.choices[0].message.content.startswith("Sure. <tool_call>") and not none.choices[0].message.tool_calls


@pytest.mark.parametrize(
    "kwargs",
    [
        {"tool_choice": NAMED, "extra_body": COMPACT},
        {"tool_choice": "required", "parallel_tool_calls": False, "extra_body": COMPACT},
        {"tool_choice": "auto", "extra_body": {"structured_outputs": {"regex": HERMES_REGEX}}},
    ],
    ids=["named", "required", "auto"],
)
def test_streamed_deltas_reassemble_into_the_non_streamed_calls(client, kwargs):
    whole = create(client, n=2, **kwargs)
    for index in range(2):
        stream = create(client, stream=True, n=2, **kwargs)
        content, calls, finish_reason = streamed_message(
            chunk.model_copy(update={"choices": [c for c in chunk.choices if c.index == index]}) for chunk in stream
        )
        message = whole.choices[index].message
        assert (content, calls, finish_reason) == (message.content, calls_of(message), "tool_calls")


def test_the_openai_clients_stream_helper_assembles_the_same_call(client):
    whole = create(client, tool_choice=NAMED, extra_body=COMPACT)
    strict_tools = [{**tool, "function": {**tool["function"], "strict": True}} for tool in TOOLS]
    kwargs = {"max_completion_tokens": 300, "temperature": 1.0, "seed": 7, "extra_body": COMPACT}
    with client.chat.completions.stream(
        model=MODEL, messages=MESSAGES, tools=strict_tools, tool_choice=NAMED, **kwargs
    ) as stream:
        final = stream.get_final_completion()
    [call] = final.choices[0].message.tool_calls
    assert calls_of(final.choices[0].message) == calls_of(whole.choices[0].message)
    assert call.function.parsed_arguments == json.loads(call.function.arguments)


def tool_call_turn(arguments) -> dict:
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    return {"role": "assistant", "content": None, "tool_calls": [call]}


def test_tools_tool_calls_and_tool_results_reach_the_template(base_url, client, tokenizer):
    result = {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}
    conversation = [*MESSAGES, tool_call_turn('{"city": "Paris"}'), result]
    # What the template gets: the arguments as an object (as Hugging Face templates expect), content "".
    template_turn = {**tool_call_turn({"city": "Paris"}), "content": ""}
    expected = tokenizer.apply_chat_template(
        [*MESSAGES, template_turn, result], tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert "<tools>" in expected and '{"name": "get_weather", "arguments": {"city": "Paris"}}' in expected
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in expected
    tokenized = httpx.post(f"{base_url}/tokenize", json={"model": MODEL, "messages": conversation, "tools": TOOLS})
    assert tokenized.status_code == 200
    assert tokenized.json()["tokens"] == tokenizer.encode(expected, add_special_tokens=False)
    response = create(client, messages=conversation, tool_choice="none", max_completion_tokens=2)
    assert response.usage.prompt_tokens == tokenized.json()["count"]


BAD = [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in tools"),
    ({"tools": None, "tool_choice": "required"}, "needs tools"),
    ({"tools": None, "tool_choice": NAMED}, "needs tools"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "name"),
    (
        {
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "frob"}}}],
            "tool_choice": {"type": "function", "function": {"name": "f"}},
        },
        "frob",
    ),
    (
        {"tool_choice": "required", "response_format": {"type": "json_object"}},
        "response_format (json_object), tool_choice",
    ),
    ({"messages": [{"role": "tool", "content": "orphan"}]}, "tool_call_id"),
]


@pytest.mark.parametrize("kwargs, message", BAD)
def test_bad_tool_requests_are_400_and_the_server_keeps_serving(client, kwargs, message):
    with pytest.raises(openai.BadRequestError) as info:
        create(client, **kwargs)
    assert info.value.status_code == 400 and message in info.value.message, info.value.message
    response = create(client, tool_choice=NAMED, extra_body=COMPACT)
    assert_calls_valid(calls_of(response.choices[0].message))
