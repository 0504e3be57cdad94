"""The Ray executor: one worker actor per device, driven step by step from the engine core.

Control path per step, one of two (``ray_compiled_graph``):

* a Ray compiled graph: the engine core writes the ``SchedulerOutput`` once
  into the graph's shared-memory input channel, which every worker reads.
  Lowest per-step cost, but channel readers spin while they wait (the driver
  for the whole step, each worker between steps), so it wants a spare core
  per worker: the default on GPUs.
* actor tasks: the ``SchedulerOutput`` is put once in the object store and
  each worker gets a task with its reference. Nothing spins: the default on
  CPUs, where the workers' compute needs every core.

Either way it is serialized once (a broadcast, not one pickle per worker);
each worker runs its part of the forward (tensors move between ranks over
torch.distributed: all-reduces within a tensor-parallel group, sends between
pipeline stages) and only the output rank (last stage, TP rank 0) returns
sampled tokens, every other rank returns None. With pipeline stages, up to
``pipeline_parallel_size`` steps are in flight at once; a worker runs them in
the order they were sent.

Faults: a worker that dies fails the step in flight at once (closed graph
channels, or its task's ActorDiedError); a worker that hangs trips
``execute_timeout_s``. Both surface as ``WorkerFailedError`` and the engine
stops (the serving layer fails the open streams and reports unhealthy).
"""

# ruff: noqa: E402 (Ray is imported after the loopback variable below is set)
from __future__ import annotations

import dataclasses
import logging
import math
import os
import pickle
import sys
from collections.abc import Callable
from concurrent.futures import Future

# Ray reads this once, when it is first imported: unset, the "127.0.0.1" of a local cluster (its node
# address and its bootstrap address) is swapped for this machine's network address. So it is set here,
# before this module imports Ray, and only where this process will start its own cluster (joining one
# at RAY_ADDRESS needs the node's real address). A process that imported Ray earlier keeps what it had.
LOOPBACK_ENV_VAR = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
if "ray" not in sys.modules and not os.environ.get("RAY_ADDRESS"):
    os.environ.setdefault(LOOPBACK_ENV_VAR, "0")

import ray
from ray._private import ray_constants
from ray.dag import InputNode, MultiOutputNode
from ray.dag.context import DAGContext
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.kv_transfer.ray_direct import KVDirectClient
from cluster.placement import (
    acquire_placement_group,
    describe_group,
    release_placement_group,
    uses_gpus,
    worker_resources,
)
from cluster.worker_actor import HEALTH_CONCURRENCY_GROUP, KV_CONCURRENCY_GROUP, LORA_CONCURRENCY_GROUP, RayWorker
from engine.config import EngineConfig
from engine.executor.base import Executor, StepFuture, all_of
from engine.sched.kv_cache_groups import KVCacheGroup
from engine.sched.step_outputs import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

HEALTH_CHECK_TIMEOUT_S = 10.0
# The start path waits for nothing without a limit: each wait's error names what it waited for.
WORKER_START_TIMEOUT_S = 180.0  # a worker actor placed in its bundle, its process started and answering
WORKER_LOAD_TIMEOUT_S = 900.0  # init_worker: the process group's rendezvous and loading the weights
# Below Ray's limit for task arguments sent inline (max_direct_call_object_size, 100 KiB).
INLINE_PAYLOAD_MAX_BYTES = 64 * 1024


class WorkerFailedError(RuntimeError):
    """A worker actor died, hung or raised; the engine cannot continue on this worker group."""


def ensure_ray_initialized() -> None:
    """Joins the cluster at RAY_ADDRESS if set, else starts a new local one bound to loopback.

    The local one is always new (``address="local"``): never another process's cluster on this machine.
    """
    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init(logging_level="warning")
        return
    if ray_constants.ENABLE_RAY_CLUSTER:
        logger.warning(
            "Ray was imported before %s=0 was set, so this local Ray cluster binds to the machine's network "
            "address, not loopback; set it before importing Ray to keep it on 127.0.0.1.",
            LOOPBACK_ENV_VAR,
        )
    ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False, logging_level="warning")


def config_for_worker(config: EngineConfig, resources: dict[str, float]) -> EngineConfig:
    """On CPU a worker uses as many torch threads as CPUs it reserved (``resources``), unless num_threads says."""
    device_config = config.device_config
    if device_config.num_threads is not None:
        return config
    num_threads = max(1, math.floor(resources.get("CPU", 0.0)))
    return dataclasses.replace(config, device_config=device_config.model_copy(update={"num_threads": num_threads}))


