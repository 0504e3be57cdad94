"""Tensor and pipeline parallelism: process groups, the parallel state, and collectives (torch only).

- ``parallel_state``: ``init_distributed`` (one group per TP rank set and PP stage), ``ParallelState``, TP
  all-reduce / all-gather, stage send / recv (re-exported here).
- ``interfaces``: the local network interface that reaches the rendezvous host, for gloo / NCCL to bind to.
"""

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
