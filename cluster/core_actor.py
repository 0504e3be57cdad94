"""The engine core as a Ray actor: where the core of an engine with Ray worker actors (TP/PP), or with KV
transfer (disaggregated prefill), runs.

Only a Ray worker can drive actors or hold Ray references, so such a core cannot be a plain child
process of the replica (``engine.core.core_proc``'s usual host). It runs in an
``EngineCoreActor`` instead, speaking the same pipe protocol
(``engine.core.core_proc``: ``EngineCoreStart`` first, one ``CoreStep`` per step)
over a Unix socket that the front end listens on in Linux's abstract
namespace (nothing on disk, nothing on the network; the actor shares the
front end's node, so it can connect).

KV handles cross by actor calls (``stash_kv`` / ``claim_kv``, beside ``run`` on the actor's other
threads), which Ray counts, never by the socket (``engine.kv_transfer.handle_stash``).

Placement: in bundle 0 of the caller's placement group (a Serve replica's;
bundle 0 holds the replica and rank 0, the core takes no CPU of its own), or
of one made here for the engine when the caller has none. The core's
executor then finds that group (``cluster.placement``) and puts one worker in
each bundle. A core whose worker is in process (KV transfer with one device)
needs no group: it runs on the caller's node, on the caller's CPUs.

Lifetime: the actor and the worker actors it creates are owned by the process
that created it, so Ray kills them all when that process dies (a SIGKILLed
replica leaves nothing behind); ``RayActorHost.kill`` ends them after a
shutdown, and removes the group if it made it. (A group the core made itself
would outlive a killed core: groups belong to the job, not to the actor.) A
dead core actor closes the socket: the front end's streams fail at once
(``engine.core.proc_client``).
"""

from __future__ import annotations

import socket
import time
import uuid
from multiprocessing.connection import Connection

import ray
from ray.util.placement_group import PlacementGroup, get_current_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from cluster.placement import acquire_placement_group, release_placement_group, uses_gpus
from cluster.ray_executor import ensure_ray_initialized
from engine.config import EngineConfig

CONNECT_TIMEOUT_S = 120.0  # the actor's process start and imports; it has no resources to wait for
KV_CALL_TIMEOUT_S = 30.0  # stash_kv / claim_kv: a dict in the actor, answered between its other calls


class EngineCoreActor:
    """Hosts ``engine.core.core_proc.run_engine_core``; ``run`` returns once the core has stopped."""

    def run(self, address: bytes) -> None:
        from engine.core.core_proc import run_engine_core

        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(address)
        run_engine_core(Connection(sock.detach()), parent_pid=None)  # Ray ends this actor with its owner

    def stash_kv(self, entries: dict) -> None:
        from engine.kv_transfer.handle_stash import CORE_STASH

        CORE_STASH.put(entries)

    def claim_kv(self, keys: list[str]) -> dict:
        from engine.kv_transfer.handle_stash import CORE_STASH

        return CORE_STASH.take(keys)


class RayActorHost:
    """A ``CoreHost`` (``engine.core.core_hosts``): the core in an ``EngineCoreActor``."""

    def __init__(self, actor, run_ref, owned_group: PlacementGroup | None) -> None:
        self.actor, self.run_ref = actor, run_ref  # run_ref resolves when the core stops (an error if it died)
        self.owned_group = owned_group  # the group made for this engine, removed by kill()

    def poll(self) -> int | None:
        return self.wait(0)

    def wait(self, timeout_s: float) -> int | None:
        done, _ = ray.wait([self.run_ref], timeout=timeout_s)
        if not done:
            return None
        try:
            ray.get(self.run_ref)
        except Exception:  # ActorDiedError (killed), or the run raised
            return 1
        return 0

    def kill(self) -> None:
        try:
            ray.kill(self.actor, no_restart=True)
        except Exception:  # already gone, or the cluster is shutting down
            pass
        if self.owned_group is not None:
            group, self.owned_group = self.owned_group, None
            release_placement_group(group)

    def set_niceness(self, niceness: int) -> bool:
        """The actor keeps the niceness Ray starts its workers with (``core_niceness`` is a child process's)."""
        return True

    def stash_kv(self, entries: dict) -> None:
        ray.get(self.actor.stash_kv.remote(entries), timeout=KV_CALL_TIMEOUT_S)

    def claim_kv(self, keys: list[str]) -> dict:
        return ray.get(self.actor.claim_kv.remote(keys), timeout=KV_CALL_TIMEOUT_S)


def start_core_actor(config: EngineConfig) -> tuple[Connection, RayActorHost]:
    """Starts an ``EngineCoreActor`` for ``config``'s engine and connects to it (``CORE_HOST_IMPORT_PATHS``)."""
    ensure_ray_initialized()
    group, owned_group = get_current_placement_group(), None
    if group is None and config.parallel_config.executor_backend == "ray":
        # Made here, not in the core, so that it goes with this process's handle on the core.
        group, _ = acquire_placement_group(config.parallel_config, uses_gpus(config.device_config.device))
        owned_group = group
    if group is not None:
        placement = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0)
    else:  # the Unix socket below reaches this node only
        placement = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    address = b"\0serval-engine-core-" + uuid.uuid4().hex.encode()  # abstract: gone with the socket
    host = None
    try:
        listener.bind(address)
        listener.listen(1)
        # Threaded (run occupies one thread): stash_kv / claim_kv are answered while the core runs.
        actor_class = ray.remote(EngineCoreActor).options(num_cpus=0, max_concurrency=4, scheduling_strategy=placement)
        actor = actor_class.remote()
        host = RayActorHost(actor, actor.run.remote(address), owned_group)
        return Connection(_accept(listener, host).detach()), host
    except BaseException:
        if host is not None:
            host.kill()
        elif owned_group is not None:
            release_placement_group(owned_group)
        raise
    finally:
        listener.close()


def _accept(listener: socket.socket, host: RayActorHost) -> socket.socket:
    """The actor's connection; raises if the actor ends (or never connects) first."""
    listener.settimeout(1.0)
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            conn, _ = listener.accept()
            conn.settimeout(None)
            return conn
        except TimeoutError:
            pass
        if host.poll() is not None:
            ray.get(host.run_ref)  # raises the actor's error
            raise RuntimeError("The engine core actor ended before connecting.")
    raise RuntimeError(f"The engine core actor did not connect within {CONNECT_TIMEOUT_S:.0f} s.")
