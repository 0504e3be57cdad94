"""A Serve config on a Ray cluster, with ``vllm serve``'s lifecycle (``serval serve``, ``make serve``).

Where the native CPU kernels are not built on this machine, it first starts their build in the background
(``kernels``: the replicas serve on plain torch ops meanwhile, and the build's end is reported).
In the foreground (the default) the launcher starts a Ray head on 127.0.0.1 (unless a cluster is named:
``--address`` / ``RAY_ADDRESS``, or one already answers on the dashboard port), deploys the config beside
the cluster's other apps, waits until it is RUNNING while printing Serve's messages, then how long each
phase took, the endpoint and a self-check, and follows Serve's logs. Ctrl-C (SIGINT) or SIGTERM tears
down what it started: a head it started drains its in-flight HTTP streams (HAProxy), shuts Serve down and
stops by id; on a cluster it joined only its apps are deleted (each replica drains first) and the
cluster stays up. ``--detach`` returns once RUNNING and leaves everything up for ``serval status`` and
``serval stop``. A config whose app names already run is refused unless ``replace``.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import yaml

from serval.launcher import haproxy, pending, processes, report, serve_client, status, timings
from serval.launcher.head import (  # noqa: F401 -- re-exported: the launcher's API for tests and benchmarks
    LOOPBACK,
    dashboard_url,
    free_port,
    ray_auth_token,
    ray_bin,
    ray_env,
    start_ray_head,
)
from serval.launcher.kernels import KernelBuild
from serval.launcher.logs import LogFollower
from serval.launcher.pending import Pending
from serval.launcher.serve_client import deploy, serve_details  # noqa: F401 -- re-exported, as above

POLL_S = 0.25  # how often the launcher asks Serve for its status
# How often it asks what the cluster has not placed yet (Ray's state API: the dashboard asks the GCS, on
# cores the replicas starting up need too); the first time after as long.
PENDING_POLL_S = 4.0
HEARTBEAT_S = 10.0  # an unchanged status is printed again this often
LIVENESS_S = 5.0  # how often the foreground server checks that its apps still exist


@dataclass
class Cluster:
    """Where the apps run. ``started``: this launcher starts (and ends) its head; ``fixed``: a head on this
    machine (it never grows, so a config that cannot fit is refused at once); ``gcs_port``,
    ``metrics_port``: a local head's (None where unknown); ``deployed``: the config was sent."""

    dashboard: str
    started: bool
    fixed: bool
    dashboard_port: int | None = None
    gcs_port: int | None = None
    metrics_port: int | None = None
    deployed: bool = False

    def session_dir(self) -> Path | None:
        return processes.session_dir(self.gcs_port) if self.gcs_port else None

    def is_local(self) -> bool:
        """Whether the head runs on this machine (its GCS port is known only then)."""
        return self.gcs_port is not None


def load_config(config_path: str) -> dict:
    with open(config_path, encoding="utf-8") as f:
        return yaml.safe_load(f)


def is_dashboard_up(port: int) -> bool:
    return serve_client.is_up(dashboard_url(port))


def cluster_address(address: str | None) -> str | None:
    """The dashboard URL of the cluster ``address`` (a dashboard URL or a GCS address) or ``RAY_ADDRESS``
    names, as Ray's job and Serve CLIs find it; None: the launcher's local head."""
    import os

    address = address or os.environ.get("RAY_ADDRESS")
    if not address:
        return None
    if address.startswith(("http://", "https://")):
        return address.rstrip("/")
    from ray.dashboard.utils import get_address_for_submission_client

    return get_address_for_submission_client(address)


def plan_cluster(address: str | None, dashboard_port: int, gcs_port: int, metrics_port: int | None) -> Cluster:
    """The cluster ``address`` names, else the head answering on ``dashboard_port``, else a head to start."""
    if url := cluster_address(address):
        parts = urlsplit(url)
        local = parts.hostname in (LOOPBACK, "localhost") and parts.port is not None
        own_gcs = processes.gcs_port_of_dashboard(parts.port) if local else None
        return Cluster(url, started=False, fixed=False, dashboard_port=parts.port, gcs_port=own_gcs)
    url = dashboard_url(dashboard_port)
    if serve_client.is_up(url):
        gcs = processes.gcs_port_of_dashboard(dashboard_port)
        return Cluster(url, started=False, fixed=True, dashboard_port=dashboard_port, gcs_port=gcs)
    return Cluster(url, True, True, dashboard_port, gcs_port, metrics_port)


