"""API keys (vLLM's ``--api-key``): ``Authorization: Bearer <key>``, or Anthropic's ``x-api-key: <key>``, on
every route that reaches a model.

The keys are the app's ``api_keys``, else the ``SERVAL_API_KEY`` environment
variable of the serving process, else none (no key asked). Open without a key:
``/health``, ``/version``, the OpenAPI schema and docs, and ``/metrics`` unless
``metrics_require_api_key``. Every other path, ``/v1/*``, ``/tokenize`` and
``/detokenize`` among them (vLLM leaves those two open), needs a key: a route
added later is closed until listed here.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Callable, Mapping, Sequence
from http import HTTPStatus

from engine.entrypoints.openai.errors import ApiStyle, make_error

API_KEY_ENV = "SERVAL_API_KEY"
OPEN_PATHS = frozenset({"/health", "/version", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})
METRICS_PATH = "/metrics"
_BEARER = b"bearer "


def resolve_api_keys(api_keys: Sequence[str], environ: Mapping[str, str] = os.environ) -> list[str]:
    """The keys a server asks for: ``api_keys`` if any, else ``SERVAL_API_KEY``'s one key; [] asks none."""
    if api_keys:
        return list(api_keys)
    from_env = environ.get(API_KEY_ENV, "")
    return [from_env] if from_env else []


class ApiKeyMiddleware:
    """ASGI middleware: 401 (in the path's ``ApiStyle``) unless a closed path carries one of ``api_keys``, as a
    bearer token or an ``x-api-key`` header.

    Keys are compared as SHA-256 digests with ``hmac.compare_digest``, against every key whatever
    matched: the time taken says neither how much of a key was right, nor its length, nor which one it was.
    """

    def __init__(self, app: Callable, api_keys: Sequence[str], metrics_require_api_key: bool) -> None:
        if not api_keys:
            raise ValueError("ApiKeyMiddleware needs at least one key.")
        self.app = app
        self.key_digests = [_digest(key.encode()) for key in api_keys]
        self.open_paths = OPEN_PATHS if metrics_require_api_key else OPEN_PATHS | {METRICS_PATH}

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or _route_path(scope) in self.open_paths or self._has_key(scope):
            await self.app(scope, receive, send)
            return
        missing = make_error(
            "Missing or invalid API key: send it as `Authorization: Bearer <key>` or `x-api-key: <key>`.",
            HTTPStatus.UNAUTHORIZED,
        )
        response = ApiStyle.of_path(_route_path(scope)).response(missing, headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)

    def _has_key(self, scope: dict) -> bool:
        headers = dict(scope["headers"])
        authorization = headers.get(b"authorization", b"")
        if authorization[: len(_BEARER)].lower() == _BEARER:
            presented = authorization[len(_BEARER) :].strip()
        elif b"x-api-key" in headers:  # Anthropic's clients send the key so
            presented = headers[b"x-api-key"].strip()
        else:
            return False
        digest = _digest(presented)
        matches = [hmac.compare_digest(digest, key_digest) for key_digest in self.key_digests]  # all, always
        return any(matches)


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


def _route_path(scope: dict) -> str:
    """The path the app routes on: a mount's (or Serve's route prefix's) ``root_path`` taken off."""
    path, root_path = scope["path"], scope.get("root_path", "")
    if root_path and path.startswith(root_path):
        return path[len(root_path) :] or "/"
    return path
