"""The soak's faults and its checks on a Ray Serve app, through the dashboard (REST and state API) and
Serve deployment handles.

Faults (``--fault ACTION@SECONDS[:ARG]``):

- ``kill-replica``: SIGKILL one ``LLMServer`` replica's process (an ALIVE ``ServeReplica:<app>:LLMServer:<model>``
  actor on this machine);
- ``kill-worker``: SIGKILL one ``RayWorker`` actor's process (a worker of a TP/PP replica);
- ``scale@T:N``: the ``LLMServer`` deployment's ``num_replicas`` set to N (Serve's per-deployment override
  in the app config, PUT through the dashboard as ``serve deploy`` does);
- ``redeploy``: the app config PUT again with ``max_num_seqs`` changed by one, so Serve rolls the replicas.
"""

from __future__ import annotations

import copy
import os
import random
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass


def _launcher():
    """The launcher, imported on first use: it loads Ray, which must not load before the soak has kept Ray on
    loopback (``serval.bench.soak.keep_ray_on_loopback``)."""
    from serval.launcher import lifecycle

    return lifecycle


ACTIONS = ("kill-replica", "kill-worker", "scale", "redeploy")
Settled = Callable[[list[dict]], bool]  # the deployment's replicas (Serve's status) -> has the app settled?


@dataclass(frozen=True)
class Fault:
    """One scheduled fault: ``action`` at ``at_s`` seconds after the start; ``arg``: the replica count of ``scale``."""

    action: str
    at_s: float
    arg: int | None = None

    @property
    def label(self) -> str:
        return f"{self.action}@{self.at_s:g}" + (f":{self.arg}" if self.arg is not None else "")


def parse_fault(text: str) -> Fault:
    """``kill-replica@20``, ``scale@40:2`` ... -> :class:`Fault`; ``ValueError`` naming what is wrong."""
    action, sep, rest = text.partition("@")
    when, _, arg = rest.partition(":")
    if action not in ACTIONS or not sep:
        raise ValueError(f"fault {text!r}: expected ACTION@SECONDS with ACTION one of {', '.join(ACTIONS)}")
    if (action == "scale") != bool(arg):
        raise ValueError(f"fault {text!r}: scale takes a replica count (scale@40:2), the others none")
    fault = Fault(action, float(when), int(arg) if arg else None)
    if fault.at_s < 0 or (fault.arg is not None and fault.arg < 1):
        raise ValueError(f"fault {text!r}: the time must be >= 0 and the replica count >= 1")
    return fault


@dataclass
class FaultRecord:
    """What happened when a fault ran: its start and end (seconds since the soak started), what it did
    (``detail``) or why it could not (``error``), and how long after its start Serve's status showed the
    deployment settled (``settled_after_s``: the replicas it should have, all RUNNING, a killed one
    replaced; None when that did not happen before the soak ended)."""

    label: str
    action: str
    at_s: float
    started_s: float = 0.0
    finished_s: float = 0.0
    detail: str = ""
    error: str | None = None
    settled_after_s: float | None = None
    last_states: list[str] | None = None  # the replica states Serve's status showed last while watching

    def to_json(self) -> dict:
        return asdict(self)


