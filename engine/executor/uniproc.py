"""One worker in the engine's own process: one device, and the tests' default."""

from __future__ import annotations

from concurrent.futures import Future

from engine.executor.base import Executor
from engine.lora_request import LoRARequest
from engine.sched.kv_cache_groups import KVCacheGroup
from engine.sched.step_outputs import ModelRunnerOutput, SchedulerOutput
from engine.worker.worker import Worker


class UniProcExecutor(Executor):
    def _init_executor(self) -> None:
        parallel = self.config.parallel_config
        if parallel.world_size != 1:
            raise ValueError(
                f"The in-process executor runs one device; world size is {parallel.world_size}. "
                "Use distributed_executor_backend='ray'."
            )
        self.worker = Worker(self.config)
        self.worker.init_device()
        self.worker.load_model()

    def get_kv_cache_groups(self) -> tuple[KVCacheGroup, ...]:
        return self.worker.get_kv_cache_groups()

    def determine_num_available_blocks(self) -> int:
        return self.worker.determine_num_available_blocks()

    def initialize_cache(self, num_blocks: int) -> None:
        self.worker.initialize_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def load_lora(self, lora_request: LoRARequest) -> Future:
        return self.worker.load_lora(lora_request)

    def shutdown(self) -> None:
        """Drops the worker, and with it the model and the KV caches; no step runs after. Idempotent."""
        if self.worker is not None:
            worker, self.worker = self.worker, None
            worker.shutdown()
