"""KV handles across the engine-core pipe: they ride Ray calls, the pipe carries a key in their place.

A ``KVHandle``'s ``data`` holds Ray references (object references, an actor handle:
``cluster.kv_transfer``). The pipe between the front end and an engine core in another process
(``engine.core.core_proc``) pickles plainly, outside Ray; a reference pickled that way is pinned for the
life of the process that pickled it (Ray's out-of-band serialization): a leak per request. So a
handle's ``data`` never crosses the pipe. It crosses by a call to the core's Ray actor
(``cluster.core_actor``), which Ray counts like any other argument or return value, and the pipe
carries ``StashedKV(request_id)`` instead:

    front end -> core   a decode request:   host.stash_kv({request_id: data}) returns once the data is in
                                            the core's ``CORE_STASH``; then the Request, its handle's data
                                            a StashedKV, which the core swaps back (``unstash_request``)
    core -> front end   a prefill's output: the core puts the data in ``CORE_STASH`` and sends the output
                                            with StashedKV (``stash_outputs``); the front end takes the
                                            data back with host.claim_kv([request_id, ...])

Each entry is taken once; whoever takes it holds the references from then on (the request, then the
response). A stashed handle that is never taken (its taker died) goes with the core process.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Iterable
from typing import Any

from engine.sched.kv_transfer import KVHandle

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class StashedKV:
    """In a handle on the pipe, in place of its ``data``: the key it waits under in a ``KVStash``."""

    key: str


class KVStash:
    """Handle data waiting to be taken, by key; thread-safe (the core's actor puts from its own threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, Any] = {}

    def put(self, entries: dict[str, Any]) -> None:
        with self._lock:
            self._entries.update(entries)

    def take(self, keys: Iterable[str]) -> dict[str, Any]:
        """The entries under ``keys`` (removed); a key with none is absent from the result."""
        with self._lock:
            return {key: self._entries.pop(key) for key in keys if key in self._entries}

    def __len__(self) -> int:
        return len(self._entries)


CORE_STASH = KVStash()  # the engine core's, in its process (the core actor's)


def remote_kv_data(kv_transfer_params: dict | None) -> Any | None:
    """The ``data`` of the params' KV handle, or None without one."""
    handle = (kv_transfer_params or {}).get("remote_kv")
    return handle.data if isinstance(handle, KVHandle) else None


def with_remote_kv_data(kv_transfer_params: dict, data: Any | None) -> dict:
    """A copy of the params with the handle's ``data`` replaced, or without the handle when ``data`` is None
    (the KV is lost: a decode engine computes the prompt itself)."""
    params = dict(kv_transfer_params)
    handle = params.pop("remote_kv")
    if data is not None:
        params["remote_kv"] = dataclasses.replace(handle, data=data)
    return params


def unstash_request(request) -> None:
    """In the core: gives a request off the pipe its handle's data back from ``CORE_STASH``."""
    stashed = remote_kv_data(request.kv_transfer_params)
    if isinstance(stashed, StashedKV):
        data = CORE_STASH.take([stashed.key]).get(stashed.key)
        if data is None:
            logger.warning("Request %s: its KV handle never reached the core; computing its prompt.", stashed.key)
        request.kv_transfer_params = with_remote_kv_data(request.kv_transfer_params, data)


def stash_outputs(outputs: list) -> None:
    """In the core: moves each output's handle data into ``CORE_STASH`` (a StashedKV in its place)."""
    for output in outputs:
        data = remote_kv_data(output.kv_transfer_params)
        if data is not None:
            CORE_STASH.put({output.request_id: data})
            output.kv_transfer_params = with_remote_kv_data(output.kv_transfer_params, StashedKV(output.request_id))