class ServeApp:
    """The app under test: its dashboard, app name and model id (``LLMServer:<model>`` deployment)."""

    def __init__(self, dashboard_url: str, app_name: str, model: str, seed: int = 0) -> None:
        self.dashboard_url = dashboard_url.rstrip("/")
        self.app_name = app_name
        self.deployment = f"LLMServer:{model}"
        self.rng = random.Random(seed)
        self._redeploys = 0
        if _launcher().ray_auth_token() is not None:
            # Ray's state API presents the cluster's token only when the mode says so.
            os.environ.setdefault("RAY_AUTH_MODE", "token")

    def run(self, fault: Fault) -> tuple[str, Settled]:
        """Runs ``fault``; returns what it did and the test of the deployment's replicas (Serve's status)
        that says the app has settled after it. Raises ``RuntimeError`` when there is nothing to act on."""
        before = self.replicas()
        running = {r["replica_id"] for r in before if r.get("state") == "RUNNING"}
        if fault.action == "kill-replica":
            detail, pid = self._kill_one(f"ServeReplica:{self.app_name}:{self.deployment}")
            return detail, lambda now: _steady(now, len(running)) and pid not in {r.get("pid") for r in now}
        if fault.action == "kill-worker":
            detail, _ = self._kill_one("RayWorker")  # the replica owning it is replaced: a new replica id
            return detail, lambda now: _steady(now, len(running)) and _ids(now) != running
        if fault.action == "scale":
            detail = self._put_changed(lambda app: _set_num_replicas(app, self.deployment, fault.arg))
            return detail, lambda now: _steady(now, fault.arg)
        self._redeploys += 1
        detail = self._put_changed(lambda app: _bump_max_num_seqs(app, 1 if self._redeploys % 2 else -1))
        return detail, lambda now: _steady(now, len(running)) and not _ids(now) & running

    def _kill_one(self, class_name: str) -> tuple[str, int]:
        actors = local_actors(self.dashboard_url, class_name)
        if not actors:
            raise RuntimeError(f"no ALIVE {class_name} actor on this machine")
        actor = self.rng.choice(actors)
        os.kill(actor["pid"], signal.SIGKILL)
        return f"SIGKILL pid {actor['pid']} ({class_name}, actor {actor['actor_id'][:12]})", actor["pid"]

    def _put_changed(self, change) -> str:
        status = _launcher().serve_details(self.dashboard_url)
        config = deploy_config(status)
        app = next((app for app in config["applications"] if app["name"] == self.app_name), None)
        if app is None:
            raise RuntimeError(f"no app {self.app_name!r} in the running Serve config")
        detail = change(app)
        _launcher().deploy(config, self.dashboard_url, timeout_s=30.0)
        return detail

    def replicas(self) -> list[dict]:
        """The deployment's replicas per Serve's status (``replica_id``, ``state``, ``pid``, ...)."""
        status = _launcher().serve_details(self.dashboard_url)
        app = status.get("applications", {}).get(self.app_name, {})
        return app.get("deployments", {}).get(self.deployment, {}).get("replicas", [])

    def num_running_replicas(self) -> int:
        return sum(replica.get("state") == "RUNNING" for replica in self.replicas())

    def replica_stats(self, num_replicas: int) -> dict[str, dict]:
        """Each replica's ``stats()`` by replica id (``replica_calls``)."""
        return self.replica_calls("stats", num_replicas)

    def replica_calls(self, method: str, num_replicas: int) -> dict[str, dict]:
        """Each replica's answer to ``method()`` by replica id (``replica_answers``)."""
        from ray import serve

        return replica_answers(
            serve.get_deployment_handle(self.deployment, app_name=self.app_name), method, num_replicas
        )

    def wait_idle(self, timeout_s: float) -> dict:
        """Waits until every live replica is idle (no running or waiting request, every KV block free), then
        checks each one's KV cache invariants (``LLMServer.check_integrity``); returns ``{"idle": bool,
        "replicas": {id: engine stats}, "num_replicas": n, "kv_integrity": {id: None or the failed invariant}}``
        (``idle`` false too when an invariant failed)."""
        deadline = time.monotonic() + timeout_s
        while True:
            num_replicas = self.num_running_replicas()
            stats = self.replica_stats(num_replicas)
            idle = len(stats) >= num_replicas and all(is_idle(s) for s in stats.values())
            if idle or time.monotonic() > deadline:
                integrity = self.replica_calls("check_integrity", num_replicas) if idle else {}
                return {
                    "idle": idle and all(check["ok"] for check in integrity.values()),
                    "num_replicas": num_replicas,
                    "replicas": {k: _brief(s) for k, s in stats.items()},
                    "kv_integrity": {k: check["error"] for k, check in integrity.items()},
                }
            time.sleep(0.5)


def _ids(replicas: list[dict]) -> set[str]:
    return {replica["replica_id"] for replica in replicas}


