"""Where an LLM server's engine runs, in Ray Serve LLM's words: ``accelerator_type`` and ``placement_group_config``.

    accelerator_type: H100           # a GPU type: the engine runs on CUDA, on nodes of that type
    placement_group_config:          # one bundle per engine worker (tensor_parallel_size x pipeline_parallel_size)
      bundles: [{CPU: 1, GPU: 1}, {CPU: 1, GPU: 1}]   # or bundle_per_worker: {CPU: 1, GPU: 1}
      strategy: SPREAD               # PACK (Ray Serve LLM's default), STRICT_PACK, SPREAD, STRICT_SPREAD

The accelerator types are Ray's (``ray.util.accelerators``); a GPU type becomes the
``accelerator_type:<type>`` resource of each bundle (or of the replica, when the engine runs in it), as
Ray Serve LLM schedules it. Serval runs on NVIDIA GPUs and CPUs: other accelerators are refused by name.
"""

from __future__ import annotations

from typing import Literal

import ray.util.accelerators.accelerators as ray_accelerators
from pydantic import BaseModel, ConfigDict, Field, model_validator

_RAY_TYPES = {
    name: value for name, value in vars(ray_accelerators).items() if isinstance(value, str) and name.isupper()
}
GPU_TYPES = frozenset(value for name, value in _RAY_TYPES.items() if name.startswith("NVIDIA_"))
ALIASES = {"A10": "A10G"}  # Ray Serve LLM's normalisation
ACCELERATOR_HINT = 0.001  # the amount of accelerator_type:<type> a bundle asks for (each node of the type has 1)


def check_accelerator_type(value: str) -> str:
    """``value`` as Ray names it; ValueError for types Serval cannot run on or Ray does not know."""
    value = ALIASES.get(value, value)
    if value in GPU_TYPES:
        return value
    if value in _RAY_TYPES.values():
        raise ValueError(f"accelerator_type {value!r}: Serval's engine runs on NVIDIA GPUs (CUDA) and CPUs only.")
    raise ValueError(f"Unknown accelerator_type {value!r}; Ray's NVIDIA GPU types: {sorted(GPU_TYPES)}.")


def accelerator_resource(accelerator_type: str) -> str:
    """The Ray resource a node of ``accelerator_type`` has (and a bundle asks ``ACCELERATOR_HINT`` of)."""
    return f"accelerator_type:{accelerator_type}"


class PlacementGroupConfig(BaseModel):
    """Each replica's placement group: one bundle per engine worker, in rank order, which that worker takes
    whole (``ParallelConfig.worker_resources``); the replica's own resources join bundle 0 (Serve places the
    replica there, and the engine core beside it, asking for nothing)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    bundles: list[dict[str, float]] | None = Field(None, min_length=1, description="One resource dict per worker.")
    bundle_per_worker: dict[str, float] | None = Field(None, description="Repeated once per worker.")
    strategy: Literal["PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD"] = "PACK"

    @model_validator(mode="after")
    def _one_way_to_give_bundles(self) -> PlacementGroupConfig:
        if (self.bundles is None) == (self.bundle_per_worker is None):
            raise ValueError("placement_group_config: give either bundles or bundle_per_worker.")
        return self

    def uses_gpus(self) -> bool:
        return any(bundle.get("GPU", 0) > 0 for bundle in self.bundles or [self.bundle_per_worker])

    def worker_bundles(self, world_size: int) -> list[dict[str, float]]:
        """Copies of the bundles for an engine of ``world_size`` workers (TP x PP); ValueError if they differ."""
        if self.bundle_per_worker is not None:
            return [dict(self.bundle_per_worker) for _ in range(world_size)]
        if len(self.bundles) != world_size:
            raise ValueError(
                f"placement_group_config has {len(self.bundles)} bundles; the engine has {world_size} workers "
                "(tensor_parallel_size x pipeline_parallel_size), one bundle each."
            )
        return [dict(bundle) for bundle in self.bundles]

    def check_engine_kwargs(self, engine_kwargs: dict, accelerator_type: str | None) -> None:
        """ValueError for an LLM config's ``engine_kwargs`` / ``accelerator_type`` that contradict these bundles."""
        if "num_cpus_per_worker" in engine_kwargs:
            raise ValueError(
                "engine_kwargs.num_cpus_per_worker: with placement_group_config each worker takes its bundle's "
                "CPUs; leave it out."
            )
        if engine_kwargs.get("distributed_executor_backend") == "uni":
            raise ValueError("placement_group_config places Ray engine workers; the executor is uni.")
        if accelerator_type is not None and not self.uses_gpus():
            raise ValueError(f"accelerator_type {accelerator_type} is a GPU; placement_group_config has none.")

    def worker_resources(self, world_size: int, on_cuda: bool) -> list[dict[str, float]]:
        """What each engine worker asks Ray for, in rank order: its bundle. ValueError naming a bundle that
        cannot hold its worker (a CPU engine's worker computes on the CPUs it holds, a CUDA one on a GPU)."""
        bundles = self.worker_bundles(world_size)
        needed = "GPU" if on_cuda else "CPU"
        for rank, bundle in enumerate(bundles):
            if bundle.get(needed, 0.0) <= 0:
                where = f"bundles[{rank}]" if self.bundles is not None else "bundle_per_worker"
                engine = "the engine runs on CUDA" if on_cuda else "its torch threads run on them"
                raise ValueError(
                    f"placement_group_config.{where} holds {bundle}; worker {rank} takes its resources from it and "
                    f"needs {needed} ({engine})."
                )
        return bundles
