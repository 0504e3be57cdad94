"""The executor interface the engine core drives, and its selection by configuration.

``engine/`` never imports Ray: the Ray executor lives in ``cluster/`` and is
found by import path when ``distributed_executor_backend`` is ``"ray"``.
"""

from __future__ import annotations

import importlib
import threading
from abc import ABC, abstractmethod
from concurrent.futures import Future
from typing import Protocol

from engine.config import EngineConfig
from engine.lora_request import LoRARequest
from engine.sched.kv_cache_groups import KVCacheGroup
from engine.sched.step_outputs import ModelRunnerOutput, SchedulerOutput

EXECUTOR_IMPORT_PATHS = {
    "uni": "engine.executor.uniproc:UniProcExecutor",
    "ray": "cluster.ray_executor:RayExecutor",
}


class StepFuture(Protocol):
    """A step in flight; ``result()`` blocks until its ModelRunnerOutput is back (or raises its error)."""

    def result(self) -> ModelRunnerOutput: ...


def done_future(output: ModelRunnerOutput) -> StepFuture:
    future: Future = Future()
    future.set_result(output)
    return future


def all_of(futures: list[Future]) -> Future:
    """A future that ends when all of ``futures`` have: with None, or the first error among them."""
    combined: Future = Future()
    remaining = [len(futures)]
    lock = threading.Lock()

    def one_done(future: Future) -> None:
        error = future.exception()
        with lock:  # callbacks run on whichever thread ends each future
            remaining[0] -= 1
            if combined.done():
                return
            if error is not None:
                combined.set_exception(error)
            elif remaining[0] == 0:
                combined.set_result(None)

    if not futures:
        combined.set_result(None)
    for future in futures:
        future.add_done_callback(one_done)
    return combined


class Executor(ABC):
    """Owns the workers of one engine: builds them, sizes their KV caches, runs steps."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._init_executor()

    @staticmethod
    def get_class(config: EngineConfig) -> type[Executor]:
        backend = config.parallel_config.executor_backend
        module_name, _, class_name = EXECUTOR_IMPORT_PATHS[backend].partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as error:
            raise ValueError(f"Executor backend {backend!r} is not available: {error}") from error
        return getattr(module, class_name)

    @property
    def max_concurrent_batches(self) -> int:
        """Steps the engine core may have in flight at once (pipeline stages keep that many busy)."""
        return 1

    @abstractmethod
    def _init_executor(self) -> None:
        """Starts the workers and loads the model on them."""

    @abstractmethod
    def get_kv_cache_groups(self) -> tuple[KVCacheGroup, ...]:
        """The model's KV cache groups (``engine.sched.kv_cache_groups``), the same on every worker."""

    @abstractmethod
    def determine_num_available_blocks(self) -> int:
        """The number of KV blocks every worker can hold (the minimum across workers)."""

    @abstractmethod
    def initialize_cache(self, num_blocks: int) -> None:
        """Allocates ``num_blocks`` KV blocks on every worker."""

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Runs one step on all workers; returns the sampled tokens."""

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> StepFuture:
        """Starts one step; steps finish in the order they were started.

        Executors with ``max_concurrent_batches`` > 1 return before the step ends.
        """
        return done_future(self.execute_model(scheduler_output))

    def load_lora(self, lora_request: LoRARequest) -> Future:
        """Starts reading an adapter into every worker's host LRU, off the step's path; the future ends once
        every worker has it (or raises the first loading error). Needs ``enable_lora``."""
        raise NotImplementedError(f"{type(self).__name__} does not load LoRA adapters.")

    def check_health(self) -> None:  # noqa: B027 (an optional hook: executors without workers have nothing to check)
        """Raises if a worker is gone. Safe to call from any thread."""

    def shutdown(self) -> None:  # noqa: B027 (an optional hook: nothing to release by default)
        """Releases the workers."""
