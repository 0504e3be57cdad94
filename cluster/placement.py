"""Where the workers of one engine run: one placement-group bundle per worker, holding what it asks for.

A tensor-parallel group must share a node (its all-reduces run every layer):
STRICT_PACK. With pipeline stages the group may span nodes (one send per
stage boundary per step): PACK. Each worker asks for its ``worker_resources``
(a serve YAML's ``placement_group_config`` bundles), else ``num_cpus_per_worker``
CPUs (and a GPU on CUDA). Inside a Serve replica the replica's own placement
group is used, built by the deployment from ``engine_bundles`` with the
replica's resources added to bundle 0, as Ray Serve LLM does; so bundle 0 holds
the replica, the engine core (which asks for nothing) and rank 0, and every
worker fits its bundle by construction.
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


def worker_resources(parallel: ParallelConfig, use_gpu: bool, rank: int) -> dict[str, float]:
    """What worker ``rank`` asks Ray for: its ``worker_resources`` entry (a serve YAML's bundle), else
    ``num_cpus_per_worker`` CPUs plus one GPU on CUDA."""
    if parallel.worker_resources is not None:
        return dict(parallel.worker_resources[rank])
    resources = {"CPU": parallel.num_cpus_per_worker}
    if use_gpu:
        resources["GPU"] = 1.0
    return resources


def placement_strategy(parallel: ParallelConfig) -> str:
    return "STRICT_PACK" if parallel.pipeline_parallel_size == 1 else "PACK"


def engine_bundles(parallel: ParallelConfig, use_gpu: bool) -> list[dict[str, float]]:
    """One bundle per worker, in rank order, holding what that worker asks for."""
    return [worker_resources(parallel, use_gpu, rank) for rank in range(parallel.world_size)]


def nonzero(bundle: dict[str, float]) -> dict[str, float]:
    """``bundle`` without zero amounts (Ray refuses them), never empty (nor does it take an empty bundle)."""
    return {name: amount for name, amount in bundle.items() if amount > 0} or {"CPU": 0.01}


def holds(bundle: dict[str, float], demand: dict[str, float]) -> bool:
    return all(bundle.get(name, 0.0) + 1e-9 >= amount for name, amount in demand.items() if amount > 0)


def describe_group(group: PlacementGroup) -> str:
    """The group's id, state and bundles, and the cluster's free resources: why its actors may not start."""
    table = ray.util.placement_group_table(group)
    bundles = [table["bundles"][index] for index in sorted(table["bundles"])]
    return (
        f"placement group {group.id.hex()} ({table['state']}, {table['strategy']}) with bundles {bundles}; "
        f"the cluster has {_rounded(ray.available_resources())} free of {_rounded(ray.cluster_resources())}"
    )


def _rounded(resources: dict[str, float]) -> dict[str, float]:
    return {name: round(amount, 3) for name, amount in sorted(resources.items()) if not name.startswith("node:")}


def acquire_placement_group(parallel: ParallelConfig, use_gpu: bool) -> tuple[PlacementGroup, bool]:
    """The current placement group if this process runs in one (a Serve replica's: its bundle 0 also holds
    the replica), else a new one; ValueError when the current one cannot hold the workers.

    Returns (group, is_owned): an owned group is removed by ``release_placement_group``.
    """
    current = get_current_placement_group()
    if current is not None:
        _check_group_holds_workers(current, parallel, use_gpu)
        return current, False
    group = placement_group([nonzero(b) for b in engine_bundles(parallel, use_gpu)], placement_strategy(parallel))
    try:
        ray.get(group.ready(), timeout=PLACEMENT_GROUP_READY_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        reason = describe_group(group)
        ray.util.remove_placement_group(group)
        raise RuntimeError(
            f"No room in the Ray cluster for the engine's {parallel.world_size} workers after "
            f"{PLACEMENT_GROUP_READY_TIMEOUT_S:.0f} s: {reason}"
        ) from None
    return group, True


def _check_group_holds_workers(group: PlacementGroup, parallel: ParallelConfig, use_gpu: bool) -> None:
    bundles = group.bundle_specs
    if len(bundles) < parallel.world_size:
        raise ValueError(
            f"This actor's placement group has {len(bundles)} bundles; "
            f"the engine needs one per worker ({parallel.world_size})."
        )
    for rank in range(parallel.world_size):
        demand = worker_resources(parallel, use_gpu, rank)
        if not holds(bundles[rank], demand):
            raise ValueError(
                f"Bundle {rank} of this actor's placement group holds {bundles[rank]}; worker {rank} needs {demand}."
            )


def release_placement_group(group: PlacementGroup) -> None:
    try:
        ray.util.remove_placement_group(group)
    except Exception:  # the cluster may already be gone at shutdown
        logger.debug("Removing the placement group failed.", exc_info=True)
