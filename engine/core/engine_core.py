"""The engine core: the scheduler plus an executor, one step at a time.

Each ``step()`` schedules, executes the schedule on the workers and feeds the
sampled tokens back to the scheduler. The core speaks token ids only; text,
stop strings and ``n`` > 1 live in the front end (``LLMEngine``).

With pipeline parallelism the executor takes several steps at once
(``max_concurrent_batches``): the core keeps a queue of steps in flight,
scheduling a new micro-batch while earlier ones move through later stages. The
scheduler already skips requests whose last step has not come back (it has no
new token to compute for them), so each micro-batch holds different requests.
"""

from __future__ import annotations

import gc
import logging
import weakref
from collections import deque

from engine.config import EngineConfig
from engine.executor.base import Executor, StepFuture
from engine.lora.loading import LoRALoading
from engine.sched.request import Request
from engine.sched.request_hold import RequestHold
from engine.sched.scheduler import Scheduler, SchedulerStats
from engine.sched.step_outputs import EngineCoreOutput, LoRAWorkerCounts, ModelRunnerOutput, SchedulerOutput
from engine.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)

# How long a core with only held requests (for their grammar, their LoRA adapter) blocks on a hold per step;
# commands wait that long.
HOLD_WAIT_S = 0.02


class EngineCore:
    def __init__(self, config: EngineConfig, executor_class: type[Executor] | None = None) -> None:
        executor_class = executor_class or Executor.get_class(config)
        self.executor = executor_class(config)
        cache_config = config.cache_config
        num_blocks = cache_config.num_blocks or self.executor.determine_num_available_blocks()
        self.executor.initialize_cache(num_blocks)
        self.cache_config = cache_config.model_copy(update={"num_blocks": num_blocks})
        self.scheduler = Scheduler(
            config.scheduler_config,
            self.cache_config,
            config.kv_transfer_config,
            config.speculative_config,
            max_loras=config.lora_config.max_loras if config.lora_config.enable_lora else 0,
            kv_cache_groups=self.executor.get_kv_cache_groups(),
        )
        self.structured_outputs = StructuredOutputManager(config)
        self.lora_loading = LoRALoading(self.executor) if config.lora_config.enable_lora else None
        # In the order a request passes them: its grammar compiles before its adapter is asked for.
        self.holds: list[RequestHold] = [self.structured_outputs]
        if self.lora_loading is not None:
            self.holds.append(self.lora_loading)
        self.lora_counts: LoRAWorkerCounts | None = None  # the workers', as the last step brought them
        self.config = config
        self.max_concurrent_batches = self.executor.max_concurrent_batches
        self.batches_in_flight: deque[tuple[SchedulerOutput, StepFuture]] = deque()
        # The block pool and the weights live for the whole run: keep them out of every
        # cyclic-GC pass (a full pass over them costs milliseconds in the middle of a step).
        gc.collect()
        gc.freeze()
        # Runs once: on shutdown(), or when the last reference to this core goes (a dropped LLM).
        self._release = weakref.finalize(self, _release_engine, self.executor)
        self._release.atexit = False  # at exit Ray tears its own cluster down

    def add_request(self, request: Request) -> None:
        """Queues ``request``; one with structured outputs waits for its grammar, then one with a LoRA adapter
        not loaded yet for its adapter (``holds``), first: neither ever blocks a step."""
        self._admit(request, 0)

    def _admit(self, request: Request, first_hold: int) -> None:
        """``request`` through the holds from ``first_hold`` on, then to the scheduler if none keeps it."""
        if not any(hold.hold(request) for hold in self.holds[first_hold:]):
            self.scheduler.add_request(request)

    def abort_requests(self, request_ids) -> None:
        for hold in self.holds:
            request_ids = hold.abort_requests(request_ids)
        self.scheduler.abort_requests(request_ids)

    def _num_held_requests(self) -> int:
        """Requests waiting in a hold (for their grammar or their LoRA adapter), not yet in the scheduler."""
        return sum(hold.num_waiting_requests() for hold in self.holds)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self.batches_in_flight) or self._num_held_requests() > 0

    def step(self) -> list[EngineCoreOutput]:
        """Runs one step; returns what each request got from it."""
        failed = self._admit_held() if self._num_held_requests() else []
        if self.max_concurrent_batches > 1:
            return failed + self._step_pipelined()
        if not self.scheduler.has_unfinished_requests():
            return failed
        scheduler_output = self._schedule()
        return failed + self._update(scheduler_output, self.executor.execute_model(scheduler_output))

    def _update(self, scheduler_output: SchedulerOutput, model_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        if model_output.lora_counts is not None:
            self.lora_counts = model_output.lora_counts
        return self.scheduler.update_from_output(scheduler_output, model_output)

    def _schedule(self) -> SchedulerOutput:
        scheduler_output = self.scheduler.schedule()
        self.structured_outputs.attach_bitmask(scheduler_output, self.scheduler.requests)
        return scheduler_output

    def _admit_held(self) -> list[EngineCoreOutput]:
        """Passes each hold's ready requests on (to the next hold, or the scheduler); returns the outputs of
        those that failed. With nothing else to run, first waits a little on a hold (not spinning meanwhile)."""
        idle = not self.batches_in_flight
        failed = []
        for index, hold in enumerate(self.holds):
            if not hold.has_waiting_requests():
                continue
            if idle and not self.scheduler.has_unfinished_requests():
                hold.wait(HOLD_WAIT_S)
            ready, failed_here = hold.take_ready()
            for request in ready:
                self._admit(request, index + 1)
            failed += failed_here
        return [
            EngineCoreOutput(r.request_id, [], r.get_finish_reason(), r.stop_reason, num_cached_tokens=0)
            for r in failed
        ]

    def _step_pipelined(self) -> list[EngineCoreOutput]:
        """Starts a micro-batch if a slot is free and there is one to run; else finishes the oldest.

        Returns [] after starting one (the caller steps again at once), so up
        to ``max_concurrent_batches`` steps overlap.
        """
        if len(self.batches_in_flight) < self.max_concurrent_batches and self.scheduler.has_unfinished_requests():
            scheduler_output = self._schedule()
            # An empty schedule still goes out when it carries finished or preempted ids (workers drop them).
            if (
                scheduler_output.total_num_scheduled_tokens > 0
                or scheduler_output.finished_req_ids
                or scheduler_output.preempted_req_ids
            ):
                self.batches_in_flight.append((scheduler_output, self.executor.execute_model_async(scheduler_output)))
                if (
                    scheduler_output.total_num_scheduled_tokens > 0
                    and len(self.batches_in_flight) < self.max_concurrent_batches
                ):
                    return []
        if not self.batches_in_flight:
            return []
        scheduler_output, future = self.batches_in_flight.popleft()
        return self._update(scheduler_output, future.result())

    def get_stats(self) -> SchedulerStats:
        stats = self.scheduler.get_stats()
        stats.num_waiting_reqs += self._num_held_requests()  # waiting for their grammar or their adapter
        stats.lora_counts = self.lora_counts
        return stats

    def kv_block_counts(self) -> tuple[int, int]:
        """(usable KV blocks, free ones): the null block is not usable, and a block that only holds
        a cached prefix counts as free (it is evicted on demand)."""
        pool = self.scheduler.kv_cache_manager.block_pool
        return pool.num_blocks - 1, pool.num_free_blocks

    def take_kv_load_latencies(self) -> list[float]:
        """The transfer latency of each KV load since the last call (disaggregated prefill); [] otherwise."""
        kv_connector = self.scheduler.kv_connector
        return [] if kv_connector is None else kv_connector.take_load_latencies()

    def check_health(self) -> None:
        self.executor.check_health()

    def check_integrity(self) -> None:
        """Raises AssertionError unless the KV cache's blocks, hashes and free queue agree."""
        self.scheduler.kv_cache_manager.check_integrity()

    def shutdown(self) -> None:
        """Releases the workers (their weights and KV caches, Ray actors and placement group). Idempotent."""
        self.structured_outputs.shutdown()
        self._release()


def _release_engine(executor: Executor) -> None:
    """Shuts the executor down, then lets the cyclic GC see what start-up froze.

    Frozen objects are never collected, and an engine holds reference cycles (each parameter's
    ``weight_loader`` is a method of its layer; the KV blocks' free list links both ways): left
    frozen, a released engine's weights would stay until the process exits. Unfrozen, the next
    collection frees them; a live engine's objects merely go back to the oldest generation.
    """
    executor.shutdown()
    gc.unfreeze()
