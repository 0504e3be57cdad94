"""Where the start-up time went: one line per phase, from the launcher's clock and Serve's typed status.

The launcher times what it waits for itself (the Ray head's start, the deploy request, the wait until
RUNNING). Inside the deploy, Serve's status says when each replica's actor started
(``ReplicaDetails.start_time_s``; before the first: the controller, the proxy, the app's import and build),
and the launcher, polling it, sees when each replica turned RUNNING (``StartClock``). Serve's start-up
histograms (``serve_replica_startup_latency_ms``, ``serve_replica_initialization_latency_ms``) are not
used: Ray 2.60 exports a histogram's observations at its bucket midpoints, so their sums are bucket
bounds, not measurements. The head's start is split too, from the first line each process logged:
``ray start`` starts the GCS, waits for the dashboard (all its modules), then starts the raylet and waits
for its agents.

Pure functions over Serve's status, log text and timestamps (seconds since the epoch), tested without a
cluster.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from ray.serve.schema import ReplicaState, ServeInstanceDetails

_STAMP = r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d[,.]\d{3})"
# ``ray start``'s phases in order, each with the log whose first line ends it (None: ``ray start`` returning).
_HEAD_PHASES = (("ray CLI", "gcs_server.out"), ("GCS and dashboard", "raylet.out"), ("raylet and agents", None))


def parse_time(stamp: str) -> float:
    """A Ray log timestamp (``2026-12-01 14:46:06,160``, local time) as seconds since the epoch."""
    return datetime.strptime(stamp.replace(",", "."), "%Y-%m-%d %H:%M:%S.%f").timestamp()


@dataclass(frozen=True)
class ReplicaStart:
    """One replica's start: ``total_s`` from its actor's start to RUNNING."""

    deployment: str
    total_s: float


class StartClock:
    """When each replica of some apps was first seen RUNNING, from successive ``ServeInstanceDetails``
    (accurate to the polling interval)."""

    def __init__(self, app_names: list[str]):
        self.app_names = app_names
        self.ready: dict[tuple[str, str], tuple[float, float]] = {}  # (deployment, replica id) -> (started, ready)

    def observe(self, details: ServeInstanceDetails, now: float) -> None:
        for app_name in self.app_names:
            app = details.applications.get(app_name)
            for name, deployment in (app.deployments if app else {}).items():
                for replica in deployment.replicas:
                    key = (name, replica.replica_id)
                    if replica.state == ReplicaState.RUNNING and key not in self.ready:
                        self.ready[key] = (replica.start_time_s, now)

    def first_started(self) -> float | None:
        return min((started for started, _ in self.ready.values()), default=None)

    def starts(self) -> list[ReplicaStart]:
        """Each replica seen RUNNING, slowest first."""
        starts = [ReplicaStart(name, ready - started) for (name, _), (started, ready) in self.ready.items()]
        return sorted(starts, key=lambda start: -start.total_s)


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


def start_up_lines(
    session_dir: Path | None,
    marks: dict[str, float],
    head_started: bool,
    clock: StartClock | None,
    kernels_line: str | None = None,
) -> list[str]:
    """The report printed once every app is RUNNING: the total, then one short line per phase.

    ``marks`` (epoch seconds): ``start`` (the launcher began), ``head`` (the Ray head answered),
    ``deploy`` (the config was sent), ``running``. ``head_started``: this launcher started the head
    (else it used one already running and that phase is not shown). ``clock``: what the wait saw of the
    replicas (the earliest actor start: before it, Serve's controller, proxy, and the apps' import and
    build; then each replica's start, slowest first). ``kernels_line``: the native kernels' compile time
    (``kernels.KernelBuild.report_line``), last.
    """
    lines = [f"Up in {marks['running'] - marks['start']:.1f} s:"]
    if head_started:
        split = head_breakdown(session_dir, marks["start"], marks["head"])
        lines.append(f"  Ray head: {marks['head'] - marks['start']:.1f} s" + (f" ({split})" if split else ""))
    first = clock.first_started() if clock else None
    if first is not None:
        lines.append(f"  Serve controller, proxy, app import and build: {max(0.0, first - marks['deploy']):.1f} s")
        lines += [
            f"  replica {r.deployment}: {r.total_s:.1f} s (its process, imports and constructor)"
            for r in clock.starts()
        ]
    else:  # no metrics to read: the deploy as one phase
        lines.append(f"  deploy until RUNNING: {marks['running'] - marks['deploy']:.1f} s")
    return lines + ([kernels_line] if kernels_line else [])
