"""Where ``store: true`` responses are kept: the ``ResponseStore`` interface the HTTP layer uses, and
``InMemoryResponseStore``, bounded and TTL'd.

The HTTP layer (``responses_routes``) stores each finished response with its conversation (the items
``previous_response_id`` resolves to: the conversation before it, its input, its output) and reads them back
for ``GET /v1/responses/{id}`` and for requests continuing it. ``build_app`` serves an in-process store by
default; the Serve app passes a client of one named Ray actor per app (``deployments.response_store``), which
holds an ``InMemoryResponseStore`` itself, so every ingress replica sees the same responses and they outlive
any replica.

Bounded: at most ``max_responses`` responses and ``max_bytes`` of them (their JSON size), the oldest dropped
first; each is kept ``ttl_s`` seconds from when it was stored. A response larger than ``max_bytes`` alone is
not kept (logged).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

from pydantic import BaseModel, ConfigDict, Field

from engine.entrypoints.openai.response_items import Item
from engine.entrypoints.openai.response_object import ResponsesResponse

logger = logging.getLogger(__name__)
MIB = 1024 * 1024


class ResponseStoreOptions(BaseModel):
    """How much the app's response store holds, and for how long (the serve YAML's ``args.response_store``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_responses: int = Field(10_000, ge=1, le=10_000_000, description="Most stored responses; oldest dropped.")
    max_bytes: int = Field(
        256 * MIB, ge=MIB, le=64 * 1024 * MIB, description="Most bytes of stored responses (JSON); oldest dropped."
    )
    ttl_s: float = Field(
        24 * 3600.0, gt=0, le=365 * 24 * 3600.0, description="Seconds a stored response is kept from its creation."
    )


class StoredResponse(BaseModel):
    """One stored response and its ``conversation``: what a request with ``previous_response_id`` continues."""

    response: ResponsesResponse
    conversation: list[Item]

    @property
    def response_id(self) -> str:
        return self.response.id


class ResponseStore(Protocol):
    """The app's stored responses, by id (an expired or dropped one is no longer there)."""

    async def put(self, stored: StoredResponse) -> None:
        """Keeps ``stored`` (replacing one with the same id)."""

    async def get(self, response_id: str) -> StoredResponse | None:
        """The stored response, or None."""

    async def delete(self, response_id: str) -> bool:
        """Drops the response; False when it was not there."""


class InMemoryResponseStore:
    """A ``ResponseStore`` in this process's memory (see the module docstring). ``clock``: seconds, monotonic."""

    def __init__(self, options: ResponseStoreOptions | None = None, clock: Callable[[], float] = time.monotonic):
        self.options = options or ResponseStoreOptions()
        self.clock = clock
        self._entries: OrderedDict[str, tuple[float, int, StoredResponse]] = OrderedDict()  # oldest first
        self.num_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def configure(self, options: ResponseStoreOptions) -> None:
        """New bounds, applied now (an app redeployed with other ``response_store`` options)."""
        self.options = options
        self._evict()

    async def put(self, stored: StoredResponse) -> None:
        size = len(stored.model_dump_json())
        if size > self.options.max_bytes:
            logger.warning(
                "Response %s not stored: its %d bytes exceed response_store.max_bytes.", stored.response_id, size
            )
            return
        self._pop(stored.response_id)
        self._entries[stored.response_id] = (self.clock() + self.options.ttl_s, size, stored)
        self.num_bytes += size
        self._evict()

    async def get(self, response_id: str) -> StoredResponse | None:
        self._evict()
        entry = self._entries.get(response_id)
        if entry is None or entry[0] <= self.clock():  # expired (a TTL lowered since: not at the front)
            return None
        return entry[2]

    async def delete(self, response_id: str) -> bool:
        self._evict()
        return self._pop(response_id)

    def _pop(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.num_bytes -= entry[1]
        return entry is not None

    def _evict(self) -> None:
        """Drops the expired responses and, oldest first, those beyond the bounds (insertion order is expiry
        order: one TTL for all)."""
        now, options = self.clock(), self.options
        while self._entries:
            response_id, (expires_at, _, _) = next(iter(self._entries.items()))
            beyond = len(self._entries) > options.max_responses or self.num_bytes > options.max_bytes
            if expires_at > now and not beyond:
                return
            self._pop(response_id)
