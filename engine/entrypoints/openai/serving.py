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
its engine requests.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from engine.engine_client import EngineClient
from engine.entrypoints.openai.continuation import Continuation, StreamProgress
from engine.entrypoints.openai.errors import ErrorResponse
from engine.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
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

# The endpoint methods a router may call by name (api_server and the Ray ingress use these names).
ENDPOINT_METHODS = ("completions", "chat", "tokenize", "detokenize")


class OpenAIServing:
    """One model's OpenAI endpoints: ``completions``, ``chat``, ``tokenize``, ``detokenize``
    (async iterators, see the module docstring), ``model_card()`` and ``check_health()``.

    It only routes: each endpoint's work is done by the serving it composes
    (completion, chat, tokenization), all over the same ``EngineClient``.
    """

    def __init__(self, engine: EngineClient, model_id: str, model_root: str | None = None) -> None:
        self.engine = engine
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
        return self._completion.completions(request, precomputed, continuation, progress)

    def chat(
        self,
        request: ChatCompletionRequest,
        precomputed: PrecomputedPrompt | None = None,
        continuation: Continuation | None = None,
        progress: StreamProgress | None = None,
    ) -> AsyncIterator[ErrorResponse | ChatCompletionResponse | str]:
        """``/v1/chat/completions`` (see ChatServing.chat)."""
        return self._chat.chat(request, precomputed, continuation, progress)

    def tokenize(self, request: TokenizeRequest) -> AsyncIterator[ErrorResponse | TokenizeResponse]:
        """vLLM's ``/tokenize`` (see TokenizationServing.tokenize)."""
        return self._tokenization.tokenize(request)

    def detokenize(self, request: DetokenizeRequest) -> AsyncIterator[ErrorResponse | DetokenizeResponse]:
        """vLLM's ``/detokenize`` (see TokenizationServing.detokenize)."""
        return self._tokenization.detokenize(request)

    def model_card(self) -> ModelCard:
        """This model's ``/v1/models`` entry."""
        return ModelCard(id=self.model_id, root=self.model_root, max_model_len=self.engine.max_model_len)

    async def check_health(self) -> None:
        """Raises EngineDeadError (or what a lost worker raised) if the engine can no longer serve."""
        await self.engine.check_health()
