"""``/v1/embeddings``: inputs (texts or token ids, one or a batch) to one pooling request each, answered
with one ``EmbeddingResponse`` (never streamed): ``data[i]`` is input ``i``'s vector; usage counts each
input's tokens once.

Every input is tokenized and checked (not empty, at most ``max_model_len`` tokens after
``truncate_prompt_tokens``) before any engine request starts, so a bad batch is one 400 and costs the
engine nothing; the engine checks the rest (``dimensions`` against the model, a ``runner`` that serves no
embeddings), also a 400.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from engine.entrypoints.openai.call_options import PLAIN_CALL, CallOptions
from engine.entrypoints.openai.embeddings import EmbeddingData, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage
from engine.entrypoints.openai.errors import ErrorResponse, from_exception
from engine.entrypoints.openai.serving_base import ServingBase, random_uuid
from engine.entrypoints.openai.streaming import collect_final_outputs
from engine.inputs import RequestOptions
from engine.pooling_params import PoolingParams
from engine.request_output import EmbeddingRequestOutput
from engine.sched.request import check_prompt_not_empty


class EmbeddingServing(ServingBase):
    async def embeddings(
        self, request: EmbeddingRequest, options: CallOptions = PLAIN_CALL
    ) -> AsyncIterator[ErrorResponse | EmbeddingResponse]:
        """One EmbeddingResponse or one ErrorResponse. ``options.lora_request``: the adapter the vectors come
        from (its hidden states); closing the iterator aborts the engine requests."""
        try:
            prompts = [self._checked_tokens(item, request) for item in request.inputs()]
            params = PoolingParams(dimensions=request.dimensions, normalize=request.normalize)
        except ValueError as exc:
            yield from_exception(exc)
            return
        request_id = f"embd-{random_uuid()}"
        engine_options = RequestOptions(priority=request.priority, lora_request=options.lora_request)
        generators = [
            self.engine.encode({"prompt_token_ids": token_ids}, params, f"{request_id}-{index}", engine_options)
            for index, token_ids in enumerate(prompts)
        ]
        try:
            outputs = await collect_final_outputs(generators)
        except Exception as exc:  # noqa: BLE001 - every failure becomes an OpenAI error
            yield from_exception(exc)
            return
        yield self._response(request, request_id, outputs)

    def _checked_tokens(self, item: str | list[int], request: EmbeddingRequest) -> list[int]:
        """One input's token ids, truncated as asked; ValueError (vLLM's message) unless they fit the context."""
        if isinstance(item, str):
            token_ids = self.tokenizer.encode(item, add_special_tokens=request.add_special_tokens)
        else:
            token_ids = list(item)
        truncate = request.truncate_prompt_tokens
        if truncate is not None:
            if truncate > self.max_model_len:
                raise ValueError(
                    f"truncate_prompt_tokens ({truncate}) is greater than max_model_len ({self.max_model_len})."
                )
            token_ids = token_ids[-(self.max_model_len if truncate == -1 else truncate) :]
        check_prompt_not_empty(len(token_ids))
        if len(token_ids) > self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{len(token_ids)} tokens in the input for embedding generation. Please reduce the length of the input."
            )
        return token_ids

    def _response(
        self, request: EmbeddingRequest, request_id: str, outputs: list[EmbeddingRequestOutput | None]
    ) -> EmbeddingResponse | ErrorResponse:
        if any(output is None for output in outputs):  # an engine request was aborted (the engine stopping)
            return from_exception(RuntimeError("An embedding request was aborted before its vector was pooled."))
        num_prompt_tokens = sum(len(output.prompt_token_ids) for output in outputs)
        return EmbeddingResponse(
            id=request_id,
            model=request.model or self.model_id,  # an adapter's request: the name it used (vLLM)
            data=[
                EmbeddingData.of(index, output.outputs.embedding, request.encoding_format)
                for index, output in enumerate(outputs)
            ],
            usage=EmbeddingUsage(prompt_tokens=num_prompt_tokens, total_tokens=num_prompt_tokens),
        )
