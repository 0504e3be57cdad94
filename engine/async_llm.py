"""The asyncio front end of the engine (vLLM's ``AsyncLLM``), for serving.

    llm = AsyncLLM.from_engine_args(EngineArgs(model="/path/to/checkpoint"))
    async for output in llm.generate("Hello", SamplingParams(output_kind=RequestOutputKind.DELTA), "req-1"):
        print(output.outputs[0].text, end="")

The busy loop (schedule, execute, update: ``LLMEngine.step()``) runs in its own
daemon thread, which alone touches the ``LLMEngine`` (it is not thread-safe).
The event loop talks to it through a thread-safe command queue (add, abort,
shutdown) applied between steps, so requests join and leave the running batch
at step boundaries (continuous batching). The thread blocks on the queue when
there is no work. Each step's outputs go back to the event loop as one batch
(one ``call_soon_threadsafe``), where each lands in its request's
``RequestOutputCollector``, which merges what a slow consumer has not read yet.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import AsyncGenerator
import dataclasses
from dataclasses import dataclass

from engine.config import EngineConfig, ModelConfig
from engine.core.kv_connector import KVTransferStats
from engine.engine_args import EngineArgs
from engine.engine_client import EngineClient, EngineDeadError, EngineOverloadedError  # errors re-exported
from engine.metrics import LoggingStatLogger, StatLogger
from engine.executor.base import Executor
from engine.llm_engine import LLMEngine, load_tokenizer
from engine.output_collector import RequestOutputCollector
from engine.outputs import RequestOutput
from engine.processor import PromptType
from engine.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineStats:
    """A snapshot the busy loop publishes after every step (``*_total`` count since start).

    Blocks exclude the null block; ``num_free_blocks`` counts blocks that only
    hold a cached prefix as free (they are evicted on demand). The prefix-cache
    counters are in tokens.
    """

    num_running_reqs: int
    num_waiting_reqs: int
    num_total_blocks: int
    num_free_blocks: int
    kv_cache_usage: float
    num_generated_tokens_total: int
    num_prompt_tokens_total: int
    num_finished_reqs_total: int
    num_aborted_reqs_total: int
    num_preemptions_total: int
    num_steps_total: int
    prefix_cache_hits: int
    prefix_cache_queries: int
    kv_transfer: KVTransferStats | None = None  # disaggregated prefill only (a copy)


def _deliver(batch: list[tuple[RequestOutputCollector, RequestOutput]]) -> None:
    """Runs on the event loop: one step's outputs into their collectors."""
    for collector, output in batch:
        collector.put(output)


def _fail(collectors: list[RequestOutputCollector], reason: str, cause: BaseException | None) -> None:
    """Runs on the event loop: ends each stream with its own EngineDeadError."""
    for collector in collectors:
        error = EngineDeadError(reason)
        error.__cause__ = cause
        collector.put_error(error)


@dataclass
class _AddCommand:
    request_id: str
    prompt: PromptType
    params: SamplingParams
    priority: int
    cache_salt: str | None
    kv_transfer_params: dict | None
    collector: RequestOutputCollector
    # (prompt text, prompt token ids) once queued in the engine, or the ValueError that refused it.
    future: concurrent.futures.Future


@dataclass
class _AbortCommand:
    request_id: str


_SHUTDOWN = object()
# An idle engine takes no steps; it still reports its (idle) state this often, so that gauges exported
# through a pipeline that drops values not set recently (Ray's) read 0 rather than vanish.
IDLE_STATS_INTERVAL_S = 2.0


