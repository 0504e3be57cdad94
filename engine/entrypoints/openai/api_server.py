"""The HTTP routes (OpenAI's, and Anthropic's ``/v1/messages``): handler functions of ``(router,
raw_request)`` and ``build_app``.

The handlers parse and validate the body (malformed JSON or invalid fields
-> 400 in the route's error shape, ``Endpoint.style``), pick the model
(unknown -> 404; omitted -> the only one served), call the router's
``Endpoint`` and turn its item stream into a response (``http_responses``).
The Responses API's routes (``responses_routes``) also use the app's response
store.

They are free functions so the Ray ingress can register them on its own
app with a router that calls Ray handles; ``build_app(LocalModelRouter(...))``
serves in-process models.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from http import HTTPStatus
from typing import Any, Protocol

from fastapi import FastAPI
from pydantic import BaseModel
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from engine.entrypoints.openai.auth import ApiKeyMiddleware, resolve_api_keys
from engine.entrypoints.openai.embeddings import EmbeddingRequest
from engine.entrypoints.openai.endpoints import Endpoint
from engine.entrypoints.openai.errors import (
    MESSAGES_PATH,
    ApiStyle,
    ErrorResponse,
    error_response,
    from_exception,
    make_error,
)
from engine.entrypoints.openai.http_responses import json_response, parse_body, respond
from engine.entrypoints.openai.limits import LimitedRouter, RequestBodyLimit
from engine.entrypoints.openai.lora_routes import (
    handle_load_lora_adapter,
    handle_unload_lora_adapter,
    model_cards,
    resolve_model,
)
from engine.entrypoints.openai.messages_protocol import MessagesRequest
from engine.entrypoints.openai.openapi_docs import request_body_docs
from engine.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
)
from engine.entrypoints.openai.response_store import InMemoryResponseStore, ResponseStore
from engine.entrypoints.openai.responses import ModelList
from engine.entrypoints.openai.responses_request import ResponsesRequest
from engine.entrypoints.openai.responses_routes import (
    handle_cancel_response,
    handle_create_response,
    handle_delete_response,
    handle_retrieve_response,
)
from engine.entrypoints.openai.server_options import ServerOptions
from engine.entrypoints.openai.serving import OpenAIServing, StreamItem

logger = logging.getLogger(__name__)


class ModelRouter(Protocol):
    """Where the handlers send a validated request: one ``OpenAIServing`` per model id, local or remote."""

    def model_ids(self) -> list[str]:
        """The served model ids."""

    def call(self, model_id: str, endpoint: Endpoint, request: BaseModel) -> AsyncGenerator[StreamItem, None]:
        """The items of ``OpenAIServing.call(endpoint, request)`` for that model.

        ``aclose()`` on the returned generator must stop the call (and so abort
        its engine requests); a remote router wraps its response stream in an
        async generator whose ``finally`` cancels it.
        """

    async def model_card(self, model_id: str) -> BaseModel:
        """That model's ``/v1/models`` entry (``OpenAIServing.model_card()``)."""

    async def adapter_cards(self, model_id: str) -> list[BaseModel]:
        """The ``/v1/models`` entries of that model's LoRA adapters (``OpenAIServing.adapter_cards()``)."""

    async def check_health(self, model_id: str) -> None:
        """Raises if that model's engine can no longer serve."""


class LocalModelRouter:
    """Serves ``OpenAIServing`` objects living in this process."""

    def __init__(self, servings: dict[str, OpenAIServing]) -> None:
        self.servings = dict(servings)

    def model_ids(self) -> list[str]:
        return list(self.servings)

    def call(self, model_id: str, endpoint: Endpoint, request: BaseModel) -> AsyncGenerator[StreamItem, None]:
        return self.servings[model_id].call(endpoint, request)

    async def model_card(self, model_id: str) -> BaseModel:
        return self.servings[model_id].model_card()

    async def adapter_cards(self, model_id: str) -> list[BaseModel]:
        return self.servings[model_id].adapter_cards()

    async def check_health(self, model_id: str) -> None:
        await self.servings[model_id].check_health()


# ---------------------------------------------------------------------------------------------- route handlers


async def handle_completions(router: ModelRouter, raw_request: Request) -> Response:
    return await _handle_endpoint(router, raw_request, Endpoint.COMPLETIONS, CompletionRequest.model_validate)


async def handle_chat(router: ModelRouter, raw_request: Request) -> Response:
    return await _handle_endpoint(router, raw_request, Endpoint.CHAT, ChatCompletionRequest.model_validate)


async def handle_messages(router: ModelRouter, raw_request: Request) -> Response:
    """Anthropic's Messages API: the request mapped onto a chat completion (``messages_protocol``)."""
    return await _handle_endpoint(router, raw_request, Endpoint.MESSAGES, parse_messages_request)


async def handle_tokenize(router: ModelRouter, raw_request: Request) -> Response:
    return await _handle_endpoint(router, raw_request, Endpoint.TOKENIZE, _parse_tokenize_request)


async def handle_detokenize(router: ModelRouter, raw_request: Request) -> Response:
    return await _handle_endpoint(router, raw_request, Endpoint.DETOKENIZE, DetokenizeRequest.model_validate)


async def handle_embeddings(router: ModelRouter, raw_request: Request) -> Response:
    return await _handle_endpoint(router, raw_request, Endpoint.EMBEDDINGS, EmbeddingRequest.model_validate)


async def handle_models(router: ModelRouter, raw_request: Request) -> Response:
    try:
        cards = await model_cards(router)
    except Exception as exc:  # noqa: BLE001 - a replica failing to answer
        return error_response(from_exception(exc))
    return json_response(ModelList(data=list(cards)))


