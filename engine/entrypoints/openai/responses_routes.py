"""The Responses API's HTTP routes: ``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{response_id}``
and ``POST /v1/responses/{response_id}/cancel``; handlers of ``(router, raw_request)`` like ``api_server``'s.

The app's response store (a ``response_store.ResponseStore``: ``build_app`` puts it in ``app.state``) is used
here only, so the model servers hold no conversation state:

* a request with ``previous_response_id`` continues the conversation stored under that id, resolved here
  (``ResponsesRequest.with_history``); 404 when nothing is stored under it (never stored, expired, dropped or
  deleted);
* a finished ``store: true`` response is stored with its conversation before the client reads it complete:
  before the JSON body is sent, before a stream's last event;
* ``GET`` reads a stored response back and ``DELETE`` drops it (404 for an unknown id); ``cancel`` is a 400
  for a stored response (only background responses can be cancelled, and this server makes none) and a 404
  for an unknown one.

A store that fails answers 503.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncGenerator
from http import HTTPStatus

from starlette.requests import Request
from starlette.responses import Response

from engine.entrypoints.openai.endpoints import Endpoint
from engine.entrypoints.openai.errors import ErrorResponse, bad_request, error_response, make_error
from engine.entrypoints.openai.http_responses import json_response, parse_body, respond
from engine.entrypoints.openai.lora_routes import resolve_model
from engine.entrypoints.openai.response_object import DeletedResponse, ResponsesResponse
from engine.entrypoints.openai.response_store import ResponseStore, StoredResponse
from engine.entrypoints.openai.responses_request import ResponsesRequest
from engine.entrypoints.openai.serving import StreamItem

logger = logging.getLogger(__name__)


def app_response_store(raw_request: Request) -> ResponseStore:
    return raw_request.app.state.response_store


async def handle_create_response(router, raw_request: Request) -> Response:
    """``POST /v1/responses``: the response, JSON or streamed (``serving_responses``), stored if asked."""
    request = await parse_body(raw_request, ResponsesRequest.model_validate)
    if isinstance(request, ErrorResponse):
        return error_response(request)
    store = app_response_store(raw_request)
    history = []
    if request.previous_response_id is not None:
        stored = await _read(store, request.previous_response_id, "previous_response_id")
        if isinstance(stored, ErrorResponse):
            return error_response(stored)
        history = stored.conversation
    request = request.with_history(history)
    model_id = await resolve_model(router, request.model)
    if isinstance(model_id, ErrorResponse):
        return error_response(model_id)
    return await respond(_storing(router.call(model_id, Endpoint.RESPONSES, request), store, request), raw_request)


async def handle_retrieve_response(router, raw_request: Request) -> Response:
    """``GET /v1/responses/{response_id}``: the stored response."""
    if raw_request.query_params:
        unsupported = ", ".join(sorted(raw_request.query_params))
        return error_response(bad_request(f"Query parameters are not supported here ({unsupported}).", unsupported))
    stored = await _read(app_response_store(raw_request), raw_request.path_params["response_id"])
    return error_response(stored) if isinstance(stored, ErrorResponse) else json_response(stored.response)


async def handle_delete_response(router, raw_request: Request) -> Response:
    """``DELETE /v1/responses/{response_id}``: ``{"id", "object": "response", "deleted": true}``."""
    response_id = raw_request.path_params["response_id"]
    try:
        deleted = await app_response_store(raw_request).delete(response_id)
    except Exception as exc:  # noqa: BLE001 - the store's failure is the client's 503, not a crash
        return error_response(_store_failed(exc))
    if not deleted:
        return error_response(_not_found(response_id))
    return json_response(DeletedResponse(id=response_id))


async def handle_cancel_response(router, raw_request: Request) -> Response:
    """``POST /v1/responses/{response_id}/cancel``: 400 for a stored response (not a background one), else 404."""
    stored = await _read(app_response_store(raw_request), raw_request.path_params["response_id"])
    if isinstance(stored, ErrorResponse):
        return error_response(stored)
    return error_response(
        bad_request("Cannot cancel a synchronous response: only background responses can be cancelled.")
    )


async def _read(store: ResponseStore, response_id: str, param: str = "response_id") -> StoredResponse | ErrorResponse:
    try:
        stored = await store.get(response_id)
    except Exception as exc:  # noqa: BLE001 - the store's failure is the client's 503, not a crash
        return _store_failed(exc)
    return _not_found(response_id, param) if stored is None else stored


async def _storing(
    items: AsyncGenerator[StreamItem, None], store: ResponseStore, request: ResponsesRequest
) -> AsyncGenerator[StreamItem, None]:
    """The call's items, its finished ``ResponsesResponse`` stored first (with ``store: true``); a stream's is
    not passed on (its last event carries it). A failed store ends the items with a 503 error."""
    async with contextlib.aclosing(items):
        async for item in items:
            match item:
                case ResponsesResponse():
                    failure = await _store(store, request, item)
                    if failure is not None:
                        yield failure
                        return
                    if request.stream:
                        continue
            yield item


async def _store(store: ResponseStore, request: ResponsesRequest, response: ResponsesResponse) -> ErrorResponse | None:
    if not request.store:
        return None
    conversation = [*request.history, *request.input_items, *response.output]
    try:
        await store.put(StoredResponse(response=response, conversation=conversation))
    except Exception as exc:  # noqa: BLE001 - the store's failure is the client's 503, not a crash
        return _store_failed(exc)
    return None


def _not_found(response_id: str, param: str = "response_id") -> ErrorResponse:
    return make_error(f"Response with id '{response_id}' not found.", HTTPStatus.NOT_FOUND, param=param)


def _store_failed(exc: Exception) -> ErrorResponse:
    logger.error("The response store failed: %r", exc)
    return make_error(f"The response store failed: {exc}", HTTPStatus.SERVICE_UNAVAILABLE)
