"""Per-request limits, enforced before a request reaches any model server.

* ``RequestLimits``: the knobs (the serve YAML's ``args.request_limits``), each
  with its default, its bound and what it caps; ``violation(request)`` names
  the first one a parsed request exceeds (400 in OpenAI's shape).
* ``LimitedRouter``: a ``ModelRouter`` that answers that 400 itself and
  passes every other request to the router it wraps.
* ``RequestBodyLimit``: ASGI middleware answering 413 to a body over
  ``max_request_body_bytes``, declared (``Content-Length``) or streamed.

Prompt length and ``max_tokens`` against ``max_model_len`` need the model's
tokenizer: ``ServingBase.check_context_length`` checks them in the model's
server, still before the engine sees the request.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from http import HTTPStatus
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException

from engine.entrypoints.openai.endpoints import Endpoint
from engine.entrypoints.openai.errors import ApiStyle, ErrorResponse, bad_request, make_error
from engine.entrypoints.openai.protocol import (
    MAX_LOGPROBS,
    MAX_N,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingRequest,
)

MIB = 1024 * 1024


class RequestLimits(BaseModel):
    """What one request may ask for. Defaults are safe for an open endpoint; lower them, or raise them
    up to each bound (the protocol's own caps for ``n`` and logprobs)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_request_body_bytes: int = Field(
        8 * MIB, ge=1024, le=1024 * MIB, description="Largest request body in bytes; beyond it 413."
    )
    max_n: int = Field(MAX_N, ge=1, le=MAX_N, description="Largest `n` (choices per prompt).")
    max_logprobs: int = Field(
        MAX_LOGPROBS,
        ge=0,
        le=MAX_LOGPROBS,
        description="Largest `logprobs` (completions) or `top_logprobs` (chat); OpenAI's cap is 20.",
    )
    max_stop_strings: int = Field(
        16, ge=0, le=1024, description="Most strings in `stop` (OpenAI allows 4; vLLM does not cap them)."
    )
    max_stop_string_chars: int = Field(
        512, ge=1, le=65536, description="Longest string in `stop`, in characters (each is matched every step)."
    )
    max_logit_bias_entries: int = Field(1024, ge=0, le=1 << 20, description="Most token ids in `logit_bias`.")

    def violation(self, request: BaseModel) -> ErrorResponse | None:
        """The first limit ``request`` exceeds, as a 400 naming its field; None: it is within every limit
        (requests without sampling fields, tokenize and detokenize, always are)."""
        if not isinstance(request, SamplingRequest):
            return None
        for param, what, value, knob in _measures(request):
            limit = getattr(self, knob)
            if value > limit:
                return bad_request(
                    f"{what} is {value}; this server allows at most {limit} (request_limits.{knob}).", param=param
                )
        return None


def _measures(request: SamplingRequest) -> list[tuple[str, str, int, str]]:
    """(field, what is measured, its value, the RequestLimits knob capping it) for each limited field."""
    stops = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    measures = [
        ("n", "n", request.n, "max_n"),
        ("stop", "the number of stop strings", len(stops), "max_stop_strings"),
        ("stop", "the length of the longest stop string", max(map(len, stops), default=0), "max_stop_string_chars"),
        ("logit_bias", "the number of logit_bias entries", len(request.logit_bias or {}), "max_logit_bias_entries"),
    ]
    if isinstance(request, CompletionRequest) and request.logprobs is not None:
        measures.append(("logprobs", "logprobs", request.logprobs, "max_logprobs"))
    if isinstance(request, ChatCompletionRequest) and request.top_logprobs is not None:
        measures.append(("top_logprobs", "top_logprobs", request.top_logprobs, "max_logprobs"))
    return measures


class LimitedRouter:
    """A ``ModelRouter`` that refuses requests beyond ``limits`` (one 400 item, nothing sent on) and
    hands the rest, untouched, to ``router``."""

    def __init__(self, router: Any, limits: RequestLimits) -> None:
        self.router = router
        self.limits = limits

    def model_ids(self) -> list[str]:
        return self.router.model_ids()

    def call(self, model_id: str, endpoint: Endpoint, request: BaseModel) -> AsyncGenerator[Any, None]:
        refusal = self.limits.violation(_measured(endpoint, request))
        if refusal is None:
            return self.router.call(model_id, endpoint, request)  # its own stream: no extra hop per item
        return _one_item(refusal)

    async def model_card(self, model_id: str) -> BaseModel:
        return await self.router.model_card(model_id)

    async def adapter_cards(self, model_id: str) -> list[BaseModel]:
        return await self.router.adapter_cards(model_id)

    async def check_health(self, model_id: str) -> None:
        await self.router.check_health(model_id)


def _measured(endpoint: Endpoint, request: BaseModel) -> BaseModel:
    """What the limits measure: a Responses request's sampling fields are those of the chat request it is
    served as (``ResponsesRequest.chat_request``)."""
    if endpoint is not Endpoint.RESPONSES:
        return request
    try:
        return request.chat_request()
    except ValueError:  # nothing to measure: the model's server answers this request's 400
        return request


async def _one_item(item: Any) -> AsyncGenerator[Any, None]:
    yield item


class RequestBodyLimit:
    """ASGI middleware: a body over ``max_bytes`` gets 413 (in the path's ``ApiStyle``) before the route reads it
    whole. A declared ``Content-Length`` is refused at once; a streamed body, as soon as it passes the limit
    (the route's body read raises the 413, which the app's HTTPException handler answers)."""

    def __init__(self, app: Callable, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            too_large = make_error(self._message(), HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
            await ApiStyle.of_path(scope["path"]).response(too_large)(scope, receive, send)
            return
        num_received = 0

        async def receive_within_limit() -> dict:
            nonlocal num_received
            message = await receive()
            if message["type"] == "http.request":
                num_received += len(message.get("body", b""))
                if num_received > self.max_bytes:
                    raise HTTPException(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, detail=self._message())
            return message

        await self.app(scope, receive_within_limit, send)

    def _message(self) -> str:
        return f"The request body is larger than this server's limit of {self.max_bytes} bytes."
