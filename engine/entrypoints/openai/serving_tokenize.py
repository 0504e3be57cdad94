"""vLLM's ``/tokenize`` and ``/detokenize``: text or messages to token ids, and back.

Neither reaches the engine's busy loop: both run on the event loop with the
engine client's tokenizer.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from engine.entrypoints.openai.call_options import PLAIN_CALL, CallOptions
from engine.entrypoints.openai.chat_template import render_chat
from engine.entrypoints.openai.errors import ErrorResponse, bad_request
from engine.entrypoints.openai.protocol import DetokenizeRequest, TokenizeChatRequest, TokenizeRequest
from engine.entrypoints.openai.responses import DetokenizeResponse, TokenizeResponse
from engine.entrypoints.openai.serving_base import ServingBase


class TokenizationServing(ServingBase):
    async def tokenize(
        self, request: TokenizeRequest, options: CallOptions = PLAIN_CALL
    ) -> AsyncIterator[ErrorResponse | TokenizeResponse]:
        """One TokenizeResponse (a prompt's token ids, or the chat template's for ``messages``), or one
        ErrorResponse. ``options`` change nothing (no engine request)."""
        try:
            if isinstance(request, TokenizeChatRequest):
                _, token_ids = render_chat(self.tokenizer, request)
            else:
                token_ids = self.tokenizer.encode(request.prompt, add_special_tokens=request.add_special_tokens)
        except ValueError as exc:
            yield bad_request(str(exc))
            return
        token_strs = self.tokenizer.convert_ids_to_tokens(token_ids) if request.return_token_strs else None
        yield TokenizeResponse(
            count=len(token_ids), max_model_len=self.max_model_len, tokens=token_ids, token_strs=token_strs
        )

    async def detokenize(
        self, request: DetokenizeRequest, options: CallOptions = PLAIN_CALL
    ) -> AsyncIterator[ErrorResponse | DetokenizeResponse]:
        """One DetokenizeResponse (the text of the token ids, special tokens kept), or one ErrorResponse.
        ``options`` change nothing (no engine request)."""
        vocab_size = self.engine.vocab_size
        bad = [token_id for token_id in request.tokens if not 0 <= token_id < vocab_size]
        if bad:
            yield bad_request(
                f"tokens contains ids outside the vocabulary (size {vocab_size}): {bad[:8]}.", param="tokens"
            )
            return
        yield DetokenizeResponse(prompt=self.tokenizer.decode(request.tokens))
