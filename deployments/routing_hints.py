"""The ingress's half of KV-aware routing: a ``RoutingHint`` for each chat / completion request.

``RoutingHints`` tokenizes the prompt as the LLM server will (the same
tokenizer; chat and Responses requests through the same chat template,
``chat_template.render_chat``), once per request, in the ingress, so
``KVAwareRouter`` can hash its blocks and the replica can serve the prompt
without tokenizing it again (``precomputed_prompt``); ``session_middleware`` reads the
``x-session-id`` header into a context variable that the request's handle
call reads. A prompt the ingress cannot render gets no hint: the replica
answers its error, and the router falls back to load.
"""

from __future__ import annotations

import contextvars
from typing import Any

from deployments.kv_index import RoutingHint
from engine.entrypoints.openai.call_options import PrecomputedPrompt
from engine.entrypoints.openai.chat_template import render_chat
from engine.entrypoints.openai.endpoints import Endpoint
from engine.entrypoints.openai.lora_models import adapter_name

SESSION_HEADER = b"x-session-id"
session_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("serval_session_id", default=None)


def session_middleware(app):
    """ASGI middleware: ``session_id`` holds the request's ``x-session-id`` while it is served."""

    async def with_session(scope, receive, send):
        value = None
        if scope["type"] == "http":
            value = next((v.decode("latin-1") for k, v in scope["headers"] if k == SESSION_HEADER), None)
        token = session_id.set(value)
        try:
            await app(scope, receive, send)
        finally:
            session_id.reset(token)

    return with_session


class PromptTokenizer:
    """The servings' prompt rendering and tokenizing without an engine (no context-length check)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def prompt(self, endpoint: Endpoint, request: Any) -> PrecomputedPrompt | None:
        """The first prompt as the serving would render (chat, messages, responses: ``text``) and tokenize it;
        None for other endpoints."""
        if endpoint.renders_chat:
            text, token_ids = render_chat(self.tokenizer, request)
            return PrecomputedPrompt(token_ids, text)
        if endpoint is Endpoint.RESPONSES:  # rendered as the chat request it is served as
            text, token_ids = render_chat(self.tokenizer, request.chat_request())
            return PrecomputedPrompt(token_ids, text)
        if endpoint is Endpoint.COMPLETIONS:
            prompt = request.prompts()[0]
            if isinstance(prompt, str):
                return PrecomputedPrompt(self.tokenizer.encode(prompt, add_special_tokens=request.add_special_tokens))
            return PrecomputedPrompt(list(prompt))
        return None


def make_hint(
    tokenizer: PromptTokenizer | None,
    endpoint: Endpoint,
    request: Any,
    session: str | None,
    model_id: str | None = None,
) -> RoutingHint | None:
    """The request's hint (None when it has neither a prompt to hash nor a ``session`` id). ``model_id``: the
    served model's id, whose LoRA adapter ``request.model`` may name (either form, as the replica resolves it)."""
    prompt = None
    if tokenizer is not None:
        try:
            prompt = tokenizer.prompt(endpoint, request)
        except Exception:  # noqa: BLE001 - a bad prompt: the replica reports it, routing falls back to load
            prompt = None
    if prompt is None and session is None:
        return None
    token_ids, text = (None, None) if prompt is None else (prompt.token_ids, prompt.text)
    model = getattr(request, "model", None)
    lora_name = adapter_name(model, model_id) if model_id is not None and isinstance(model, str) else None
    return RoutingHint(token_ids, getattr(request, "cache_salt", None), session, text, lora_name)


def precomputed_prompt(endpoint: Endpoint, hint: Any) -> PrecomputedPrompt | None:
    """What the replica's serving may use of ``hint`` (a ``RoutingHint`` from ``make_hint``, or None) instead of
    rendering and tokenizing the prompt again: the token ids, and for chat and responses the rendered text as
    well (a hint of theirs without it is not used)."""
    if not isinstance(hint, RoutingHint) or hint.prompt_token_ids is None:
        return None
    if endpoint.renders_chat or endpoint is Endpoint.RESPONSES:
        return None if hint.prompt_text is None else PrecomputedPrompt(hint.prompt_token_ids, hint.prompt_text)
    if endpoint is Endpoint.COMPLETIONS:
        return PrecomputedPrompt(hint.prompt_token_ids)
    return None
