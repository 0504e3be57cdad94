"""The front end of ``AsyncLLM`` on the serving event loop (vLLM's ``output_handler`` task).

Everything that touches the ``LLMEngine`` front end runs on one event loop, the one serving requests: adds
(tokenize, validate, ``CoreClient.add_request``) and aborts in the caller's coroutine, and each ``CoreStep``
(detokenize, stop strings, stats) in ``OutputHandler.drain``, which puts every output straight into its
request's ``RequestOutputCollector`` (the request's ``OutputStream`` in ``OutputProcessor.requests``). A
step changes hands twice between the core and a consumer: the core client's thread (``engine.core``) gives
it to the ``StepBuffer`` (a ``CoreSink``), which wakes the loop with one ``call_soon_threadsafe`` per batch
of steps the loop has not taken yet (one per step while the loop keeps up).

One loop at a time: the handler serves the loop of the latest call, and moves to a new loop when a call
comes from one while the old one has stopped (tests run ``asyncio.run`` several times on one engine) or has
no request in flight (several servers on one engine, used in turn); the requests left on a stopped loop are
aborted then, and steps that arrived while no loop ran are taken first. A lock makes the move safe against
a wake-up still posted to the old loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading

from engine.core.core_client import SHUTDOWN_TIMEOUT_S
from engine.core.core_proc import CoreStep
from engine.engine_client import EngineDeadError, EngineOverloadedError
from engine.frontend.output_collector import PoolingOutputCollector, RequestOutputCollector
from engine.inputs import PromptType, RequestOptions
from engine.llm_engine import LLMEngine
from engine.metrics import EngineStats
from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams
from engine.sched.kv_events import KVEventBatch

logger = logging.getLogger(__name__)


def dead_error(reason: str, cause: BaseException | None) -> EngineDeadError:
    """The error every caller and stream gets once the engine is dead; ``cause``: what killed it (None: a stop)."""
    error = EngineDeadError(reason)
    error.__cause__ = cause
    return error


class StepBuffer:
    """The core's steps (from the core client's thread) until the event loop takes them, and its death; a
    ``CoreSink``. It wakes the loop it is given once per batch; with no loop, or a closed one, it calls
    ``off_loop`` (on the core client's thread) instead."""

    def __init__(self, off_loop) -> None:
        self._off_loop = off_loop
        self._lock = threading.Lock()
        self._steps: list[CoreStep] = []
        self.core_error: RuntimeError | None = None  # set once the core has died
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake = None  # the loop's callback that takes the steps
        self._is_wake_posted = False

    def on_step(self, step: CoreStep) -> None:
        with self._lock:
            self._steps.append(step)
            is_woken = self._post_wake()
        if not is_woken:
            self._off_loop()

    def on_died(self, reason: str) -> None:
        with self._lock:
            self.core_error = RuntimeError(reason)
            self._post_wake()  # with no loop: a dead core is seen by check_alive, released by stop

    @property
    def has_steps(self) -> bool:
        return bool(self._steps)

    def move_to(self, loop: asyncio.AbstractEventLoop, wake) -> None:
        """From now on ``wake`` runs on ``loop`` once steps wait."""
        with self._lock:
            self._loop, self._wake, self._is_wake_posted = loop, wake, False
            if self._steps or self.core_error is not None:
                self._post_wake()

    def take(self) -> tuple[list[CoreStep], RuntimeError | None]:
        """(the steps waiting, in order; the core's error or None); the loop only."""
        with self._lock:
            steps, self._steps = self._steps, []
            self._is_wake_posted = False
            return steps, self.core_error

    def _post_wake(self) -> bool:
        """True if the loop will take the steps (woken now or before); False: no loop, or a closed one."""
        if self._loop is None or self._loop.is_closed():
            return False
        if not self._is_wake_posted:
            try:
                self._loop.call_soon_threadsafe(self._wake)
            except RuntimeError:
                return False  # it closed just now
            self._is_wake_posted = True
        return True


class OutputHandler:
    """Owns an ``LLMEngine`` (whose core steps on its own) and runs its front end on the serving event loop.

    ``add``, ``abort`` and ``drain`` run on that loop; ``latest_stats``, ``take_kv_events``, ``check_alive``
    and ``stop`` are for any thread. While no loop is served (none yet, or the last one closed) the steps are
    processed where they arrive, or where ``latest_stats`` is called, under the same lock. Once the engine is
    dead (a step raised, the core died, or it was stopped) ``add`` and ``check_alive`` raise EngineDeadError,
    and so does every open stream.
    """

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.max_num_queued_reqs = engine.config.scheduler_config.max_num_queued_reqs
        self.stats: EngineStats = engine.get_stats()  # the latest snapshot; replaced whole, never mutated
        self._lock = threading.Lock()  # guards the dead state and the KV events
        self._engine_lock = threading.RLock()  # the engine's front end and the loop served: one thread at a time
        self._dead_reason: str | None = None
        self._dead_cause: BaseException | None = None
        self._is_released = False
        self._kv_events = KVEventBatch()  # the prefix cache's changes not taken yet
        # Core requests added since the latest step came in: the core may not count them as waiting yet.
        self._num_unreported_reqs = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._steps = StepBuffer(self.drain_off_loop)
        engine.engine_core.attach(self._steps)

    # ------------------------------------------------------------- the loop

    def add(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams,
        options: RequestOptions,
        collector: RequestOutputCollector | PoolingOutputCollector,
    ) -> tuple[str | None, list[int]]:
        """Queues a request whose outputs go to ``collector``; returns its (prompt text, prompt token ids).
        Raises ValueError (bad input), EngineOverloadedError or EngineDeadError, having queued nothing."""
        with self._engine_lock:
            self.check_alive()
            self._serve(asyncio.get_running_loop())
            self.check_alive()
            return self._add(request_id, prompt, params, options, collector)

    def _add(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams,
        options: RequestOptions,
        collector,
    ) -> tuple[str | None, list[int]]:
        limit = self.max_num_queued_reqs
        num_waiting = self.stats.num_waiting_reqs + self._num_unreported_reqs
        if limit is not None and num_waiting >= limit:
            raise EngineOverloadedError(
                f"{num_waiting} requests are already waiting (max_num_queued_reqs={limit}); retry later."
            )
        prompt_info = self.engine.add_request(request_id, prompt, params, options, collector)
        self._num_unreported_reqs += params.n
        self.stats = self.engine.get_stats()
        return prompt_info

    def abort(self, request_id: str) -> None:
        """Aborts the request and ends its stream ("abort"); nothing once the engine is dead."""
        loop = _running_loop()
        if self._dead_reason is not None or loop is None:
            return  # dead: nothing left to abort; no loop: a stream finalized outside one, aborted on the move
        with self._engine_lock:
            self._serve(loop)
            for collector in self.engine.abort_request([request_id]):
                collector.put_abort()
            self.stats = self.engine.get_stats()

    def drain(self) -> None:
        """Processes the steps waiting, in order: each output into its stream, then the stats published."""
        with self._engine_lock:
            if _running_loop() is self._loop:  # not a wake-up posted to a loop since left
                self._drain()

    def drain_off_loop(self) -> None:
        """Processes the steps waiting here, if no loop is served; the requests left on a closed loop are
        aborted first. A death found here is only marked (``stop`` releases the engine, off the core's thread)."""
        with self._engine_lock:
            if self._loop is None or self._loop.is_closed():
                self._abort_orphans()
                self._drain(on_loop=False)

    def _drain(self, on_loop: bool = True) -> None:
        steps, core_error = self._steps.take()
        if self._dead_reason is not None:
            return
        try:
            for step in steps:
                self.engine.process_core_step(step)
                self._num_unreported_reqs = 0
                self._publish()
            if core_error is not None and on_loop:
                raise core_error
        except Exception as error:
            logger.error("The engine died; every request in flight fails with EngineDeadError: %s", error)
            self._mark_dead(f"The engine died: {error!r}", error)
            if on_loop:
                self._die()

    def _abort_orphans(self) -> None:
        orphans = list(self.engine.streams())  # their consumers' loop has stopped
        if orphans:
            self.engine.abort_request(orphans)

    def _serve(self, loop: asyncio.AbstractEventLoop) -> None:
        """Makes ``loop`` the one served, if it is not: the old one must have stopped or be idle."""
        old = self._loop
        if loop is old:
            return
        is_old_running = old is not None and not old.is_closed() and old.is_running()
        if is_old_running and self.engine.has_unfinished_requests():
            raise RuntimeError("This AsyncLLM serves requests on another event loop: one loop at a time.")
        self._loop = loop
        self._abort_orphans()
        self._steps.move_to(loop, self.drain)
        self._drain()

    def _publish(self) -> None:
        kv_events = self.engine.take_kv_events()
        self.stats = self.engine.get_stats()
        if kv_events:
            with self._lock:
                self._kv_events.merge(kv_events)

    # ------------------------------------------------------------- any thread

    def latest_stats(self) -> EngineStats:
        """The snapshot published after the latest step processed (steps left by a closed loop taken first)."""
        loop = self._loop
        if self._steps.has_steps and (loop is None or loop.is_closed()):
            self.drain_off_loop()
        return self.stats

    def take_kv_events(self) -> KVEventBatch:
        """The prefix cache's changes published since the last call (empty unless the engine keeps them)."""
        with self._lock:
            batch, self._kv_events = self._kv_events, KVEventBatch()
        return batch

    def check_alive(self) -> None:
        """Raises EngineDeadError if the engine died (its core included) or was stopped."""
        with self._lock:
            if self._dead_reason is not None:
                raise dead_error(self._dead_reason, self._dead_cause)
        core_error = self._steps.core_error
        if core_error is not None:
            raise dead_error(f"The engine died: {core_error!r}", core_error)

    def stop(self) -> None:
        """Stops the engine: streams in flight end with EngineDeadError; on the served loop's thread when it
        runs (waiting for it), else here. Idempotent."""
        self._mark_dead("The engine was shut down.", None)
        loop = self._loop
        if loop is None or loop.is_closed() or not loop.is_running() or _running_loop() is loop:
            self._die()
            return
        done: concurrent.futures.Future = concurrent.futures.Future()
        try:
            loop.call_soon_threadsafe(lambda: done.set_result(self._die()))
            done.result(timeout=SHUTDOWN_TIMEOUT_S)
        except (RuntimeError, concurrent.futures.TimeoutError):  # the loop closed or hangs: release from here
            self._die()

    def _mark_dead(self, reason: str, cause: BaseException | None) -> None:
        """From now on every call and stream raises EngineDeadError (a cause replaces a stop's reason)."""
        with self._lock:
            if self._dead_reason is None or cause is not None:
                self._dead_reason, self._dead_cause = reason, cause

    def _die(self) -> None:
        """Ends every stream in flight with the dead engine's error, then releases the engine; once."""
        with self._engine_lock:
            with self._lock:
                reason, cause = self._dead_reason, self._dead_cause
                if self._is_released:
                    return
                self._is_released = True
            streams = self.engine.streams()
            for collector in streams.values():
                try:
                    collector.put_error(dead_error(reason, cause))
                except RuntimeError:
                    pass  # its loop is closed: nobody waits there
            try:
                if cause is None:  # a clean stop: leave the core consistent before releasing it
                    self.engine.abort_request(list(streams))
                self.engine.shutdown()
            except Exception:
                logger.exception("Releasing the engine failed.")


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
