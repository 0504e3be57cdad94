"""Keep Serve replicas' internal gRPC servers on the node's own address instead of every interface.

Ray Serve 2.60 starts an inter-deployment gRPC server in each replica bound to
``[::]:0``: reachable on every interface of the machine, whatever address the
Ray node was started with. Serval's replicas rebind it to the node's IP
(127.0.0.1 for a loopback cluster such as `make serve` and the tests; the
node's cluster address otherwise), which is the address Serve's handles dial
anyway, so nothing reachable before becomes unreachable.
"""

from __future__ import annotations

import functools

import ray
from ray.serve._private import replica

_WILDCARD_HOSTS = ("[::]", "0.0.0.0", "")


def bind_replica_grpc_to_node_ip() -> None:
    """Patches this process's replica module (idempotent); call before the replica finishes starting."""
    original = replica.add_port_to_grpc_server
    if getattr(original, "is_node_bound", False):
        return
    node_ip = ray.util.get_node_ip_address()

    @functools.wraps(original)
    def add_port_on_node_ip(server, address: str):
        host, _, port = address.rpartition(":")
        if host in _WILDCARD_HOSTS:
            address = f"{node_ip}:{port}"
        return original(server, address)

    add_port_on_node_ip.is_node_bound = True
    replica.add_port_to_grpc_server = add_port_on_node_ip
