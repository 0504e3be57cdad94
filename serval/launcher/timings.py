"""Where the start-up time went: one line per phase, from the launcher's clock, Serve's typed status and
Serve's own start-up metrics.

The launcher times what it waits for itself (the Ray head's start, the deploy request, the wait until
RUNNING). Inside the deploy, Serve's status (``ReplicaDetails.start_time_s``) says when the first replica
was asked for (before: the controller, the proxy, the app's import and build), and Serve's histograms
``serve_replica_startup_latency_ms`` (asking for a replica to ready) and
``serve_replica_initialization_latency_ms`` (its constructor, reconfigure and first health check), read
from the node's Prometheus endpoint, split each deployment's replica start into process start and imports,
and constructor. The head's start is split too, from the first line each process logged: ``ray start``
starts the GCS, waits for the dashboard (all its modules), then starts the raylet and waits for its agents.

Pure functions over metrics text, log text and timestamps (seconds since the epoch), tested without a
cluster; ``scrape`` is the one that reads an endpoint.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

_STAMP = r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d[,.]\d{3})"
STARTUP_METRIC = "ray_serve_replica_startup_latency_ms"
INITIALIZATION_METRIC = "ray_serve_replica_initialization_latency_ms"
# ``ray start``'s phases in order, each with the log whose first line ends it (None: ``ray start`` returning).
_HEAD_PHASES = (("ray CLI", "gcs_server.out"), ("GCS and dashboard", "raylet.out"), ("raylet and agents", None))


def parse_time(stamp: str) -> float:
    """A Ray log timestamp (``2026-12-01 14:46:06,160``, local time) as seconds since the epoch."""
    return datetime.strptime(stamp.replace(",", "."), "%Y-%m-%d %H:%M:%S.%f").timestamp()


@dataclass(frozen=True)
class ReplicaStart:
    """One deployment's replica starts as Serve's histograms count them: ``replicas`` of them, each
    ``total_s`` on average from asking for it to ready, of which ``constructor_s`` ran its ``__init__``
    (with reconfigure and the first health check; None where Serve did not say)."""

    deployment: str
    replicas: int
    total_s: float
    constructor_s: float | None


Totals = dict[tuple[str, str, str], tuple[float, float]]  # (metric, app, deployment) -> (sum in ms, count)


def histogram_totals(metrics_text: str, app_names: list[str]) -> Totals:
    """The sums and counts of Serve's two replica start-up histograms for ``app_names``, from a
    Prometheus text exposition (series that differ in other labels added up)."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[tuple[str, str, str], list[float]] = {}
    for family in text_string_to_metric_families(metrics_text):
        if family.name not in (STARTUP_METRIC, INITIALIZATION_METRIC):
            continue
        for sample in family.samples:
            app = sample.labels.get("application")
            if app not in app_names or not sample.name.endswith(("_sum", "_count")):
                continue
            pair = totals.setdefault((family.name, app, sample.labels.get("deployment", "?")), [0.0, 0.0])
            pair[sample.name.endswith("_count")] += sample.value
    return {key: (pair[0], pair[1]) for key, pair in totals.items()}


def replica_starts(totals: Totals, baseline: Totals | None = None) -> list[ReplicaStart]:
    """Each deployment's replica starts counted in ``totals`` and not yet in ``baseline`` (taken before
    the deploy: a cluster that ran the app before has counted its earlier replicas), slowest first."""
    baseline = baseline or {}

    def new(metric: str, app: str, deployment: str) -> tuple[float, float]:
        now, before = totals.get((metric, app, deployment), (0.0, 0.0)), baseline.get((metric, app, deployment))
        return (now[0] - before[0], now[1] - before[1]) if before else now

    starts = []
    for metric, app, deployment in totals:
        if metric != STARTUP_METRIC:
            continue
        (total_ms, count), (init_ms, init_count) = (
            new(metric, app, deployment),
            new(INITIALIZATION_METRIC, app, deployment),
        )
        if count > 0:
            constructor = init_ms / init_count / 1000 if init_count > 0 else None
            starts.append(ReplicaStart(deployment, int(count), total_ms / count / 1000, constructor))
    return sorted(starts, key=lambda start: -start.total_s)


def scrape(metrics_port: int | None, host: str = "127.0.0.1", timeout_s: float = 5.0) -> str:
    """The Prometheus text of the node's metrics endpoint; "" when there is none or it does not answer."""
    import httpx

    if metrics_port is None:
        return ""
    try:
        return httpx.get(f"http://{host}:{metrics_port}/metrics", timeout=timeout_s).text
    except httpx.HTTPError:
        return ""


def first_logged(path: Path) -> float | None:
    """When ``path``'s first timestamped line was written (epoch seconds), or None."""
    try:
        with path.open(errors="replace") as f:
            for _, line in zip(range(50), f):
                if match := re.search(_STAMP, line):
                    return parse_time(match.group(1))
    except OSError:
        pass
    return None


def head_breakdown(session_dir: Path | None, started: float, ready: float) -> str:
    """``ray start``'s wall time (``started`` to ``ready``, epoch seconds) split by what it was doing:
    its own start-up until the GCS process logs, the GCS and the dashboard (``ray start`` waits for
    all the dashboard's modules before it starts the raylet), the raylet and its agents; "" if unknown."""
    if session_dir is None:
        return ""
    marks = [first_logged(session_dir / "logs" / name) if name else ready for _, name in _HEAD_PHASES]
    if any(mark is None for mark in marks):
        return ""
    bounds = [started, *marks]
    return ", ".join(f"{label} {end - start:.1f} s" for (label, _), start, end in zip(_HEAD_PHASES, bounds, bounds[1:]))


def _replica_text(replica: ReplicaStart) -> str:
    times = f" x {replica.replicas}" if replica.replicas > 1 else ""
    if replica.constructor_s is None:
        return f"{replica.deployment}{times} {replica.total_s:.1f} s"
    process_s = max(0.0, replica.total_s - replica.constructor_s)
    return (
        f"{replica.deployment}{times} {replica.total_s:.1f} s"
        f" (process and imports {process_s:.1f} s, constructor {replica.constructor_s:.1f} s)"
    )


def start_up_lines(
    session_dir: Path | None,
    marks: dict[str, float],
    head_started: bool,
    first_replica_asked: float | None,
    replicas: list[ReplicaStart],
) -> list[str]:
    """The report printed once every app is RUNNING: the total, then one short line per phase.

    ``marks`` (epoch seconds): ``start`` (the launcher began), ``head`` (the Ray head answered),
    ``deploy`` (the config was sent), ``running``. ``head_started``: this launcher started the head
    (else it used one already running and that phase is not shown). ``first_replica_asked``: the
    earliest ``start_time_s`` of the apps' replicas (before it: Serve's controller, proxy, and the apps'
    import and build). ``replicas``: ``replica_starts`` (each deployment's, split into process start and
    imports, and constructor; an average where it started several).
    """
    lines = [f"Up in {marks['running'] - marks['start']:.1f} s:"]
    if head_started:
        split = head_breakdown(session_dir, marks["start"], marks["head"])
        lines.append(f"  Ray head: {marks['head'] - marks['start']:.1f} s" + (f" ({split})" if split else ""))
    if first_replica_asked is not None and replicas:
        lines.append(f"  Serve controller, proxy, app import and build: {first_replica_asked - marks['deploy']:.1f} s")
        lines += [f"  replica {_replica_text(r)}" for r in replicas]
    else:  # no metrics to read: the deploy as one phase
        lines.append(f"  deploy until RUNNING: {marks['running'] - marks['deploy']:.1f} s")
    return lines
