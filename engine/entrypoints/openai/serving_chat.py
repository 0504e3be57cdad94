"""``/v1/chat/completions``: messages through the chat template to OpenAI chat
responses or SSE chunks.

A stream opens every choice with a ``{"role": "assistant", "content": ""}``
delta, then sends content deltas; the chunk that finishes a choice carries
its ``finish_reason``.

With a reasoning parser (the engine's ``reasoning_parser``), each choice's
reasoning is split out of its text: ``message.reasoning_content``
(``delta.reasoning_content`` when streamed; dropped with ``include_reasoning:
false``) and ``usage.completion_tokens_details.reasoning_tokens``.

With tools, the text after the reasoning goes through a ``tool_parsers``
parser: the message's ``tool_calls`` (``delta.tool_calls`` when streamed, one
chunk per call delta) and ``finish_reason: "tool_calls"`` where the engine's
was ``stop``; a ``length`` finish stays ``length``. Both go through one
``choice_parser.ChoiceParser`` per choice.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from engine.entrypoints.openai.call_options import PLAIN_CALL, CallOptions, request_options
from engine.entrypoints.openai.chat_template import render_chat
from engine.entrypoints.openai.choice_parser import ChoiceParser
from engine.entrypoints.openai.continuation import ResumedRequest, StreamProgress
from engine.entrypoints.openai.errors import ApiStyle, ErrorResponse, from_exception
from engine.entrypoints.openai.logprobs import chat_logprobs
from engine.entrypoints.openai.protocol import ChatCompletionRequest
from engine.entrypoints.openai.responses import (
    ChatCompletionLogProbs,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatResponseMessage,
    DeltaMessage,
    DeltaToolCall,
    UsageInfo,
    unix_time,
)
from engine.entrypoints.openai.serving_base import ServingBase, random_uuid
from engine.entrypoints.openai.streaming import ResponseStream, SSEChunk, sse_event
from engine.entrypoints.openai.tool_parsers import make_tool_parser
from engine.request_output import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class ChatCall:
    """One chat request being served: its id, the prompt it rendered (its text, for the choice parsers, and
    its token count), the stream it continues (if any) and whether its stream is tracked."""

    request: ChatCompletionRequest
    request_id: str
    prompt_text: str | None
    num_prompt_tokens: int
    resumed: ResumedRequest | None = None
    track: bool = False

    def sent_text(self, tokenizer: Any) -> str:
        """The text the stream this call continues had sent (its parsers are fed it first); "" for a new one."""
        if self.resumed is None:
            return ""
        continuation = self.resumed.continuation
        text = tokenizer.decode(continuation.token_ids, skip_special_tokens=self.request.skip_special_tokens)
        return text[: continuation.num_sent_chars]


class ChatServing(ServingBase):
    async def chat(
        self, request: ChatCompletionRequest, options: CallOptions = PLAIN_CALL
    ) -> AsyncIterator[ErrorResponse | ChatCompletionResponse | SSEChunk]:
        """Not streamed: one ChatCompletionResponse or one ErrorResponse. Streamed: one ErrorResponse, or
        ``SSEChunk``\\ s (``serve_chat``)."""
        async with contextlib.aclosing(
            self.serve_chat(request, options, "chatcmpl-", self._response, _ChatStream, ApiStyle.OPENAI)
        ) as items:
            async for item in items:
                yield item

    async def serve_chat(
        self,
        request: ChatCompletionRequest,
        options: CallOptions,
        id_prefix: str,
        make_response: Callable[[ChatCall, RequestOutput], Any],
        make_stream: Callable[[ChatServing, ChatCall], ResponseStream],
        style: ApiStyle,
    ) -> AsyncIterator[Any]:
        """A chat request's items, its response (or stream) made by ``make_response`` (``make_stream``) in
        ``style``: the shape chat completions and the Messages API share.

        Closing the iterator aborts the engine request.
        """
        try:
            text, token_ids, params, resumed = self._prepare(request, options)
        except ValueError as exc:
            yield from_exception(exc)
            return
        request_id = f"{id_prefix}{random_uuid()}"
        prompts = [{"prompt": text, "prompt_token_ids": token_ids}]
        generators = self.start_or_resume(request_id, prompts, params, resumed, request_options(request, options))
        prompt_text = text if text is not None or self.reasoning is None else self.tokenizer.decode(token_ids)
        call = ChatCall(request, request_id, prompt_text, len(token_ids), resumed, options.track)
        async with contextlib.aclosing(
            self.respond(
                generators,
                request.stream,
                lambda outputs: make_response(call, outputs[0]),
                lambda: make_stream(self, call),
                style,
            )
        ) as items:
            async for item in items:
                yield item

    def _prepare(
        self, request: ChatCompletionRequest, options: CallOptions
    ) -> tuple[str | None, list[int], SamplingParams, ResumedRequest | None]:
        """The prompt's text and tokens, the sampling parameters and the stream continued; ValueError (-> 400).

        ``options.precomputed`` (with its ``text``) is used instead of the chat template and the tokenizer; a
        ``continuation`` is not rendered again (``CallOptions``)."""
        continuation, precomputed = options.continuation, options.precomputed
        if continuation is not None:
            text, token_ids = None, continuation.prompt_token_ids
        elif precomputed is not None and precomputed.text is not None:
            text, token_ids = precomputed.text, precomputed.token_ids
        else:
            text, token_ids = render_chat(self.tokenizer, request)
        self.check_context_length(len(token_ids), request.requested_max_tokens)
        params = self.sampling_params(request, request.requested_max_tokens, request.num_logprobs)
        resumed = None if continuation is None else ResumedRequest.of(continuation, self.tokenizer, params)
        return text, token_ids, params, resumed

    def make_logprobs(
        self, request: ChatCompletionRequest, completion: CompletionOutput
    ) -> ChatCompletionLogProbs | None:
        if not request.logprobs:
            return None
        return chat_logprobs(completion.token_ids, completion.logprobs or [], request.top_logprobs or 0, self.tokenizer)

    def choice_parser(self, request: ChatCompletionRequest, prompt_text: str | None) -> ChoiceParser:
        """A fresh parser for one choice: this model's reasoning parser, then the request's tool parser."""
        return ChoiceParser(self.reasoning, make_tool_parser(request), prompt_text)

    def num_reasoning_tokens(self, request: ChatCompletionRequest, parser: ChoiceParser, token_ids: list[int]) -> int:
        """The choice's reasoning tokens (``ChoiceParser.num_reasoning_tokens``)."""
        return parser.num_reasoning_tokens(self.tokenizer, token_ids, request.skip_special_tokens)

    def _response(self, call: ChatCall, output: RequestOutput) -> ChatCompletionResponse:
        request = call.request
        choices, num_reasoning_tokens = [], None
        for completion in output.outputs:
            parser = self.choice_parser(request, call.prompt_text)
            parsed = parser.parse(completion.text)
            reasoning = parsed.reasoning if request.include_reasoning else None
            choices.append(
                ChatCompletionResponseChoice(
                    index=completion.index,
                    message=ChatResponseMessage(
                        content=parsed.content, reasoning_content=reasoning, tool_calls=parsed.tool_calls
                    ),
                    logprobs=self.make_logprobs(request, completion),
                    finish_reason=finish_reason(completion.finish_reason, bool(parsed.tool_calls)),
                    stop_reason=completion.stop_reason,
                )
            )
            if self.reasoning is not None:
                count = self.num_reasoning_tokens(request, parser, completion.token_ids)
                num_reasoning_tokens = (num_reasoning_tokens or 0) + count
        num_completion_tokens = sum(len(completion.token_ids) for completion in output.outputs)
        return ChatCompletionResponse(
            id=call.request_id,
            model=request.model or self.model_id,  # an adapter's request: the name it used (vLLM)
            choices=choices,
            usage=UsageInfo.of(len(output.prompt_token_ids), num_completion_tokens, num_reasoning_tokens),
        )