def wait_until_running(
    dashboard: str,
    app_names: list[str],
    timeout_s: float,
    config_path: str = "the config",
    fixed_cluster: bool = False,
    clock: timings.StartClock | None = None,
    kernels: KernelBuild | None = None,
):
    """Polls Serve's status until every app is RUNNING, printing Serve's messages as they change (and
    the end of the native kernels' build: ``kernels``, default: as found on this machine now); returns
    the last ``ServeInstanceDetails``.

    Raises RuntimeError as soon as the reason is final (a failed deploy; with ``fixed_cluster``, a
    cluster that does not grow, deployments whose resources can never fit), TimeoutError after
    ``timeout_s``; both carry the last status lines.
    """
    start, last, last_print = time.monotonic(), "", 0.0
    nodes = serve_client.cluster_nodes(dashboard) if fixed_cluster else []
    kernels = kernels or KernelBuild.observe()
    waiting, asked = Pending(), 0.0  # the first ask after PENDING_POLL_S: most deploys need none
    while True:
        details = serve_client.instance_details(dashboard)
        if clock is not None:
            clock.observe(details, time.time())
        if built := kernels.poll():
            print(built, flush=True)
        elapsed = time.monotonic() - start
        if elapsed - asked >= PENDING_POLL_S:  # the state API's answers cost the head more than Serve's status
            waiting, asked = Pending.fetch(dashboard), elapsed
        activities = status.replica_activities(details, app_names, kernels.activity())
        text = "\n".join(status.progress_lines(details, app_names, activities) + pending.lines(waiting))
        if text != last or elapsed - last_print >= HEARTBEAT_S:
            print(f"  [{elapsed:5.1f} s] " + text.replace("\n", "\n           "), flush=True)
            last, last_print = text, elapsed
        if status.is_running(details, app_names):
            return details
        if reason := status.final_reason(details, app_names, nodes, config_path):
            raise RuntimeError(reason)
        if fixed_cluster and (reason := pending.infeasible_reason(waiting, app_names)):
            raise RuntimeError(reason)
        if elapsed > timeout_s:
            raise TimeoutError(f"Not RUNNING after {timeout_s:.0f} s:\n{text}")
        time.sleep(POLL_S)


def refusal(config: dict, config_path: str, cluster: Cluster, replace: bool) -> str | None:
    """Why ``config`` is not deployed on ``cluster``: its app names already run there (unless ``replace``),
    or (on a fixed cluster) its deployments can never fit; None to deploy."""
    details = serve_client.wait_for_serve_api(cluster.dashboard)
    running = [name for name in (app["name"] for app in config["applications"]) if name in details.applications]
    if running and not replace:
        apps = ", ".join(f"{name!r} ({details.applications[name].status.value})" for name in running)
        return (
            f"app {apps} already runs on the cluster at {cluster.dashboard}: `serval stop` ends it, "
            "`serval serve --replace` replaces it"
        )
    nodes = serve_client.cluster_nodes(cluster.dashboard) if cluster.fixed else []
    return status.unfit_reason(status.config_needs(config), nodes, config_path)


def deploy_and_report(
    config: dict, config_path: str, cluster: Cluster, marks: dict, timeout_s: float, kernels: KernelBuild
) -> int:
    """Deploys ``config`` beside the cluster's other apps (once ``kernels``' build, if running, holds its
    lock), waits until RUNNING, prints the start-up times, the endpoint and a self-check; 0, or 1 after
    printing why it is not RUNNING."""
    names = [app["name"] for app in config["applications"]]
    clock = timings.StartClock(names)
    kernels.wait_until_locked()
    print(f"Deploying {config_path} ...", flush=True)
    marks["deploy"] = time.time()
    try:
        cluster.deployed = True
        deploy(
            serve_client.with_running_apps(config, serve_client.instance_details(cluster.dashboard)), cluster.dashboard
        )
        wait_until_running(cluster.dashboard, names, timeout_s, config_path, cluster.fixed, clock, kernels)
    except (RuntimeError, TimeoutError) as error:
        print(error, file=sys.stderr, flush=True)
        return 1
    marks["running"] = time.time()
    report.print_usage(config, cluster.dashboard)
    print(report.self_check(config), flush=True)
    if built := kernels.poll():
        print(built, flush=True)
    lines = timings.start_up_lines(cluster.session_dir(), marks, cluster.started, clock, kernels.report_line())
    print("\n".join(lines), flush=True)
    return 0


def follow(cluster: Cluster, names: list[str], kernels: KernelBuild) -> int:
    """Prints Serve's logs (and the end of ``kernels``' build) until interrupted (KeyboardInterrupt) or the
    apps are gone (returns 1)."""
    session = cluster.session_dir()
    if session is None:
        print("Serving until Ctrl-C. Serve's logs: on the cluster's head node, under its session's logs/serve/.")
    else:
        print(f"Serving until Ctrl-C. Serve's logs follow ({session / 'logs' / 'serve'}).", flush=True)
    follower = LogFollower(session / "logs" / "serve") if session else None
    checked = time.monotonic()
    while True:
        if follower:
            follower.print_new()
        if built := kernels.poll():
            print(built, flush=True)
        if time.monotonic() - checked > LIVENESS_S:
            checked = time.monotonic()
            try:
                gone = set(names) - set(serve_client.instance_details(cluster.dashboard).applications)
            except (ConnectionError, RuntimeError):
                gone = set(names)
            if gone:
                print(f"The app(s) {sorted(gone)} no longer run on {cluster.dashboard} (stopped elsewhere).")
                return 1
        time.sleep(0.5)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def _start_or_join(cluster: Cluster, head_options: dict, marks: dict) -> KernelBuild:
    """Starts the kernels' build where the cluster is this machine and they are not built (it runs while the
    head starts), then the head, or joins the cluster; returns the build."""
    kernels = KernelBuild.start(cluster.is_local())
    if cluster.started:
        start_ray_head(
            cluster.gcs_port, cluster.dashboard_port, metrics_export_port=cluster.metrics_port, **head_options
        )
        print(f"  Ray head up in {time.time() - marks['start']:.1f} s.", flush=True)
    else:
        print(f"Using the Ray cluster at {cluster.dashboard} (it stays up when this server stops).", flush=True)
    marks["head"] = time.time()
    return kernels


