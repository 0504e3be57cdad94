"""``OpenAIServing``: everything one served model answers, as picklable items.

``call(endpoint, request, options)`` is the one way in: the ``Endpoint`` names what to serve, the validated
request model and a ``CallOptions`` say how, and it returns an async iterator of items, so the same object
serves in-process (``LocalModelRouter``) and behind a Ray Serve handle (an LLM-server replica streams the
items to the ingress). The items (``StreamItem``), each of a declared type:

* not streamed: exactly one item, the response model or an ``ErrorResponse``;
* streamed: one ``ErrorResponse`` (then nothing), or ``streaming.SSEChunk``\\ s of SSE events, the last
  ending with ``"data: [DONE]\\n\\n"``; a Responses stream (``serving_responses``) ends without it, and
  yields its finished ``ResponsesResponse`` just before its last chunk (for the HTTP layer's store).

Nothing runs until the iterator is first advanced; closing it early aborts
its engine requests. A request whose ``model`` names a LoRA adapter
(``lora_models``) runs with it; an unknown adapter is one 404 item, a bad one
a 400. ``LOAD_LORA_ADAPTER`` / ``UNLOAD_LORA_ADAPTER`` yield one
``LoRAAdapterStatus`` (vLLM's plain-text answer) or one ``ErrorResponse``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable
from http import HTTPStatus
from typing import Any

from pydantic import BaseModel

from engine.engine_client import EngineClient
from engine.entrypoints.openai.call_options import PLAIN_CALL, CallOptions
from engine.entrypoints.openai.endpoints import Endpoint
from engine.entrypoints.openai.errors import ErrorResponse, from_exception, make_error, model_not_found
from engine.entrypoints.openai.lora_models import AdapterNotFoundError, LoRAModels
from engine.entrypoints.openai.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from engine.entrypoints.openai.responses import ModelCard
from engine.entrypoints.openai.serving_completion import CompletionServing
from engine.entrypoints.openai.serving_embedding import EmbeddingServing
from engine.entrypoints.openai.serving_messages import MessagesServing
from engine.entrypoints.openai.serving_responses import ResponsesServing
from engine.entrypoints.openai.serving_tokenize import TokenizationServing
from engine.entrypoints.openai.streaming import SSEChunk

# What an endpoint call yields (see the module docstring): a response model, an error or an SSE chunk.
StreamItem = BaseModel | ErrorResponse | SSEChunk
# One endpoint: the validated request and the call's options -> its items.
EndpointMethod = Callable[[Any, CallOptions], AsyncIterator[StreamItem]]


class LoRAAdapterStatus(BaseModel):
    """What vLLM's adapter routes answer on success: a plain-text ``message``, status 200."""

    message: str


class OpenAIServing:
    """One model's OpenAI endpoints (``call``, see the module docstring), ``model_card()``, ``adapter_cards()``
    and ``check_health()``.

    It only routes: each endpoint's work is done by the serving it composes
    (completion, chat and messages, responses, tokenization, embedding), all over the same ``EngineClient``.
    """

    def __init__(
        self, engine: EngineClient, model_id: str, model_root: str | None = None, lora: LoRAModels | None = None
    ) -> None:
        """``lora``: the adapters this model serves (None: none; a request naming one gets 404)."""
        self.engine = engine
        self.lora = lora
        self.model_id = model_id
        self.model_root = model_root if model_root is not None else engine.model_config.model
        completion = CompletionServing(engine, model_id)
        chat = MessagesServing(engine, model_id)  # chat completions, and Anthropic's Messages API over them
        responses = ResponsesServing(engine, model_id)
        tokenization = TokenizationServing(engine, model_id)
        embedding = EmbeddingServing(engine, model_id)
        self._endpoints: dict[Endpoint, EndpointMethod] = {
            Endpoint.COMPLETIONS: completion.completions,
            Endpoint.CHAT: chat.chat,
            Endpoint.MESSAGES: chat.messages,
            Endpoint.RESPONSES: responses.responses,
            Endpoint.TOKENIZE: tokenization.tokenize,  # an adapter tokenizes as its base model
            Endpoint.DETOKENIZE: tokenization.detokenize,
            Endpoint.EMBEDDINGS: embedding.embeddings,  # an adapter's: its hidden states pooled
            Endpoint.LOAD_LORA_ADAPTER: self._load_lora_adapter,
            Endpoint.UNLOAD_LORA_ADAPTER: self._unload_lora_adapter,
        }

    def call(self, endpoint: Endpoint, request: Any, options: CallOptions = PLAIN_CALL) -> AsyncIterator[StreamItem]:
        """The items of ``endpoint`` for ``request`` (its validated request model), served as ``options`` say;
        a ``model`` naming an adapter resolves it first (``options.lora_request``; 404 unknown, 400 bad)."""
        serve = self._endpoints[endpoint]
        if not self._names_adapter(request.model):
            return serve(request, options)
        return self._with_adapter(serve, request, options)

    async def _load_lora_adapter(
        self, request: LoadLoRAAdapterRequest, options: CallOptions
    ) -> AsyncIterator[ErrorResponse | BaseModel]:
        """vLLM's ``/v1/load_lora_adapter``: 400 when dynamic loading is off, the name is in use or the adapter is
        bad (``LoRAModels.load``)."""
        try:
            if self.lora is None:
                raise ValueError(f"The model {self.model_id!r} serves no LoRA adapters (no lora_config).")
            yield LoRAAdapterStatus(message=await self.lora.load(request.lora_name, request.lora_path))
        except ValueError as exc:
            yield from_exception(exc)

    async def _unload_lora_adapter(
        self, request: UnloadLoRAAdapterRequest, options: CallOptions
    ) -> AsyncIterator[ErrorResponse | BaseModel]:
        """vLLM's ``/v1/unload_lora_adapter``: 404 for an adapter not held, 400 when dynamic loading is off."""
        if self.lora is None or not self.lora.dynamic_loading:
            yield from_exception(ValueError("Dynamic LoRA loading is off: set lora_config.dynamic_lora_loading_path."))
            return
        try:
            yield LoRAAdapterStatus(message=self.lora.unload(request.lora_name))
        except AdapterNotFoundError:
            yield make_error(f"The lora adapter '{request.lora_name}' cannot be found.", HTTPStatus.NOT_FOUND)

    def adapter_cards(self) -> list[ModelCard]:
        """The adapters' ``/v1/models`` entries (``LoRAModels.cards``)."""
        return [] if self.lora is None else self.lora.cards(self.engine.max_model_len)

    def _names_adapter(self, model: str | None) -> bool:
        return model is not None and model != self.model_id

    async def _with_adapter(
        self, serve: EndpointMethod, request: Any, options: CallOptions
    ) -> AsyncIterator[StreamItem]:
        """``serve``'s items with the adapter ``request.model`` names, or one error item (404 unknown, 400 bad)."""
        try:
            if self.lora is None:
                raise AdapterNotFoundError(request.model)
            lora_request = await self.lora.resolve(request.model)
        except AdapterNotFoundError:
            yield model_not_found(request.model)
            return
        except ValueError as exc:
            yield from_exception(exc)
            return
        async with contextlib.aclosing(
            serve(request, dataclasses.replace(options, lora_request=lora_request))
        ) as items:
            async for item in items:
                yield item

    def model_card(self) -> ModelCard:
        """This model's ``/v1/models`` entry."""
        return ModelCard(id=self.model_id, root=self.model_root, max_model_len=self.engine.max_model_len)

    async def check_health(self) -> None:
        """Raises EngineDeadError (or what a lost worker raised) if the engine can no longer serve."""
        await self.engine.check_health()