async def handle_health(router: ModelRouter, raw_request: Request) -> Response:
    """200 when every model's engine can serve, else 503."""
    try:
        await asyncio.gather(*(router.check_health(model_id) for model_id in router.model_ids()))
    except Exception as exc:  # noqa: BLE001 - any failure means unhealthy
        return error_response(make_error(f"Unhealthy: {exc}", HTTPStatus.SERVICE_UNAVAILABLE))
    return Response(status_code=HTTPStatus.OK)


async def handle_version(router: ModelRouter, raw_request: Request) -> Response:
    try:
        version = importlib.metadata.version("serval")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return Response(json.dumps({"version": version}), media_type="application/json")


# (method, path, handler): build_app registers these; the Ray ingress registers the same on its app.
ROUTES: list[tuple[str, str, Callable[[ModelRouter, Request], Awaitable[Response]]]] = [
    ("POST", "/v1/completions", handle_completions),
    ("POST", "/v1/chat/completions", handle_chat),
    ("POST", MESSAGES_PATH, handle_messages),
    ("POST", "/v1/embeddings", handle_embeddings),
    ("POST", "/v1/responses", handle_create_response),
    ("GET", "/v1/responses/{response_id}", handle_retrieve_response),
    ("DELETE", "/v1/responses/{response_id}", handle_delete_response),
    ("POST", "/v1/responses/{response_id}/cancel", handle_cancel_response),
    ("GET", "/v1/models", handle_models),
    ("POST", "/tokenize", handle_tokenize),
    ("POST", "/detokenize", handle_detokenize),
    ("GET", "/health", handle_health),
    ("GET", "/version", handle_version),
    ("POST", "/v1/load_lora_adapter", handle_load_lora_adapter),
    ("POST", "/v1/unload_lora_adapter", handle_unload_lora_adapter),
]

# The JSON body each POST route parses (its schema is documented in /openapi.json: ``openapi_docs``).
REQUEST_MODELS: dict[str, Any] = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    MESSAGES_PATH: MessagesRequest,
    "/v1/embeddings": EmbeddingRequest,
    "/v1/responses": ResponsesRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
    "/v1/load_lora_adapter": LoadLoRAAdapterRequest,
    "/v1/unload_lora_adapter": UnloadLoRAAdapterRequest,
}


def build_app(
    router: ModelRouter, options: ServerOptions | None = None, response_store: ResponseStore | None = None
) -> FastAPI:
    """A FastAPI app serving ``ROUTES`` through ``router``; HTTP errors (404 route, 405) in OpenAI's shape.

    ``options`` (default ``ServerOptions()``): API keys, checked first, then ``request_limits``, all before
    ``router`` sees a request. ``response_store``: where ``/v1/responses`` keeps stored responses (default: an
    ``InMemoryResponseStore`` of ``options.response_store``'s size, in this process).
    """
    options = options or ServerOptions()
    router = LimitedRouter(router, options.request_limits)
    app = FastAPI(title="Serval OpenAI-compatible server")
    app.state.response_store = response_store or InMemoryResponseStore(options.response_store)
    for method, path, handler in ROUTES:
        docs = request_body_docs(REQUEST_MODELS.get(path))
        app.add_api_route(path, _bind(router, handler), methods=[method], openapi_extra=docs)
    app.add_exception_handler(HTTPException, http_exception_handler)
    app.add_exception_handler(Exception, internal_error_handler)
    app.add_middleware(RequestBodyLimit, max_bytes=options.request_limits.max_request_body_bytes)
    if api_keys := resolve_api_keys(options.api_keys):  # added last: the outermost, so it runs first
        app.add_middleware(ApiKeyMiddleware, api_keys=api_keys, metrics_require_api_key=options.metrics_require_api_key)
    return app


async def http_exception_handler(raw_request: Request, exc: HTTPException) -> Response:
    style = ApiStyle.of_path(raw_request.url.path)
    return style.response(make_error(str(exc.detail), HTTPStatus(exc.status_code)))


async def internal_error_handler(raw_request: Request, exc: Exception) -> Response:
    """A fault no handler caught (a router bug): 500 in the route's shape instead of plain text."""
    return ApiStyle.of_path(raw_request.url.path).response(from_exception(exc))


def _bind(router: ModelRouter, handler: Callable[[ModelRouter, Request], Awaitable[Response]]):
    async def endpoint(raw_request: Request) -> Response:
        return await handler(router, raw_request)

    endpoint.__name__ = handler.__name__
    return endpoint


async def _handle_endpoint(
    router: ModelRouter, raw_request: Request, endpoint: Endpoint, parse: Callable[[dict], BaseModel]
) -> Response:
    style = endpoint.style
    request = await parse_body(raw_request, parse)
    if isinstance(request, ErrorResponse):
        return style.response(request)
    model_id = await resolve_model(router, getattr(request, "model", None))
    if isinstance(model_id, ErrorResponse):
        return style.response(model_id)
    return await respond(router.call(model_id, endpoint, request), raw_request, style)


def parse_messages_request(body: dict) -> ChatCompletionRequest:
    """A Messages API body as the chat completion it maps to (``MessagesRequest.chat_request``)."""
    return MessagesRequest.model_validate(body).chat_request()


def _parse_tokenize_request(body: dict) -> BaseModel:
    if "messages" in body:
        return TokenizeChatRequest.model_validate(body)
    return TokenizeCompletionRequest.model_validate(body)
