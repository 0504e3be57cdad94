"""``/v1/responses``: a ``ResponsesRequest`` served as the chat completion it amounts to
(``ResponsesRequest.chat_request``: the chat template, the tool-call parser, the output constraint), its text
turned into Responses output items (``responses_output``): with the engine's ``reasoning_parser``, a
``reasoning`` item first (``usage.output_tokens_details.reasoning_tokens`` its tokens), then the message and
the function calls parsed from the text after the reasoning (``choice_parser.ChoiceParser``, as chat's).

Not streamed: one ``ResponsesResponse``, or one ``ErrorResponse``. Streamed: one ``ErrorResponse`` (a failure
before the first event), or ``SSEChunk``\\ s of OpenAI's events, numbered by ``sequence_number`` and ending
without ``[DONE]``: ``response.created`` and ``response.in_progress`` with the first tokens, the items' events,
then ``response.completed`` (``response.incomplete`` when ``max_output_tokens`` cut it). Just before that last
chunk the stream yields the finished ``ResponsesResponse`` itself, so the HTTP layer can store it before the
client reads it complete (``responses_routes``). A failure after the first event ends the stream with a
``response.failed`` event.

Status: ``completed`` when the model stopped, ``incomplete`` (``incomplete_details.reason``
``max_output_tokens``) at the token limit, ``cancelled`` when the engine aborted the request. A stream is never
continued on another server (``Endpoint.resumable``): ``options.continuation`` is never set for it.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator

from engine.entrypoints.openai.call_options import PLAIN_CALL, CallOptions, request_options
from engine.entrypoints.openai.chat_template import render_chat
from engine.entrypoints.openai.choice_parser import ChoiceParser
from engine.entrypoints.openai.errors import ErrorResponse, from_exception
from engine.entrypoints.openai.protocol import ChatCompletionRequest
from engine.entrypoints.openai.response_items import ItemStatus, item_id
from engine.entrypoints.openai.response_object import ResponseError, ResponsesResponse, ResponseUsage
from engine.entrypoints.openai.responses_output import OutputBuilder, ResponseEvents
from engine.entrypoints.openai.responses_request import ResponsesRequest
from engine.entrypoints.openai.serving_base import ServingBase
from engine.entrypoints.openai.streaming import SSEChunk, collect_final_outputs, merge_streams
from engine.entrypoints.openai.tool_parsers import make_tool_parser
from engine.request_output import RequestOutput

# The engine's finish reason -> the response's status, its open item's status, and the stream's last event.
_ENDINGS: dict[str | None, tuple[str, ItemStatus, str]] = {
    "stop": ("completed", "completed", "response.completed"),
    "length": ("incomplete", "incomplete", "response.incomplete"),
    "abort": ("cancelled", "incomplete", "response.incomplete"),
}

ResponsesItem = ErrorResponse | ResponsesResponse | SSEChunk


class ResponsesServing(ServingBase):
    async def responses(
        self, request: ResponsesRequest, options: CallOptions = PLAIN_CALL
    ) -> AsyncIterator[ResponsesItem]:
        """The items of one response (see the module docstring). ``options.precomputed`` (with its ``text``)
        is used instead of the chat template and the tokenizer. Closing the iterator aborts the engine request."""
        precomputed = options.precomputed
        try:
            chat = request.chat_request()
            if precomputed is not None and precomputed.text is not None:
                text, token_ids = precomputed.text, precomputed.token_ids
            else:
                text, token_ids = render_chat(self.tokenizer, chat)
            self.check_context_length(len(token_ids), chat.requested_max_tokens)
            params = self.sampling_params(chat, chat.requested_max_tokens, None)
        except ValueError as exc:
            yield from_exception(exc)
            return
        response_id = item_id("resp")
        started = ResponsesResponse.started(request, response_id, request.model or self.model_id, params)
        prompt = {"prompt": text, "prompt_token_ids": token_ids}
        [generator] = self.start_requests(response_id, [prompt], params, request_options(chat, options))
        run = _Run(self, chat, started, prompt)
        items = _streamed(generator, run) if request.stream else _whole(generator, run)
        async with contextlib.aclosing(items) as items:
            async for item in items:
                yield item


class _Run:
    """One response being made: its text through the choice parser (the model's reasoning parser, then the
    request's tool parser) into the output builder; its usage."""

    def __init__(
        self, serving: ResponsesServing, chat: ChatCompletionRequest, started: ResponsesResponse, prompt: dict
    ) -> None:
        self.serving, self.chat, self.started = serving, chat, started
        self.events = ResponseEvents() if chat.stream else None
        self.parser = ChoiceParser(serving.reasoning, make_tool_parser(chat), prompt["prompt"])
        self.builder = OutputBuilder(self.events)
        self.num_prompt_tokens = len(prompt["prompt_token_ids"])
        self.token_ids: list[int] = []

    def feed(self, output: RequestOutput) -> None:
        completion = output.outputs[0]
        self.token_ids += completion.token_ids
        parsed = self.parser.feed(completion.text)
        if completion.finish_reason is not None:
            parsed.extend(self.parser.finish())
        self.builder.add(parsed)

    def end(self, last: RequestOutput) -> ResponsesResponse:
        """The finished response, from the engine's last output (its finish reason, cached tokens)."""
        status, item_status, _ = _ENDINGS[last.outputs[0].finish_reason]
        tokenizer, skip_special_tokens = self.serving.tokenizer, self.chat.skip_special_tokens
        num_reasoning = self.parser.num_reasoning_tokens(tokenizer, self.token_ids, skip_special_tokens)
        usage = ResponseUsage.of(self.num_prompt_tokens, last.num_cached_tokens, len(self.token_ids), num_reasoning)
        return self.started.ended(status, self.builder.finish(item_status), usage)


async def _whole(generator: AsyncGenerator[RequestOutput, None], run: _Run) -> AsyncIterator[ResponsesItem]:
    try:
        [output] = await collect_final_outputs([generator])
    except Exception as exc:  # noqa: BLE001 - every failure becomes an OpenAI error
        yield from_exception(exc)
        return
    run.feed(output)
    yield run.end(output)


async def _streamed(generator: AsyncGenerator[RequestOutput, None], run: _Run) -> AsyncIterator[ResponsesItem]:
    events, last = run.events, None
    async with contextlib.aclosing(merge_streams([generator])) as batches:
        try:
            async for batch in batches:
                if last is None:
                    events.emit("response.created", response=run.started.model_dump(mode="json"))
                    events.emit("response.in_progress", response=run.started.model_dump(mode="json"))
                for _, last in batch:
                    run.feed(last)
                if text := events.take():
                    yield SSEChunk(text)
        except Exception as exc:  # noqa: BLE001 - every failure becomes an OpenAI error
            error = from_exception(exc)
            if last is None:
                yield error
                return
            failed = run.started.model_copy(
                update={"status": "failed", "error": ResponseError(code="server_error", message=error.error.message)}
            )
            events.emit("response.failed", response=failed.model_dump(mode="json"))
            yield SSEChunk(events.take())
            return
    response = run.end(last)
    yield response  # before the client reads it complete: the HTTP layer stores it first
    events.emit(_ENDINGS[last.outputs[0].finish_reason][2], response=response.model_dump(mode="json"))
    yield SSEChunk(events.take())
