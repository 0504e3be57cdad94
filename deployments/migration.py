"""Request migration: a request whose LLM-server replica dies goes on on another replica.

The ingress calls a replica through a Serve handle; a replica that dies (SIGKILL, a lost node) shows up
as one of ``REPLICA_GONE`` raised by the handle's response. Then:

* a chat / completions stream that can move (``continuation.can_continue``: one choice, no tools, no
  output constraint) is continued on another replica from the tokens already generated
  (``continuation.Continuation``): the replica streams tracked ``SSEChunk``\\ s (the SSE text plus its
  ``StreamDelta``: the token ids of each delta), the ingress keeps the ids and the characters sent and passes
  each chunk on as it came, and the client's stream goes on
  under the same id, without an error; usage stays exact;
* any other request is sent again whole, if nothing of it was sent yet (non-streamed requests always);
* otherwise, or after ``migration_limit`` migrations, or when no replica answers within
  ``RETRY_WINDOW_S``, the client gets an OpenAI error: the response's status before anything was sent, a
  final ``data: {"error": ...}`` event after.

Serve keeps routing to a dead replica for a short while (until it learns of the death): a call that fails
before its first item is tried again with a short backoff, within ``RETRY_WINDOW_S``, without counting as a
migration.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Callable
from http import HTTPStatus
from typing import Any

from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.exceptions import ReplicaUnavailableError

from engine.entrypoints.openai.continuation import Continuation, StreamDelta, can_continue
from engine.entrypoints.openai.endpoints import Endpoint
from engine.entrypoints.openai.errors import ErrorResponse, make_error
from engine.entrypoints.openai.serving import StreamItem
from engine.entrypoints.openai.streaming import SSEChunk

logger = logging.getLogger("ray.serve")

# What a Serve handle's response raises when the replica serving it died (ActorDiedError is a RayActorError).
REPLICA_GONE = (RayActorError, ActorUnavailableError, ReplicaUnavailableError)
# How long one migration may look for a live replica; Serve drops a dead one from routing soon after it dies.
RETRY_WINDOW_S = 10.0
FIRST_BACKOFF_S = 0.05
MAX_BACKOFF_S = 1.0


class StreamState:
    """What the client has received of one request: whether anything, and for a stream that can move,
    the token ids generated and the characters of text sent (``continuation``)."""

    def __init__(self, is_tracked: bool) -> None:
        self.is_tracked = is_tracked
        self.is_started = False
        self.request_id = ""
        self.created = 0
        self.prompt_token_ids: list[int] | None = None
        self.token_ids: list[int] = []
        self.num_sent_chars = 0
        self.is_finished = False

    def advance(self, item: StreamItem) -> None:
        """Records that ``item`` went to the client, and what it carried if it is a tracked ``SSEChunk``."""
        self.is_started = True
        match item:
            case SSEChunk(delta=StreamDelta() as delta):
                self.request_id, self.created = delta.request_id, delta.created
                if delta.prompt_token_ids is not None and self.prompt_token_ids is None:
                    self.prompt_token_ids = delta.prompt_token_ids
                self.token_ids.extend(delta.token_ids)
                self.num_sent_chars += delta.num_chars
                self.is_finished = self.is_finished or delta.is_finished

    def continuation(self) -> Continuation | None:
        """Where the stream stands (None before its first item: the request is simply sent again)."""
        if not self.is_started:
            return None
        return Continuation(
            self.request_id,
            self.created,
            list(self.prompt_token_ids or []),
            list(self.token_ids),
            self.num_sent_chars,
            self.is_finished,
        )

    def can_resend(self) -> bool:
        """Whether another replica can take the request over: nothing sent yet, or a tracked stream."""
        return not self.is_started or (self.is_tracked and self.prompt_token_ids is not None)


def replica_gone_error(exc: BaseException, reason: str) -> ErrorResponse:
    return make_error(f"The model server serving this request died ({reason}): {exc}", HTTPStatus.SERVICE_UNAVAILABLE)


class MigratingCall:
    """One request's items from ``open_call(continuation, track)`` (a Serve handle call's response), moved to
    another replica when the one serving it dies (see the module docstring); ``on_migration(kind)`` is called
    for each migration, ``kind`` ``"continued"`` or ``"resent"``."""

    def __init__(
        self,
        endpoint: Endpoint,
        request: Any,
        open_call: Callable[[Continuation | None, bool], Any],
        migration_limit: int,
        on_migration: Callable[[str], None],
    ) -> None:
        self.open_call = open_call
        self.style = endpoint.style
        self.migration_limit = migration_limit
        self.on_migration = on_migration
        self.state = StreamState(migration_limit > 0 and can_continue(endpoint, request))

    async def items(self) -> AsyncGenerator[StreamItem, None]:
        """The client's items: the replica's, as they came; an error item once the request cannot go on."""
        num_migrations = 0
        gone_since: float | None = None  # when the current migration began looking for a live replica
        while True:
            received = False
            response = self.open_call(self.state.continuation(), self.state.is_tracked)
            try:
                async for item in response:
                    received = True
                    self.state.advance(item)
                    yield item
                return
            except REPLICA_GONE as exc:
                failure = exc
            finally:
                response.cancel()
            if received or gone_since is None:  # this replica died serving it: one more migration
                num_migrations += 1
                gone_since = time.monotonic()
                reason = self._refusal(num_migrations)
                if reason is None:
                    self.on_migration("continued" if self.state.is_started else "resent")
                    logger.warning("Migrating a request after its replica died (%s).", type(failure).__name__)
            else:
                reason = "no replica answered" if time.monotonic() - gone_since > RETRY_WINDOW_S else None
            if reason is not None:
                yield self._error_item(failure, reason)
                return
            await asyncio.sleep(_backoff(time.monotonic() - gone_since))

    def _refusal(self, num_migrations: int) -> str | None:
        """Why this request cannot migrate again, or None."""
        if self.migration_limit == 0:
            return "migration_limit is 0"
        if num_migrations > self.migration_limit:
            return f"migration_limit {self.migration_limit} reached"
        if not self.state.can_resend():
            return "this request cannot move once started (n > 1, several prompts, tools or an output constraint)"
        return None

    def _error_item(self, exc: BaseException, reason: str) -> ErrorResponse | SSEChunk:
        error = replica_gone_error(exc, reason)
        return SSEChunk(self.style.late_error(error)) if self.state.is_started else error


def _backoff(elapsed_s: float) -> float:
    """Short first (a dead replica soon leaves Serve's routing), longer while none answers."""
    return min(MAX_BACKOFF_S, FIRST_BACKOFF_S + elapsed_s / 4)
