"""The waiting queue under the two scheduling policies.

FCFS keeps arrival order (preempted requests go back to the front); priority
orders by (priority, arrival time), lower values first, as vLLM does.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator

from engine.sched.request import Request


class FCFSQueue:
    def __init__(self) -> None:
        self._requests: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._requests.append(request)

    def prepend(self, request: Request) -> None:
        """Puts a preempted request back at the front: it was admitted before everything waiting."""
        self._requests.appendleft(request)

    def peek(self) -> Request:
        return self._requests[0]

    def pop(self) -> Request:
        return self._requests.popleft()

    def remove(self, request: Request) -> None:
        self._requests.remove(request)

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._requests)


class PriorityQueue:
    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._tiebreak = itertools.count()

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.priority, request.arrival_time, next(self._tiebreak), request))

    # A preempted request simply re-enters at its (priority, arrival) rank.
    prepend = add

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, request: Request) -> None:
        self._heap = [entry for entry in self._heap if entry[3] is not request]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[3] for entry in sorted(self._heap))


def make_request_queue(policy: str) -> FCFSQueue | PriorityQueue:
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue()
    raise ValueError(f"Unknown scheduling policy {policy!r}; choose 'fcfs' or 'priority'.")
