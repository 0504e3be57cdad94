"""What the endpoint servings (completions, chat, tokenization) share: the
engine client, the tokenizer, the context-length check, starting engine
requests and turning their outputs into items.

Everything here runs before a request reaches the engine and raises
ValueError on bad input, which the endpoints turn into a 400 without
touching the requests already running.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence
from typing import Any

from engine.engine_client import EngineClient
from engine.entrypoints.openai.continuation import ResumedRequest, resumed_outputs
from engine.entrypoints.openai.errors import ApiStyle, from_exception
from engine.entrypoints.openai.protocol import SamplingRequest
from engine.entrypoints.openai.streaming import ResponseStream, collect_final_outputs, merge_streams, stream_events
from engine.inputs import RequestOptions
from engine.model.source import sampling_defaults
from engine.reasoning import reasoning_parser
from engine.request_output import RequestOutput
from engine.sampling_params import SamplingParams
from engine.sched.request import check_prompt_not_empty


def random_uuid() -> str:
    return uuid.uuid4().hex


class ServingBase:
    """One served model as an endpoint sees it: its engine client and the name clients call it by."""

    def __init__(self, engine: EngineClient, model_id: str) -> None:
        self.engine = engine
        self.model_id = model_id
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        config = engine.model_config
        self.sampling_defaults = sampling_defaults(config.model, config.generation_config)
        self.reasoning = reasoning_parser(config.reasoning_parser)  # None: the output is all content

    def sampling_params(
        self, request: SamplingRequest, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None
    ) -> SamplingParams:
        """``request``'s parameters, the model's sampling defaults filling the fields it left unset."""
        return request.to_sampling_params(max_tokens, logprobs, prompt_logprobs, defaults=self.sampling_defaults)

    def check_context_length(self, num_prompt_tokens: int, max_tokens: int | None) -> None:
        """Raises ValueError (vLLM's message) unless the prompt plus ``max_tokens`` fit the context.

        The OpenAI layer's only token-level prompt check: it answers 400 before any engine (a remote prefill
        pool included) sees the request. The engine checks again for its other callers (``Request``,
        ``Scheduler.add_request``).
        """
        check_prompt_not_empty(num_prompt_tokens)
        if max_tokens is None:
            if num_prompt_tokens >= self.max_model_len:
                raise ValueError(
                    f"This model's maximum context length is {self.max_model_len} tokens. However, your request "
                    f"has {num_prompt_tokens} input tokens, which leaves no room for the completion. Please "
                    "reduce the length of the messages."
                )
            return
        if num_prompt_tokens + max_tokens > self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the messages, {max_tokens} in "
                "the completion). Please reduce the length of the messages or completion."
            )

    def start_requests(
        self, request_id: str, prompts: Sequence[Mapping], params: SamplingParams, options: RequestOptions
    ) -> list[AsyncGenerator[RequestOutput, None]]:
        """One engine request per prompt, ids ``<request_id>-<i>``, each with ``options`` (``request_options``:
        the call's priority, cache salt and adapter); nothing runs until iterated."""
        return [
            self.engine.generate(prompt, params, f"{request_id}-{index}", options)
            for index, prompt in enumerate(prompts)
        ]

    def start_or_resume(
        self,
        request_id: str,
        prompts: Sequence[Mapping],
        params: SamplingParams,
        resumed: ResumedRequest | None,
        options: RequestOptions,
    ) -> list[AsyncGenerator[RequestOutput, None]]:
        """``start_requests``, or for a continued stream its one engine request (none once it had finished)."""
        if resumed is None:
            return self.start_requests(request_id, prompts, params, options)
        if resumed.params is None:
            return []
        [generator] = self.start_requests(
            f"{request_id}-r{resumed.num_generated}", [resumed.prompt], resumed.params, options
        )
        return [resumed_outputs(generator, resumed, self.tokenizer)]

    async def respond(
        self,
        generators: list[AsyncGenerator[RequestOutput, None]],
        is_stream: bool,
        make_response: Callable[[list[RequestOutput]], Any],
        make_stream: Callable[[], ResponseStream],
        style: ApiStyle = ApiStyle.OPENAI,
    ) -> AsyncIterator[Any]:
        """The items of started engine requests: not streamed, one response built from the final outputs
        (or one error); streamed, the ``SSEChunk``\\ s of ``make_stream()`` (``streaming.stream_events``, its
        end and late errors in ``style``)."""
        if not is_stream:
            try:
                outputs = await collect_final_outputs(generators)
            except Exception as exc:  # noqa: BLE001 - every failure becomes an OpenAI error
                yield from_exception(exc)
                return
            yield make_response(outputs)
            return
        async with contextlib.aclosing(stream_events(merge_streams(generators), make_stream(), style)) as items:
            async for item in items:
                yield item
