"""Serve on a running cluster, through its dashboard, with Ray's own client (``ServeSubmissionClient``: what
``serve deploy`` / ``serve status`` / ``serve shutdown`` use; it presents the cluster's auth token itself)
and Serve's typed status (``ServeInstanceDetails``).

Serve's deploy is declarative: a config replaces every application on the cluster. So a deploy here keeps
the applications it does not name (``with_running_apps``) and a delete of some applications redeploys the
others; only deleting the last one shuts Serve down.
"""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlsplit

from ray.dashboard.modules.serve.sdk import ServeSubmissionClient
from ray.exceptions import AuthenticationError
from ray.serve.schema import ServeInstanceDetails

NOT_READY_RETRY_S = 0.5


def client(dashboard: str) -> ServeSubmissionClient:
    """Ray's Serve client of the dashboard at ``dashboard`` (``http://host:port``); raises ConnectionError
    when nothing answers there."""
    return ServeSubmissionClient(dashboard)


def is_up(dashboard: str) -> bool:
    """Whether a Ray dashboard answers at ``dashboard``.

    With token authentication on and no token on this machine yet (a new machine: the head's start makes
    one), Ray's client refuses before it connects; then whether anything listens there decides, and talking
    to a cluster that does listen raises Ray's own error naming the missing token.
    """
    try:
        client(dashboard)
        return True
    except (ConnectionError, RuntimeError):
        return False
    except AuthenticationError:
        parts = urlsplit(dashboard)
        try:
            socket.create_connection((parts.hostname, parts.port), timeout=2).close()
            return True
        except OSError:
            return False


def serve_details(dashboard: str) -> dict:
    """Serve's status as the dashboard's JSON (``GET /api/serve/applications/``)."""
    return client(dashboard).get_serve_details()


def instance_details(dashboard: str) -> ServeInstanceDetails:
    """Serve's status, typed."""
    return ServeInstanceDetails(**serve_details(dashboard))


def wait_for_serve_api(dashboard: str, timeout_s: float = 120.0) -> ServeInstanceDetails:
    """Serve's status once the dashboard's Serve module answers (``deploy`` waits the same way)."""
    return ServeInstanceDetails(**_ready_client(dashboard, timeout_s).get_serve_details())


def _ready_client(dashboard: str, timeout_s: float) -> ServeSubmissionClient:
    """A client once the dashboard's Serve module answers (a dashboard just started may answer 5xx first)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            serve = client(dashboard)
            serve.get_serve_details()
            return serve
        except (ConnectionError, RuntimeError) as error:
            if time.monotonic() > deadline:
                raise RuntimeError(f"The dashboard at {dashboard} does not answer Serve's API: {error}") from None
            print("  the dashboard is not ready yet; retrying ...", flush=True)
            time.sleep(NOT_READY_RETRY_S)


def deploy(config: dict, dashboard: str, timeout_s: float = 120.0) -> None:
    """PUTs a whole Serve config (declarative: it replaces what runs), as ``serve deploy`` does; raises
    RuntimeError with Serve's message when Serve refuses it."""
    serve = _ready_client(dashboard, timeout_s)
    try:
        serve.deploy_applications(config)
    except RuntimeError as error:
        raise RuntimeError(f"Deploy refused: {error}") from None


def _app_config(details: ServeInstanceDetails, name: str) -> dict:
    config = details.applications[name].deployed_app_config
    if config is None:
        raise RuntimeError(
            f"The cluster's app {name!r} was deployed from Python (serve.run), not from a config: "
            "Serve deploys no config beside it."
        )
    return json.loads(config.json(exclude_unset=True))


def with_running_apps(config: dict, details: ServeInstanceDetails) -> dict:
    """``config`` plus the apps already on the cluster that it does not name, as they were deployed."""
    ours = {app["name"] for app in config["applications"]}
    kept = [_app_config(details, name) for name in details.applications if name not in ours]
    return {**config, "applications": [*kept, *config["applications"]]}


def delete_apps(names: list[str], dashboard: str, timeout_s: float = 60.0) -> None:
    """Deletes the apps ``names`` (each replica drains its requests first) and waits until they are gone;
    the cluster's other apps stay. Deleting the last app shuts Serve down (its proxies too)."""
    details = instance_details(dashboard)
    rest = [name for name in details.applications if name not in names]
    if not rest:
        shutdown_serve(dashboard)
        return
    config = {"applications": [_app_config(details, name) for name in rest]}
    if details.http_options is not None:
        config["http_options"] = json.loads(details.http_options.json(exclude_unset=True))
    if details.proxy_location is not None:
        config["proxy_location"] = details.proxy_location.value
    deploy(config, dashboard)
    deadline = time.monotonic() + timeout_s
    while set(names) & set(instance_details(dashboard).applications) and time.monotonic() < deadline:
        time.sleep(NOT_READY_RETRY_S)


def shutdown_serve(dashboard: str) -> None:
    """Deletes every Serve app and the controller; returns once Serve has shut down (each replica drains
    its in-flight requests first, up to its ``graceful_shutdown_timeout_s``)."""
    client(dashboard).delete_applications()


def cluster_nodes(dashboard: str) -> list[dict[str, float]]:
    """Each live node's total resources (Ray's state API); [] when it cannot say."""
    from ray.util.state import list_nodes

    try:
        nodes = list_nodes(address=dashboard, detail=True, timeout=10)
    except Exception:  # noqa: BLE001 -- the state API raises several kinds; no answer means no verdict
        return []
    return [dict(node.resources_total) for node in nodes if node.state == "ALIVE"]


def cluster_usage(dashboard: str) -> dict[str, tuple[float, float]]:
    """Each resource's (used, total) over the cluster, from the autoscaler's report (what ``ray status``
    prints as Usage); {} when it cannot say."""
    try:
        # Ray's client sends the cluster's auth token; the dashboard's /api/cluster_status has no SDK call.
        response = client(dashboard)._do_request("GET", "/api/cluster_status")
        report = response.json()["data"]["clusterStatus"]["loadMetricsReport"]["usage"]
    except Exception:  # noqa: BLE001 -- no answer, or a report of another shape: no verdict
        return {}
    return {name: (float(used), float(total)) for name, (used, total) in report.items()}