def finish_reason(engine_reason: str | None, made_tool_calls: bool) -> str | None:
    """OpenAI's ``tool_calls`` for a choice that ended calling tools; the engine's reason otherwise."""
    return "tool_calls" if made_tool_calls and engine_reason == "stop" else engine_reason


class _ChatStream:
    """Per-request state of a streamed chat completion."""

    def __init__(self, serving: ChatServing, call: ChatCall) -> None:
        self.serving = serving
        self.request = request = call.request
        self.request_id = call.request_id
        self.prompt_text = call.prompt_text
        self.created = unix_time()
        self.num_prompt_tokens = call.num_prompt_tokens
        self.num_completion_tokens = 0
        self.is_role_sent = False
        self.parsers: dict[int, ChoiceParser] = {}  # choice index -> its parser
        # choice index -> its tokens, kept only to count its reasoning's in the usage chunk
        self.token_ids: dict[int, list[int]] | None = None
        if serving.reasoning is not None and request.is_usage_streamed:
            self.token_ids = {}
        self.sent_text = call.sent_text(serving.tokenizer)  # a continued stream's: its parsers are fed it first
        self.progress = StreamProgress() if call.track else None  # a tracked stream: each chunk's StreamDelta
        if self.progress is not None:
            self.progress.request_id, self.progress.created = call.request_id, self.created
        if (resumed := call.resumed) is not None:  # continues a stream that had sent its role chunk
            self.request_id, self.created = resumed.continuation.request_id, resumed.continuation.created
            self.num_completion_tokens, self.is_role_sent = resumed.num_generated, True
            if self.token_ids is not None:
                self.token_ids[0] = list(resumed.continuation.token_ids)
            resumed.progress(self.progress)

    def format_batch(self, batch: list[tuple[int, RequestOutput]]) -> str:
        events = [] if self.is_role_sent else [self._role_event()]
        self.is_role_sent = True
        for _, output in batch:
            for completion in output.outputs:
                self.num_completion_tokens += len(completion.token_ids)
                if self.token_ids is not None:
                    self.token_ids.setdefault(completion.index, []).extend(completion.token_ids)
                if self.progress is not None:
                    self.progress.add(output, completion.token_ids, completion.text, completion.finish_reason)
                events.extend(sse_event(self._chunk([choice])) for choice in self._choices(completion))
        return "".join(events)

    def _role_event(self) -> str:
        """One chunk per choice (as vLLM sends them): clients often read only ``choices[0]``."""
        return "".join(
            sse_event(
                self._chunk([ChatCompletionStreamChoice(index=index, delta=DeltaMessage(role="assistant", content=""))])
            )
            for index in range(self.request.n)
        )

    def _parser(self, index: int) -> ChoiceParser:
        if index not in self.parsers:
            self.parsers[index] = parser = self.serving.choice_parser(self.request, self.prompt_text)
            if self.sent_text:  # a continued stream's: back where the stream it continues was
                parser.feed(self.sent_text)
        return self.parsers[index]

    def _choices(self, completion: CompletionOutput) -> list[ChatCompletionStreamChoice]:
        """This output's chunks for its choice: reasoning, content (and logprobs) first, then one per tool-call
        delta; the last carries the finish reason. Empty when there is nothing to send yet (text held back)."""
        parser = self._parser(completion.index)
        parsed = parser.feed(completion.text)
        if completion.finish_reason is not None:
            parsed.extend(parser.finish())
        reasoning = parsed.reasoning if self.request.include_reasoning else ""
        has_tokens = self.request.logprobs and completion.token_ids
        if not (reasoning or parsed.content or parsed.tool_calls or completion.finish_reason or has_tokens):
            return []
        calls: list[DeltaToolCall | None] = parsed.tool_calls or [None]
        choices = [
            ChatCompletionStreamChoice(
                index=completion.index,
                delta=DeltaMessage(
                    content=(parsed.content or None) if position == 0 else None,
                    reasoning_content=(reasoning or None) if position == 0 else None,
                    tool_calls=None if call is None else [call],
                ),
            )
            for position, call in enumerate(calls)
        ]
        choices[0].logprobs = self.serving.make_logprobs(self.request, completion)
        choices[-1].finish_reason = finish_reason(completion.finish_reason, parser.num_calls > 0)
        choices[-1].stop_reason = completion.stop_reason
        return choices

    def format_end(self) -> str:
        if not self.request.is_usage_streamed:
            return ""
        num_reasoning_tokens = None
        if self.token_ids is not None:  # a reasoning parser's: every choice's (a finished one continued has none yet)
            num_reasoning_tokens = sum(
                self.serving.num_reasoning_tokens(self.request, self._parser(index), self.token_ids.get(index, []))
                for index in range(self.request.n)
            )
        usage = UsageInfo.of(self.num_prompt_tokens, self.num_completion_tokens, num_reasoning_tokens)
        return sse_event(self._chunk([], usage))

    def _chunk(
        self, choices: list[ChatCompletionStreamChoice], usage: UsageInfo | None = None
    ) -> ChatCompletionStreamResponse:
        return ChatCompletionStreamResponse(
            id=self.request_id,
            created=self.created,
            model=self.request.model or self.serving.model_id,
            choices=choices,
            usage=usage,
        )
