"""The worker actor: one device's ``engine.worker.Worker`` inside a Ray actor.

The executor creates one per rank in its placement group, sets up
torch.distributed among them through rank 0's address, then drives them
with ``execute_model`` (through a compiled graph or as actor tasks) and plain
calls for everything else.
"""

from __future__ import annotations

import os
import pickle
import socket
import time

import ray

from engine.config import EngineConfig
from engine.sched.step_outputs import ModelRunnerOutput, SchedulerOutput

HEALTH_CONCURRENCY_GROUP = "health"
# KV transfers (disaggregated prefill) run beside steps: a pull must not wait for a long prefill to finish.
KV_CONCURRENCY_GROUP = "kv"
# LoRA adapters load beside steps too (engine.lora.manager.LoRAManager.load_async): off the step's path.
LORA_CONCURRENCY_GROUP = "lora"


class RayWorker:
    """A thin host: every method forwards to ``engine.worker.Worker`` once ``init_worker`` made it."""

    def __init__(self) -> None:
        self.worker = None
        self.num_steps = 0
        self.busy_s = 0.0  # time inside execute_model, for measuring the control path around it

    def get_address(self) -> tuple[str, int]:
        """This node's IP and a port free on it now, for the process-group rendezvous."""
        node_ip = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((node_ip, 0))
            return node_ip, sock.getsockname()[1]

    def init_worker(self, config: EngineConfig, rank: int, distributed_init_method: str) -> int:
        """Builds the worker, joins the process group (blocks until every rank joins), loads weights."""
        from engine.worker.worker import Worker

        self.worker = Worker(config, rank=rank, distributed_init_method=distributed_init_method)
        self.worker.init_device()
        self.worker.load_model()
        return os.getpid()

    def get_kv_cache_groups(self):
        return self.worker.get_kv_cache_groups()

    def determine_num_available_blocks(self) -> int:
        return self.worker.determine_num_available_blocks()

    def initialize_cache(self, num_blocks: int) -> None:
        self.worker.initialize_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """One step; the sampled tokens from the output rank, None from every other rank."""
        start = time.perf_counter()
        output = self.worker.execute_model(scheduler_output)
        self.busy_s += time.perf_counter() - start
        self.num_steps += 1
        return output

    def execute_serialized(self, payload: bytes) -> ModelRunnerOutput | None:
        """``execute_model`` for a SchedulerOutput the executor pickled once for all workers."""
        return self.execute_model(pickle.loads(payload))

    def step_stats(self) -> tuple[int, float]:
        """(steps run, seconds spent inside them) since start."""
        return self.num_steps, self.busy_s

    # ---- KV transfer (ray_direct): blocks this worker saved leave through read_kv*, blocks for its
    # own requests arrive through receive_kv (see cluster.kv_transfer.ray_direct).

    @ray.method(concurrency_group=KV_CONCURRENCY_GROUP)
    def read_kv(self, kv_id: str, block_indices: list[int]) -> list:
        """Saved blocks, through the object store (a pair of workers outside the collective group)."""
        from cluster.kv_transfer.transports import get_outbox

        return get_outbox().take(kv_id, block_indices)

    @ray.method(concurrency_group=KV_CONCURRENCY_GROUP, tensor_transport="gloo")
    def read_kv_gloo(self, kv_id: str, block_indices: list[int]) -> list:
        """Saved blocks, kept here until the caller passes them on to a worker of the gloo group."""
        return self.read_kv(kv_id, block_indices)

    @ray.method(concurrency_group=KV_CONCURRENCY_GROUP, tensor_transport="nccl")
    def read_kv_nccl(self, kv_id: str, block_indices: list[int]) -> list:
        """Saved blocks (on the GPU), kept here until the caller passes them on to a worker of the nccl group."""
        return self.read_kv(kv_id, block_indices)

    @ray.method(concurrency_group=KV_CONCURRENCY_GROUP)
    def receive_kv(self, req_id: str, blocks: list) -> None:
        """Blocks for one of this worker's requests, until its step loads them."""
        from cluster.kv_transfer.transports import get_outbox

        get_outbox().deliver(req_id, blocks)

    @ray.method(concurrency_group=LORA_CONCURRENCY_GROUP)
    def load_lora(self, lora_request) -> None:
        """Returns once the adapter is in this rank's host LRU (raises its loading error)."""
        self.worker.load_lora(lora_request).result()

    # Health calls run in their own thread: with the task control path a step occupies the default one.
    @ray.method(concurrency_group=HEALTH_CONCURRENCY_GROUP)
    def ping(self) -> int:
        return os.getpid()

    @ray.method(concurrency_group=HEALTH_CONCURRENCY_GROUP)
    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()
