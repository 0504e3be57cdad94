"""Tensor and pipeline parallelism: process groups, the parallel state, and collectives (torch only)."""

from engine.distributed.parallel_state import (
    ParallelState,
    destroy_distributed,
    get_parallel_state,
    get_pp_indices,
    init_distributed,
    recv_from_prev_stage,
    send_to_next_stage,
    tp_all_gather,
    tp_all_reduce,
)

__all__ = [
    "ParallelState",
    "destroy_distributed",
    "get_parallel_state",
    "get_pp_indices",
    "init_distributed",
    "recv_from_prev_stage",
    "send_to_next_stage",
    "tp_all_gather",
    "tp_all_reduce",
]
