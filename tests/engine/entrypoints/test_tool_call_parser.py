"""Tool-call parsing and the request -> constraint conversion, without an engine.

The parsers (``tool_parsers``) are fed text in pieces of every size: the deltas must reassemble into
exactly what the whole text parses to (what a non-streamed response carries). The request models turn
``response_format`` / ``structured_outputs`` / ``guided_*`` / ``tools`` into one ``StructuredOutputsParams``
or a ValueError naming what is wrong.
"""

from __future__ import annotations

import json
import random

import pytest
from pydantic import ValidationError

from engine.entrypoints.openai.choice_parser import ChoiceParser
from engine.entrypoints.openai.json_scan import JsonCompactor
from engine.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from engine.entrypoints.openai.tool_calls import required_tools_schema
from engine.entrypoints.openai.tool_parsers import (
    HermesToolParser,
    NamedToolParser,
    ParsedDelta,
    RequiredToolParser,
)
from engine.sampling_params import StructuredOutputsParams

USER = [{"role": "user", "content": "hi"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}


def streamed(make_parser, text: str, seed: int) -> tuple[str, list[tuple[str, str]], list]:
    """Feeds ``text`` in random pieces; returns the content, the reassembled calls and the raw deltas."""
    rng, parser, delta, position = random.Random(seed), make_parser(), ParsedDelta(), 0
    while position < len(text):
        size = rng.randint(0, 5)
        delta.extend(parser.feed(text[position : position + size]))
        position += size
    delta.extend(parser.finish())
    calls: list[list[str]] = []
    for piece in delta.tool_calls:
        if piece.id is not None:
            assert piece.id.startswith("call_") and piece.type == "function" and piece.function.arguments == ""
            assert piece.index == len(calls)
            calls.append([piece.function.name, ""])
        else:
            assert piece.function.name is None
        calls[piece.index][1] += piece.function.arguments or ""
    return delta.content, [tuple(call) for call in calls], delta.tool_calls


CASES = [
    # (parser, text, content, calls)
    (lambda: NamedToolParser("f"), '{"a": "x y", "b": [1, 2]}', None, [("f", '{"a":"x y","b":[1,2]}')]),
    (lambda: NamedToolParser("f"), '{"a": "x\\" }', None, [("f", '{"a":"x\\" }')]),  # cut short: what there is
    (lambda: NamedToolParser("f"), "", None, [("f", "")]),
    (
        RequiredToolParser,
        '[{"name": "f", "parameters": {"q": "}\\"]"}}, {"name":"g","parameters":{"n":[1, {"m": null}]}}]',
        None,
        [("f", '{"q":"}\\"]"}'), ("g", '{"n":[1,{"m":null}]}')],
    ),
    (RequiredToolParser, '[{"parameters": {"c": 1}, "name": "f"}]', None, [("f", '{"c":1}')]),
    (RequiredToolParser, '[{"name": "f", "parameters": 12}]', None, [("f", "12")]),
    (RequiredToolParser, '[{"name":"f","parameters":{"c":1', None, [("f", '{"c":1')]),
    (RequiredToolParser, '[{"na', '[{"na', []),
    (
        HermesToolParser,
        'Sure.\n<tool_call>\n{"name": "f", "arguments": {"c": "é"}}\n</tool_call>\n'
        '<tool_call>{"name": "g", "arguments": {}}</tool_call>\nbye <tool_c',
        "Sure.\nbye <tool_c",
        [("f", '{"c":"é"}'), ("g", "{}")],
    ),
    (HermesToolParser, "hi <tool_call>{bad}</tool_call> x", "hi <tool_call>{bad}</tool_call> x", []),
    (HermesToolParser, 'a <tool_call>{"arguments": {}}</tool_call>', 'a <tool_call>{"arguments": {}}</tool_call>', []),
    (HermesToolParser, "plain text < with a tag-like <tool end  ", "plain text < with a tag-like <tool end  ", []),
    (HermesToolParser, '<tool_call>{"name": "f", "arguments": {"a": 1}}', None, [("f", '{"a":1}')]),
    (HermesToolParser, '<tool_call>{"name": "f", "arguments": {"a"', '<tool_call>{"name": "f", "arguments": {"a"', []),
]


@pytest.mark.parametrize("make_parser, text, content, calls", CASES)
def test_whole_text_and_every_chunking_parse_the_same(make_parser, text, content, calls):
    whole = ChoiceParser(None, make_parser()).parse(text)
    assert whole.content == content and whole.reasoning is None
    assert [(call.function.name, call.function.arguments) for call in whole.tool_calls] == calls
    for seed in range(20):
        stream_content, stream_calls, _ = streamed(make_parser, text, seed)
        assert (stream_content or None, stream_calls) == (content, calls)


def test_hermes_holds_back_only_what_may_start_a_tag():
    parser = HermesToolParser()
    assert parser.feed("Hello <tool").content == "Hello"  # the space and '<tool' wait
    assert parser.feed("box> and ").content == " <toolbox> and"
    call = parser.feed('<tool_call>{"name": "f", "arguments": {}}')
    assert call.content == "" and call.tool_calls == []  # a block goes out only once closed
    closed = parser.feed("</tool_call>")
    assert [piece.function.name for piece in closed.tool_calls] == ["f", None]


def test_required_streams_arguments_as_they_are_generated():
    parser = RequiredToolParser()
    assert parser.feed('[{"name": "f"').tool_calls[0].function.name == "f"
    fragments = [parser.feed(piece).tool_calls for piece in (', "parameters": {"a', '": 1', "}}]")]
    assert [[piece.function.arguments for piece in pieces] for pieces in fragments] == [['{"a'], ['":1'], ["}"]]


def test_the_compactor_keeps_whitespace_inside_strings_only():
    compactor = JsonCompactor()
    pieces = ['{ "a b" :', ' "c\\"', ' d" ,\n "e": [ 1 , 2 ] }']
    assert "".join(map(compactor.feed, pieces)) == '{"a b":"c\\" d","e":[1,2]}'


# ------------------------------------------------------------------------------------- request -> constraint


def constraint(body: dict, model=CompletionRequest) -> StructuredOutputsParams | None:
    return model.model_validate({"prompt": "x"} | body if model is CompletionRequest else body).output_constraint()


@pytest.mark.parametrize(
    "body, expected",
    [
        ({}, None),
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "boolean"}}}},
            StructuredOutputsParams(json={"type": "boolean"}),
        ),
        ({"structured_outputs": {"regex": "a|b"}}, StructuredOutputsParams(regex="a|b")),
        ({"structured_outputs": {"choice": ["a"]}}, StructuredOutputsParams(choice=["a"])),
        ({"guided_json": '{"type": "null"}'}, StructuredOutputsParams(json='{"type": "null"}')),
        ({"guided_regex": "a+"}, StructuredOutputsParams(regex="a+")),
        ({"guided_choice": ["x", "y"]}, StructuredOutputsParams(choice=["x", "y"])),
        ({"guided_grammar": 'root ::= "a"'}, StructuredOutputsParams(grammar='root ::= "a"')),
        (
            {"guided_regex": "a+", "structured_outputs": {"disable_any_whitespace": True}},
            StructuredOutputsParams(regex="a+", disable_any_whitespace=True),
        ),
        (
            {"structured_outputs": {"structural_tag": {"type": "structural_tag", "format": {}}}},
            StructuredOutputsParams(structural_tag='{"type": "structural_tag", "format": {}}'),
        ),
    ],
)
def test_every_constraint_source_becomes_structured_outputs(body, expected):
    assert constraint(body) == expected
    params = CompletionRequest.model_validate({"prompt": "x", **body}).to_sampling_params(4, None)
    assert params.structured_outputs == expected


