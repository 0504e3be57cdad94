"""OpenAI-shaped errors and the exception -> HTTP status mapping.

Every failure a client can see is an :class:`ErrorResponse`: OpenAI's body
``{"error": {"message", "type", "param", "code"}}`` plus the HTTP status (and
``Retry-After`` for 503), which travel with it but stay out of the body. It is
a pydantic model, so it pickles across the Ray ingress / LLM-server boundary.
"""

from __future__ import annotations

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
    """``error`` as an HTTP response: its status, its headers (plus ``headers``), OpenAI's JSON body."""
    return Response(
        json.dumps(error.body()),
        status_code=error.status_code,
        headers={**error.headers(), **(headers or {})},
        media_type="application/json",
    )


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
