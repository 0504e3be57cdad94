"""The OpenAI layer's pure parts, without a model: request validation and the SamplingParams they
build, the error bodies and status mapping, the two logprobs formats, and the output merger that
batches several engine streams (and closes them all when its consumer leaves)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import pickle

import pytest
from pydantic import ValidationError

from engine.async_llm import EngineDeadError, EngineOverloadedError
from engine.entrypoints.openai.errors import ErrorResponse, from_exception, model_not_found
from engine.entrypoints.openai.logprobs import chat_logprobs, completion_logprobs
from engine.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from engine.entrypoints.openai.responses import ChatCompletionStreamChoice, DeltaMessage
from engine.entrypoints.openai.streaming import collect_final_outputs, merge_streams, stream_events
from engine.request_output import CompletionOutput, Logprob, RequestOutput
from engine.sampling_params import RequestOutputKind

USER = [{"role": "user", "content": "Hi"}]


def error_of(body: dict, model=CompletionRequest) -> ErrorResponse:
    with pytest.raises(ValidationError) as caught:
        model.model_validate(body)
    return from_exception(caught.value)


# --------------------------------------------------------------------------------------------- requests


def test_completion_request_maps_openai_and_vllm_fields_onto_sampling_params():
    request = CompletionRequest.model_validate(
        dict(
            prompt="x",
            n=2,
            temperature=0.5,
            top_p=0.9,
            max_tokens=7,
            stop="\n",
            seed=3,
            presence_penalty=0.1,
            frequency_penalty=0.2,
            logit_bias={"17": 5.0},
            top_k=4,
            min_p=0.05,
            repetition_penalty=1.1,
            min_tokens=2,
            ignore_eos=True,
            stop_token_ids=[9],
            include_stop_str_in_output=True,
            skip_special_tokens=False,
            logprobs=3,
            echo=True,
        )
    )
    params = request.to_sampling_params(request.max_tokens, request.logprobs)
    assert (params.n, params.temperature, params.top_p, params.max_tokens, params.stop, params.seed) == (
        2,
        0.5,
        0.9,
        7,
        ["\n"],
        3,
    )
    assert (params.presence_penalty, params.frequency_penalty, params.logit_bias) == (0.1, 0.2, {17: 5.0})
    assert (params.top_k, params.min_p, params.repetition_penalty, params.min_tokens) == (4, 0.05, 1.1, 2)
    assert params.ignore_eos and params.include_stop_str_in_output and not params.skip_special_tokens
    assert params.stop_token_ids == [9] and params.logprobs == 3
    assert params.output_kind == RequestOutputKind.FINAL_ONLY


def test_defaults_follow_openai_and_streaming_asks_for_deltas():
    request = CompletionRequest.model_validate({"prompt": "x", "stream": True})
    params = request.to_sampling_params(request.max_tokens, request.logprobs)
    assert (params.max_tokens, params.temperature, params.top_p, params.n) == (16, 1.0, 1.0, 1)
    assert params.output_kind == RequestOutputKind.DELTA
    chat = ChatCompletionRequest.model_validate({"messages": USER})
    assert chat.requested_max_tokens is None  # chat: up to the context length


@pytest.mark.parametrize(
    "prompt, expected",
    [("text", ["text"]), (["a", "b"], ["a", "b"]), ([5, 6], [[5, 6]]), ([[5], [6, 7]], [[5], [6, 7]])],
)
def test_completion_prompt_shapes(prompt, expected):
    assert CompletionRequest.model_validate({"prompt": prompt}).prompts() == expected


@pytest.mark.parametrize(
    "body, field",
    [
        ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": [True]}, "prompt"),
        ({"prompt": 3}, "prompt"),
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": "x", "logprobs": 21}, "logprobs"),
        ({"prompt": "x", "temperature": "hot"}, "temperature"),
        ({}, "prompt"),
    ],
)
def test_invalid_completion_fields_are_400_naming_the_field(body, field):
    error = error_of(body)
    assert error.status_code == 400 and error.error.type == "BadRequestError"
    assert error.error.param == field and field in error.error.message


@pytest.mark.parametrize(
    "body, message",
    [
        ({"prompt": "x", "suffix": "y"}, "suffix is not supported"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options can only be set"),
        ({"prompt": "x", "best_of": 3}, "best_of is not supported"),
    ],
)
def test_unsupported_completion_options_are_400(body, message):
    assert message in error_of(body).error.message


def test_empty_prompts_are_refused():
    with pytest.raises(ValueError, match="must not be empty"):
        CompletionRequest.model_validate({"prompt": []}).prompts()


def test_unknown_fields_are_ignored_with_a_debug_log(caplog):
    with caplog.at_level(logging.DEBUG, logger="engine.entrypoints.openai.protocol"):
        request = CompletionRequest.model_validate({"prompt": "x", "frobnicate": 1, "metadata": {}})
    assert not hasattr(request, "frobnicate")
    assert "frobnicate" in caplog.text and "metadata" in caplog.text


def test_chat_request_contents_roles_and_token_limits():
    request = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": "ok"},
            ],
            "max_tokens": 9,
            "max_completion_tokens": 5,
            "logprobs": True,
            "top_logprobs": 2,
        }
    )
    assert request.conversation() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "ok"},
    ]
    assert request.requested_max_tokens == 5  # max_completion_tokens wins over the deprecated max_tokens
    assert request.num_logprobs == 2
    assert ChatCompletionRequest.model_validate({"messages": USER, "logprobs": True}).num_logprobs == 0
    assert ChatCompletionRequest.model_validate({"messages": USER}).num_logprobs is None


@pytest.mark.parametrize(
    "body, message",
    [
        ({"messages": [{"role": "tool", "content": "x"}]}, "tool_call_id"),
        ({"messages": [{"role": "developer", "content": "x"}]}, "role"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "'image_url' are not"),
        ({"messages": [{"role": "user", "content": 7}]}, "content must be a string"),
        ({"messages": []}, "messages"),
        ({"messages": USER, "top_logprobs": 2}, "top_logprobs needs logprobs"),
        ({"messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"messages": USER, "tools": [{"type": "function"}]}, "tools"),
        ({"messages": USER, "response_format": {"type": "json_schema"}}, "json_schema.schema"),
        ({"messages": USER, "continue_final_message": True}, "cannot both be true"),
    ],
)
def test_invalid_chat_requests_are_400(body, message):
    error = error_of(body, ChatCompletionRequest)
    assert error.status_code == 400 and message in error.error.message


# ------------------------------------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    "exc, status, error_type",
    [
        (ValueError("bad prompt"), 400, "BadRequestError"),
        (EngineOverloadedError("full"), 503, "ServiceUnavailableError"),
        (EngineDeadError("gone"), 500, "InternalServerError"),
        (RuntimeError("bug"), 500, "InternalServerError"),
    ],
)
def test_exceptions_map_to_openai_errors(exc, status, error_type):
    error = from_exception(exc)
    assert (error.status_code, error.error.type, error.error.code) == (status, error_type, status)
    assert str(exc) in error.error.message
    assert (error.headers() == {"Retry-After": "1"}) == (status == 503)


def test_error_body_is_openais_shape_and_pickles():
    error = model_not_found("nope")
    assert error.body() == {
        "error": {"message": "The model `nope` does not exist.", "type": "NotFoundError", "param": "model", "code": 404}
    }
    copy = pickle.loads(pickle.dumps(error))
    assert copy == error and copy.status_code == 404


def test_stream_delta_leaves_out_unset_parts():
    assert DeltaMessage(role="assistant", content="").model_dump() == {"role": "assistant", "content": ""}
    chunk = ChatCompletionStreamChoice(index=0, delta=DeltaMessage(), finish_reason="stop")
    assert chunk.model_dump(mode="json")["delta"] == {}


# ---------------------------------------------------------------------------------------------- logprobs


class CharTokenizer:
    """Token id i is the character chr(i): enough for the formatting code (decode only)."""

    def decode(self, token_ids):
        return "".join(chr(token_id) for token_id in token_ids)


def test_completion_logprobs_format():
    a, b, c = ord("a"), ord("b"), ord("c")
    positions = [
        None,
        {b: Logprob(-0.5, 2, "b"), a: Logprob(-0.2, 1, "a")},
        {c: Logprob(-math.inf, 9, None), a: Logprob(-0.1, 1, "a")},
    ]
    result = completion_logprobs([a, b, c], positions, CharTokenizer(), initial_text_offset=10)
    assert result.tokens == ["a", "b", "c"]
    assert result.text_offset == [10, 11, 12]
    assert result.token_logprobs == [None, -0.5, -9999.0]  # -inf is not JSON: OpenAI's floor
    assert result.top_logprobs == [None, {"b": -0.5, "a": -0.2}, {"c": -9999.0, "a": -0.1}]


def test_chat_logprobs_top_alternatives_by_rank():
    a, b, c, d = map(ord, "abcd")
    position = {c: Logprob(-3.0, 4, "c"), a: Logprob(-0.1, 1, "a"), b: Logprob(-1.0, 2, "b"), d: Logprob(-2.0, 3, "d")}
    [content] = chat_logprobs([c], [position], 2, CharTokenizer()).content
    assert (content.token, content.logprob, content.bytes) == ("c", -3.0, [ord("c")])
    assert [(top.token, top.logprob) for top in content.top_logprobs] == [("a", -0.1), ("b", -1.0)]
    [content] = chat_logprobs([a], [{a: Logprob(-0.1, 1, "a")}], 0, CharTokenizer()).content
    assert content.top_logprobs == []


# ------------------------------------------------------------------------------------------ output merger


def output(request_id: str, text: str, finished: bool = False) -> RequestOutput:
    completion = CompletionOutput(index=0, text=text, token_ids=[1], finish_reason="stop" if finished else None)
    return RequestOutput(
        request_id=request_id, prompt=None, prompt_token_ids=[1], outputs=[completion], finished=finished
    )


class EngineStream:
    """An async generator shaped like AsyncLLM.generate's, recording whether it was closed early."""

    def __init__(
        self,
        name: str,
        texts: list[str],
        start_error: Exception | None = None,
        gate: asyncio.Event | None = None,
        delay_s: float = 0.0,
    ) -> None:
        self.name, self.texts, self.start_error, self.gate, self.delay_s = name, texts, start_error, gate, delay_s
        self.is_closed_early = False

    async def run(self):
        is_done = False
        try:
            if self.gate is not None:
                await self.gate.wait()
            if self.start_error is not None:
                raise self.start_error
            for i, text in enumerate(self.texts):
                await asyncio.sleep(self.delay_s)
                yield output(self.name, text, finished=i == len(self.texts) - 1)
            is_done = True
        finally:
            self.is_closed_early = not is_done


