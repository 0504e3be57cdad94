"""Errors in each API's shape and the exception -> HTTP status mapping.

Every failure a client can see is an :class:`ErrorResponse`: OpenAI's body
``{"error": {"message", "type", "param", "code"}}`` plus the HTTP status (and
``Retry-After`` for 503), which travel with it but stay out of the body. It is
a pydantic model, so it pickles across the Ray ingress / LLM-server boundary.
Where it reaches the client, the route's ``ApiStyle`` shapes it: OpenAI's body
as is, or Anthropic's ``{"type": "error", "error": {"type", "message"}}`` on
``/v1/messages`` (``MESSAGES_PATH``).
"""

from __future__ import annotations

import enum
import json
import logging
from http import HTTPStatus

from pydantic import BaseModel, Field, ValidationError
from starlette.responses import Response

from engine.engine_client import EngineDeadError, EngineOverloadedError

logger = logging.getLogger(__name__)

# Seconds an overloaded engine asks clients to wait before retrying.
RETRY_AFTER_S = 1

# OpenAI's error type for each status the server sends.
_ERROR_TYPES = {
    HTTPStatus.BAD_REQUEST: "BadRequestError",
    HTTPStatus.UNAUTHORIZED: "AuthenticationError",
    HTTPStatus.NOT_FOUND: "NotFoundError",
    HTTPStatus.METHOD_NOT_ALLOWED: "MethodNotAllowedError",
    HTTPStatus.REQUEST_ENTITY_TOO_LARGE: "RequestTooLargeError",
    HTTPStatus.INTERNAL_SERVER_ERROR: "InternalServerError",
    HTTPStatus.SERVICE_UNAVAILABLE: "ServiceUnavailableError",
}


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    """One error: ``body()`` is what the client reads, ``status_code`` / ``retry_after`` go in the headers."""

    error: ErrorInfo
    status_code: int = Field(exclude=True)
    retry_after: int | None = Field(None, exclude=True)

    def body(self) -> dict:
        return self.model_dump(mode="json")

    def headers(self) -> dict[str, str]:
        return {} if self.retry_after is None else {"Retry-After": str(self.retry_after)}


# Anthropic's error type for each status (its "overloaded_error" answers 529; here the status stays 503).
_ANTHROPIC_ERROR_TYPES = {
    HTTPStatus.BAD_REQUEST: "invalid_request_error",
    HTTPStatus.UNAUTHORIZED: "authentication_error",
    HTTPStatus.FORBIDDEN: "permission_error",
    HTTPStatus.NOT_FOUND: "not_found_error",
    HTTPStatus.METHOD_NOT_ALLOWED: "invalid_request_error",
    HTTPStatus.REQUEST_ENTITY_TOO_LARGE: "request_too_large",
    HTTPStatus.TOO_MANY_REQUESTS: "rate_limit_error",
    HTTPStatus.SERVICE_UNAVAILABLE: "overloaded_error",
}
MESSAGES_PATH = "/v1/messages"
DONE_EVENT = "data: [DONE]\n\n"


class ApiStyle(enum.Enum):
    """Whose shapes a route's errors and streams take (``endpoints.Endpoint.style``)."""

    OPENAI = "openai"
    ANTHROPIC = "anthropic"

    @classmethod
    def of_path(cls, path: str) -> ApiStyle:
        """The style of the route at ``path`` (for errors answered before any route: keys, body size, 404),
        under any route prefix."""
        return cls.ANTHROPIC if path.rstrip("/").endswith(MESSAGES_PATH) else cls.OPENAI

    def body(self, error: ErrorResponse) -> dict:
        if self is ApiStyle.OPENAI:
            return error.body()
        error_type = _ANTHROPIC_ERROR_TYPES.get(HTTPStatus(error.status_code), "api_error")
        return {"type": "error", "error": {"type": error_type, "message": error.error.message}}

    def response(self, error: ErrorResponse, headers: dict[str, str] | None = None) -> Response:
        """``error`` as an HTTP response: its status, its headers (plus ``headers``), this style's JSON body."""
        return Response(
            json.dumps(self.body(error)),
            status_code=error.status_code,
            headers={**error.headers(), **(headers or {})},
            media_type="application/json",
        )

    def late_error(self, error: ErrorResponse) -> str:
        """The events that end a stream failing after its first event: OpenAI's ``data: {"error"}`` and
        ``[DONE]``, or Anthropic's ``event: error``."""
        if self is ApiStyle.OPENAI:
            return f"data: {json.dumps(error.body())}\n\n" + DONE_EVENT
        return f"event: error\ndata: {json.dumps(self.body(error))}\n\n"

    @property
    def end(self) -> str:
        """What follows a stream's last event: OpenAI's ``[DONE]``; nothing after Anthropic's ``message_stop``."""
        return DONE_EVENT if self is ApiStyle.OPENAI else ""


def make_error(
    message: str, status: HTTPStatus, param: str | None = None, retry_after: int | None = None
) -> ErrorResponse:
    error_type = _ERROR_TYPES.get(status, status.phrase.replace(" ", "") + "Error")
    return ErrorResponse(
        error=ErrorInfo(message=message, type=error_type, param=param, code=int(status)),
        status_code=int(status),
        retry_after=retry_after,
    )


def error_response(error: ErrorResponse, headers: dict[str, str] | None = None) -> Response:
    """``error`` as an HTTP response in OpenAI's shape (``ApiStyle.response``)."""
    return ApiStyle.OPENAI.response(error, headers)


def bad_request(message: str, param: str | None = None) -> ErrorResponse:
    return make_error(message, HTTPStatus.BAD_REQUEST, param)


def model_not_found(model: str | None) -> ErrorResponse:
    return make_error(f"The model `{model}` does not exist.", HTTPStatus.NOT_FOUND, param="model")


def from_validation_error(exc: ValidationError) -> ErrorResponse:
    """A 400 naming every invalid field (instead of FastAPI's 422 shape)."""
    problems = []
    for error in exc.errors(include_url=False):
        location = ".".join(str(part) for part in error["loc"])
        message = error["msg"].removeprefix("Value error, ")
        problems.append(f"{location}: {message}" if location else message)
    first_location = exc.errors()[0]["loc"] if exc.errors() else ()
    param = str(first_location[0]) if first_location else None
    return bad_request("; ".join(problems), param=param)


class ServiceUnavailableError(RuntimeError):
    """Something the request needs (another pool of replicas) failed or is busy; retrying may work (503)."""


def from_exception(exc: BaseException) -> ErrorResponse:
    """Maps what the engine raises to a status: bad input 400, overload or unavailable 503, anything else 500."""
    if isinstance(exc, ServiceUnavailableError):
        return make_error(str(exc), HTTPStatus.SERVICE_UNAVAILABLE, retry_after=RETRY_AFTER_S)
    if isinstance(exc, EngineOverloadedError):
        return make_error(
            str(exc) or "The engine is overloaded; retry later.",
            HTTPStatus.SERVICE_UNAVAILABLE,
            retry_after=RETRY_AFTER_S,
        )
    if isinstance(exc, ValidationError):
        return from_validation_error(exc)
    if isinstance(exc, ValueError):
        return bad_request(str(exc))
    if isinstance(exc, EngineDeadError):
        logger.error("Request failed: the engine is dead: %s", exc)
        return make_error(f"The engine is dead: {exc}", HTTPStatus.INTERNAL_SERVER_ERROR)
    logger.exception("Internal error while serving a request", exc_info=exc)
    return make_error(f"Internal server error: {type(exc).__name__}: {exc}", HTTPStatus.INTERNAL_SERVER_ERROR)
