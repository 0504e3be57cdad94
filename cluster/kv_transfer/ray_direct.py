"""Ray Direct Transport of KV blocks between the worker actors of a prefill and a decode engine.

Two rules of Ray's collective groups shape this: a process joins at most one
group per backend (the gloo group is the process's torch.distributed world),
and only the process that created a group can start transfers over it. So one
coordinator actor per cluster (``KVDirectCoordinator``, named, detached) holds
the group: every engine with ``kv_connector: ray_direct`` registers its worker
actor at start, and the first transfer forms one group over all workers
registered by then. Each transfer is then, from the coordinator:

    blocks = prefill_worker.read_kv_<backend>.remote(kv_id, block_indices)   # RDT: stays on the prefill worker
    decode_worker.receive_kv.remote(req_id, blocks)                          # sent worker to worker

A pair of workers outside the group (one started after it formed: a new or
restarted replica) moves the same blocks through the object store instead.
The decode engine's executor asks for the transfers of a step and waits for
them before it sends the step; a transfer that fails or times out leaves the
decode worker without the blocks, and it computes that KV itself.
"""

from __future__ import annotations

import asyncio
import logging

import ray
from ray.experimental.collective import create_collective_group

from cluster.kv_transfer.transports import LOAD_TIMEOUT_S, DirectKVRef
from engine.config import KVTransferConfig
from engine.sched.kv_transfer import KVLoad

logger = logging.getLogger(__name__)

COORDINATOR_NAME = "serval-kv-direct"
COORDINATOR_NAMESPACE = "serval"
REGISTER_TIMEOUT_S = 120.0  # the detached coordinator's start (it asks for no resources) and one call
# Ray's names for the gloo backend: the collective group's, and the tensor transport's.
GROUP_BACKENDS = {"gloo": "torch_gloo", "nccl": "nccl"}


@ray.remote(num_cpus=0, max_restarts=0)
class KVDirectCoordinator:
    """Owns the collective group over every registered worker and starts each transfer (async actor)."""

    def __init__(self) -> None:
        self.members: list = []
        self.group_member_ids: set | None = None  # None until formed; empty if forming failed
        self.backend: str | None = None
        self.lock = asyncio.Lock()
        self.num_transfers = {"direct": 0, "object_store": 0}

    async def register(self, worker, tensor_transport: str) -> None:
        if self.backend not in (None, tensor_transport):
            raise ValueError(f"Workers registered with tensor_transport {self.backend!r}; got {tensor_transport!r}.")
        self.backend = tensor_transport
        self.members.append(worker)

    async def transfer(self, src_worker, kv_id: str, block_indices: list[int], dst_worker, req_id: str) -> str:
        """Moves the blocks into ``dst_worker``'s inbox; returns how ("direct" or "object_store")."""
        is_direct = await self._in_group(src_worker, dst_worker)
        if is_direct:
            read = src_worker.read_kv_gloo if self.backend == "gloo" else src_worker.read_kv_nccl
        else:
            read = src_worker.read_kv
        await dst_worker.receive_kv.remote(req_id, read.remote(kv_id, block_indices))
        path = "direct" if is_direct else "object_store"
        self.num_transfers[path] += 1
        return path

    async def stats(self) -> dict:
        """Workers registered and in the group; transfers done by each path."""
        return {
            "num_registered": len(self.members),
            "group_size": len(self.group_member_ids or ()),
            "num_transfers": dict(self.num_transfers),
        }

    async def _in_group(self, src_worker, dst_worker) -> bool:
        async with self.lock:
            if self.group_member_ids is None:
                await self._form_group()
        return {src_worker._actor_id, dst_worker._actor_id} <= self.group_member_ids

    async def _form_group(self) -> None:
        members = [worker for worker in self.members if worker is not None]
        try:
            await asyncio.to_thread(create_collective_group, members, GROUP_BACKENDS[self.backend])
            self.group_member_ids = {worker._actor_id for worker in members}
            logger.info("KV transfer group formed over %d workers (%s).", len(members), self.backend)
        except Exception:  # noqa: BLE001 - a member that died before the group formed: object store for all
            logger.exception("Forming the KV transfer group failed; KV moves through the object store.")
            self.group_member_ids = set()


def resolve_tensor_transport(config: KVTransferConfig, uses_gpu: bool) -> str:
    if config.tensor_transport != "auto":
        return config.tensor_transport
    return "nccl" if uses_gpu else "gloo"


class KVDirectClient:
    """The decode engine executor's side: registers its worker, then has each step's blocks sent to it."""

    def __init__(self, worker, config: KVTransferConfig, uses_gpu: bool) -> None:
        self.worker = worker
        self.coordinator = KVDirectCoordinator.options(
            name=COORDINATOR_NAME, namespace=COORDINATOR_NAMESPACE, get_if_exists=True, lifetime="detached"
        ).remote()
        registered = self.coordinator.register.remote(worker, resolve_tensor_transport(config, uses_gpu))
        try:
            ray.get(registered, timeout=REGISTER_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(
                f"The KV transfer coordinator ({COORDINATOR_NAMESPACE}/{COORDINATOR_NAME}) did not register this "
                f"engine's worker within {REGISTER_TIMEOUT_S:.0f} s."
            ) from None

    def pull(self, loads: list[KVLoad]) -> None:
        """Delivers every load's blocks to this engine's worker before its step; failures are left to the
        worker (it computes what did not arrive)."""
        transfers = [
            self.coordinator.transfer.remote(
                load.handle.data.worker, load.handle.data.kv_id, load.src_block_indices, self.worker, load.req_id
            )
            for load in loads
            if isinstance(load.handle.data, DirectKVRef)
        ]
        for transfer in transfers:
            try:
                ray.get(transfer, timeout=LOAD_TIMEOUT_S)
            except Exception as error:  # noqa: BLE001 - the worker recomputes; the engine goes on
                logger.warning("A KV transfer failed: %r", error)
