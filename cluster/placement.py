"""Where the workers of one engine run: one placement-group bundle per worker.

A tensor-parallel group must share a node (its all-reduces run every layer):
STRICT_PACK. With pipeline stages the group may span nodes (one send per
stage boundary per step): PACK. Inside a Serve replica the replica's own
placement group is used, built by the deployment from ``engine_bundles``
with the replica's resources added to bundle 0, as Ray Serve LLM does; so
bundle 0 holds the replica (the engine core) and rank 0.
"""

from __future__ import annotations

import logging

import ray
from ray.util.placement_group import PlacementGroup, get_current_placement_group, placement_group

from engine.config import ParallelConfig

logger = logging.getLogger(__name__)

PLACEMENT_GROUP_READY_TIMEOUT_S = 120.0


def uses_gpus(device: str) -> bool:
    """Whether the workers run on CUDA: asked for, or ``auto`` on a cluster that has GPUs.

    Decided from the cluster, not from this process: a Serve replica is a
    CPU-only actor even when its workers hold GPUs.
    """
    if device != "auto":
        return device == "cuda"
    return ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0


def worker_resources(parallel: ParallelConfig, use_gpu: bool) -> dict[str, float]:
    resources = {"CPU": parallel.num_cpus_per_worker}
    if use_gpu:
        resources["GPU"] = 1.0
    return resources


def placement_strategy(parallel: ParallelConfig) -> str:
    return "STRICT_PACK" if parallel.pipeline_parallel_size == 1 else "PACK"


def engine_bundles(
    parallel: ParallelConfig, use_gpu: bool, bundle0_extra: dict[str, float] | None = None
) -> list[dict[str, float]]:
    """One bundle per worker, in rank order; ``bundle0_extra`` (the replica's resources) joins bundle 0."""
    bundles = [worker_resources(parallel, use_gpu) for _ in range(parallel.world_size)]
    for name, amount in (bundle0_extra or {}).items():
        bundles[0][name] = bundles[0].get(name, 0.0) + amount
    # Ray rejects empty bundles and zero amounts.
    return [{name: amount for name, amount in bundle.items() if amount > 0} or {"CPU": 0.01} for bundle in bundles]


def acquire_placement_group(parallel: ParallelConfig, use_gpu: bool) -> tuple[PlacementGroup, bool]:
    """The current placement group if this process runs in one, else a new one.

    Returns (group, is_owned): an owned group is removed by ``release_placement_group``.
    """
    current = get_current_placement_group()
    if current is not None:
        if len(current.bundle_specs) < parallel.world_size:
            raise ValueError(
                f"This actor's placement group has {len(current.bundle_specs)} bundles; "
                f"the engine needs one per worker ({parallel.world_size})."
            )
        return current, False
    group = placement_group(engine_bundles(parallel, use_gpu), strategy=placement_strategy(parallel))
    try:
        ray.get(group.ready(), timeout=PLACEMENT_GROUP_READY_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        ray.util.remove_placement_group(group)
        raise RuntimeError(
            f"No room in the Ray cluster for {parallel.world_size} workers of {worker_resources(parallel, use_gpu)} "
            f"({placement_strategy(parallel)}) after {PLACEMENT_GROUP_READY_TIMEOUT_S:.0f} s; "
            f"cluster resources: {ray.cluster_resources()}"
        ) from None
    return group, True


def release_placement_group(group: PlacementGroup) -> None:
    try:
        ray.util.remove_placement_group(group)
    except Exception:  # the cluster may already be gone at shutdown
        logger.debug("Removing the placement group failed.", exc_info=True)
