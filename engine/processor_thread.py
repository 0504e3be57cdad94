"""The front end's thread behind ``AsyncLLM``: it alone touches the ``LLMEngine`` front end.

It tokenizes requests in, detokenizes the core's steps out, and publishes the engine's ``EngineStats``; it
never steps the model (the core steps on its own: ``engine.core.core_client``). It waits on one ``Inbox``
with two lanes: commands from the event loops (add, abort, stop), applied in order, and the core's
``CoreStep``\\ s, handed on in order. A request joins the core's running batch when its add is applied here
(continuous batching). The output processor puts each output into its request's ``LoopStream``, which
batches it by event loop; once the step is processed each batch goes to its loop in one
``call_soon_threadsafe``, into the requests' ``RequestOutputCollector``\\ s. An applied abort ends its
stream the same way (finish_reason "abort"). The requests in flight are the ``LLMEngine``'s own map
(``OutputProcessor.requests``); this thread keeps none.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from dataclasses import dataclass

from engine.core.core_proc import CoreStep
from engine.engine_client import EngineDeadError, EngineOverloadedError
from engine.frontend.output_collector import RequestOutputCollector
from engine.inputs import PromptType, RequestOptions
from engine.llm_engine import LLMEngine
from engine.metrics import EngineStats
from engine.request_output import RequestOutput
from engine.sampling_params import SamplingParams
from engine.sched.kv_events import KVEventBatch

logger = logging.getLogger(__name__)


def dead_error(reason: str, cause: BaseException | None) -> EngineDeadError:
    """The error every caller and stream gets once the loop is dead; ``cause``: what killed it (None: a stop)."""
    error = EngineDeadError(reason)
    error.__cause__ = cause
    return error


class Inbox:
    """What the front end's thread waits on: commands (from any thread) and the core's steps (from the core
    client's thread) in two lanes under one condition, and the core's death; a ``CoreSink``."""

    def __init__(self) -> None:
        self._ready = threading.Condition()
        self._commands: list = []
        self._steps: list[CoreStep] = []
        self._core_died: str | None = None

    def put_command(self, command) -> None:
        with self._ready:
            self._commands.append(command)
            self._ready.notify()

    def on_step(self, step: CoreStep) -> None:
        with self._ready:
            self._steps.append(step)
            self._ready.notify()

    def on_died(self, reason: str) -> None:
        with self._ready:
            self._core_died = reason
            self._ready.notify()

    def take(self, block: bool = True) -> tuple[list, list[CoreStep], str | None]:
        """(commands, steps, the reason the core died or None), each in order, once any is there (or at once)."""
        with self._ready:
            if block:
                self._ready.wait_for(lambda: self._commands or self._steps or self._core_died)
            commands, steps = self._commands, self._steps
            self._commands, self._steps = [], []
            return commands, steps, self._core_died


@dataclass
class AddCommand:
    request_id: str
    prompt: PromptType
    params: SamplingParams
    options: RequestOptions
    collector: RequestOutputCollector
    # (prompt text, prompt token ids) once queued in the engine, or the ValueError that refused it.
    future: concurrent.futures.Future

    @property
    def num_reqs(self) -> int:
        """Core requests it adds (``n``), counted as waiting until applied."""
        return self.params.n

    def apply(self, thread: ProcessorThread) -> bool:
        """Applies this command on the front end's thread; False: stop."""
        thread._add(self)
        return True

    def refuse(self, error: BaseException) -> None:
        """The loop died before applying it."""
        if self.future.set_running_or_notify_cancel():
            self.future.set_exception(error)


@dataclass
class AbortCommand:
    request_id: str
    num_reqs = 0

    def apply(self, thread: ProcessorThread) -> bool:
        thread._abort([self.request_id])
        return True

    def refuse(self, error: BaseException) -> None:
        pass  # nothing left to abort


class StopCommand:
    num_reqs = 0

    def apply(self, thread: ProcessorThread) -> bool:
        return False

    def refuse(self, error: BaseException) -> None:
        pass


class LoopStream:
    """A request's ``OutputStream`` on the front end's thread: each output, with its collector, joins its event
    loop's batch in ``outbox`` until the step is processed (``ProcessorThread._publish``)."""

    def __init__(self, collector: RequestOutputCollector, outbox: dict) -> None:
        self.collector = collector
        self._outbox = outbox  # event loop -> [(collector, output)]

    def put(self, output: RequestOutput) -> None:
        _copy_shared_lists(output)
        self._outbox.setdefault(self.collector.loop, []).append((self.collector, output))


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


def _end_aborted(collectors: list[RequestOutputCollector]) -> None:
    """Runs on the event loop: ends each aborted stream with its final "abort" output."""
    for collector in collectors:
        collector.put_abort()


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


class ProcessorThread:
    """A daemon thread that owns an LLMEngine (whose core steps on its own) and runs its processors.

    ``submit_add``, ``submit_abort``, ``stop`` and ``check_alive`` may be called from any thread, and
    ``stats`` read from any; everything else runs on this thread. Once the loop is dead (it raised, the
    core died, or it was stopped) every call that would queue work raises EngineDeadError, and so does
    every open stream.
    """

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.max_num_queued_reqs = engine.config.scheduler_config.max_num_queued_reqs
        self._inbox = Inbox()
        # Guards the dead state, the unapplied count and the stats snapshot together, so that the
        # overload check sees a consistent count and no command is queued after the loop has stopped.
        self._lock = threading.Lock()
        self._dead_reason: str | None = None
        self._dead_cause: BaseException | None = None
        self._num_unapplied_reqs = 0  # core requests (n per add) in the inbox, not yet in the scheduler
        self._outbox: dict[asyncio.AbstractEventLoop, list] = {}  # this thread only: the step's outputs per loop
        self.stats: EngineStats = engine.get_stats()  # the latest snapshot; replaced whole, never mutated
        self._kv_events = KVEventBatch()  # the prefix cache's changes not taken yet (guarded by _lock)
        engine.engine_core.attach(self._inbox)
        self.thread = threading.Thread(target=self._run, name="AsyncLLM-frontend", daemon=True)
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
            self._inbox.put_command(command)

    def submit_abort(self, request_id: str) -> None:
        """Queues an abort; once the loop is dead nothing is left to abort and this does nothing."""
        with self._lock:
            if self._dead_reason is None:
                self._inbox.put_command(AbortCommand(request_id))

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
            raise dead_error("The engine's front-end thread is gone.", None)

    def stop(self) -> None:
        """Stops the loop after what it is doing: streams in flight end with EngineDeadError. Idempotent."""
        with self._lock:
            if self._dead_reason is None:
                self._dead_reason = "The engine was shut down."
                self._inbox.put_command(StopCommand())
        if self.thread is not threading.current_thread():
            self.thread.join()

    def _raise_if_dead(self) -> None:
        if self._dead_reason is not None:
            raise dead_error(self._dead_reason, self._dead_cause)

    # ----------------------------------------------------- the front end's thread

    def _run(self) -> None:
        try:
            while self._take_inbox():
                pass
        except Exception as error:
            logger.exception("The engine died; every request in flight fails with EngineDeadError.")
            self._die(f"The engine died: {error!r}", error)
        else:
            self._die("The engine was shut down.", None)

    def _take_inbox(self) -> bool:
        """Applies the commands waiting, then hands on the steps waiting; False once asked to stop."""
        commands, steps, core_died = self._inbox.take()
        is_running = all([command.apply(self) for command in commands])  # each applied; False after a StopCommand
        if commands:
            with self._lock:
                self._num_unapplied_reqs -= sum(command.num_reqs for command in commands)
                self.stats = self.engine.get_stats()
        if not is_running:
            return False
        for step in steps:
            self.engine.process_core_step(step)  # its outputs go to the outbox (each request's LoopStream)
            self._publish()
        if core_died is not None:
            raise RuntimeError(core_died)
        return True

    def _publish(self) -> None:
        """One step's outputs (in the outbox) to their streams."""
        kv_events = self.engine.take_kv_events()
        # Stats first: a consumer that sees a step's output sees that step's stats too.
        with self._lock:
            self.stats = self.engine.get_stats()
            if kv_events:
                self._kv_events.merge(kv_events)
        batches = dict(self._outbox)  # each LoopStream holds this very dict: emptied in place
        self._outbox.clear()
        for loop, batch in batches.items():
            self._post(loop, _deliver, batch)

    def _add(self, command: AddCommand) -> None:
        if not command.future.set_running_or_notify_cancel():
            return  # the caller went away before the request was queued
        stream = LoopStream(command.collector, self._outbox)
        try:
            prompt = self.engine.add_request(
                command.request_id, command.prompt, command.params, command.options, stream
            )
        except Exception as error:  # bad input: refuse this request, keep serving the others
            command.future.set_exception(error)
            return
        command.future.set_result(prompt)

    def _abort(self, request_ids: list[str]) -> None:
        """Aborts these requests in the engine and ends their streams ("abort")."""
        by_loop: dict[asyncio.AbstractEventLoop, list[RequestOutputCollector]] = {}
        for stream in self.engine.abort_request(request_ids):
            by_loop.setdefault(stream.collector.loop, []).append(stream.collector)
        for loop, collectors in by_loop.items():
            self._post(loop, _end_aborted, collectors)

    def _post(self, loop: asyncio.AbstractEventLoop, callback, *args) -> None:
        try:
            loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # that event loop is closed: nobody reads these streams any more
            streams = self.engine.streams()
            self.engine.abort_request([rid for rid, stream in streams.items() if stream.collector.loop is loop])

    def _die(self, reason: str, cause: BaseException | None) -> None:
        """Fails everything queued and in flight, then releases the engine."""
        with self._lock:
            if self._dead_reason is None or cause is not None:
                self._dead_reason, self._dead_cause = reason, cause
            reason, cause = self._dead_reason, self._dead_cause
            commands, _, _ = self._inbox.take(block=False)
        for command in commands:
            command.refuse(dead_error(reason, cause))
        self._fail_streams(reason, cause)
        try:
            if cause is None:  # a clean stop: leave the core consistent before releasing it
                self.engine.abort_request(list(self.engine.streams()))
            self.engine.shutdown()
        except Exception:
            logger.exception("Releasing the engine failed.")

    def _fail_streams(self, reason: str, cause: BaseException | None) -> None:
        """Ends every stream in flight with EngineDeadError (one callback per event loop)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[RequestOutputCollector]] = {}
        for stream in self.engine.streams().values():
            by_loop.setdefault(stream.collector.loop, []).append(stream.collector)
        for loop, collectors in by_loop.items():
            try:
                loop.call_soon_threadsafe(_fail, collectors, reason, cause)
            except RuntimeError:
                pass  # that loop is closed: nobody is waiting there
