"""``OpenAIServing``: everything one served model answers, as picklable items.

Each endpoint is ONE method taking the validated request model and returning
an async iterator, so the same object serves in-process (``LocalModelRouter``)
and behind a Ray Serve handle (an LLM-server replica streams the items to the
ingress):

* not streamed: exactly one item, the response model or an ``ErrorResponse``;
* streamed: one ``ErrorResponse`` (then nothing), or ``str`` items of SSE
  events (``"data: ...\\n\\n"``, several joined when the engine is ahead of the
  consumer), the last ending with ``"data: [DONE]\\n\\n"``.

Nothing runs until the iterator is first advanced; closing it early aborts
its engine requests. A request whose ``model`` names a LoRA adapter
(``lora_models``) runs with it; an unknown adapter is one 404 item, a bad one
a 400. ``load_lora_adapter`` / ``unload_lora_adapter`` yield one
``LoRAAdapterStatus`` (vLLM's plain-text answer) or one ``ErrorResponse``.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from http import HTTPStatus

from pydantic import BaseModel

from engine.engine_client import EngineClient
from engine.entrypoints.openai.continuation import Continuation, StreamProgress
from engine.entrypoints.openai.errors import ErrorResponse, from_exception, make_error, model_not_found
from engine.entrypoints.openai.lora_models import AdapterNotFoundError, LoRAModels
from engine.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
)
from engine.entrypoints.openai.responses import (
    ChatCompletionResponse,
    CompletionResponse,
    DetokenizeResponse,
    ModelCard,
    TokenizeResponse,
)
from engine.entrypoints.openai.serving_base import PrecomputedPrompt
from engine.entrypoints.openai.serving_chat import ChatServing
from engine.entrypoints.openai.serving_completion import CompletionServing
from engine.entrypoints.openai.serving_tokenize import TokenizationServing
from engine.lora.request import LoRARequest

# The endpoint methods a router may call by name (api_server and the Ray ingress use these names).
ENDPOINT_METHODS = ("completions", "chat", "tokenize", "detokenize", "load_lora_adapter", "unload_lora_adapter")


class LoRAAdapterStatus(BaseModel):
    """What vLLM's adapter routes answer on success: a plain-text ``message``, status 200."""

    message: str


class OpenAIServing:
    """One model's OpenAI endpoints: ``completions``, ``chat``, ``tokenize``, ``detokenize``
    (async iterators, see the module docstring), ``model_card()`` and ``check_health()``.

    It only routes: each endpoint's work is done by the serving it composes
    (completion, chat, tokenization), all over the same ``EngineClient``.
    """

    def __init__(
        self, engine: EngineClient, model_id: str, model_root: str | None = None, lora: LoRAModels | None = None
    ) -> None:
        """``lora``: the adapters this model serves (None: none; a request naming one gets 404)."""
        self.engine = engine
        self.lora = lora
        self.model_id = model_id
        self.model_root = model_root if model_root is not None else engine.model_config.model
        self._completion = CompletionServing(engine, model_id)
        self._chat = ChatServing(engine, model_id)
        self._tokenization = TokenizationServing(engine, model_id)

    def completions(
        self,
        request: CompletionRequest,
        precomputed: PrecomputedPrompt | None = None,
        continuation: Continuation | None = None,
        progress: StreamProgress | None = None,
    ) -> AsyncIterator[ErrorResponse | CompletionResponse | str]:
        """``/v1/completions`` (see CompletionServing.completions)."""
        if not self._names_adapter(request.model):
            return self._completion.completions(request, precomputed, continuation, progress)
        return self._with_adapter(
            request.model, lambda lora: self._completion.completions(request, precomputed, continuation, progress, lora)
        )

    def chat(
        self,
        request: ChatCompletionRequest,
        precomputed: PrecomputedPrompt | None = None,
        continuation: Continuation | None = None,
        progress: StreamProgress | None = None,
    ) -> AsyncIterator[ErrorResponse | ChatCompletionResponse | str]:
        """``/v1/chat/completions`` (see ChatServing.chat)."""
        if not self._names_adapter(request.model):
            return self._chat.chat(request, precomputed, continuation, progress)
        return self._with_adapter(
            request.model, lambda lora: self._chat.chat(request, precomputed, continuation, progress, lora)
        )

    def tokenize(self, request: TokenizeRequest) -> AsyncIterator[ErrorResponse | TokenizeResponse]:
        """vLLM's ``/tokenize`` (see TokenizationServing.tokenize; an adapter tokenizes as its base model)."""
        if not self._names_adapter(request.model):
            return self._tokenization.tokenize(request)
        return self._with_adapter(request.model, lambda _: self._tokenization.tokenize(request))

    def detokenize(self, request: DetokenizeRequest) -> AsyncIterator[ErrorResponse | DetokenizeResponse]:
        """vLLM's ``/detokenize`` (see TokenizationServing.detokenize)."""
        if not self._names_adapter(request.model):
            return self._tokenization.detokenize(request)
        return self._with_adapter(request.model, lambda _: self._tokenization.detokenize(request))

    async def load_lora_adapter(self, request: LoadLoRAAdapterRequest) -> AsyncIterator[ErrorResponse | BaseModel]:
        """vLLM's ``/v1/load_lora_adapter``: 400 when dynamic loading is off, the name is in use or the adapter is
        bad (``LoRAModels.load``)."""
        try:
            if self.lora is None:
                raise ValueError(f"The model {self.model_id!r} serves no LoRA adapters (no lora_config).")
            yield LoRAAdapterStatus(message=await self.lora.load(request.lora_name, request.lora_path))
        except ValueError as exc:
            yield from_exception(exc)

    async def unload_lora_adapter(self, request: UnloadLoRAAdapterRequest) -> AsyncIterator[ErrorResponse | BaseModel]:
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
        self, model: str, endpoint: Callable[[LoRARequest | None], AsyncIterator]
    ) -> AsyncIterator[ErrorResponse | BaseModel | str]:
        """``endpoint``'s items with the adapter ``model`` names, or one error item (404 unknown, 400 bad)."""
        try:
            if self.lora is None:
                raise AdapterNotFoundError(model)
            lora_request = await self.lora.resolve(model)
        except AdapterNotFoundError:
            yield model_not_found(model)
            return
        except ValueError as exc:
            yield from_exception(exc)
            return
        async with contextlib.aclosing(endpoint(lora_request)) as items:
            async for item in items:
                yield item

    def model_card(self) -> ModelCard:
        """This model's ``/v1/models`` entry."""
        return ModelCard(id=self.model_id, root=self.model_root, max_model_len=self.engine.max_model_len)

    async def check_health(self) -> None:
        """Raises EngineDeadError (or what a lost worker raised) if the engine can no longer serve."""
        await self.engine.check_health()
