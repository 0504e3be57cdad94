"""What an engine core in another process runs in: a ``CoreHost``, started by placement.

A child process of the front end's (``python -m engine.core.core_proc``, here), or a Ray actor
(``cluster.core_actor``, found by import path: ``engine/`` never imports Ray) for a core that drives Ray
worker actors (TP/PP) or moves KV blocks through Ray (disaggregated prefill), since only a Ray worker can
do either. Both speak the pipe protocol of ``engine.core.core_proc``; the front end's client is
``engine.core.core_client.ProcCoreClient``.
"""

from __future__ import annotations

import importlib
import os
import socket
import subprocess
import sys
from multiprocessing.connection import Connection
from typing import Protocol

from engine.config import EngineConfig

# What starts a core in another process, by where it runs (``CorePlacement`` values): a function
# (config) -> (the front end's end of the pipe, CoreHost).
CORE_HOST_IMPORT_PATHS = {
    "child_process": "engine.core.core_hosts:start_child_process",
    "ray_actor": "cluster.core_actor:start_core_actor",
}


class CoreHost(Protocol):
    """What an engine core runs in, as ``ProcCoreClient`` sees it (it talks to the core over the pipe)."""

    def poll(self) -> int | None:
        """None while the core runs, else its exit code; never waits."""

    def wait(self, timeout_s: float) -> int | None:
        """Its exit code once it has ended within ``timeout_s``, else None."""

    def kill(self) -> None:
        """Ends it now and frees what it holds (its process; Ray worker actors it owns). Idempotent."""

    def set_niceness(self, niceness: int) -> bool:
        """Gives every thread of the core's process ``niceness``; False where not allowed."""

    def stash_kv(self, entries: dict[str, object]) -> None:
        """Puts KV handles' data in the core's stash, by request id; returns once they are there.
        Raises where the host cannot (a child process holds no Ray references)."""

    def claim_kv(self, keys: list[str]) -> dict[str, object]:
        """Takes KV handles' data out of the core's stash; a key with none is absent."""


def start_core_host(placement: str, config: EngineConfig) -> tuple[Connection, CoreHost]:
    """Starts the host ``CORE_HOST_IMPORT_PATHS[placement]`` for ``config``; its core then waits for
    EngineCoreStart."""
    module_name, _, function_name = CORE_HOST_IMPORT_PATHS[placement].partition(":")
    return getattr(importlib.import_module(module_name), function_name)(config)


def set_process_niceness(pid: int, niceness: int) -> bool:
    """Sets every thread of process ``pid`` to ``niceness`` (Linux keeps one per thread: its OpenMP threads
    exist already and later ones inherit it). False when not allowed (raising a priority needs
    CAP_SYS_NICE) or not on Linux; the threads keep theirs then."""
    task_dir = f"/proc/{pid}/task"
    if not os.path.isdir(task_dir) or not hasattr(os, "setpriority"):
        return False
    for _ in range(2):  # a thread started while the first pass ran gets the second
        for tid in os.listdir(task_dir):
            try:
                os.setpriority(os.PRIO_PROCESS, int(tid), niceness)
            except ProcessLookupError:
                continue  # that thread ended
            except PermissionError:
                return False
    return True


class ChildProcess:
    """A ``CoreHost``: the core in a child process of this one."""

    def __init__(self, process: subprocess.Popen) -> None:
        self.process = process

    def poll(self) -> int | None:
        return self.process.poll()

    def wait(self, timeout_s: float) -> int | None:
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def set_niceness(self, niceness: int) -> bool:
        if os.getpriority(os.PRIO_PROCESS, self.process.pid) == niceness:
            return True
        return set_process_niceness(self.process.pid, niceness)

    def stash_kv(self, entries: dict[str, object]) -> None:
        raise RuntimeError("KV handles hold Ray references: a core with KV transfer runs in a Ray actor.")

    def claim_kv(self, keys: list[str]) -> dict[str, object]:
        raise RuntimeError("KV handles hold Ray references: a core with KV transfer runs in a Ray actor.")


def start_child_process(config: EngineConfig) -> tuple[Connection, ChildProcess]:
    """``python -m engine.core.core_proc`` with one end of a socket pair; this process keeps the other
    (``config`` reaches the child in EngineCoreStart).

    Not multiprocessing's spawn: that re-runs the parent's main script in the child, which breaks
    scripts without a ``__main__`` guard and Ray's worker processes alike.
    """
    parent_socket, child_socket = socket.socketpair()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path for path in sys.path if path)}
    process = subprocess.Popen(
        [sys.executable, "-m", "engine.core.core_proc", str(child_socket.fileno()), str(os.getpid())],
        pass_fds=[child_socket.fileno()],
        env=env,
    )
    child_socket.close()
    return Connection(parent_socket.detach()), ChildProcess(process)
