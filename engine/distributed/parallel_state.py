"""Process groups for tensor and pipeline parallelism, and the collectives the model uses.

One process per rank. Rank layout: ``rank = pp_rank * tp_size + tp_rank``, so the
ranks of one tensor-parallel group are contiguous (they share a node and all-reduce
every layer) and a pipeline group holds the same ``tp_rank`` of every stage.

Before ``init_distributed`` (one device) ``get_parallel_state()`` is the single-rank
state and the model never calls a collective: the TP layers only call one when
``tp_size > 1``, the model runner only sends and receives with ``pp_size > 1``.

Sockets: with a ``tcp://HOST:PORT`` rendezvous, rank 0's store listens on HOST only
(``TCPStore`` alone would listen on every interface), and gloo / NCCL bind to the
interface holding the address this machine uses to reach HOST, not to whatever the
machine's hostname resolves to (``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``,
unless already set). With HOST = 127.0.0.1 everything stays on loopback.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
from dataclasses import dataclass
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from engine.distributed.interfaces import interface_with_address, local_address_towards

logger = logging.getLogger(__name__)

STORE_TIMEOUT = datetime.timedelta(seconds=300)  # how long ranks wait for each other to join


@dataclass(frozen=True)
class ParallelState:
    """Where this process sits: its global rank and its place in the TP and PP groups."""

    rank: int = 0
    world_size: int = 1
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1

    @staticmethod
    def for_rank(rank: int, tp_size: int, pp_size: int) -> ParallelState:
        if not 0 <= rank < tp_size * pp_size:
            raise ValueError(f"rank {rank} is outside a world of {tp_size} x {pp_size} ranks")
        return ParallelState(
            rank=rank,
            world_size=tp_size * pp_size,
            tp_rank=rank % tp_size,
            tp_size=tp_size,
            pp_rank=rank // tp_size,
            pp_size=pp_size,
        )

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def is_output_rank(self) -> bool:
        """The one rank whose sampled tokens go back to the scheduler: last stage, TP rank 0."""
        return self.is_last_stage and self.tp_rank == 0


_state = ParallelState()
_tp_group: dist.ProcessGroup | None = None
_pp_group: dist.ProcessGroup | None = None


def get_parallel_state() -> ParallelState:
    """This process's state; the single-rank default until ``init_distributed``."""
    return _state


def get_pp_indices(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """Layers ``[start, end)`` of stage ``pp_rank``: an even split (vLLM's rule).

    When the split is uneven the extra layers go to the stages before the last
    one, which also runs the final norm and the LM head.
    """
    if num_layers < pp_size:
        raise ValueError(f"{num_layers} layers cannot fill {pp_size} pipeline stages")
    sizes = [num_layers // pp_size] * pp_size
    for i in range(2, num_layers % pp_size + 2):
        sizes[-i] += 1
    start = sum(sizes[:pp_rank])
    return start, start + sizes[pp_rank]


def init_distributed(
    world_size: int, rank: int, init_method: str, tp_size: int, pp_size: int, backend: str | None = None
) -> ParallelState:
    """Joins the process group of ``world_size`` ranks and builds every TP and PP group.

    Blocks until all ranks have called it (collective). ``init_method`` is
    ``tcp://HOST:PORT`` (rank 0 listens there) or any URL torch accepts.
    ``backend`` defaults to "nccl" when CUDA is available, else "gloo".
    """
    global _state, _tp_group, _pp_group
    if tp_size * pp_size != world_size:
        raise ValueError(f"tp_size {tp_size} x pp_size {pp_size} != world_size {world_size}")
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised in this process")
    state = ParallelState.for_rank(rank, tp_size, pp_size)
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    url = urlparse(init_method)
    if url.scheme == "tcp":
        store = _make_tcp_store(url.hostname, url.port, rank, world_size)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
    else:
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
    # Every rank creates every group, in the same order (new_group is collective).
    for pp_rank in range(pp_size):
        group = dist.new_group([pp_rank * tp_size + tp_rank for tp_rank in range(tp_size)])
        if pp_rank == state.pp_rank:
            _tp_group = group
    for tp_rank in range(tp_size):
        group = dist.new_group([pp_rank * tp_size + tp_rank for pp_rank in range(pp_size)])
        if tp_rank == state.tp_rank:
            _pp_group = group
    _state = state
    return state


def _make_tcp_store(host: str, port: int, rank: int, world_size: int) -> dist.TCPStore:
    """The rendezvous store, listening on ``host`` only; also points gloo/NCCL at the right interface."""
    address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][4][0]
    _bind_collectives_to_interface_towards(address, port)
    if rank != 0:
        return dist.TCPStore(address, port, world_size, False, STORE_TIMEOUT)
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    listener = socket.create_server((address, port), family=family, backlog=max(128, world_size))
    # detach(): the store's event loop owns the socket from here on and closes it.
    return dist.TCPStore(address, port, world_size, True, STORE_TIMEOUT, master_listen_fd=listener.detach())


def _bind_collectives_to_interface_towards(address: str, port: int) -> None:
    local = local_address_towards(address, port)
    interface = interface_with_address(local)
    if interface is None:
        logger.warning("No network interface holds %s; gloo/NCCL choose their own", local)
        return
    for variable in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        os.environ.setdefault(variable, interface)


def destroy_distributed() -> None:
    """Leaves the process group (if any) and returns to the single-rank state."""
    global _state, _tp_group, _pp_group
    if dist.is_initialized():
        dist.destroy_process_group()
    _state, _tp_group, _pp_group = ParallelState(), None, None


# ----------------------------------------------------------------- collectives


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum of ``x`` over the tensor-parallel group, in place; returns ``x``."""
    dist.all_reduce(x, group=_require(_tp_group))
    return x


def tp_all_gather(x: torch.Tensor) -> torch.Tensor:
    """Concatenates every TP rank's ``x`` along the last dim, in rank order ([..., n] -> [..., tp_size * n])."""
    tp_size = _state.tp_size
    # Concatenated along dim 0 (the form every backend accepts): [tp * m, ..., n], viewed as [tp, m, ..., n].
    gathered = torch.empty((tp_size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_gather_single(gathered, x.contiguous(), group=_require(_tp_group))
    gathered = gathered.view(tp_size, *x.shape)
    # [tp, ..., n] -> [..., tp, n] -> [..., tp * n]: rank r's columns land at r * n.
    return gathered.movedim(0, -2).reshape(*x.shape[:-1], tp_size * x.shape[-1])


def send_to_next_stage(hidden: torch.Tensor, residual: torch.Tensor) -> None:
    """Sends this stage's output ([T, hidden] each) to the same TP rank of the next stage."""
    packed = torch.stack((hidden, residual))  # [2, T, hidden]: one message instead of two
    dist.send(packed, dst=_state.rank + _state.tp_size, group=_require(_pp_group))


def recv_from_prev_stage(
    num_tokens: int, hidden_size: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Receives the previous stage's (hidden, residual), each [num_tokens, hidden_size]."""
    packed = torch.empty((2, num_tokens, hidden_size), dtype=dtype, device=device)  # [2, T, hidden]
    dist.recv(packed, src=_state.rank - _state.tp_size, group=_require(_pp_group))
    return packed[0], packed[1]


def _require(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    if group is None:
        raise RuntimeError("A tensor/pipeline-parallel collective was called before init_distributed")
    return group
