"""``/v1/chat/completions``: messages through the chat template to OpenAI chat
responses or SSE chunks.

A stream opens every choice with a ``{"role": "assistant", "content": ""}``
delta, then sends content deltas; the chunk that finishes a choice carries
its ``finish_reason``.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from engine.entrypoints.openai.errors import ErrorResponse, from_exception
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
    UsageInfo,
    unix_time,
)
from engine.entrypoints.openai.serving_base import ServingBase, random_uuid
from engine.entrypoints.openai.streaming import sse_event
from engine.request_output import CompletionOutput, RequestOutput


class ChatServing(ServingBase):
    async def chat(self, request: ChatCompletionRequest) -> AsyncIterator[ErrorResponse | ChatCompletionResponse | str]:
        """Not streamed: one ChatCompletionResponse or one ErrorResponse. Streamed: one ErrorResponse, or SSE strings.

        Closing the iterator aborts the engine request.
        """
        try:
            text, token_ids = self.render_chat(request)
            self.check_context_length(len(token_ids), request.requested_max_tokens)
            params = request.to_sampling_params(request.requested_max_tokens, request.num_logprobs)
        except ValueError as exc:
            yield from_exception(exc)
            return
        request_id = f"chatcmpl-{random_uuid()}"
        generators = self.start_requests(request_id, [{"prompt": text, "prompt_token_ids": token_ids}], params, request)
        async with contextlib.aclosing(
            self.respond(
                generators,
                request.stream,
                lambda outputs: self._response(request, request_id, outputs[0]),
                lambda: _ChatStream(self, request, request_id, num_prompt_tokens=len(token_ids)),
            )
        ) as items:
            async for item in items:
                yield item

    def make_logprobs(
        self, request: ChatCompletionRequest, completion: CompletionOutput
    ) -> ChatCompletionLogProbs | None:
        if not request.logprobs:
            return None
        return chat_logprobs(completion.token_ids, completion.logprobs or [], request.top_logprobs or 0, self.tokenizer)

    def _response(
        self, request: ChatCompletionRequest, request_id: str, output: RequestOutput
    ) -> ChatCompletionResponse:
        choices = [
            ChatCompletionResponseChoice(
                index=completion.index,
                message=ChatResponseMessage(content=completion.text),
                logprobs=self.make_logprobs(request, completion),
                finish_reason=completion.finish_reason,
                stop_reason=completion.stop_reason,
            )
            for completion in output.outputs
        ]
        num_completion_tokens = sum(len(completion.token_ids) for completion in output.outputs)
        return ChatCompletionResponse(
            id=request_id,
            model=self.model_id,
            choices=choices,
            usage=UsageInfo.of(len(output.prompt_token_ids), num_completion_tokens),
        )


class _ChatStream:
    """Per-request state of a streamed chat completion."""

    def __init__(
        self, serving: ChatServing, request: ChatCompletionRequest, request_id: str, num_prompt_tokens: int
    ) -> None:
        self.serving = serving
        self.request = request
        self.request_id = request_id
        self.created = unix_time()
        self.num_prompt_tokens = num_prompt_tokens
        self.num_completion_tokens = 0
        self.is_role_sent = False

    def format_batch(self, batch: list[tuple[int, RequestOutput]]) -> str:
        events = [] if self.is_role_sent else [self._role_event()]
        self.is_role_sent = True
        for _, output in batch:
            for completion in output.outputs:
                self.num_completion_tokens += len(completion.token_ids)
                has_tokens = self.request.logprobs and completion.token_ids
                if completion.text or completion.finish_reason or has_tokens:
                    events.append(sse_event(self._chunk([self._choice(completion)])))
        return "".join(events)

    def _role_event(self) -> str:
        """One chunk per choice (as vLLM sends them): clients often read only ``choices[0]``."""
        return "".join(
            sse_event(
                self._chunk([ChatCompletionStreamChoice(index=index, delta=DeltaMessage(role="assistant", content=""))])
            )
            for index in range(self.request.n)
        )

    def _choice(self, completion: CompletionOutput) -> ChatCompletionStreamChoice:
        delta = DeltaMessage(content=completion.text if completion.text else None)
        return ChatCompletionStreamChoice(
            index=completion.index,
            delta=delta,
            logprobs=self.serving.make_logprobs(self.request, completion),
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
        )

    def format_end(self) -> str:
        if not self.request.is_usage_streamed:
            return ""
        return sse_event(self._chunk([], UsageInfo.of(self.num_prompt_tokens, self.num_completion_tokens)))

    def _chunk(
        self, choices: list[ChatCompletionStreamChoice], usage: UsageInfo | None = None
    ) -> ChatCompletionStreamResponse:
        return ChatCompletionStreamResponse(
            id=self.request_id, created=self.created, model=self.serving.model_id, choices=choices, usage=usage
        )
