"""``/v1/completions``: prompts (text or token ids, one or a batch) to OpenAI
completion responses or SSE chunks.

Choice ``i * n + j`` is the j-th completion of the i-th prompt (vLLM's and
OpenAI's numbering); usage counts each prompt once.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from engine.entrypoints.openai.call_options import PLAIN_CALL, CallOptions, PrecomputedPrompt, request_options
from engine.entrypoints.openai.continuation import ResumedRequest, StreamProgress
from engine.entrypoints.openai.errors import ErrorResponse, from_exception
from engine.entrypoints.openai.logprobs import completion_logprobs
from engine.entrypoints.openai.protocol import CompletionRequest
from engine.entrypoints.openai.responses import (
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
    UsageInfo,
    unix_time,
)
from engine.entrypoints.openai.serving_base import ServingBase, random_uuid
from engine.entrypoints.openai.streaming import SSEChunk, sse_event
from engine.request_output import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams


class CompletionServing(ServingBase):
    async def completions(
        self, request: CompletionRequest, options: CallOptions = PLAIN_CALL
    ) -> AsyncIterator[ErrorResponse | CompletionResponse | SSEChunk]:
        """Not streamed: one CompletionResponse or one ErrorResponse. Streamed: one ErrorResponse, or
        ``SSEChunk``\\ s.

        ``options.precomputed``: the first prompt's token ids as the caller tokenized them, used instead of the
        tokenizer when that prompt is text (not for a ``continuation``; ``CallOptions``). Closing the iterator
        aborts the engine requests.
        """
        resumed, continuation = None, options.continuation
        try:
            prompts = self._tokenize_prompts(request, options.precomputed if continuation is None else None)
            params = self._sampling_params(request, prompts)
            if continuation is not None:
                resumed = ResumedRequest.of(continuation, self.tokenizer, params)
        except ValueError as exc:
            yield from_exception(exc)
            return
        request_id = f"cmpl-{random_uuid()}"
        generators = self.start_or_resume(request_id, prompts, params, resumed, request_options(request, options))
        async with contextlib.aclosing(
            self.respond(
                generators,
                request.stream,
                lambda outputs: self._response(request, request_id, prompts, outputs),
                lambda: _CompletionStream(self, request, request_id, prompts, resumed, options.track),
            )
        ) as items:
            async for item in items:
                yield item

    def _tokenize_prompts(self, request: CompletionRequest, precomputed: PrecomputedPrompt | None) -> list[dict]:
        """Engine prompts with their token ids (so lengths are checked here, before the engine)."""
        prompts = []
        for index, prompt in enumerate(request.prompts()):
            if isinstance(prompt, str):
                if index == 0 and precomputed is not None:
                    token_ids = precomputed.token_ids
                else:
                    token_ids = self.tokenizer.encode(prompt, add_special_tokens=request.add_special_tokens)
                prompts.append({"prompt": prompt, "prompt_token_ids": token_ids})
            else:
                prompts.append({"prompt_token_ids": list(prompt)})
        return prompts

    def _sampling_params(self, request: CompletionRequest, prompts: list[dict]) -> SamplingParams:
        for prompt in prompts:
            self.check_context_length(len(prompt["prompt_token_ids"]), request.max_tokens)
        # echo + logprobs reports the prompt's logprobs too (the first prompt token has none).
        prompt_logprobs = request.logprobs if request.echo and request.logprobs is not None else None
        return self.sampling_params(request, request.max_tokens, request.logprobs, prompt_logprobs)

    def prompt_text_of(self, prompt: dict) -> str:
        """The text of one of ``_tokenize_prompts``' prompts (echoed)."""
        return prompt["prompt"] if "prompt" in prompt else self.tokenizer.decode(prompt["prompt_token_ids"])

    def prompt_text(self, output: RequestOutput) -> str:
        return output.prompt if output.prompt is not None else self.tokenizer.decode(output.prompt_token_ids)

    def _response(
        self, request: CompletionRequest, request_id: str, prompts: list[dict], outputs: list[RequestOutput]
    ) -> CompletionResponse:
        choices = []
        num_completion_tokens = 0
        for prompt_index, output in enumerate(outputs):
            for completion in output.outputs:
                num_completion_tokens += len(completion.token_ids)
                choices.append(
                    self.make_choice(request, prompt_index, output, completion, echo=request.echo, text_offset=0)
                )
        num_prompt_tokens = sum(len(prompt["prompt_token_ids"]) for prompt in prompts)
        return CompletionResponse(
            id=request_id,
            model=request.model or self.model_id,  # an adapter's request: the name it used (vLLM)
            choices=choices,
            usage=UsageInfo.of(num_prompt_tokens, num_completion_tokens),
        )

    def make_choice(
        self,
        request: CompletionRequest,
        prompt_index: int,
        output: RequestOutput,
        completion: CompletionOutput,
        echo: bool,
        text_offset: int,
    ) -> CompletionResponseChoice:
        """One choice; with ``echo`` the prompt (text and logprobs) comes first."""
        text, token_ids, positions = completion.text, completion.token_ids, completion.logprobs or []
        if echo:
            text = self.prompt_text(output) + text
            token_ids = output.prompt_token_ids + token_ids
            # Prompt logprobs may still be partial while a long prompt is prefilled in chunks: pad them.
            prompt_positions = list(output.prompt_logprobs or [])
            prompt_positions += [None] * (len(output.prompt_token_ids) - len(prompt_positions))
            positions = prompt_positions + positions
        logprobs = None
        if request.logprobs is not None:
            logprobs = completion_logprobs(token_ids, positions, self.tokenizer, initial_text_offset=text_offset)
        return CompletionResponseChoice(
            index=prompt_index * request.n + completion.index,
            text=text,
            logprobs=logprobs,
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
        )


