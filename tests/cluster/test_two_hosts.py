"""A real two-host Ray cluster on this machine: network namespaces as hosts (``tests/cluster/netns.py``).

The Ray head runs in one namespace (10.213.7.1), a worker node in the other (10.213.7.2), joined by a
veth pair on the private 10.213.7.0/30 that the module creates and removes. The drivers run inside the
head host (``tests/cluster/two_host_driver.py``) and report JSON; this module asserts on it and on the
hosts' listening sockets (``ss`` inside each namespace). In order, on one cluster:

1. an offline ``LLM`` with ``pipeline_parallel_size=2``, one stage per host (the gloo rendezvous crosses
   the veth), gives the single-device greedy tokens;
2. a Serve app whose LLM server is placed on the worker host serves a completion through the HTTP proxy
   on the head host;
3. the worker host's raylet is SIGKILLed (node loss) under load: its replica is replaced on the head host,
   every request in flight ends within a bound (ok or an honest error: none cut, none hung), and the
   requests sent after the replacement succeed.

Skipped only where network namespaces cannot be created (not root, no iproute2), saying so.
"""

from __future__ import annotations

import pytest

from serval.launcher import processes as ray_processes
from tests.cluster import netns
from tests.cluster.netns import HEAD_ADDRESS, HTTP_PORT, WORKER_ADDRESS
from tests.cluster.two_host_driver import REQUEST_BOUND_S

# 90-120 s for the module on the shared 2-core machine (20-45 s of it starting the two Ray nodes).
pytestmark = [pytest.mark.ray, pytest.mark.slow]
DRIVER = "tests.cluster.two_host_driver"
LOOPBACK_OR_ANY = {"127.0.0.1", "::1", "0.0.0.0", "*", "::"}


@pytest.fixture(scope="module")
def two_hosts():
    try:
        with netns.two_host_cluster() as cluster:
            yield cluster
    except netns.NamespacesUnavailable as reason:
        pytest.skip(f"no network namespaces for the two test hosts: {reason}")


def test_pipeline_stages_on_two_hosts_match_single_device(two_hosts, tiny_checkpoint):
    result = two_hosts.run_driver(DRIVER, "pp", tiny_checkpoint("llama"), timeout_s=180)
    assert sorted(result["stage_addresses"]) == [HEAD_ADDRESS, WORKER_ADDRESS]
    assert result["tokens"] == result["expected"]


@pytest.mark.serve
def test_replica_on_the_worker_host_serves(two_hosts, model_path):
    result = two_hosts.run_driver(DRIVER, "serve", model_path, timeout_s=300)
    [(server_address, server_pid)] = result["servers"]
    assert server_address == WORKER_ADDRESS
    assert [address for address, _ in result["ingresses"]] == [HEAD_ADDRESS]
    assert result["completion_tokens"] == 8
    # The HTTP proxy listens on the head host's loopback only; the worker host has no HTTP listener.
    head_listeners, worker_listeners = two_hosts.head.listeners(), two_hosts.worker.listeners()
    assert {address for address, port, _ in head_listeners if port == HTTP_PORT} == {"127.0.0.1"}
    assert not [listener for listener in worker_listeners if listener[1] == HTTP_PORT]
    # Every socket in a host is on its own address or its own loopback / wildcard (the namespace's only).
    for host, listeners in ((two_hosts.head, head_listeners), (two_hosts.worker, worker_listeners)):
        assert {address for address, _, _ in listeners} <= LOOPBACK_OR_ANY | {host.address}, listeners
    # The replica's server for calls from other deployments (the ingress on the head) is on its host's address.
    assert WORKER_ADDRESS in {address for address, _, pid in worker_listeners if pid == server_pid}


@pytest.mark.serve
def test_node_loss_replaces_the_replica_on_the_head_host(two_hosts, model_path):
    servers = two_hosts.run_driver(DRIVER, "serve", model_path, timeout_s=300)["servers"]
    assert [address for address, _ in servers] == [WORKER_ADDRESS]  # (re)deployed: idempotent
    result = two_hosts.run_driver(DRIVER, "node-loss", str(two_hosts.worker.raylet_pid()), timeout_s=300)
    assert [address for address, _ in result["servers"]] == [HEAD_ADDRESS]
    assert not ray_processes.is_running(servers[0][1])  # the old replica went down with its node
    outcomes = result["outcomes"]
    fates = [outcome["fate"] for outcome in outcomes]
    assert not {"hung", "cut"} & set(fates), outcomes
    assert all(o["end"] - o["start"] < REQUEST_BOUND_S for o in outcomes), outcomes
    in_flight = [o for o in outcomes if o["start"] < result["killed"] < o["end"]]
    assert in_flight, outcomes  # the kill happened under load
    after = [o for o in outcomes if o["start"] > result["replaced"]]
    assert after and all(o["fate"] == "ok" for o in after), after
    assert result["after"]["fate"] == "ok", result["after"]
    counts = {fate: fates.count(fate) for fate in set(fates)}
    print(
        f"node loss: {len(outcomes)} requests ({len(in_flight)} in flight at the kill): {counts}; replica "
        f"running on the head host {result['replaced'] - result['killed']:.1f} s after the kill"
    )
