"""``CoreClient``: the front end's one handle on an engine core, wherever the core runs.

``make_core_client(config, placement)`` (``engine.core.make_client``) starts the core and returns its
client; every placement runs the same loop (``engine.core.core_proc.EngineCoreProc``) and speaks the same
messages (``CoreStep``, ...):

    INLINE          in the caller's thread, which turns the loop with ``step()`` (the offline ``LLM``;
                    vLLM's ``InprocClient``)
    THREAD          on a thread of this process, over an in-memory queue (nothing pickled)
    CHILD_PROCESS   in a child process, over a pipe (``engine.core.core_hosts``)
    RAY_ACTOR       in a Ray actor beside this process, over a pipe (``cluster.core_actor``), for a core that
                    drives Ray worker actors (TP/PP) or moves KV blocks through Ray

The contract, for every client:
- ``add_request``, ``abort_requests``, ``call`` (run an ``EngineCore`` method between steps) and
  ``check_health`` may be called from any thread; commands are applied in the order sent.
- A core that steps on its own (all but INLINE) sends each ``CoreStep`` to the sink given to ``attach``, in
  order, from a thread of the client's, and once it has died one ``on_died`` and nothing after. An INLINE
  core takes a step only in ``step()``, which returns it.
- ``take_step(step)`` (the front end, once per step, in order) returns the step's outputs and makes
  its state what ``get_stats``, ``kv_block_counts``, ``take_kv_load_latencies`` and ``take_kv_events`` read.
- ``shutdown`` stops the core and frees what it holds; idempotent.
"""

from __future__ import annotations

import enum
import itertools
import logging
from concurrent.futures import Future
from typing import Protocol

from engine.config import EngineConfig
from engine.core.core_proc import AbortRequests, CoreFailed, CoreStep, UtilityCall, UtilityResult
from engine.sched.kv_cache_manager import PrefixCacheStats
from engine.sched.kv_events import KVEventBatch
from engine.sched.request import Request
from engine.sched.scheduler import SchedulerStats

logger = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_S = 10.0


class CorePlacement(enum.Enum):
    """Where an engine core runs (the module docstring says what each means)."""

    INLINE = "inline"
    THREAD = "thread"
    CHILD_PROCESS = "child_process"
    RAY_ACTOR = "ray_actor"

    @property
    def in_this_process(self) -> bool:
        return self in (CorePlacement.INLINE, CorePlacement.THREAD)


def serving_placement(config: EngineConfig) -> CorePlacement:
    """Where serving (``AsyncLLM``) runs ``config``'s core: in another process unless ``engine_core_process``
    is off; a Ray actor when it drives Ray worker actors or moves KV through Ray (only a Ray worker can).

    A core actor holds no GPU of its own: an engine with KV transfer and one in-process CUDA worker keeps
    its core in this process.
    """
    parallel = config.parallel_config
    if not parallel.engine_core_process:
        return CorePlacement.THREAD
    if parallel.executor_backend == "ray":
        return CorePlacement.RAY_ACTOR
    if config.kv_transfer_config is None:
        return CorePlacement.CHILD_PROCESS
    from engine.worker.worker import resolve_device  # torch: only for this one case

    on_cpu = resolve_device(config.device_config.device).type == "cpu"
    return CorePlacement.RAY_ACTOR if on_cpu else CorePlacement.THREAD


class CoreSink(Protocol):
    """Where a core that steps on its own sends what it reports (``CoreClient.attach``)."""

    def on_step(self, step: CoreStep) -> None: ...

    def on_died(self, reason: str) -> None: ...