def test_merger_batches_what_arrived_while_the_consumer_was_busy():
    async def main():
        stream = EngineStream("a", ["1", "2", "3", "4"])
        batches = []
        async with contextlib.aclosing(merge_streams([stream.run()])) as merged:
            async for batch in merged:
                batches.append([out.outputs[0].text for _, out in batch])
                await asyncio.sleep(0.01)  # a slow consumer: the rest piles up meanwhile
        return batches

    batches = asyncio.run(main())
    assert [text for batch in batches for text in batch] == ["1", "2", "3", "4"]
    assert len(batches) < 4


class FixedStream:
    """A ``streaming.ResponseStream`` formatting every batch as ``events``, untracked, with no closing events."""

    progress = None

    def __init__(self, events: str) -> None:
        self.events = events

    def format_batch(self, batch) -> str:
        return self.events

    def format_end(self) -> str:
        return ""


def test_merger_first_batch_waits_for_every_stream_and_a_start_error_comes_first():
    async def main():
        gate = asyncio.Event()
        good = EngineStream("good", ["x"] * 1000, delay_s=0.01)
        bad = EngineStream("bad", [], start_error=ValueError("prompt too long"), gate=gate)
        items = stream_events(merge_streams([good.run(), bad.run()]), FixedStream("event"))
        first = asyncio.ensure_future(anext(items))
        # A fixed wait on purpose: the check is that nothing is yielded yet, so there is no event to poll
        # for; 50 ms is five of "good"'s outputs, time enough for a wrong merger to yield one.
        await asyncio.sleep(0.05)
        assert not first.done()  # "good" has output, but "bad" has not started yet
        gate.set()
        item = await first
        with pytest.raises(StopAsyncIteration):
            await anext(items)
        await asyncio.sleep(0.01)
        return item, good

    item, good = asyncio.run(main())
    assert isinstance(item, ErrorResponse) and item.status_code == 400
    assert good.is_closed_early  # the other prompt's request was closed (AsyncLLM aborts it)


