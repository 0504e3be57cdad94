"""How an endpoint's item stream (``serving.StreamItem``) becomes an HTTP response: by the declared type of its
first item, an ``SSEChunk`` -> an SSE stream of it and the rest; an ``ErrorResponse`` -> that status, its body
in the route's ``ApiStyle``; a response model -> a JSON body. A client that disconnects closes the item
stream, which aborts the engine requests. ``parse_body``: a request body parsed into its model.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Callable
from http import HTTPStatus

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from engine.entrypoints.openai.errors import (
    ApiStyle,
    ErrorResponse,
    bad_request,
    from_exception,
    from_validation_error,
    make_error,
)
from engine.entrypoints.openai.protocol import parse_json_object
from engine.entrypoints.openai.serving import StreamItem
from engine.entrypoints.openai.streaming import SSEChunk

# Returned (never sent) when the client went away before the first item.
HTTP_CLIENT_CLOSED_REQUEST = 499


async def parse_body(raw_request: Request, parse: Callable[[dict], BaseModel]) -> BaseModel | ErrorResponse:
    """The body, a JSON object, parsed by ``parse``; a 400 naming what is wrong (malformed JSON, invalid fields)."""
    try:
        return parse(parse_json_object(await raw_request.body()))
    except ValidationError as exc:
        return from_validation_error(exc)
    except ValueError as exc:
        return bad_request(str(exc))


def json_response(model: BaseModel, status_code: int = HTTPStatus.OK, headers: dict | None = None) -> Response:
    return Response(model.model_dump_json(), status_code=status_code, headers=headers, media_type="application/json")


class EventStreamResponse(StreamingResponse):
    """SSE; closes its item stream however the response ends (the client gone mid-stream included)."""

    media_type = "text/event-stream"

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


async def respond(
    items: AsyncGenerator[StreamItem, None], raw_request: Request, style: ApiStyle = ApiStyle.OPENAI
) -> Response:
    """The response the first item's type calls for (the stream is closed unless an SSE response takes it over);
    errors, also those after the first event of a stream, in ``style``."""
    try:
        first = await _first_item_unless_disconnected(items, raw_request)
    except StopAsyncIteration:
        first = make_error("The model server returned no response.", HTTPStatus.INTERNAL_SERVER_ERROR)
    except Exception as exc:  # noqa: BLE001 - e.g. a replica that died
        first = from_exception(exc)
    match first:
        case SSEChunk():
            return EventStreamResponse(_continue_stream(first, items, style))
        case None:
            response = Response(status_code=HTTP_CLIENT_CLOSED_REQUEST)
        case ErrorResponse():
            response = style.response(first)
        case _:
            response = json_response(first)
    await items.aclose()
    return response


async def _first_item_unless_disconnected(
    items: AsyncGenerator[StreamItem, None], raw_request: Request
) -> StreamItem | None:
    """The first item, or None if the client disconnected first (the pending call is then cancelled).

    A long non-streamed generation would otherwise run to the end for nobody.
    """
    next_item = asyncio.ensure_future(anext(items))
    disconnected = asyncio.ensure_future(_wait_for_disconnect(raw_request))
    try:
        await asyncio.wait({next_item, disconnected}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        disconnected.cancel()
        if not next_item.done():
            next_item.cancel()  # runs the stream's cleanup (engine abort) before it is closed
            await asyncio.wait({next_item})
    if next_item.cancelled():
        return None
    return next_item.result()


async def _wait_for_disconnect(raw_request: Request) -> None:
    while (await raw_request.receive())["type"] != "http.disconnect":
        pass


async def _continue_stream(
    first: SSEChunk, items: AsyncGenerator[StreamItem, None], style: ApiStyle
) -> AsyncGenerator[str, None]:
    async with contextlib.aclosing(items):
        yield first.text
        try:
            async for item in items:
                match item:
                    case SSEChunk():
                        yield item.text
                    case ErrorResponse():  # a router may report a late failure as an item
                        yield style.late_error(item)
                        return
        except Exception as exc:  # noqa: BLE001 - e.g. a replica that died mid-stream
            yield style.late_error(from_exception(exc))
