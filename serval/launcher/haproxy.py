"""Serve's HAProxy ingress, seen through its admin socket: how many client streams are open, and a drain.

Serve kills HAProxy (SIGKILL) as the first step of its shutdown, which cuts every stream in flight,
so the launcher drains here first: it stops HAProxy's client frontends from accepting connections and
waits until no request is in flight to a Serve backend (a backend's current sessions; a frontend's also
count idle keep-alive connections, which may stay open for 90 s).
"""

from __future__ import annotations

import csv
import io
import socket
import time
from pathlib import Path

from serval.launcher import processes as ray_processes

OWN_PROXIES = ("stats", "prometheus", "default_backend")  # HAProxy's own listeners and its 404 backend


def state_dir(gcs_port: int) -> Path:
    """Where the HAProxy of the head on ``gcs_port`` keeps its config, admin socket and state files."""
    return Path(f"/tmp/serval-haproxy-{gcs_port}")


def command(socket_path: Path, line: str, timeout_s: float = 2.0) -> str:
    """One admin-socket command's answer."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout_s)
        s.connect(str(socket_path))
        s.sendall(line.encode() + b"\n")
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks).decode(errors="replace")


def admin_sockets(gcs_port: int) -> list[Path]:
    """The admin sockets under the head's state dir (Serve puts each HAProxy in a per-node subdirectory)."""
    root = state_dir(gcs_port)
    return sorted(root.glob("*/admin.sock")) + sorted(root.glob("admin.sock"))


def _stat_rows(socket_path: Path) -> list[dict[str, str]]:
    """``show stat`` as CSV rows (pxname, svname, scur, ...), for Serve's proxies only."""
    text = command(socket_path, "show stat").lstrip("# ")
    return [row for row in csv.DictReader(io.StringIO(text)) if row.get("pxname") not in OWN_PROXIES]


def in_flight(socket_path: Path) -> int:
    """Requests HAProxy is forwarding to Serve right now (the BACKEND rows' current sessions)."""
    return sum(int(row.get("scur") or 0) for row in _stat_rows(socket_path) if row.get("svname") == "BACKEND")


def processes(gcs_port: int) -> set[int]:
    """The pids of the head's HAProxy processes: the one that answers the admin socket and any older one
    still finishing its sessions after a reload (Serve reloads with ``-sf``: soft stop, then exit)."""
    marker = f"{state_dir(gcs_port)}/"
    return {
        pid
        for pid, (_, command) in ray_processes.command_lines().items()
        if marker in command and command.split(" ", 1)[0].endswith("/haproxy")
    }


def drain(socket_paths: list[Path], timeout_s: float, poll_s: float = 0.1, lingering=lambda: 0) -> int:
    """Refuses new connections on Serve's frontends, waits up to ``timeout_s`` until no request is in
    flight, on the live HAProxy (``socket_paths``) and on the older ones ``lingering()`` counts (their
    sessions are not in the live one's stats); returns how many are left (0: drained, or no HAProxy)."""
    live = []
    for path in socket_paths:
        try:
            for row in _stat_rows(path):
                if row.get("svname") == "FRONTEND":
                    command(path, f"disable frontend {row['pxname']}")
            live.append(path)
        except OSError:  # a stale socket of an earlier HAProxy
            continue
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            left = sum(in_flight(path) for path in live) + lingering()
        except OSError:  # HAProxy went away: nothing left to drain
            return 0
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(poll_s)


def drain_head(gcs_port: int, timeout_s: float) -> int:
    """:func:`drain` for the HAProxy of the head on ``gcs_port``, older soft-stopping processes included."""
    return drain(admin_sockets(gcs_port), timeout_s, lingering=lambda: max(0, len(processes(gcs_port)) - 1))
