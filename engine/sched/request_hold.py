"""``RequestHold``: requests the engine core keeps from the scheduler until what they need is ready (their
grammar compiled: ``engine.structured_output.manager``; their LoRA adapter loaded: ``engine.lora.loading``).

A held request takes no KV and no seat in the batch. The core keeps its holds in a list and passes each new
request through them in order (``hold``); between steps each hold hands its ready requests to the next hold
(or, after the last, the scheduler) and finishes those that failed (``take_ready``). A new kind of hold is
one more subclass in that list, not one more branch in the core.
"""

from __future__ import annotations

import abc
from typing import Any


class RequestHold(abc.ABC):
    """The waiting requests, by id (``_waiting``: the holder's own entry per request)."""

    def __init__(self) -> None:
        self._waiting: dict[str, Any] = {}

    def has_waiting_requests(self) -> bool:
        return bool(self._waiting)

    def num_waiting_requests(self) -> int:
        return len(self._waiting)

    def abort_requests(self, request_ids) -> list[str]:
        """Forgets the given waiting requests; returns the ids that were not waiting here."""
        return [request_id for request_id in request_ids if self._waiting.pop(request_id, None) is None]

    @abc.abstractmethod
    def hold(self, request) -> bool:
        """Keeps ``request`` (True) until what it needs is ready, starting that work; False: it needs
        nothing from this hold and goes on at once."""

    @abc.abstractmethod
    def take_ready(self) -> tuple[list, list]:
        """(waiting requests now ready, in arrival order; requests that failed, finished with
        ``FINISHED_ERROR`` and their reason in ``stop_reason``); both leave the hold."""

    @abc.abstractmethod
    def wait(self, timeout_s: float) -> None:
        """Blocks until a waiting request may be ready or ``timeout_s`` passes (the core has nothing else to run)."""
