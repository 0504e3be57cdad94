"""Helpers for the serving tests: ports, listening sockets, Serve configs and their deployment.

Deployments go through the dashboard's REST API, as ``serve deploy`` and
``make serve`` (``serval.launcher``) do.
"""

from __future__ import annotations

import re
import socket
import subprocess
from dataclasses import dataclass
from typing import Any

import httpx

from serval.launcher import lifecycle as launcher
from tests.serve.haproxy_log import HAProxyLog

LOOPBACK = "127.0.0.1"
OBJECT_STORE_BYTES = 200 * 1024 * 1024


def listening_addresses() -> set[tuple[str, int]]:
    """(address, port) of every listening TCP socket on this machine, from /proc/net/tcp{,6}."""
    found = set()
    for path, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        with open(path, encoding="ascii") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] != "0A":  # TCP_LISTEN
                    continue
                address_hex, port_hex = fields[1].split(":")
                found.add((_decode_address(address_hex, width), int(port_hex, 16)))
    return found


def _decode_address(address_hex: str, width: int) -> str:
    raw = bytes.fromhex(address_hex)
    if width == 8:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    # /proc/net/tcp6 stores four little-endian 32-bit words.
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
    return socket.inet_ntop(socket.AF_INET6, words)


def is_loopback(address: str) -> bool:
    return address in ("127.0.0.1", "::1", "::ffff:127.0.0.1")


@dataclass
class RayHead:
    gcs_port: int
    dashboard_port: int
    http_port: int
    metrics_port: int  # the node's Prometheus endpoint
    listeners_before: set[tuple[str, int]]  # listening sockets on this machine before Ray started
    haproxy_log: HAProxyLog | None = None  # Serve's HAProxy access log, where the head sends it there

    @property
    def dashboard_url(self) -> str:
        return launcher.dashboard_url(self.dashboard_port)

    @property
    def base_url(self) -> str:
        return f"http://{LOOPBACK}:{self.http_port}"


def serve_config(http_port: int, llm_configs: list[dict], **app_fields) -> dict:
    return {
        "proxy_location": "HeadOnly",
        "http_options": {"host": LOOPBACK, "port": http_port},
        "applications": [
            {
                "name": "llm",
                "route_prefix": "/",
                "import_path": "deployments.app:build_openai_app",
                "args": {"llm_configs": llm_configs},
                **app_fields,
            }
        ],
    }


def llm_config(model_id: str, model_source: str, num_replicas: int = 1, **engine_kwargs) -> dict:
    return {
        "model_loading_config": {"model_id": model_id, "model_source": model_source},
        "engine_kwargs": {"dtype": "float32", "max_model_len": 512, "max_num_seqs": 64, **engine_kwargs},
        "deployment_config": {
            "num_replicas": num_replicas,
            "max_ongoing_requests": 256,
            "ray_actor_options": {"num_cpus": 0.5},
            "graceful_shutdown_timeout_s": 60,
        },
    }


def deploy_and_wait(head: RayHead, config: dict, timeout_s: float = 300.0) -> None:
    launcher.deploy(config, head.dashboard_url)
    launcher.wait_until_running(head.dashboard_url, [app["name"] for app in config["applications"]], timeout_s)


def app_status(head: RayHead, app_name: str = "llm") -> dict:
    return launcher.serve_details(head.dashboard_url)["applications"][app_name]


@dataclass(frozen=True)
class Replica:
    """One RUNNING replica of a deployment: its id, its process and its Ray actor."""

    replica_id: str
    pid: int
    actor: Any  # the replica's Ray actor handle (Serve's ReplicaActor)


def running_replicas(head: RayHead, deployment: str, app_name: str = "llm") -> list[Replica]:
    """The RUNNING replicas of ``deployment`` per Serve's status, with their actors (looked up once: ask
    before the traffic that is measured, not during it)."""
    import ray
    from ray.serve._private.common import REPLICA_ID_FULL_ID_STR_PREFIX
    from ray.serve._private.constants import SERVE_NAMESPACE

    replicas = app_status(head, app_name)["deployments"][deployment]["replicas"]
    return [
        Replica(
            r["replica_id"],
            r["pid"],
            ray.get_actor(f"{REPLICA_ID_FULL_ID_STR_PREFIX}{app_name}#{deployment}#{r['replica_id']}", SERVE_NAMESPACE),
        )
        for r in replicas
        if r["state"] == "RUNNING"
    ]


def replica_loads(replicas: list[Replica], timeout_s: float = 30.0) -> dict[str, dict[str, int]]:
    """Each LLM-server replica's engine load, ``{"num_running": ..., "num_waiting": ...}`` by replica id, asked
    of every replica's actor at once (the replica's ``record_routing_stats``, what Serve's controller polls):
    the engine's snapshot after its latest step.

    Not through a deployment handle: Serve's router sends each call to the less loaded of two replicas, so
    calls made that way reach an idle replica while another runs the streams under test.
    """
    import ray

    calls = {replica.replica_id: replica.actor.record_routing_stats.remote() for replica in replicas}
    loads = {}
    for replica_id, call in calls.items():
        published = ray.get(call, timeout=timeout_s)
        loads[replica_id] = {key: published[key] for key in ("num_running", "num_waiting")}
    return loads


def serve_shutdown(head: RayHead) -> None:
    subprocess.run(
        [launcher.ray_bin("serve"), "shutdown", "-y", "--address", head.dashboard_url],
        env=launcher.ray_env(),
        check=True,
        capture_output=True,
    )


def sse_lines(response: httpx.Response):
    """The lines of an SSE body, split where SSE splits them (CR, LF, CRLF) and nowhere else.

    Not ``httpx``'s ``iter_lines``: it splits like ``str.splitlines``, also at U+0085, U+2028 and U+2029,
    which JSON leaves unescaped, so a text holding one would read as a cut data line.
    """
    pending = ""
    for text in response.iter_text():
        *lines, pending = re.split(r"\r\n|\r|\n", pending + text)
        yield from lines
    if pending:
        yield pending