@pytest.mark.parametrize(
    "body, message",
    [
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_regex, guided_choice"),
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "json_object"),
        ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern is not supported"),
        ({"guided_decoding_backend": "outlines"}, "xgrammar"),
        ({"response_format": {"type": "json_schema"}}, "json_schema.schema"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"structured_outputs": {"choice": []}}, "must not be empty"),
        ({"structured_outputs": {"regex": "a", "frob": 1}}, "frob"),
        ({"structured_outputs": {"disable_any_whitespace": True}}, "needs a constraint"),
        ({"guided_json": "{not json"}, "not valid JSON"),
    ],
)
def test_bad_or_conflicting_constraints_are_value_errors(body, message):
    with pytest.raises(ValueError, match=None) as info:
        constraint(body)
    assert message in str(info.value)


def chat(**body) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": USER, **body})


def test_tool_choices_and_their_constraints():
    assert chat().tool_mode == "none" and chat(tools=[WEATHER]).tool_mode == "auto"
    assert chat(tools=[WEATHER], tool_choice="none").output_constraint() is None
    assert chat(tools=[WEATHER], tool_choice="auto").output_constraint() is None
    named = chat(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named.output_constraint() == StructuredOutputsParams(json=WEATHER["function"]["parameters"])
    no_parameters = chat(tools=[TIME], tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert no_parameters.output_constraint().json == {"type": "object", "properties": {}, "additionalProperties": False}
    required = chat(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    schema = required.output_constraint().json
    assert schema["maxItems"] == 1 and schema["minItems"] == 1
    assert [branch["properties"]["name"] for branch in schema["items"]["anyOf"]] == [
        {"type": "string", "enum": ["get_weather"]},
        {"type": "string", "enum": ["get_time"]},
    ]
    assert "maxItems" not in required_tools_schema([named.named_tool], parallel_tool_calls=True)


@pytest.mark.parametrize(
    "body, message",
    [
        ({"tool_choice": "required"}, "needs tools"),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "needs tools"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in tools"),
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "name"),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "name"),
        ({"tools": [{"type": "retrieval"}]}, "tools"),
        ({"tools": [WEATHER, WEATHER]}, "more than one function named 'get_weather'"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice must be"),
        ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "guided_regex, tool_choice"),
    ],
)
def test_bad_tool_requests_are_value_errors(body, message):
    with pytest.raises((ValueError, ValidationError)) as info:
        chat(**body).output_constraint()
    assert message in str(info.value)


def test_tool_turns_reach_the_template_with_arguments_as_objects():
    request = chat(
        messages=[
            *USER,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "42"},
        ],
        tools=[WEATHER],
    )
    assert request.conversation()[1:] == [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}],
        },
        {"role": "tool", "content": "42", "tool_call_id": "call_1"},
    ]
    assert request.tool_dicts() == [WEATHER]
    assert json.loads(json.dumps(request.tool_dicts())) == [WEATHER]
