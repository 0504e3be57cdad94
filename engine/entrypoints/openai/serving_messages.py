"""``/v1/messages``: Anthropic's Messages API over the chat serving.

The request arrives as the ``ChatCompletionRequest`` it maps to (``messages_protocol``), so rendering,
sampling, tools and the reasoning split are chat completions' own (``ChatServing.serve_chat``); only the
answer's shape is Anthropic's (``messages_responses``): a ``MessageResponse``, or the stream
``message_start``, each block's ``content_block_start`` / ``content_block_delta`` / ``content_block_stop``,
``message_delta`` (``stop_reason``, ``usage.output_tokens``) and ``message_stop``. Errors take Anthropic's
shape (``ApiStyle.ANTHROPIC``). A continued stream (request migration) replays the text it had sent through
a fresh parser, so its blocks go on where they were.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from engine.entrypoints.openai.call_options import PLAIN_CALL, CallOptions
from engine.entrypoints.openai.continuation import StreamProgress
from engine.entrypoints.openai.errors import ApiStyle, ErrorResponse
from engine.entrypoints.openai.messages_responses import MessageBlocks, MessageResponse, MessagesUsage, sse, stop_reason
from engine.entrypoints.openai.protocol import ChatCompletionRequest
from engine.entrypoints.openai.responses import unix_time
from engine.entrypoints.openai.serving_chat import ChatCall, ChatServing
from engine.entrypoints.openai.streaming import SSEChunk
from engine.request_output import RequestOutput

ID_PREFIX = "msg_"


class MessagesServing(ChatServing):
    async def messages(
        self, request: ChatCompletionRequest, options: CallOptions = PLAIN_CALL
    ) -> AsyncIterator[ErrorResponse | MessageResponse | SSEChunk]:
        """Not streamed: one MessageResponse or one ErrorResponse. Streamed: one ErrorResponse, or
        ``SSEChunk``\\ s of Anthropic's events."""
        async with contextlib.aclosing(
            self.serve_chat(request, options, ID_PREFIX, self._message, _MessagesStream, ApiStyle.ANTHROPIC)
        ) as items:
            async for item in items:
                yield item

    def _message(self, call: ChatCall, output: RequestOutput) -> MessageResponse:
        [completion] = output.outputs
        parser = self.choice_parser(call.request, call.prompt_text)
        blocks = MessageBlocks(call.request.include_reasoning)
        blocks.add(parser.feed(completion.text).extend(parser.finish()))
        blocks.close()
        reason, sequence = stop_reason(completion, parser.num_calls > 0)
        return MessageResponse(
            id=call.request_id,
            model=call.request.model or self.model_id,
            content=blocks.blocks,
            stop_reason=reason,
            stop_sequence=sequence,
            usage=MessagesUsage(input_tokens=len(output.prompt_token_ids), output_tokens=len(completion.token_ids)),
        )


class _MessagesStream:
    """Per-request state of a streamed answer: its parser and blocks, its tokens, its stop reason."""

    def __init__(self, serving: MessagesServing, call: ChatCall) -> None:
        self.serving = serving
        self.call = call
        self.request_id = call.request_id
        self.parser = serving.choice_parser(call.request, call.prompt_text)
        self.blocks = MessageBlocks(call.request.include_reasoning)
        self.is_started = False
        self.num_output_tokens = 0
        self.stop: tuple[str, str | None] = ("end_turn", None)
        self.progress = StreamProgress() if call.track else None  # a tracked stream: each chunk's StreamDelta
        if self.progress is not None:
            self.progress.request_id, self.progress.created = call.request_id, unix_time()
        if (resumed := call.resumed) is not None:  # message_start went out; the blocks go on where they were
            self.request_id, self.is_started = resumed.continuation.request_id, True
            self.num_output_tokens = resumed.num_generated
            self.blocks.add(self.parser.feed(call.sent_text(serving.tokenizer)))
            if resumed.params is None and self.num_output_tokens >= call.request.requested_max_tokens:
                self.stop = ("max_tokens", None)  # it had finished at the cap: nothing is left to generate
            resumed.progress(self.progress)

    def format_batch(self, batch: list[tuple[int, RequestOutput]]) -> str:
        events = [] if self.is_started else [self._message_start()]
        self.is_started = True
        for _, output in batch:
            [completion] = output.outputs
            self.num_output_tokens += len(completion.token_ids)
            if self.progress is not None:
                self.progress.add(output, completion.token_ids, completion.text, completion.finish_reason)
            delta = self.parser.feed(completion.text)
            if completion.finish_reason is not None:
                delta.extend(self.parser.finish())
                self.stop = stop_reason(completion, self.parser.num_calls > 0)
            events += self.blocks.add(delta)
        return "".join(sse(event) for event in events)

    def _message_start(self) -> dict:
        message = MessageResponse(
            id=self.request_id,
            model=self.call.request.model or self.serving.model_id,
            content=[],
            stop_reason=None,
            usage=MessagesUsage(input_tokens=self.call.num_prompt_tokens, output_tokens=0),
        )
        return {"type": "message_start", "message": message.model_dump()}

    def format_end(self) -> str:
        reason, sequence = self.stop
        events = [
            *self.blocks.close(),
            {
                "type": "message_delta",
                "delta": {"stop_reason": reason, "stop_sequence": sequence},
                "usage": {"output_tokens": self.num_output_tokens},
            },
            {"type": "message_stop"},
        ]
        return "".join(sse(event) for event in events)
