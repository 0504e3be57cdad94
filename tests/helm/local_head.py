"""A Ray head on loopback for one test module, started as `make serve` starts it (``deployments.launcher``),
and stopped alone: ``ray stop`` would end every Ray cluster on the machine, other people's too.

No driver joins it: the tests deploy through the dashboard's REST API and talk HTTP to Serve.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from deployments import launcher
from deployments.launcher import free_port
from tests.serve.cluster import OBJECT_STORE_BYTES, RayHead, listening_addresses

DASHBOARD_START_TIMEOUT_S = 60.0
STOP_GRACE_S = 10.0


def start_head(num_cpus: int = 2) -> RayHead:
    head = RayHead(free_port(), free_port(), free_port(), free_port(), listening_addresses())
    launcher.start_ray_head(
        head.gcs_port,
        head.dashboard_port,
        num_cpus=num_cpus,
        object_store_bytes=OBJECT_STORE_BYTES,
        metrics_export_port=head.metrics_port,
    )
    deadline = time.monotonic() + DASHBOARD_START_TIMEOUT_S
    while not launcher.is_dashboard_up(head.dashboard_port):
        if time.monotonic() > deadline:
            stop_head(head)
            raise TimeoutError("the Ray dashboard did not come up")
        time.sleep(0.5)
    return head


def _command_lines() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line) of every process we can read."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        found[int(entry.name)] = (parent, command)
    return found


def head_processes(gcs_port: int) -> set[int]:
    """The head's processes: its GCS, whatever names its session or GCS address, and their descendants
    (the raylet's workers: Serve's controller, proxy and replicas; HAProxy)."""
    processes = _command_lines()
    sessions = {
        word.split("=", 1)[1]
        for _, command in processes.values()
        if f"--gcs_server_port={gcs_port} " in command
        for word in command.split()
        if word.startswith("--session-name=")
    }
    markers = {f"127.0.0.1:{gcs_port} ", f"serval-haproxy-{gcs_port}/", *sessions}
    members = {pid for pid, (_, command) in processes.items() if any(m in command + " " for m in markers)}
    members.discard(os.getpid())
    grew = True
    while grew:
        children = {pid for pid, (parent, _) in processes.items() if parent in members} - members - {os.getpid()}
        members |= children
        grew = bool(children)
    return members


def stop_head(head: RayHead) -> None:
    """Ends the head's processes by id: SIGTERM, then SIGKILL for those left after ``STOP_GRACE_S``."""
    members = head_processes(head.gcs_port)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in members:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + STOP_GRACE_S
        while time.monotonic() < deadline and any(map(_is_running, members)):
            time.sleep(0.2)


def _is_running(pid: int) -> bool:
    """Alive and not a zombie waiting for its parent."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