def test_closing_the_merger_closes_every_stream():
    async def main():
        streams = [EngineStream(name, ["x"] * 1000, delay_s=0.01) for name in "ab"]
        merged = merge_streams([stream.run() for stream in streams])
        await anext(merged)
        await merged.aclose()
        await asyncio.sleep(0.01)
        return streams

    assert all(stream.is_closed_early for stream in asyncio.run(main()))


def test_an_error_mid_stream_becomes_a_final_error_event():
    async def failing():
        yield output("a", "hello")
        raise EngineDeadError("the busy loop died")

    async def main():
        items = stream_events(merge_streams([failing()]), FixedStream("data: chunk\n\n"))
        return [item async for item in items]

    items = [item.text for item in asyncio.run(main())]
    assert items[0] == "data: chunk\n\n"
    assert items[1].startswith('data: {"error": {"message": "The engine is dead: the busy loop died"')
    assert items[1].endswith("data: [DONE]\n\n") and len(items) == 2


def test_collect_final_outputs_keeps_prompt_order():
    async def main():
        return await collect_final_outputs([EngineStream("a", ["a1", "a2"]).run(), EngineStream("b", ["b1"]).run()])

    finals = asyncio.run(main())
    assert [final.outputs[0].text for final in finals] == ["a2", "b1"]
