"""Where ``make serve``'s start-up time went: one line per phase, from the launcher's clock and Ray's logs.

The launcher times what it waits for itself (the Ray head's start, the deploy request, the wait until
RUNNING). Inside the deploy, Serve's controller log (``<session>/logs/serve/controller_*.log``) says
when the app was imported and built and how long each replica took to start: Serve's own "started
successfully ... after N s", of which "Replica constructor ... took M s" is ``__init__`` and the rest
the replica's process start and the import of its deployment's module. The head's start is split
too, from the first line each process logged: ``ray start`` starts the GCS, waits for the dashboard
(all its modules), then starts the raylet and waits for its agents.

Pure functions over log text and timestamps (seconds since the epoch), so they are tested without a cluster.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

_STAMP = r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d[,.]\d{3})"
_LINE = re.compile(r"^\w+ " + _STAMP + r" controller \d+ -- (.*)$")
_BUILD_START = re.compile(r"Importing and building app '([^']+)'")
_BUILD_END = re.compile(r"Imported and built app '([^']+)' successfully")
_REPLICA_UP = re.compile(
    r"Replica\(id='[^']+', deployment='([^']+)', app='([^']+)'\) started successfully .* after ([\d.]+)s"
    r"(?:.*Replica constructor, reconfigure method, and initial health check took ([\d.]+)s)?"
)
# ``ray start``'s phases in order, each with the log whose first line ends it (None: ``ray start`` returning).
_HEAD_PHASES = (("ray CLI", "gcs_server.out"), ("GCS and dashboard", "raylet.out"), ("raylet and agents", None))


def parse_time(stamp: str) -> float:
    """A Ray log timestamp (``2026-12-01 14:46:06,160``, local time) as seconds since the epoch."""
    return datetime.strptime(stamp.replace(",", "."), "%Y-%m-%d %H:%M:%S.%f").timestamp()


@dataclass
class ReplicaStart:
    """One replica's start as Serve reports it: ``total_s`` from asking for it to ready, of which
    ``constructor_s`` ran its ``__init__`` (None where Serve did not say)."""

    deployment: str
    total_s: float
    constructor_s: float | None


@dataclass
class ServeEvents:
    """What the controller log says about one deploy: each app's build window, each replica's start."""

    builds: dict[str, tuple[float, float | None]] = field(default_factory=dict)  # app -> (start, end or None)
    replicas: list[ReplicaStart] = field(default_factory=list)


def parse_controller_log(text: str, app_names: list[str], since: float = 0.0) -> ServeEvents:
    """The build windows and replica starts of ``app_names`` logged at or after ``since`` (epoch seconds)."""
    events = ServeEvents()
    for line in text.splitlines():
        match = _LINE.match(line)
        if not match or parse_time(match.group(1)) < since:
            continue
        at, message = parse_time(match.group(1)), match.group(2)
        if (start := _BUILD_START.search(message)) and start.group(1) in app_names:
            events.builds[start.group(1)] = (at, None)
        elif (end := _BUILD_END.search(message)) and end.group(1) in events.builds:
            events.builds[end.group(1)] = (events.builds[end.group(1)][0], at)
        elif (up := _REPLICA_UP.search(message)) and up.group(2) in app_names:
            constructor = float(up.group(4)) if up.group(4) else None
            events.replicas.append(ReplicaStart(up.group(1), float(up.group(3)), constructor))
    return events


def controller_log_text(session_dir: Path | None) -> str:
    """The controller logs of the session (several after a controller restart), oldest first; "" if none."""
    if session_dir is None:
        return ""
    paths = sorted((session_dir / "logs" / "serve").glob("controller_*.log"), key=lambda p: p.stat().st_mtime)
    return "\n".join(p.read_text(errors="replace") for p in paths if not p.name.startswith("controller_build"))


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
    if replica.constructor_s is None:
        return f"{replica.deployment} {replica.total_s:.1f} s"
    process_s = max(0.0, replica.total_s - replica.constructor_s)
    return (
        f"{replica.deployment} {replica.total_s:.1f} s"
        f" (process and imports {process_s:.1f} s, constructor {replica.constructor_s:.1f} s)"
    )


def start_up_lines(
    session_dir: Path | None, app_names: list[str], marks: dict[str, float], head_started: bool
) -> list[str]:
    """The report printed once every app is RUNNING: the total, then one short line per phase.

    ``marks`` (epoch seconds): ``start`` (the launcher began), ``head`` (the Ray head answered),
    ``deploy`` (the config was sent), ``running``. ``head_started``: this launcher started the head
    (else it used one already running and that phase is not shown). The deploy's phases come from
    the controller log: Serve's controller and HTTP proxy (until the first build starts), each app's
    import and build, each replica's start (slowest first) split into process and imports, and
    constructor.
    """
    lines = [f"Up in {marks['running'] - marks['start']:.1f} s:"]
    if head_started:
        split = head_breakdown(session_dir, marks["start"], marks["head"])
        lines.append(f"  Ray head: {marks['head'] - marks['start']:.1f} s" + (f" ({split})" if split else ""))
    events = parse_controller_log(controller_log_text(session_dir), app_names, since=marks["deploy"] - 1.0)
    starts = [start for start, _ in events.builds.values()]
    if starts:
        lines.append(f"  Serve controller and HTTP proxy: {min(starts) - marks['deploy']:.1f} s")
    for app, (start, end) in events.builds.items():
        if end is not None:
            lines.append(f"  app {app!r} imported and built: {end - start:.1f} s")
    lines += [f"  replica {_replica_text(r)}" for r in sorted(events.replicas, key=lambda r: -r.total_s)]
    if len(lines) == 1 + head_started:  # no controller log to read: the deploy as one phase
        lines.append(f"  deploy until RUNNING: {marks['running'] - marks['deploy']:.1f} s")
    return lines
