"""``OpenAIServing``: everything one served model answers, as picklable items.

Each endpoint is ONE async-generator method taking the validated request
model, so the same object serves in-process (``LocalModelRouter``) and behind
a Ray Serve handle (an LLM-server replica streams the items to the ingress):

* not streamed: exactly one item, the response model or an ``ErrorResponse``;
* streamed: one ``ErrorResponse`` (then nothing), or ``str`` items of SSE
  events (``"data: ...\\n\\n"``, several joined when the engine is ahead of the
  consumer), the last ending with ``"data: [DONE]\\n\\n"``.

Closing an endpoint's iterator early aborts its engine requests.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from engine.async_llm import AsyncLLM
from engine.entrypoints.openai.errors import ErrorResponse, bad_request
from engine.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, \
    TokenizeChatRequest, TokenizeRequest
from engine.entrypoints.openai.responses import ChatCompletionResponse, CompletionResponse, DetokenizeResponse, \
    ModelCard, TokenizeResponse
from engine.entrypoints.openai.serving_base import ServingBase
from engine.entrypoints.openai.serving_chat import ChatServing
from engine.entrypoints.openai.serving_completion import CompletionServing

# The endpoint methods a router may call by name (api_server and the Ray ingress use these names).
ENDPOINT_METHODS = ("completions", "chat", "tokenize", "detokenize")


class OpenAIServing(ServingBase):
    """One model's OpenAI endpoints: ``completions``, ``chat``, ``tokenize``, ``detokenize``
    (async generators, see the module docstring), ``model_card()`` and ``check_health()``."""

    def __init__(self, engine: AsyncLLM, model_id: str, model_root: str | None = None) -> None:
        super().__init__(engine, model_id)
        self.model_root = model_root if model_root is not None else engine.config.model_config.model
        self._completion = CompletionServing(engine, model_id)
        self._chat = ChatServing(engine, model_id)

    async def completions(self, request: CompletionRequest
                          ) -> AsyncIterator[ErrorResponse | CompletionResponse | str]:
        """``/v1/completions`` (see CompletionServing.completions)."""
        async with contextlib.aclosing(self._completion.completions(request)) as items:
            async for item in items:
                yield item

    async def chat(self, request: ChatCompletionRequest) -> AsyncIterator[ErrorResponse | ChatCompletionResponse | str]:
        """``/v1/chat/completions`` (see ChatServing.chat)."""
        async with contextlib.aclosing(self._chat.chat(request)) as items:
            async for item in items:
                yield item

    def model_card(self) -> ModelCard:
        """This model's ``/v1/models`` entry."""
        return ModelCard(id=self.model_id, root=self.model_root, max_model_len=self.max_model_len)

    async def check_health(self) -> None:
        """Raises EngineDeadError if the engine can no longer serve."""
        await self.engine.check_health()

    async def tokenize(self, request: TokenizeRequest) -> AsyncIterator[ErrorResponse | TokenizeResponse]:
        """vLLM's ``/tokenize``: a prompt's token ids, or the chat template's for ``messages``."""
        try:
            if isinstance(request, TokenizeChatRequest):
                _, token_ids = self.render_chat(request)
            else:
                token_ids = self.tokenizer.encode(request.prompt, add_special_tokens=request.add_special_tokens)
        except ValueError as exc:
            yield bad_request(str(exc))
            return
        token_strs = self.tokenizer.convert_ids_to_tokens(token_ids) if request.return_token_strs else None
        yield TokenizeResponse(count=len(token_ids), max_model_len=self.max_model_len, tokens=token_ids,
                               token_strs=token_strs)

    async def detokenize(self, request: DetokenizeRequest) -> AsyncIterator[ErrorResponse | DetokenizeResponse]:
        """vLLM's ``/detokenize``: the text of token ids (special tokens kept)."""
        bad = [token_id for token_id in request.tokens if not 0 <= token_id < self.engine.vocab_size]
        if bad:
            yield bad_request(f"tokens contains ids outside the vocabulary (size {self.engine.vocab_size}): "
                              f"{bad[:8]}.", param="tokens")
            return
        yield DetokenizeResponse(prompt=self.tokenizer.decode(request.tokens))
