"""Structured outputs through the OpenAI API: the official client against a real AsyncLLM (real xgrammar)
on the tiny random-weight Qwen2 checkpoint.

Every constraint source (``response_format``, ``structured_outputs``, the ``guided_*`` aliases) on chat and
completions, streamed and not, ``n`` = 3 at temperature 1 with a seed; every output validates (``jsonschema``,
``re.fullmatch``, the choice list, the grammar's language). The constraints are bounded (enums, booleans,
bounded integers, strings with maxLength, arrays with maxItems) and this module's engine has
``structured_outputs_config.disable_any_whitespace``, so the grammar, not luck, ends each output (finish
reason ``stop``) well within ``max_tokens``. Bad constraints are 400s that leave the server serving.
"""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from tests.engine.entrypoints.conftest import MODEL, make_async_llm, make_client, serve_models

pytestmark = pytest.mark.usefixtures("engine_left_idle")

SCHEMA = {
    "type": "object",
    "properties": {
        "colour": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
        "count": {"type": "integer", "minimum": 0, "maximum": 9},
        "name": {"type": "string", "maxLength": 6},
        "point": {
            "type": "object",
            "properties": {"x": {"type": "integer", "minimum": -5, "maximum": 5}},
            "required": ["x"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["colour", "ok", "count", "name", "point", "tags"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}
REGEX = r"(yes|no)-[0-9]{2}"
CHOICES = ["alpha", "beta", "gamma"]
GRAMMAR = 'root ::= "(" digit ("+" digit)? ")"\ndigit ::= [0-9]'
GRAMMAR_LANGUAGE = r"\(\d(\+\d)?\)"
MESSAGES = [{"role": "user", "content": "Describe a thing."}]
MAX_TOKENS = 400  # far more than any of these constraints allows


@pytest.fixture(scope="module")
def structured_engine(model_path):
    engine = make_async_llm(model_path, structured_outputs_config={"disable_any_whitespace": True})
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def client(structured_engine):
    from engine.entrypoints.openai.serving import OpenAIServing

    with serve_models({MODEL: OpenAIServing(structured_engine, MODEL)}) as server:
        yield make_client(server.base_url)


def chat(client, stream=False, **kwargs):
    response = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_completion_tokens=MAX_TOKENS, seed=0, stream=stream, **kwargs
    )
    if not stream:
        return [(choice.message.content, choice.finish_reason) for choice in response.choices]
    return reassemble(response, lambda choice: choice.delta.content)


def complete(client, stream=False, **kwargs):
    response = client.completions.create(
        model=MODEL, prompt="A thing:", max_tokens=MAX_TOKENS, seed=0, stream=stream, **kwargs
    )
    if not stream:
        return [(choice.text, choice.finish_reason) for choice in response.choices]
    return reassemble(response, lambda choice: choice.text)


def reassemble(chunks, text_of) -> list[tuple[str, str]]:
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (text_of(choice) or "")
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
    return [(texts[index], reasons.get(index)) for index in sorted(texts)]


def assert_valid_json(outputs, schema=SCHEMA):
    for text, finish_reason in outputs:
        assert finish_reason == "stop", text
        jsonschema.validate(json.loads(text), schema)
        # Compact JSON (no whitespace between tokens): exactly what json.dumps writes with tight separators.
        assert json.dumps(json.loads(text), separators=(",", ":"), ensure_ascii=False) == text


@pytest.mark.parametrize("stream", [False, True])
def test_chat_response_format_json_schema(client, stream):
    assert_valid_json(chat(client, stream, response_format=RESPONSE_FORMAT, temperature=0))


@pytest.mark.parametrize("stream", [False, True])
def test_completions_honour_response_format_and_the_aliases(client, stream):
    assert_valid_json(complete(client, stream, extra_body={"response_format": RESPONSE_FORMAT}, temperature=0))
    assert_valid_json(complete(client, stream, extra_body={"guided_json": SCHEMA}, temperature=0))


def test_n_3_at_temperature_1_each_choice_validates_and_the_seed_repeats(client):
    first = chat(client, n=3, temperature=1.0, extra_body={"structured_outputs": {"json": SCHEMA}})
    assert len(first) == 3
    assert_valid_json(first)
    assert chat(client, n=3, temperature=1.0, extra_body={"structured_outputs": {"json": SCHEMA}}) == first


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "body, check",
    [
        ({"structured_outputs": {"regex": REGEX}}, lambda text: re.fullmatch(REGEX, text)),
        ({"guided_regex": REGEX}, lambda text: re.fullmatch(REGEX, text)),
        ({"structured_outputs": {"choice": CHOICES}}, lambda text: text in CHOICES),
        ({"guided_choice": CHOICES}, lambda text: text in CHOICES),
        ({"structured_outputs": {"grammar": GRAMMAR}}, lambda text: re.fullmatch(GRAMMAR_LANGUAGE, text)),
        ({"guided_grammar": GRAMMAR}, lambda text: re.fullmatch(GRAMMAR_LANGUAGE, text)),
    ],
)
def test_regex_choice_and_grammar_constraints(client, stream, body, check):
    for outputs in (chat(client, stream, temperature=1.0, extra_body=body), complete(client, stream, extra_body=body)):
        for text, finish_reason in outputs:
            assert check(text) and finish_reason == "stop", text


def test_json_object_is_a_json_object(client):
    # Unbounded by nature (any object): a random model may nest until max_tokens; it still writes an object.
    [(text, finish_reason)] = chat(client, response_format={"type": "json_object"}, temperature=0, max_tokens=64)
    if finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert finish_reason == "length" and text.startswith("{")


BAD_BODIES = [
    ({"structured_outputs": {"regex": "(unclosed"}}, "regex"),
    ({"structured_outputs": {"json": {"type": "frobnicate"}}}, "frobnicate"),
    ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "undefined_rule"),
    ({"structured_outputs": {"choice": []}}, "must not be empty"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_regex, guided_choice"),
    ({"response_format": {"type": "json_object"}, "guided_json": SCHEMA}, "guided_json"),
    ({"guided_whitespace_pattern": r"\s*", "guided_json": SCHEMA}, "guided_whitespace_pattern"),
    ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "xgrammar"),
    ({"response_format": {"type": "json_schema"}}, "json_schema.schema"),
]


@pytest.mark.parametrize("body, message", BAD_BODIES)
def test_bad_constraints_are_400_and_the_server_keeps_serving(client, body, message):
    for call in (chat, complete):
        with pytest.raises(openai.BadRequestError) as info:
            call(client, extra_body=body)
        assert info.value.status_code == 400 and message in info.value.message, info.value.message
    [(text, finish_reason)] = complete(client, extra_body={"guided_choice": CHOICES})
    assert text in CHOICES and finish_reason == "stop"
