"""The busy loop behind ``AsyncLLM``: a daemon thread that alone touches the ``LLMEngine``.

The event loop talks to it through a thread-safe command queue (add, abort,
shutdown) that the thread applies between steps, so requests join and leave
the running batch at step boundaries (continuous batching); it blocks on the
queue when there is no work. Each step's outputs go back to their requests'
event loops as one batch per loop (one ``call_soon_threadsafe``), into each
request's ``RequestOutputCollector``. After every step (and every batch of
commands) it publishes the engine's ``EngineStats``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from dataclasses import dataclass

from engine.core.core_client import CoreDied, EngineCoreProcess
from engine.core.core_proc import CoreStep
from engine.engine_client import EngineDeadError, EngineOverloadedError
from engine.frontend.output_collector import RequestOutputCollector
from engine.frontend.processor import PromptType
from engine.llm_engine import LLMEngine
from engine.lora.request import LoRARequest
from engine.metrics import EngineStats
from engine.request_output import RequestOutput
from engine.sampling_params import SamplingParams
from engine.sched.kv_events import KVEventBatch

logger = logging.getLogger(__name__)

# An idle engine takes no steps; it still reports its (idle) state this often, so that gauges exported
# through a pipeline that drops values not set recently (Ray's) read 0 rather than vanish.
IDLE_STATS_INTERVAL_S = 2.0


def dead_error(reason: str, cause: BaseException | None) -> EngineDeadError:
    """The error every caller and stream gets once the loop is dead; ``cause``: what killed it (None: a stop)."""
    error = EngineDeadError(reason)
    error.__cause__ = cause
    return error


@dataclass
class AddCommand:
    request_id: str
    prompt: PromptType
    params: SamplingParams
    priority: int
    cache_salt: str | None
    kv_transfer_params: dict | None
    collector: RequestOutputCollector
    # (prompt text, prompt token ids) once queued in the engine, or the ValueError that refused it.
    future: concurrent.futures.Future
    lora_request: LoRARequest | None = None  # multi-LoRA: the request's adapter


@dataclass
class _AbortCommand:
    request_id: str


@dataclass
class _IntegrityCheck:
    """``EngineCore.check_integrity`` of an in-process core, run by the busy loop between steps."""

    future: concurrent.futures.Future


_SHUTDOWN = object()


def _deliver(batch: list[tuple[RequestOutputCollector, RequestOutput]]) -> None:
    """Runs on the event loop: one step's outputs into their collectors.

    A completion the core finished with "error" (its grammar did not compile) ends its stream
    with a ValueError carrying the core's reason instead (a 400 over HTTP).
    """
    for collector, output in batch:
        failed = next((c for c in output.outputs if c.finish_reason == "error"), None)
        if failed is None:
            collector.put(output)
        else:
            collector.put_error(ValueError(str(failed.stop_reason)))


def _fail(collectors: list[RequestOutputCollector], reason: str, cause: BaseException | None) -> None:
    """Runs on the event loop: ends each stream with its own EngineDeadError."""
    for collector in collectors:
        collector.put_error(dead_error(reason, cause))


def _copy_shared_lists(output: RequestOutput) -> None:
    """The output processor hands out lists it keeps extending (prompt logprobs, cumulative logprobs);
    the event loop reads them while this thread steps on, so it gets copies."""
    if output.prompt_logprobs is not None:
        output.prompt_logprobs = list(output.prompt_logprobs)
    for completion in output.outputs:
        if completion.logprobs is not None:
            completion.logprobs = list(completion.logprobs)


class EngineThread:
    """The busy loop: a daemon thread that owns an LLMEngine and steps it while there is work.

    ``submit_add``, ``submit_abort``, ``stop`` and ``check_alive`` may be called
    from any thread, and ``stats`` read from any; everything else runs on the
    busy-loop thread. Once the loop is dead (it raised, or was stopped) every
    call that would queue work raises EngineDeadError, and so does every open stream.
    """

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.max_num_queued_reqs = engine.config.scheduler_config.max_num_queued_reqs
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        # Guards the dead state, the unapplied count and the stats snapshot together, so that the
        # overload check sees a consistent count and no command is queued after the loop has stopped.
        self._lock = threading.Lock()
        self._dead_reason: str | None = None
        self._dead_cause: BaseException | None = None
        self._num_unapplied_reqs = 0  # core requests (n per add) in the queue, not yet in the scheduler
        self._collector_of: dict[str, RequestOutputCollector] = {}  # busy-loop thread only: requests in the engine
        self.stats: EngineStats = engine.get_stats()  # the latest snapshot; replaced whole, never mutated
        self._kv_events = KVEventBatch()  # the prefix cache's changes not taken yet (guarded by _lock)
        # A core process steps on its own: its steps arrive in the command queue, in order with the commands.
        self._core_steps_itself = isinstance(engine.engine_core, EngineCoreProcess)
        if self._core_steps_itself:
            engine.engine_core.attach(self._commands.put)
        self.thread = threading.Thread(target=self._run, name="AsyncLLM-busy-loop", daemon=True)
        self.thread.start()

    # ------------------------------------------------------------- any thread

    def submit_add(self, command: AddCommand) -> None:
        """Queues an add. Raises EngineDeadError, or EngineOverloadedError when too many requests wait;
        on either nothing was queued."""
        with self._lock:
            self._raise_if_dead()
            limit = self.max_num_queued_reqs
            num_waiting = self.stats.num_waiting_reqs + self._num_unapplied_reqs
            if limit is not None and num_waiting >= limit:
                raise EngineOverloadedError(
                    f"{num_waiting} requests are already waiting (max_num_queued_reqs={limit}); retry later."
                )
            self._num_unapplied_reqs += command.params.n
            self._commands.put(command)

    def submit_abort(self, request_id: str) -> None:
        """Queues an abort; once the loop is dead nothing is left to abort and this does nothing."""
        with self._lock:
            if self._dead_reason is None:
                self._commands.put(_AbortCommand(request_id))

    def check_integrity(self, timeout_s: float = 30.0) -> None:
        """Raises AssertionError unless the core's KV cache is consistent (``KVCacheManager.check_integrity``),
        checked between steps: by a core process itself, or by this loop for an in-process core. Blocks; call
        it off the event loop."""
        if self._core_steps_itself:
            self.engine.engine_core.check_integrity()
            return
        check = _IntegrityCheck(concurrent.futures.Future())
        with self._lock:
            self._raise_if_dead()
            self._commands.put(check)
        check.future.result(timeout=timeout_s)

    def take_kv_events(self) -> KVEventBatch:
        """The prefix cache's changes published since the last call (empty unless the engine keeps them)."""
        with self._lock:
            batch, self._kv_events = self._kv_events, KVEventBatch()
        return batch

    def check_alive(self) -> None:
        """Raises EngineDeadError if the loop died, was stopped, or its thread is gone."""
        with self._lock:
            self._raise_if_dead()
        if not self.thread.is_alive():
            raise dead_error("The engine's busy-loop thread is gone.", None)

    def stop(self) -> None:
        """Stops the loop after the current step: streams in flight end with EngineDeadError. Idempotent."""
        with self._lock:
            if self._dead_reason is None:
                self._dead_reason = "The engine was shut down."
                self._commands.put(_SHUTDOWN)
        if self.thread is not threading.current_thread():
            self.thread.join()

    def _raise_if_dead(self) -> None:
        if self._dead_reason is not None:
            raise dead_error(self._dead_reason, self._dead_cause)

    # ------------------------------------------------------- busy-loop thread

    def _has_steps_to_take(self) -> bool:
        return not self._core_steps_itself and self.engine.has_unfinished_requests()

    def _run(self) -> None:
        try:
            while self._apply_commands(block=not self._has_steps_to_take()):
                if self._has_steps_to_take():
                    self._publish(self.engine.step())
        except Exception as error:
            logger.exception("The engine's busy loop died; every request in flight fails with EngineDeadError.")
            self._die(f"The engine's busy loop died: {error!r}", error)
        else:
            self._die("The engine was shut down.", None)

    def _publish(self, outputs: list[RequestOutput]) -> None:
        """One step's outputs to their streams."""
        batches = self._route(outputs)
        kv_events = self.engine.take_kv_events()
        # Stats first: a consumer that sees a step's output sees that step's stats too.
        with self._lock:
            self.stats = self.engine.get_stats()
            if kv_events:
                self._kv_events.merge(kv_events)
        for loop, batch in batches.items():
            self._post(loop, _deliver, batch)

    def _drain_commands(self, commands: list) -> list:
        """``commands`` with every command queued now appended (without waiting)."""
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _apply_commands(self, block: bool) -> bool:
        """Applies every queued command (waiting for one if ``block``); False once asked to stop."""
        first = []
        if block:
            try:
                first.append(self._commands.get(timeout=IDLE_STATS_INTERVAL_S))
            except queue.Empty:
                self.engine.record_idle_stats()
                return True
        num_applied_reqs, is_stopping = 0, False
        for command in self._drain_commands(first):
            if isinstance(command, AddCommand):
                self._add(command)
                num_applied_reqs += command.params.n
            elif isinstance(command, _AbortCommand):
                self._abort(command.request_id)
            elif isinstance(command, CoreStep):
                self._publish(self.engine.process_core_step(command))
            elif isinstance(command, CoreDied):
                raise RuntimeError(command.reason)
            elif isinstance(command, _IntegrityCheck):
                try:
                    self.engine.engine_core.check_integrity()
                    command.future.set_result(None)
                except AssertionError as error:
                    command.future.set_exception(error)
            else:
                is_stopping = True
        with self._lock:
            self._num_unapplied_reqs -= num_applied_reqs
            self.stats = self.engine.get_stats()
        return not is_stopping

    def _add(self, command: AddCommand) -> None:
        if not command.future.set_running_or_notify_cancel():
            return  # the caller went away before the request was queued
        try:
            prompt = self.engine.add_request(
                command.request_id,
                command.prompt,
                command.params,
                command.priority,
                command.cache_salt,
                command.kv_transfer_params,
                command.lora_request,
            )
        except Exception as error:  # bad input: refuse this request, keep serving the others
            command.future.set_exception(error)
            return
        self._collector_of[command.request_id] = command.collector
        command.future.set_result(prompt)

    def _abort(self, request_id: str) -> None:
        self.engine.abort_request([request_id])
        self._collector_of.pop(request_id, None)

    def _route(self, outputs: list[RequestOutput]) -> dict[asyncio.AbstractEventLoop, list]:
        """One step's outputs grouped by their requests' event loops (one callback per loop)."""
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        for output in outputs:
            collector = self._collector_of[output.request_id]
            if output.finished:
                del self._collector_of[output.request_id]
            _copy_shared_lists(output)
            batches.setdefault(collector.loop, []).append((collector, output))
        return batches

    def _post(self, loop: asyncio.AbstractEventLoop, callback, *args) -> None:
        try:
            loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # that event loop is closed: nobody reads these streams any more
            orphans = [request_id for request_id, collector in self._collector_of.items() if collector.loop is loop]
            for request_id in orphans:
                self._abort(request_id)

    def _die(self, reason: str, cause: BaseException | None) -> None:
        """Fails everything queued and in flight, then releases the engine."""
        with self._lock:
            if self._dead_reason is None or cause is not None:
                self._dead_reason, self._dead_cause = reason, cause
            reason, cause = self._dead_reason, self._dead_cause
            commands = self._drain_commands([])
        for command in commands:
            if isinstance(command, AddCommand) and command.future.set_running_or_notify_cancel():
                command.future.set_exception(dead_error(reason, cause))
        self._fail_streams(reason, cause)
        try:
            if cause is None:  # a clean stop: leave the core consistent before releasing it
                self.engine.abort_request(list(self.engine.core_ids_of))
            self.engine.shutdown()
        except Exception:
            logger.exception("Releasing the engine failed.")

    def _fail_streams(self, reason: str, cause: BaseException | None) -> None:
        """Ends every stream in flight with EngineDeadError (one callback per event loop)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[RequestOutputCollector]] = {}
        for collector in self._collector_of.values():
            by_loop.setdefault(collector.loop, []).append(collector)
        for loop, collectors in by_loop.items():
            try:
                loop.call_soon_threadsafe(_fail, collectors, reason, cause)
            except RuntimeError:
                pass  # that loop is closed: nobody is waiting there
        self._collector_of.clear()