def _actor_options(demand: dict[str, float]) -> dict:
    """``demand`` (a bundle's form: CPU, GPU, memory, custom) as ``ray.remote`` options."""
    custom = {name: amount for name, amount in demand.items() if name not in ("CPU", "GPU", "memory")}
    options = {"num_cpus": demand.get("CPU", 0.0), "num_gpus": demand.get("GPU", 0.0), "resources": custom}
    if "memory" in demand:
        options["memory"] = demand["memory"]
    return options


class _GraphStep:
    """A compiled-graph step in flight; ``result()`` reads the output rank's ModelRunnerOutput."""

    def __init__(self, executor: RayExecutor, ref) -> None:
        self.executor, self.ref = executor, ref

    def result(self) -> ModelRunnerOutput:
        return self.executor._collect(lambda timeout_s: ray.get(self.ref, timeout=timeout_s)[self.executor.output_rank])


class _TaskStep:
    """A step in flight as one actor task per worker; ``result()`` waits for all of them.

    ``ray.get`` on the list raises as soon as any worker fails, without waiting
    for the survivors (which may be stuck in a collective with it).
    """

    def __init__(self, executor: RayExecutor, refs: list) -> None:
        self.executor, self.refs = executor, refs

    def result(self) -> ModelRunnerOutput:
        return self.executor._collect(
            lambda timeout_s: ray.get(self.refs, timeout=timeout_s)[self.executor.output_rank]
        )


