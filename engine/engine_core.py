"""The engine core: the scheduler plus an executor, one busy loop step at a time.

Each ``step()`` schedules, executes the schedule on the workers and feeds the
sampled tokens back to the scheduler. The core speaks token ids only; text,
stop strings and ``n`` > 1 live in the front end (``LLMEngine``).
"""

from __future__ import annotations

import gc
import logging

from engine.config import EngineConfig
from engine.core.outputs import EngineCoreOutput
from engine.core.request import Request
from engine.core.scheduler import Scheduler, SchedulerStats
from engine.executor.base import Executor

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig, executor_class: type[Executor] | None = None) -> None:
        executor_class = executor_class or Executor.get_class(config)
        self.executor = executor_class(config)
        cache_config = config.cache_config
        num_blocks = cache_config.num_blocks or self.executor.determine_num_available_blocks()
        self.executor.initialize_cache(num_blocks)
        self.cache_config = cache_config.model_copy(update={"num_blocks": num_blocks})
        self.scheduler = Scheduler(config.scheduler_config, self.cache_config)
        self.config = config
        # The block pool and the weights live for the whole run: keep them out of every
        # cyclic-GC pass (a full pass over them costs milliseconds in the middle of a step).
        gc.collect()
        gc.freeze()

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids) -> None:
        self.scheduler.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        """Runs one step; returns what each request got from it."""
        if not self.scheduler.has_unfinished_requests():
            return []
        scheduler_output = self.scheduler.schedule()
        model_output = self.executor.execute_model(scheduler_output)
        return self.scheduler.update_from_output(scheduler_output, model_output)

    def make_stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()

    def shutdown(self) -> None:
        self.executor.shutdown()
