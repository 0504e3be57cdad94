"""A worker: one device, its model runner, and the sizing of its KV cache.

Executors drive workers through this interface only (in-process for one
device; as Ray actors in ``cluster/`` for several), so the two paths run the
same code. With ``world_size > 1`` there is one worker per rank, each in its
own process: build it with its rank and the process group's rendezvous URL,
then call every method on all workers at once (``init_device``,
``determine_num_available_blocks`` and ``execute_model`` are collective).
"""

from __future__ import annotations

import ctypes
import logging
import os
from concurrent.futures import Future

import torch

from engine.config import EngineConfig
from engine.distributed.parallel_state import ParallelState, destroy_distributed, get_parallel_state, init_distributed
from engine.lora_request import LoRARequest
from engine.model.architecture import parse_dtype
from engine.sched.kv_cache_groups import KVCacheGroup
from engine.sched.step_outputs import ModelRunnerOutput, SchedulerOutput
from engine.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

GiB = 1 << 30
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was requested but no CUDA device is visible.")
    return torch.device(name)


def resolve_dtype(config: EngineConfig) -> torch.dtype:
    """``auto`` means the checkpoint's dtype (float32 if it records none)."""
    if config.model_config.dtype != "auto":
        return parse_dtype(config.model_config.dtype)
    from engine.model.architecture import Architecture

    return Architecture.from_model(config.model_config.model).torch_dtype or torch.float32


def available_cpu_memory_bytes() -> int:
    with open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("MemAvailable not found in /proc/meminfo")


def keep_freed_memory_in_heap() -> None:
    """Stops glibc from returning large freed blocks to the OS after every step.

    By default every activation over 128 KiB is a fresh mmap whose pages fault
    in on first touch and are unmapped on free: on CPU that costs more than the
    matmuls of a small model's decode step. Raising the mmap and trim thresholds
    keeps those blocks in the heap for reuse (the role jemalloc/tcmalloc play
    for vLLM's CPU backend).
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return
    libc.mallopt(_M_MMAP_THRESHOLD, 1 << 29)
    libc.mallopt(_M_TRIM_THRESHOLD, (1 << 31) - 1)


def device_for_rank(device: torch.device, rank: int) -> torch.device:
    """``cuda`` without an index means one GPU per rank when several are visible (Ray shows each actor one)."""
    if device.type != "cuda" or device.index is not None:
        return device
    return torch.device("cuda", rank % torch.cuda.device_count())


class Worker:
    """One rank: ``rank`` of ``parallel_config.world_size`` (``rank = pp_rank * tp_size + tp_rank``).

    ``distributed_init_method`` (e.g. ``tcp://HOST:PORT``, where rank 0
    listens) is required when the world size is above 1.
    """

    def __init__(self, config: EngineConfig, rank: int = 0, distributed_init_method: str | None = None) -> None:
        parallel = config.parallel_config
        if parallel.world_size > 1 and distributed_init_method is None:
            raise ValueError(f"A worker of a world of {parallel.world_size} ranks needs distributed_init_method")
        self.config = config
        self.rank = rank
        self.distributed_init_method = distributed_init_method
        self.parallel_state = ParallelState.for_rank(
            rank, parallel.tensor_parallel_size, parallel.pipeline_parallel_size
        )
        self.device = device_for_rank(resolve_device(config.device_config.device), rank)
        self.dtype = resolve_dtype(config)
        self.model_runner = ModelRunner(config, self.device, self.dtype)

    @property
    def is_output_rank(self) -> bool:
        """Whether ``execute_model`` returns the sampled tokens here (last stage, TP rank 0), not None."""
        return self.parallel_state.is_output_rank

    def init_device(self) -> None:
        """Sets up the device and, with several ranks, joins the process group (blocks until all join)."""
        if self.device.type == "cpu":
            torch.set_num_threads(self.config.device_config.num_threads or os.cpu_count() or 1)
            keep_freed_memory_in_heap()
        else:
            torch.cuda.set_device(self.device)
        parallel = self.config.parallel_config
        if parallel.world_size > 1:
            init_distributed(
                parallel.world_size,
                self.rank,
                self.distributed_init_method,
                parallel.tensor_parallel_size,
                parallel.pipeline_parallel_size,
                backend="nccl" if self.device.type == "cuda" else "gloo",
            )
        torch.manual_seed(self.config.model_config.seed)

    def load_model(self) -> None:
        """Loads this rank's part of the model; after ``init_device``."""
        if get_parallel_state() != self.parallel_state:  # else every rank would load the whole model
            raise RuntimeError(f"Worker {self.rank}: call init_device (joins the process group) before load_model")
        self.model_runner.load_model()

    def get_kv_cache_groups(self) -> tuple[KVCacheGroup, ...]:
        """The model's KV cache groups (after ``load_model``)."""
        return self.model_runner.kv_cache_groups

    def determine_num_available_blocks(self) -> int:
        """How many KV blocks fit this worker's budget, after loading (and on GPU a profiling forward).

        The budget is ``kv_cache_memory_bytes`` if set (per worker, as vLLM's);
        else on GPU ``gpu_memory_utilization`` of the device minus what the
        weights and the profiled activation peak use; on CPU
        ``cpu_kv_cache_fraction`` of the RAM still available, divided by the
        world size. Capped at the blocks ``max_num_seqs`` sequences of
        ``max_model_len`` tokens could ever hold at once. Collective with
        tp_size > 1 (the profiling forward): call it on every worker at once.
        """
        cache_config = self.config.cache_config
        if self.device.type == "cuda":  # on CPU the budget is RAM's, whatever a step's activations take
            torch.cuda.reset_peak_memory_stats()
            self.model_runner.profile_run()
        if cache_config.kv_cache_memory_bytes is not None:
            budget = cache_config.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            torch.cuda.synchronize()
            free, total = torch.cuda.mem_get_info()
            activation_peak = torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated()
            # In use now (weights, other processes) plus the activations a full step needs on top.
            budget = int(total * cache_config.gpu_memory_utilization) - (total - free) - activation_peak
        else:
            # Workers on one machine share its RAM but each sees all of it free (the executor sizes every
            # worker before any allocates): each takes its share. Conservative when they span nodes.
            world_size = self.config.parallel_config.world_size
            budget = int(available_cpu_memory_bytes() * cache_config.cpu_kv_cache_fraction / world_size)
        block_bytes = self.model_runner.get_kv_cache_block_bytes()
        scheduler_config = self.config.scheduler_config
        max_useful = (
            scheduler_config.max_num_seqs
            * self.model_runner.max_num_blocks_per_req
            * len(self.model_runner.kv_cache_groups)
            + 1
        )
        num_blocks = min(budget // block_bytes, max_useful)
        logger.info(
            "KV cache: %d blocks of %d tokens (%.2f GiB)",
            num_blocks,
            cache_config.block_size,
            num_blocks * block_bytes / GiB,
        )
        return max(num_blocks, 0)

    def initialize_cache(self, num_blocks: int) -> None:
        self.model_runner.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """One step; the sampled tokens on the output rank, None on every other rank."""
        return self.model_runner.execute_model(scheduler_output)

    def load_lora(self, lora_request: LoRARequest) -> Future:
        """Starts reading the adapter into this rank's host LRU, off the step's path (``LoRAManager.load_async``)."""
        return self.model_runner.lora.load_async(lora_request)

    def check_health(self) -> None:
        return None

    def shutdown(self) -> None:
        """Leaves the process group, if this worker joined one."""
        if self.model_runner.lora is not None:
            self.model_runner.lora.shutdown()
        if self.config.parallel_config.world_size > 1:
            destroy_distributed()