class RayExecutor(Executor):
    def _init_executor(self) -> None:
        ensure_ray_initialized()
        parallel = self.config.parallel_config
        self.world_size = parallel.world_size
        self.output_rank = (parallel.pipeline_parallel_size - 1) * parallel.tensor_parallel_size
        self.timeout_s = parallel.execute_timeout_s
        use_gpu = uses_gpus(self.config.device_config.device)
        self.use_compiled_graph = use_gpu if parallel.ray_compiled_graph is None else parallel.ray_compiled_graph
        self.dag = None
        self._failure: BaseException | None = None
        self.placement_group, self._owns_placement_group = acquire_placement_group(parallel, use_gpu)
        self.kv_direct: KVDirectClient | None = None
        try:
            demands = [worker_resources(parallel, use_gpu, rank) for rank in range(self.world_size)]
            self.workers = self._start_workers(demands)
            self._init_workers(demands)
            kv_config = self.config.kv_transfer_config
            if kv_config is not None and kv_config.kv_connector == "ray_direct":
                self.kv_direct = KVDirectClient(self.workers[0], kv_config, use_gpu)
        except BaseException:
            self.shutdown()
            raise

    def _start_workers(self, demands: list[dict[str, float]]) -> list:
        """One worker actor per rank, in its bundle, asking for ``demands[rank]``; returns once all answer."""
        groups = {HEALTH_CONCURRENCY_GROUP: 1, KV_CONCURRENCY_GROUP: 2, LORA_CONCURRENCY_GROUP: 1}
        actor_class = ray.remote(concurrency_groups=groups)(RayWorker)
        workers = []
        for rank, demand in enumerate(demands):
            placement = PlacementGroupSchedulingStrategy(
                self.placement_group, placement_group_bundle_index=rank, placement_group_capture_child_tasks=False
            )
            workers.append(actor_class.options(**_actor_options(demand), scheduling_strategy=placement).remote())
        pings = [worker.ping.remote() for worker in workers]
        ready, _ = ray.wait(pings, num_returns=len(pings), timeout=WORKER_START_TIMEOUT_S)
        missing = [rank for rank, ping in enumerate(pings) if ping not in ready]
        if missing:
            for worker in workers:
                ray.kill(worker)
            asks = "; ".join(f"worker {rank} asks for {demands[rank]} in bundle {rank}" for rank in missing)
            raise WorkerFailedError(
                f"{len(missing)} of this engine's {len(demands)} worker actors did not start within "
                f"{WORKER_START_TIMEOUT_S:.0f} s ({asks}) of {describe_group(self.placement_group)}."
            )
        ray.get(pings)  # a worker whose process failed to start raises here
        return workers

    def _init_workers(self, demands: list[dict[str, float]]) -> None:
        host, port = ray.get(self.workers[0].get_address.remote(), timeout=HEALTH_CHECK_TIMEOUT_S)
        init_method = f"tcp://{host}:{port}"
        # All ranks at once: joining the process group blocks until every rank has joined.
        inits = [
            worker.init_worker.remote(config_for_worker(self.config, demands[rank]), rank, init_method)
            for rank, worker in enumerate(self.workers)
        ]
        try:
            pids = ray.get(inits, timeout=WORKER_LOAD_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise WorkerFailedError(
                f"This engine's {self.world_size} workers did not join their process group at {init_method} and "
                f"load the model within {WORKER_LOAD_TIMEOUT_S:.0f} s."
            ) from None
        logger.info("%d workers up (pids %s), process group at %s", self.world_size, pids, init_method)

    @property
    def max_concurrent_batches(self) -> int:
        return self.config.parallel_config.pipeline_parallel_size

    def get_kv_cache_groups(self) -> tuple[KVCacheGroup, ...]:
        ref = self.workers[0].get_kv_cache_groups.remote()  # every rank derives them from the whole model
        return self._collect(lambda timeout_s: ray.get(ref, timeout=timeout_s))

    def determine_num_available_blocks(self) -> int:
        refs = [worker.determine_num_available_blocks.remote() for worker in self.workers]
        return min(self._collect(lambda timeout_s: ray.get(refs, timeout=timeout_s)))

    def initialize_cache(self, num_blocks: int) -> None:
        refs = [worker.initialize_cache.remote(num_blocks) for worker in self.workers]
        self._collect(lambda timeout_s: ray.get(refs, timeout=timeout_s))
        if self.use_compiled_graph:
            self.dag = self._compile_dag()

    def _compile_dag(self):
        with InputNode() as scheduler_output:
            outputs = [worker.execute_model.bind(scheduler_output) for worker in self.workers]
            dag = MultiOutputNode(outputs)
        # Reads of results (and Ray's internal buffer releases) wait up to this long; Ray's default is 10 s,
        # less than a long prefill on CPU can take.
        DAGContext.get_current().get_timeout = self.timeout_s
        return dag.experimental_compile(
            _submit_timeout=self.timeout_s, _max_inflight_executions=max(2, self.max_concurrent_batches)
        )

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.execute_model_async(scheduler_output).result()

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> StepFuture:
        self._raise_if_failed()
        kv_meta = scheduler_output.kv_connector_metadata
        if self.kv_direct is not None and kv_meta and kv_meta.loads:
            self.kv_direct.pull(kv_meta.loads)  # the blocks reach the worker before the step that loads them
        try:
            if self.dag is not None:
                return _GraphStep(self, self.dag.execute(scheduler_output))
            payload = pickle.dumps(scheduler_output, protocol=pickle.HIGHEST_PROTOCOL)  # serialized once
            # Small payloads travel inside each task (a copy of bytes, no re-pickling); big ones go to the
            # object store once and every worker reads that copy.
            arg = payload if len(payload) <= INLINE_PAYLOAD_MAX_BYTES else ray.put(payload)
            return _TaskStep(self, [worker.execute_serialized.remote(arg) for worker in self.workers])
        except Exception as error:
            raise self._fail(error) from error

    def _collect(self, wait: Callable[[float], ModelRunnerOutput]) -> ModelRunnerOutput:
        self._raise_if_failed()
        try:
            return wait(self.timeout_s)
        except Exception as error:
            raise self._fail(error) from error

    def _fail(self, error: BaseException) -> WorkerFailedError:
        self._failure = error
        return WorkerFailedError(f"A worker of this engine failed: {type(error).__name__}: {error}")

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise WorkerFailedError(f"A worker of this engine failed earlier: {self._failure}")

    def load_lora(self, lora_request) -> Future:
        return all_of([worker.load_lora.remote(lora_request).future() for worker in self.workers])

    def check_health(self) -> None:
        """Raises WorkerFailedError if a step failed or a worker does not answer a ping."""
        self._raise_if_failed()
        try:
            ray.get([worker.ping.remote() for worker in self.workers], timeout=HEALTH_CHECK_TIMEOUT_S)
        except Exception as error:
            raise WorkerFailedError(f"A worker of this engine is gone: {type(error).__name__}: {error}") from error

    def shutdown(self) -> None:
        """Stops the compiled graph and kills the workers. Idempotent.

        After a failure the workers are killed first: a survivor may be blocked
        in a collective with a dead peer, and a graceful teardown would wait for it.
        """
        if self._failure is None:
            self._teardown_dag()
        for worker in getattr(self, "workers", []):
            try:
                ray.kill(worker)
            except Exception:
                logger.debug("Killing a worker failed.", exc_info=True)
        self.workers = []
        self._teardown_dag()
        if getattr(self, "_owns_placement_group", False):
            release_placement_group(self.placement_group)
            self._owns_placement_group = False

    def _teardown_dag(self) -> None:
        if self.dag is not None:
            dag, self.dag = self.dag, None
            try:
                dag.teardown()
            except Exception:
                logger.debug("Compiled graph teardown failed.", exc_info=True)