class EngineThread:
    """The busy loop: a daemon thread that owns an LLMEngine and steps it while there is work.

    ``submit_add``, ``submit_abort``, ``stop`` and ``check_alive`` may be called
    from any thread; everything else runs on the busy-loop thread.
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
        # Busy-loop thread only:
        self._collector_of: dict[str, RequestOutputCollector] = {}  # requests in the engine
        self._num_counted_tokens: dict[str, dict[int, int]] = {}  # CUMULATIVE / FINAL_ONLY: tokens counted
        self._num_generated_tokens = self._num_prompt_tokens = 0
        self._num_finished_reqs = self._num_aborted_reqs = self._num_steps = 0
        self._is_stopping = False
        self.stats = self._make_stats()
        self.thread = threading.Thread(target=self._run, name="AsyncLLM-busy-loop", daemon=True)
        self.thread.start()

    # ------------------------------------------------------------- any thread

    def submit_add(self, command: _AddCommand) -> None:
        """Queues an add. Raises EngineDeadError, or EngineOverloadedError when too many requests wait."""
        with self._lock:
            self._raise_if_dead()
            limit = self.max_num_queued_reqs
            num_waiting = self.stats.num_waiting_reqs + self._num_unapplied_reqs
            if limit is not None and num_waiting >= limit:
                raise EngineOverloadedError(f"{num_waiting} requests are already waiting "
                                            f"(max_num_queued_reqs={limit}); retry later.")
            self._num_unapplied_reqs += command.params.n
            self._commands.put(command)

    def submit_abort(self, request_id: str) -> None:
        with self._lock:
            if self._dead_reason is None:
                self._commands.put(_AbortCommand(request_id))

    def check_alive(self) -> None:
        with self._lock:
            self._raise_if_dead()
        if not self.thread.is_alive():
            raise EngineDeadError("The engine's busy-loop thread is gone.")

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
            raise EngineDeadError(self._dead_reason) from self._dead_cause

    # ------------------------------------------------------- busy-loop thread

    def _run(self) -> None:
        try:
            while self._apply_commands(block=not self.engine.has_unfinished_requests()):
                if self.engine.has_unfinished_requests():
                    batches = self._route(self.engine.step())
                    self._num_steps += 1
                    # Stats first: a consumer that sees a step's output sees that step's stats too.
                    with self._lock:
                        self.stats = self._make_stats()
                    for loop, batch in batches.items():
                        self._post(loop, _deliver, batch)
        except Exception as error:
            logger.exception("The engine's busy loop died; every request in flight fails with EngineDeadError.")
            self._die(f"The engine's busy loop died: {error!r}", error)
        else:
            self._die("The engine was shut down.", None)

    def _apply_commands(self, block: bool) -> bool:
        """Applies every queued command (waiting for one if ``block``); False once asked to stop."""
        commands = []
        if block:
            try:
                commands.append(self._commands.get(timeout=IDLE_STATS_INTERVAL_S))
            except queue.Empty:
                self.engine.record_idle_stats()
                return True
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                break
        num_applied_reqs = 0
        for command in commands:
            if isinstance(command, _AddCommand):
                self._add(command)
                num_applied_reqs += command.params.n
            elif isinstance(command, _AbortCommand):
                self._abort(command.request_id)
            else:
                self._is_stopping = True
        with self._lock:
            self._num_unapplied_reqs -= num_applied_reqs
            self.stats = self._make_stats()
        return not self._is_stopping

    def _add(self, command: _AddCommand) -> None:
        if not command.future.set_running_or_notify_cancel():
            return  # the caller went away before the request was queued
        try:
            self.engine.add_request(command.request_id, command.prompt, command.params, command.priority,
                                    command.cache_salt, command.kv_transfer_params)
        except Exception as error:  # bad input: refuse this request, keep serving the others
            command.future.set_exception(error)
            return
        state = self.engine.output_processor.states[self.engine.core_ids_of[command.request_id][0]]
        self._collector_of[command.request_id] = command.collector
        self._num_prompt_tokens += len(state.prompt_token_ids)
        command.future.set_result((state.prompt, state.prompt_token_ids))

    def _abort(self, request_id: str) -> None:
        if request_id in self.engine.core_ids_of:
            self._num_aborted_reqs += 1
        self.engine.abort_request([request_id])
        self._collector_of.pop(request_id, None)
        self._num_counted_tokens.pop(request_id, None)

    def _route(self, outputs: list[RequestOutput]) -> dict[asyncio.AbstractEventLoop, list]:
        """One step's outputs grouped by their requests' event loops (one callback per loop); counts them."""
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        for output in outputs:
            collector = self._collector_of[output.request_id]
            self._count_generated_tokens(output, collector.output_kind)
            if output.finished:
                self._num_finished_reqs += 1
                del self._collector_of[output.request_id]
                self._num_counted_tokens.pop(output.request_id, None)
            _copy_shared_lists(output)
            batches.setdefault(collector.loop, []).append((collector, output))
        return batches

    def _count_generated_tokens(self, output: RequestOutput, kind: RequestOutputKind) -> None:
        if kind == RequestOutputKind.DELTA:
            self._num_generated_tokens += sum(len(completion.token_ids) for completion in output.outputs)
            return
        # CUMULATIVE / FINAL_ONLY outputs repeat earlier tokens: count only the growth.
        counted = self._num_counted_tokens.setdefault(output.request_id, {})
        for completion in output.outputs:
            self._num_generated_tokens += len(completion.token_ids) - counted.get(completion.index, 0)
            counted[completion.index] = len(completion.token_ids)

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
            commands = []
            while True:
                try:
                    commands.append(self._commands.get_nowait())
                except queue.Empty:
                    break
        for command in commands:
            if isinstance(command, _AddCommand) and command.future.set_running_or_notify_cancel():
                error = EngineDeadError(reason)
                error.__cause__ = cause
                command.future.set_exception(error)
        by_loop: dict[asyncio.AbstractEventLoop, list[RequestOutputCollector]] = {}
        for collector in self._collector_of.values():
            by_loop.setdefault(collector.loop, []).append(collector)
        for loop, collectors in by_loop.items():
            try:
                loop.call_soon_threadsafe(_fail, collectors, reason, cause)
            except RuntimeError:
                pass  # that loop is closed: nobody is waiting there
        self._collector_of.clear()
        try:
            if cause is None:  # a clean stop: leave the core consistent before releasing it
                self.engine.abort_request(list(self.engine.core_ids_of))
            self.engine.shutdown()
        except Exception:
            logger.exception("Releasing the engine failed.")

    def _make_stats(self) -> EngineStats:
        scheduler_stats = self.engine.engine_core.make_stats()
        pool = self.engine.engine_core.scheduler.kv_cache_manager.block_pool
        prefix = scheduler_stats.prefix_cache_stats
        return EngineStats(
            num_running_reqs=scheduler_stats.num_running_reqs, num_waiting_reqs=scheduler_stats.num_waiting_reqs,
            num_total_blocks=pool.num_blocks - 1, num_free_blocks=pool.num_free_blocks,
            kv_cache_usage=scheduler_stats.kv_cache_usage, num_generated_tokens_total=self._num_generated_tokens,
            num_prompt_tokens_total=self._num_prompt_tokens, num_finished_reqs_total=self._num_finished_reqs,
            num_aborted_reqs_total=self._num_aborted_reqs, num_preemptions_total=scheduler_stats.num_preemptions,
            num_steps_total=self._num_steps, prefix_cache_hits=prefix.num_hit_tokens,
            prefix_cache_queries=prefix.num_queried_tokens,
            kv_transfer=None if scheduler_stats.kv_transfer_stats is None else
            dataclasses.replace(scheduler_stats.kv_transfer_stats))


def _copy_shared_lists(output: RequestOutput) -> None:
    """The output processor hands out lists it keeps extending (prompt logprobs, cumulative logprobs);
    the event loop reads them while this thread steps on, so it gets copies."""
    if output.prompt_logprobs is not None:
        output.prompt_logprobs = list(output.prompt_logprobs)
    for completion in output.outputs:
        if completion.logprobs is not None:
            completion.logprobs = list(completion.logprobs)


class AsyncLLM(EngineClient):
    """The engine behind an asyncio server: ``generate`` streams, ``abort`` stops, ``get_stats`` observes.

    Use it from one event loop at a time (the HTTP server's). Construction loads
    the model and starts the busy-loop thread; ``shutdown`` stops it.
    """

    def __init__(self, config: EngineConfig, executor_class: type[Executor] | None = None,
                 stat_loggers: list[StatLogger] | None = None) -> None:
        self.config = config
        engine = LLMEngine(config, executor_class, stat_loggers=stat_loggers)
        # The engine's tokenizer belongs to the busy-loop thread; the event loop (chat templates) gets its own.
        self.tokenizer = load_tokenizer(config.model_config.tokenizer_path)
        self._vocab_size = engine.processor.vocab_size
        self._collectors: dict[str, RequestOutputCollector] = {}  # streams open on the event loop
        self._engine_thread = EngineThread(engine)

    @classmethod
    def from_engine_args(cls, args: EngineArgs, stat_loggers: list[StatLogger] | None = None) -> "AsyncLLM":
        """``stat_loggers`` join vLLM's periodic throughput log line; ``disable_log_stats`` turns all off."""
        if args.disable_log_stats:
            return cls(args.create_engine_config(), stat_loggers=[])
        return cls(args.create_engine_config(), stat_loggers=[LoggingStatLogger(), *(stat_loggers or [])])

    @property
    def max_model_len(self) -> int:
        return self.config.scheduler_config.max_model_len

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def model_config(self) -> ModelConfig:
        return self.config.model_config

    def get_tokenizer(self):
        return self.tokenizer

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams, request_id: str, *,
                       priority: int = 0, cache_salt: str | None = None,
                       kv_transfer_params: dict | None = None) -> AsyncGenerator[RequestOutput, None]:
        """Streams the request's outputs as ``sampling_params.output_kind`` says; the last has finished=True.

        Bad input or a request id in use (ValueError), EngineOverloadedError and
        EngineDeadError are raised by the first ``__anext__``, before any output.
        Closing or cancelling the generator early aborts the request (its KV
        blocks are freed); ``abort(request_id)`` ends it with finish_reason "abort".
        ``kv_transfer_params``: disaggregated prefill (``engine.core.kv_connector``).
        """
        if request_id in self._collectors:
            raise ValueError(f"Request id {request_id!r} is already in use.")
        collector = RequestOutputCollector(request_id, sampling_params, asyncio.get_running_loop())
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._engine_thread.submit_add(_AddCommand(request_id, prompt, sampling_params, priority, cache_salt,
                                                   kv_transfer_params, collector, future))
        self._collectors[request_id] = collector
        is_finished = False
        try:
            collector.prompt, collector.prompt_token_ids = await asyncio.wrap_future(future)
            while not is_finished:
                output = await collector.get()
                is_finished = output.finished
                yield output
        finally:
            if self._collectors.get(request_id) is collector:
                del self._collectors[request_id]
            if not is_finished:  # the consumer left early (or the add failed): abort iff it was queued
                future.add_done_callback(lambda done: self._abort_if_added(done, request_id))

    def _abort_if_added(self, future: concurrent.futures.Future, request_id: str) -> None:
        # Runs on whichever thread completes the future (possibly the busy loop): submit_abort is thread-safe.
        if not future.cancelled() and future.exception() is None:
            self._engine_thread.submit_abort(request_id)

    async def abort(self, request_id: str) -> None:
        """Stops a request before the next step; its stream ends with finish_reason "abort". No-op if unknown."""
        collector = self._collectors.pop(request_id, None)
        if collector is not None:
            collector.put_abort()
        self._engine_thread.submit_abort(request_id)

    async def check_health(self) -> None:
        """Raises EngineDeadError if the busy loop died or the engine was shut down, or the
        executor's error if a worker is gone (pinging workers may block: done off the event loop)."""
        self._engine_thread.check_alive()
        await asyncio.to_thread(self._engine_thread.engine.engine_core.check_health)

    def get_stats(self) -> EngineStats:
        """The snapshot published after the latest step (or command); cheap, from any thread."""
        return self._engine_thread.stats

    def shutdown(self) -> None:
        """Stops the busy loop after its current step and joins it; open streams raise EngineDeadError."""
        self._engine_thread.stop()
