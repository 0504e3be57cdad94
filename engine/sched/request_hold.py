"""``RequestHold``: requests the engine core keeps from the scheduler until what they need is ready (their
grammar compiled: ``engine.structured_output.manager``; their LoRA adapter loaded: ``engine.lora.loading``).

A held request takes no KV and no seat in the batch; each holder hands its ready requests over between steps.
"""

from __future__ import annotations

from typing import Any


class RequestHold:
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
