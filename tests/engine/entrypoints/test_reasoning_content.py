"""Reasoning content in chat completions (``reasoning_parser``), the real ``openai`` client against servers
on the tiny checkpoint.

* ``qwen3`` with ``enable_in_reasoning`` (``qwen3_base_url``): a regex forces the whole output, ``<think>``
  included, so the reasoning is exact: ``message.reasoning_content`` / ``delta.reasoning_content``, the
  content after it, its tokens in ``usage``, tool calls parsed from the content only.
* ``deepseek_r1`` (a constraint starts after the reasoning): the model starts inside its reasoning, which a
  JSON schema leaves free; a prompt that closed the reasoning gets the schema from the first token.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from engine.entrypoints.openai.protocol import ChatCompletionRequest
from engine.entrypoints.openai.serving import OpenAIServing
from engine.entrypoints.openai.serving_chat import ChatServing
from tests.engine.entrypoints.conftest import MODEL, make_async_llm, make_client, serve_models
from tests.engine.entrypoints.test_stream_continuation import cut_and_continue, events, run_tracked

USER = [{"role": "user", "content": "think first"}]
FORCED = "<think>a b c</think>answer"
SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}},
    "required": ["n", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def deepseek_r1_engine(model_path):
    # Compact JSON: the grammar, not luck, ends a schema's answer.
    engine = make_async_llm(
        model_path,
        max_num_seqs=4,
        reasoning_parser="deepseek_r1",
        structured_outputs_config={"disable_any_whitespace": True},
    )
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def qwen3(qwen3_base_url):
    return make_client(qwen3_base_url)


@pytest.fixture(scope="module")
def deepseek_r1_server(deepseek_r1_engine):
    with serve_models({MODEL: OpenAIServing(deepseek_r1_engine, MODEL)}) as server:
        yield server


@pytest.fixture(scope="module")
def deepseek_r1(deepseek_r1_server):
    return make_client(deepseek_r1_server.base_url)


def forced(regex: str = FORCED, **fields) -> dict:
    body = {"structured_outputs": {"regex": regex}, **fields.pop("extra_body", {})}
    return dict(model=MODEL, messages=USER, max_tokens=60, temperature=0.0, extra_body=body, **fields)


def test_the_reasoning_is_split_out_streamed_and_not(qwen3):
    response = qwen3.chat.completions.create(**forced(logprobs=True))
    choice = response.choices[0]
    assert (choice.message.reasoning_content, choice.message.content) == ("a b c", "answer")
    assert choice.finish_reason == "stop"
    # The reasoning's tokens: those up to the one that completes "</think>" (the tokens' texts are ASCII).
    lengths = [len(entry.token) for entry in choice.logprobs.content]
    reasoning_tokens = next(i + 1 for i in range(len(lengths)) if sum(lengths[: i + 1]) >= len("<think>a b c</think>"))
    assert response.usage.completion_tokens_details.reasoning_tokens == reasoning_tokens
    assert response.usage.completion_tokens == len(lengths) > reasoning_tokens

    chunks = list(qwen3.chat.completions.create(**forced(stream=True, stream_options={"include_usage": True})))
    deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
    assert "".join(getattr(delta, "reasoning_content", None) or "" for delta in deltas) == "a b c"
    assert "".join(delta.content or "" for delta in deltas) == "answer"
    assert not any(getattr(delta, "reasoning_content", None) and delta.content for delta in deltas[2:-1])
    assert chunks[-1].usage.model_dump() == response.usage.model_dump()


def test_include_reasoning_false_drops_it_and_keeps_the_content(qwen3):
    response = qwen3.chat.completions.create(**forced(extra_body={"include_reasoning": False}))
    assert (response.choices[0].message.reasoning_content, response.choices[0].message.content) == (None, "answer")
    chunks = list(qwen3.chat.completions.create(**forced(stream=True, extra_body={"include_reasoning": False})))
    deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
    assert not any(getattr(delta, "reasoning_content", None) for delta in deltas)
    assert "".join(delta.content or "" for delta in deltas) == "answer"


def test_tool_calls_come_from_the_content_only(qwen3):
    tools = [{"type": "function", "function": {"name": name}} for name in ("f", "g")]
    block = '<tool_call>{{"name": "{}", "arguments": {{}}}}</tool_call>'
    regex = ("<think>" + block.format("f") + "</think>" + block.format("g")).replace("{", r"\{").replace("}", r"\}")
    for stream in (False, True):
        request = {**forced(regex, tools=tools, stream=stream), "max_tokens": 200}
        if not stream:
            message = qwen3.chat.completions.create(**request).choices[0].message
            calls = [(call.function.name, call.function.arguments) for call in message.tool_calls]
            reasoning = message.reasoning_content
        else:
            deltas = [c.choices[0].delta for c in qwen3.chat.completions.create(**request) if c.choices]
            calls = joined_calls(call for d in deltas for call in d.tool_calls or [])
            reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
        assert calls == [("g", "{}")] and reasoning == block.format("f")


def joined_calls(pieces) -> list[tuple[str, str]]:
    """Streamed tool-call deltas joined into (name, arguments) per call."""
    calls: dict[int, list[str]] = {}
    for piece in pieces:
        name, arguments = calls.setdefault(piece.index, ["", ""])
        calls[piece.index] = [name + (piece.function.name or ""), arguments + (piece.function.arguments or "")]
    return [tuple(call) for call in calls.values()]


def test_a_schema_leaves_the_reasoning_free(deepseek_r1):
    """deepseek_r1's model starts inside its reasoning: a schema does not constrain it, so a greedy run is
    the unconstrained run, token for token (and it is no JSON)."""
    request = dict(model=MODEL, messages=USER, max_tokens=12, temperature=0.0)
    free = deepseek_r1.chat.completions.create(**request).choices[0]
    schema_format = {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}}
    constrained = deepseek_r1.chat.completions.create(**request, response_format=schema_format).choices[0]
    assert constrained.message.reasoning_content == free.message.reasoning_content
    assert (constrained.message.content, constrained.finish_reason) == (None, "length")
    assert not constrained.message.reasoning_content.lstrip().startswith("{")


def test_after_a_closed_reasoning_the_answer_validates(deepseek_r1):
    """The prompt closes the reasoning (an assistant turn continued): the schema applies from the first token."""
    messages = [*USER, {"role": "assistant", "content": "<think>a b c</think>"}]
    schema_format = {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}}
    for stream in (False, True):
        response = deepseek_r1.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=60,
            temperature=0.0,
            response_format=schema_format,
            stream=stream,
            extra_body={"continue_final_message": True, "add_generation_prompt": False},
        )
        if stream:
            deltas = [chunk.choices[0].delta for chunk in response if chunk.choices]
            content = "".join(delta.content or "" for delta in deltas)
            assert not any(getattr(delta, "reasoning_content", None) for delta in deltas)
        else:
            assert response.choices[0].message.reasoning_content is None
            assert response.choices[0].finish_reason == "stop"
            content = response.choices[0].message.content
        jsonschema.validate(json.loads(content), SCHEMA)


def test_a_continued_stream_goes_on_with_its_reasoning(deepseek_r1_engine):
    """A stream cut after any item and continued elsewhere (request migration) sends the same reasoning and
    counts the same reasoning tokens: the new parser is fed what the first had taken."""
    chat = ChatServing(deepseek_r1_engine, MODEL)
    request = ChatCompletionRequest(
        model=MODEL,
        messages=USER,
        max_tokens=10,
        temperature=0,
        ignore_eos=True,
        stream=True,
        stream_options={"include_usage": True},
    )
    full = run_tracked(chat.chat, request)

    def assembled(items: list[str]) -> tuple:
        parsed = events(items)[:-1]
        deltas = [choice["delta"] for event in parsed for choice in event["choices"]]
        return (
            "".join(d.get("reasoning_content", "") for d in deltas),
            "".join(d.get("content") or "" for d in deltas),
            parsed[-1]["usage"],
        )

    reasoning, content, usage = assembled([item.text for item in full])
    assert reasoning and content == "" and usage["completion_tokens_details"]["reasoning_tokens"] == 10
    for cut in range(1, len(full)):
        assert assembled(cut_and_continue(chat.chat, request, full, cut)[0]) == (reasoning, content, usage), cut


def test_the_messages_api_answers_the_reasoning_as_a_thinking_block(deepseek_r1_server, deepseek_r1):
    """Anthropic's client: the reasoning is a ``thinking`` block (its deltas ``thinking_delta``), the same
    text chat completions give as reasoning_content; a schema in output_config applies after a closed one."""
    import anthropic

    claude = anthropic.Anthropic(base_url=deepseek_r1_server.base_url, api_key="unused", max_retries=0)
    request = dict(model=MODEL, max_tokens=12, messages=USER, extra_body={"temperature": 0.0})
    chat = deepseek_r1.chat.completions.create(model=MODEL, messages=USER, max_tokens=12, temperature=0.0)
    message = claude.messages.create(**request, thinking={"type": "adaptive"})
    [block] = message.content
    assert (block.type, block.thinking) == ("thinking", chat.choices[0].message.reasoning_content)
    with claude.messages.stream(**request) as stream:
        events = list(stream)
    deltas = [event.delta for event in events if event.type == "content_block_delta"]
    assert {delta.type for delta in deltas} == {"thinking_delta"}
    assert "".join(delta.thinking for delta in deltas) == block.thinking
    omitted = claude.messages.create(**request, thinking={"type": "adaptive", "display": "omitted"})
    assert omitted.content == [] and omitted.stop_reason == "max_tokens"
    closed = claude.messages.create(
        model=MODEL,
        max_tokens=60,
        messages=[*USER, {"role": "assistant", "content": "<think>a b c</think>"}],  # a prefill, continued
        output_config={"format": {"type": "json_schema", "schema": SCHEMA}},
        extra_body={"temperature": 0.0},
    )
    [answer] = closed.content
    assert (answer.type, closed.stop_reason) == ("text", "end_turn")
    jsonschema.validate(json.loads(answer.text), SCHEMA)