def _steady(replicas: list[dict], count: int) -> bool:
    """Exactly ``count`` replicas, all RUNNING (none starting or stopping)."""
    return len(replicas) == count and all(replica.get("state") == "RUNNING" for replica in replicas)


def replica_answers(handle, method: str, num_replicas: int, burst: int = 16, rounds: int = 4) -> dict[str, dict]:
    """Each replica's answer to ``method()`` (a dict with ``replica_id``) by replica id, through a Serve
    deployment handle, in rounds of ``burst`` concurrent calls until ``num_replicas`` replicas answered.

    Concurrent, because Serve's router sends each call to the less loaded of two replicas: calls made one at
    a time all reach an idle replica while another runs requests. A burst raises the idle one's queue in the
    router's count until calls spill onto the busy ones.
    """
    answers: dict[str, dict] = {}
    for _ in range(rounds):
        for response in [getattr(handle, method).remote() for _ in range(burst)]:
            result = response.result(timeout_s=30)
            answers[result["replica_id"]] = result
        if len(answers) >= num_replicas:
            break
    return answers


def is_idle(stats: dict) -> bool:
    """An engine runs and queues nothing and holds no KV block."""
    return (
        stats["num_running_reqs"] == stats["num_waiting_reqs"] == 0
        and stats["num_free_blocks"] == stats["num_total_blocks"]
    )


def _brief(stats: dict) -> dict:
    keys = ("num_running_reqs", "num_waiting_reqs", "num_free_blocks", "num_total_blocks", "engine_core_pid")
    return {key: stats.get(key) for key in keys}


def local_addresses() -> set[str]:
    """This machine's IP addresses, as Ray reports node addresses."""
    addresses = {"127.0.0.1", "::1"}
    try:
        addresses |= {info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None)}
    except OSError:
        pass
    return addresses


def local_actors(dashboard_url: str, class_name: str) -> list[dict]:
    """ALIVE actors of ``class_name`` whose process runs on this machine (Ray's state API)."""
    from ray.util.state import list_actors, list_nodes

    here = local_addresses()
    nodes = {node.node_id: node.node_ip for node in list_nodes(address=dashboard_url, raise_on_missing_output=False)}
    actors = list_actors(
        address=dashboard_url,
        filters=[("class_name", "=", class_name), ("state", "=", "ALIVE")],
        limit=1000,
        raise_on_missing_output=False,
    )
    return [
        {"pid": actor.pid, "actor_id": actor.actor_id}
        for actor in actors
        if actor.pid and nodes.get(actor.node_id) in here and os.path.exists(f"/proc/{actor.pid}")
    ]


def deploy_config(status: dict) -> dict:
    """The Serve config that reproduces what runs, from ``GET /api/serve/applications/``: each app's
    ``deployed_app_config`` with the cluster's proxy and HTTP options."""
    config = {"applications": [copy.deepcopy(app["deployed_app_config"]) for app in status["applications"].values()]}
    if status.get("proxy_location"):
        config["proxy_location"] = status["proxy_location"]
    http = {key: value for key, value in (status.get("http_options") or {}).items() if value is not None}
    if http:
        config["http_options"] = http
    return config


def _set_num_replicas(app: dict, deployment: str, num_replicas: int) -> str:
    overrides = [d for d in app.get("deployments", []) if d.get("name") != deployment]
    app["deployments"] = [*overrides, {"name": deployment, "num_replicas": num_replicas}]
    return f"{deployment} num_replicas -> {num_replicas}"


def _bump_max_num_seqs(app: dict, step: int) -> str:
    """Changes every LLM config's ``max_num_seqs`` by ``step`` (a changed arg: Serve rolls the replicas)."""
    changed = []
    for llm in app.get("args", {}).get("llm_configs", []):
        kwargs = llm.setdefault("engine_kwargs", {})
        kwargs["max_num_seqs"] = max(1, int(kwargs.get("max_num_seqs", 64)) + step)
        changed.append(kwargs["max_num_seqs"])
    if not changed:
        raise RuntimeError("the app's args have no llm_configs to change")
    return f"max_num_seqs -> {changed}"