class CoreClient:
    """The contract is the module docstring's; this base keeps the reported state (``take_step``)."""

    pid: int | None = None  # the core's process id where it runs in another process
    num_blocks: int | None = None  # the KV pool's size, known once ready

    def __init__(self) -> None:
        self._latest: CoreStep | None = None
        self._kv_load_latencies: list[float] = []
        self._kv_events = KVEventBatch()

    def wait_ready(self) -> None:
        """Blocks until the core has loaded its model; raises RuntimeError if it failed to start."""

    def attach(self, sink: CoreSink) -> None:
        raise NotImplementedError(f"A {type(self).__name__} core steps only when step() is called.")

    def step(self) -> CoreStep:
        raise NotImplementedError(f"A {type(self).__name__} core steps on its own: attach a sink.")

    def add_request(self, request: Request) -> None:
        raise NotImplementedError

    def abort_requests(self, request_ids) -> None:
        raise NotImplementedError

    def call(self, method: str, timeout_s: float = 30.0):
        """Runs ``EngineCore.<method>()`` between steps; returns its value or raises its error (with the core's
        traceback as a note)."""
        raise NotImplementedError

    def check_health(self) -> None:
        """Raises if the core is gone or its executor's own check fails (a Ray worker lost)."""
        self.call("check_health")

    def check_integrity(self) -> None:
        """Raises AssertionError unless the core's KV cache is consistent (``KVCacheManager.check_integrity``),
        checked between steps."""
        self.call("check_integrity")

    def shutdown(self) -> None:
        raise NotImplementedError

    def take_step(self, step: CoreStep) -> list:
        """Makes ``step`` the state the readers below see; returns its outputs (the front end)."""
        self._latest = step
        self._kv_load_latencies.extend(step.kv_load_latencies)
        if step.kv_events:
            self._kv_events.merge(step.kv_events)
        return step.outputs

    def get_stats(self) -> SchedulerStats:
        if self._latest is None:
            return SchedulerStats(0, 0, 0.0, 0, PrefixCacheStats())
        return self._latest.scheduler_stats

    def kv_block_counts(self) -> tuple[int, int]:
        """(usable KV blocks, free ones) after the latest step."""
        return (self.num_blocks - 1, self.num_blocks - 1) if self._latest is None else self._latest.kv_block_counts

    def take_kv_load_latencies(self) -> list[float]:
        latencies, self._kv_load_latencies = self._kv_load_latencies, []
        return latencies

    def take_kv_events(self) -> KVEventBatch:
        """The prefix cache's changes in the steps taken since the last call (empty without ``kv_events``)."""
        batch, self._kv_events = self._kv_events, KVEventBatch()
        return batch


class BackgroundCoreClient(CoreClient):
    """A core that steps on its own (THREAD, CHILD_PROCESS, RAY_ACTOR): what it sends arrives in
    ``_on_message`` (on a thread of the client's), utility calls wait for their results."""

    def __init__(self) -> None:
        super().__init__()
        self._sink: CoreSink | None = None
        self._calls: dict[int, Future] = {}
        self._call_ids = itertools.count()

    def attach(self, sink: CoreSink) -> None:
        """After ``wait_ready``: every CoreStep (then one on_died at the end) goes to ``sink``."""
        self._sink = sink
        self._start_delivery()

    def _start_delivery(self) -> None:
        """Starts handing the core's messages to ``_on_message`` (where they are not handed already)."""

    def _send(self, command: object) -> None:
        raise NotImplementedError

    def add_request(self, request: Request) -> None:
        self._send(request)

    def abort_requests(self, request_ids) -> None:
        self._send(AbortRequests(list(request_ids)))

    def call(self, method: str, timeout_s: float = 30.0):
        future: Future = Future()
        call_id = next(self._call_ids)
        self._calls[call_id] = future
        try:
            self._send(UtilityCall(call_id, method))
            return future.result(timeout=timeout_s)
        finally:
            self._calls.pop(call_id, None)

    def _on_message(self, message: object) -> None:
        """One message from the core (the protocol of ``engine.core.core_proc``)."""
        if isinstance(message, CoreStep):
            self._sink.on_step(message)
        elif isinstance(message, UtilityResult):
            future = self._calls.get(message.call_id)
            if future is None:
                return  # the caller timed out
            if message.error is not None:
                message.error.add_note(f"Raised in the engine core:\n{message.traceback}")
                future.set_exception(message.error)
            else:
                future.set_result(message.value)
        elif isinstance(message, CoreFailed):
            self._sink.on_died(f"The engine core failed:\n{message.error}")
        else:
            raise TypeError(f"Unknown engine-core message {message!r}")
