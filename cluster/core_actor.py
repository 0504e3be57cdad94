"""The engine core as a Ray actor: where the core of an engine with Ray worker actors (TP/PP) runs.

Only a Ray worker can drive actors, so such a core cannot be a plain child
process of the replica (``engine.core_proc``'s usual host). It runs in an
``EngineCoreActor`` instead, speaking the same pipe protocol
(``engine.core_proc``: ``EngineCoreStart`` first, one ``CoreStep`` per step)
over a Unix socket that the front end listens on in Linux's abstract
namespace (nothing on disk, nothing on the network; the actor shares the
front end's node, so it can connect).

Placement: in bundle 0 of the caller's placement group when it has one (a
Serve replica's; bundle 0 holds the replica and rank 0, the core takes no
CPU of its own), else on the caller's node. The core's executor then finds
the same placement group (``cluster.placement``) and puts one worker in each
bundle.

Lifetime: the actor and the worker actors it creates are owned by the process
that created it, so Ray kills them all when that process dies (a SIGKILLed
replica leaves nothing behind); ``RayActorHost.kill`` ends them after a
shutdown. A dead core actor closes the socket: the front end's streams fail
at once (``engine.core_client``).
"""

from __future__ import annotations

import socket
import time
import uuid
from multiprocessing.connection import Connection

import ray
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from cluster.ray_executor import ensure_ray_initialized

CONNECT_TIMEOUT_S = 120.0  # the actor's process start and imports; it has no resources to wait for


class EngineCoreActor:
    """Hosts ``engine.core_proc.run_engine_core``; ``run`` returns once the core has stopped."""

    def run(self, address: bytes) -> None:
        from engine.core_proc import run_engine_core

        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(address)
        run_engine_core(Connection(sock.detach()), parent_pid=None)  # Ray ends this actor with its owner


class RayActorHost:
    """A ``CoreHost`` (``engine.core_client``): the core in an ``EngineCoreActor``."""

    def __init__(self, actor, run_ref) -> None:
        self.actor, self.run_ref = actor, run_ref  # run_ref resolves when the core stops (an error if it died)

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


def start_core_actor() -> tuple[Connection, RayActorHost]:
    """Starts an ``EngineCoreActor`` beside this process and connects to it (``CORE_HOST_IMPORT_PATHS``)."""
    ensure_ray_initialized()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    address = b"\0serval-engine-core-" + uuid.uuid4().hex.encode()  # abstract: gone with the socket
    try:
        listener.bind(address)
        listener.listen(1)
        actor = ray.remote(EngineCoreActor).options(num_cpus=0, scheduling_strategy=_beside_this_process()).remote()
        host = RayActorHost(actor, actor.run.remote(address))
        try:
            return Connection(_accept(listener, host).detach()), host
        except BaseException:
            host.kill()
            raise
    finally:
        listener.close()


def _beside_this_process():
    """Bundle 0 of this process's placement group (a replica's), else this node."""
    group = get_current_placement_group()
    if group is not None:
        return PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0)
    return NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)


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