def serve(
    config: dict,
    config_path: str,
    cluster: Cluster,
    *,
    detach: bool,
    replace: bool,
    head_options: dict,
    timeout_s: float,
    drain_timeout_s: float,
) -> int:
    """Runs ``config`` on ``cluster`` (``plan_cluster``) in the foreground until Ctrl-C / SIGTERM, then
    tears down what it started; with ``detach``, returns once RUNNING. ``head_options``: ``num_cpus`` and
    ``object_store_bytes`` of a head it starts. Returns the exit status."""
    marks = {"start": time.time()}
    names = [app["name"] for app in config["applications"]]
    # SIGINT too, explicitly: a process started in the background of a non-interactive shell inherits SIGINT
    # ignored, and Python then installs no KeyboardInterrupt handler of its own.
    previous = {signum: signal.signal(signum, _interrupt) for signum in (signal.SIGINT, signal.SIGTERM)}
    code = 0
    try:
        kernels = _start_or_join(cluster, head_options, marks)
        if reason := refusal(config, config_path, cluster, replace):
            print(f"serval serve: not deploying {config_path}: {reason}.", file=sys.stderr, flush=True)
            return 2
        code = deploy_and_report(config, config_path, cluster, marks, timeout_s, kernels)
        if code == 0 and not detach:
            code = follow(cluster, names, kernels)
    except KeyboardInterrupt:
        print("\nStopping ...", flush=True)
    except (ConnectionError, RuntimeError, subprocess.CalledProcessError) as error:
        print(f"serval serve: {error}", file=sys.stderr, flush=True)
        code = 1
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if not detach:
            teardown(cluster, names, drain_timeout_s)
        elif code == 1:
            print(
                "(The Ray cluster stays up for `serval status` and its logs: `serval stop` ends it.)", file=sys.stderr
            )
    return code


def teardown(cluster: Cluster, names: list[str], drain_timeout_s: float) -> None:
    """Ends what ``serve`` started, deaf to further Ctrl-C (a half-stopped head would be left running): the
    head it started, else the apps it deployed."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        if cluster.started:
            stop_cluster(cluster.dashboard_port, cluster.gcs_port, drain_timeout_s)
        elif cluster.deployed:
            try:
                serve_client.delete_apps(names, cluster.dashboard, timeout_s=drain_timeout_s)
                print(f"Deleted {', '.join(names)}; the Ray cluster at {cluster.dashboard} stays up.", flush=True)
            except (ConnectionError, RuntimeError) as error:
                print(f"Could not delete {', '.join(names)} ({error}).", file=sys.stderr, flush=True)
    finally:
        signal.signal(signal.SIGINT, previous)


def stop_cluster(dashboard_port: int, gcs_port: int | None = None, drain_timeout_s: float = 60.0) -> int:
    """Ends the local head whose dashboard is on ``dashboard_port`` (its GCS port found from the dashboard's
    process, else ``gcs_port``): in-flight HTTP requests finish (at most ``drain_timeout_s``; new connections
    are refused meanwhile), Serve shuts down, then the head's processes stop, by id. Other clusters on this
    machine are left alone. Returns how many processes it stopped (0: no such head)."""
    gcs_port = processes.gcs_port_of_dashboard(dashboard_port) or gcs_port
    if is_dashboard_up(dashboard_port):
        left = haproxy.drain_head(gcs_port, drain_timeout_s) if gcs_port else 0
        if left:
            print(f"  {left} HTTP requests still in flight after {drain_timeout_s:.0f} s; stopping anyway.")
        try:
            serve_client.shutdown_serve(dashboard_url(dashboard_port))
        except (ConnectionError, RuntimeError) as error:
            print(f"  Serve did not shut down cleanly ({error}); stopping its processes.", flush=True)
    count = processes.stop_head(gcs_port) if gcs_port else 0
    if count:
        print(f"Stopped the Ray head on {LOOPBACK}:{gcs_port} ({count} processes).", flush=True)
    else:
        print(f"No Ray head with its dashboard on port {dashboard_port} runs on this machine.", flush=True)
    return count
