"""The processes of one local Ray head, found with psutil and stopped by id (``serval stop``, the test clusters).

``ray stop`` ends every Ray process on the machine, other people's clusters included, and waits up to
16 s for processes that ignore SIGTERM (the GCS, the autoscaler monitor). Here the head is the one whose
GCS listens on ``gcs_port``: its GCS, every process that names its session or GCS address, the
HAProxy of ``head.haproxy_env``, and all their descendants (Serve's controller and replicas, their
engine processes).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import psutil

# Workers exit at once on SIGTERM once Serve has shut down; the GCS and the monitor linger: killed after this.
STOP_GRACE_S = 1.0
# Ray's processes that catch SIGTERM and go on running (`ray stop` waits up to 16 s for them, then kills
# them): killed as soon as the others are gone, rather than at the end of the grace period.
LINGERING = ("/ray/gcs/gcs_server ", "/ray/raylet/raylet ", "ray::RuntimeEnvAgent", "/autoscaler/_private/monitor.py ")


def command_lines() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line) of every process this user can read."""
    found = {}
    for process in psutil.process_iter(["ppid", "cmdline"]):
        if process.info["cmdline"]:  # None or []: not ours to read, a zombie or a kernel thread
            found[process.pid] = (process.info["ppid"], " ".join(process.info["cmdline"]))
    return found


def _flag_values(command: str, flag: str) -> list[str]:
    return [word.split("=", 1)[1] for word in command.split() if word.startswith(f"{flag}=")]


def gcs_port_of_dashboard(dashboard_port: int) -> int | None:
    """The GCS port of the local head whose dashboard listens on ``dashboard_port``, if one runs here."""
    for _, command in command_lines().values():
        if "dashboard/dashboard.py" in command and f"--port={dashboard_port} " in command + " ":
            for address in _flag_values(command, "--gcs-address"):
                return int(address.rsplit(":", 1)[1])
    return None


def session_dir(gcs_port: int) -> Path | None:
    """The session directory (``/tmp/ray/session_...``) of the local head on ``gcs_port``, if one runs here."""
    for _, command in command_lines().values():
        if f"--gcs_server_port={gcs_port} " in command + " ":
            for log_dir in _flag_values(command, "--log_dir"):
                return Path(log_dir).parent
    return None


def head_processes(gcs_port: int) -> set[int]:
    """The pids of the local head on ``gcs_port`` and of all their descendants (never this process)."""
    processes = command_lines()
    sessions = {
        name
        for _, command in processes.values()
        if f"--gcs_server_port={gcs_port} " in command + " "
        for name in _flag_values(command, "--session-name")
    }
    markers = {f"127.0.0.1:{gcs_port} ", f"serval-haproxy-{gcs_port}/", *sessions}
    roots = {pid for pid, (_, command) in processes.items() if any(m in command + " " for m in markers)}
    members = set(roots)
    for pid in roots:
        try:
            members |= {child.pid for child in psutil.Process(pid).children(recursive=True)}
        except psutil.NoSuchProcess:
            members.discard(pid)
    return members - {os.getpid(), os.getppid()}


def descendants(pid: int) -> dict[int, str]:
    """pid -> command line of every descendant of ``pid``."""
    found = {}
    for child in psutil.Process(pid).children(recursive=True):
        try:
            found[child.pid] = " ".join(child.cmdline())
        except psutil.NoSuchProcess:
            continue
    return found


def is_running(pid: int) -> bool:
    """Alive and not a zombie waiting for its parent."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def stop_processes(pids: set[int], grace_s: float = STOP_GRACE_S) -> set[int]:
    """SIGTERM to each pid, SIGKILL to those still running after ``grace_s`` (or once only Ray's ``LINGERING``
    ones are left); returns the pids killed."""
    deaf = {pid for pid, command in _command_lines(pids).items() if any(m in command for m in LINGERING)}
    _signal_all(pids, signal.SIGTERM)
    _wait_gone(pids - deaf, grace_s)
    lingering = {pid for pid in pids if is_running(pid)}
    _signal_all(lingering, signal.SIGKILL)
    _wait_gone(lingering, grace_s)
    return lingering


def _command_lines(pids: set[int]) -> dict[int, str]:
    """pid -> command line (with a trailing space) of each of ``pids`` still there."""
    found = {}
    for pid in pids:
        try:
            found[pid] = " ".join(psutil.Process(pid).cmdline()) + " "
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def _wait_gone(pids: set[int], timeout_s: float) -> None:
    # Not psutil.wait_procs: a process that is not our child stays a zombie until its own parent reaps it.
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(map(is_running, pids)):
        time.sleep(0.05)


def _signal_all(pids: set[int], sig: signal.Signals) -> None:
    for pid in pids:
        try:
            psutil.Process(pid).send_signal(sig)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass


def stop_head(gcs_port: int, grace_s: float = STOP_GRACE_S) -> int:
    """Stops the local head on ``gcs_port``: SIGTERM to all its processes at once, SIGKILL to those left
    after ``grace_s`` (Serve should be shut down first: its replicas then have nothing left to finish).
    Returns how many processes it had (0: none runs here)."""
    members = head_processes(gcs_port)
    stop_processes(members, grace_s)
    stop_processes(head_processes(gcs_port), grace_s)  # anything started meanwhile (a worker being spawned)
    return len(members)


def start_head(command: list[str], env: dict[str, str], gcs_port: int) -> None:
    """Runs ``command`` (a ``ray start --head`` on ``gcs_port``) in a session of its own (a Ctrl-C in the
    terminal reaches the launcher, which drains first, not the head); if it fails where no head ran on that
    port before, stops what it started (by id) and runs it once more; raises CalledProcessError if that
    fails too.

    Why: on a loaded small machine ``ray start`` gives up when the raylet takes more than 30 s to
    register with the GCS (fixed in Ray), leaving the GCS and the dashboard running.
    """
    theirs = head_processes(gcs_port)  # a head already on the port: its failure to bind is not ours to clean up
    try:
        subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL, start_new_session=True)
        return
    except subprocess.CalledProcessError:
        if theirs:
            raise
    print(
        f"  `ray start` failed (above); stopped the {stop_head(gcs_port)} processes it left; once more ...", flush=True
    )
    subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL, start_new_session=True)


def private_metric_ports() -> dict[str, str]:
    """Free loopback ports for a head's dashboard and autoscaler metrics, which Ray otherwise binds at fixed
    ports (44227, 44217): a second head on the machine could not bind them, and Prometheus found them refused."""
    ports = {}
    for name in ("DASHBOARD_METRIC_PORT", "AUTOSCALER_METRIC_PORT"):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            ports[name] = str(sock.getsockname()[1])
    return ports
