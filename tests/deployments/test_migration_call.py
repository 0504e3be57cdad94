"""``MigratingCall``'s policy without a cluster: the replicas are scripted stand-ins for Serve's response
generator (items, then Ray's real ``ActorDiedError``). A tracked stream continues from what it sent; a
request that cannot move is sent again only before its first item; ``migration_limit`` and the retry
window end in an error item (an error event once streaming), never a cut. The real path, with replicas
killed, is tests/serve/test_migration.py."""

from __future__ import annotations

import asyncio
import json

from ray.exceptions import ActorDiedError

from deployments import migration
from deployments.migration import MigratingCall
from engine.entrypoints.openai.continuation import StreamDelta
from engine.entrypoints.openai.endpoints import Endpoint
from engine.entrypoints.openai.errors import ErrorResponse
from engine.entrypoints.openai.protocol import CompletionRequest
from engine.entrypoints.openai.streaming import SSEChunk

STREAM = CompletionRequest(model="m", prompt="p", stream=True)
DONE = SSEChunk("data: [DONE]\n\n")


class ScriptedResponse:
    """Serve's streaming response as the ingress sees it: an async iterator with ``cancel()``."""

    def __init__(self, items: list, dies: bool) -> None:
        self.items, self.dies, self.cancelled = items, dies, False

    def __aiter__(self):
        return self._run()

    async def _run(self):
        for item in self.items:
            yield item
        if self.dies:
            raise ActorDiedError()

    def cancel(self) -> None:
        self.cancelled = True


def item(text: str, token_ids: list[int], first: bool = False) -> SSEChunk:
    return SSEChunk(text, StreamDelta(token_ids, len(text), False, "cmpl-1", 7, [1, 2] if first else None))


def run(request, script: list[tuple[list, bool]], limit: int = 3) -> tuple[list, list, list]:
    """The client's items, each call's continuation, and the migrations recorded."""
    calls, migrations = [], []

    def open_call(continuation, track):
        calls.append((continuation, track))
        return ScriptedResponse(*script[len(calls) - 1])

    async def collect():
        return [
            x async for x in MigratingCall(Endpoint.COMPLETIONS, request, open_call, limit, migrations.append).items()
        ]

    return asyncio.run(collect()), calls, migrations


def test_a_stream_continues_from_what_it_sent():
    first = [item("ab", [10], first=True), item("c", [11, 12])]
    items, calls, migrations = run(STREAM, [(first, True), ([item("d", [13]), DONE], False)])
    assert [x.text for x in items] == ["ab", "c", "d", "data: [DONE]\n\n"]
    assert calls[0] == (None, True)
    continuation = calls[1][0]
    assert (continuation.prompt_token_ids, continuation.token_ids, continuation.num_sent_chars) == (
        [1, 2],
        [10, 11, 12],
        3,
    )
    assert (continuation.request_id, continuation.created) == ("cmpl-1", 7)
    assert migrations == ["continued"]


def test_a_dead_replica_still_routed_to_is_retried_without_counting(monkeypatch):
    monkeypatch.setattr(migration, "FIRST_BACKOFF_S", 0.0)
    script = [([item("a", [5], first=True)], True), ([], True), ([], True), ([DONE], False)]
    items, calls, migrations = run(STREAM, script, limit=1)
    assert [x.text for x in items] == ["a", "data: [DONE]\n\n"] and len(calls) == 4
    assert migrations == ["continued"]  # one migration, three calls to find a live replica


def test_the_limit_ends_the_stream_with_an_error_event():
    script = [([item("a", [5], first=True)], True), ([item("b", [6])], True)]
    items, calls, migrations = run(STREAM, script, limit=1)
    assert [x.text for x in items[:2]] == ["a", "b"] and len(calls) == 2 and migrations == ["continued"]
    error, done = items[2].text.split("\n\n")[:2]
    assert "migration_limit 1 reached" in json.loads(error[len("data: ") :])["error"]["message"]
    assert done == "data: [DONE]"


def test_off_before_the_first_item_is_an_error_response():
    items, calls, migrations = run(STREAM, [([], True)], limit=0)
    assert len(calls) == 1 and migrations == [] and calls[0] == (None, False)  # untracked: nothing to continue
    [error] = items
    assert isinstance(error, ErrorResponse) and error.status_code == 503
    assert "migration_limit is 0" in error.error.message


def test_a_request_that_cannot_move_is_only_sent_again_before_its_first_item():
    several = CompletionRequest(model="m", prompt="p", stream=True, n=2)
    items, calls, migrations = run(several, [([], True), ([SSEChunk("data: x\n\n")], True)])
    assert calls == [(None, False), (None, False)] and migrations == ["resent"]
    assert items[0].text == "data: x\n\n" and "cannot move once started" in items[1].text
    plain = CompletionRequest(model="m", prompt="p")
    items, calls, migrations = run(plain, [([], True), (["response"], False)])
    assert items == ["response"] and migrations == ["resent"]