class _CompletionStream:
    """Per-request state of a streamed completion: what each choice has sent so far (a continued
    stream's: what the stream it continues had sent)."""

    def __init__(
        self,
        serving: CompletionServing,
        request: CompletionRequest,
        request_id: str,
        prompts: list[dict],
        resumed: ResumedRequest | None = None,
        track: bool = False,
    ) -> None:
        self.serving = serving
        self.request = request
        self.request_id = request_id
        self.created = unix_time()
        self.num_prompt_tokens = sum(len(prompt["prompt_token_ids"]) for prompt in prompts)
        self.num_completion_tokens = 0
        self.num_sent_chars: dict[int, int] = {}  # choice index -> characters of text streamed
        self.progress = StreamProgress() if track else None  # a tracked stream: each chunk's StreamDelta
        if self.progress is not None:
            self.progress.request_id, self.progress.created = request_id, self.created
        if resumed is not None:  # one choice, its echo (if any) already sent
            self.request_id, self.created = resumed.continuation.request_id, resumed.continuation.created
            self.num_completion_tokens = resumed.num_generated
            echo_chars = len(serving.prompt_text_of(prompts[0])) if request.echo else 0
            self.num_sent_chars[0] = echo_chars + resumed.continuation.num_sent_chars
            resumed.progress(self.progress)

    def format_batch(self, batch: list[tuple[int, RequestOutput]]) -> str:
        events = []
        for prompt_index, output in batch:
            for completion in output.outputs:
                self.num_completion_tokens += len(completion.token_ids)
                if self.progress is not None:
                    self.progress.add(output, completion.token_ids, completion.text, completion.finish_reason)
                event = self._event(prompt_index, output, completion)
                if event:
                    events.append(event)
        return "".join(events)

    def _event(self, prompt_index: int, output: RequestOutput, completion: CompletionOutput) -> str:
        index = prompt_index * self.request.n + completion.index
        is_first = index not in self.num_sent_chars
        echo = self.request.echo and is_first
        has_tokens = self.request.logprobs is not None and completion.token_ids
        if not (completion.text or completion.finish_reason or echo or has_tokens):
            return ""  # nothing new yet (text held back for a possible stop string)
        choice = self.serving.make_choice(
            self.request, prompt_index, output, completion, echo=echo, text_offset=self.num_sent_chars.get(index, 0)
        )
        self.num_sent_chars[index] = self.num_sent_chars.get(index, 0) + len(choice.text)
        return sse_event(self._chunk([choice]))

    def format_end(self) -> str:
        if not self.request.is_usage_streamed:
            return ""
        return sse_event(self._chunk([], UsageInfo.of(self.num_prompt_tokens, self.num_completion_tokens)))

    def _chunk(self, choices: list[CompletionResponseChoice], usage: UsageInfo | None = None):
        return CompletionStreamResponse(
            id=self.request_id,
            created=self.created,
            model=self.request.model or self.serving.model_id,
            choices=choices,
            usage=usage,
        )
