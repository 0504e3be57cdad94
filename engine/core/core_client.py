"""The front end's handle on an engine core running in another process (``engine.core.core_proc``).

The core runs in a child process, or, when it drives Ray worker actors (the Ray executor: TP/PP) or moves
KV blocks through Ray (disaggregated prefill), in a Ray actor (``cluster.core_actor``, found by import
path: ``engine/`` never imports Ray), since only a Ray worker can do either; both are a ``CoreHost``
behind the same pipe protocol. KV handles go by the host, not the pipe (``engine.kv_transfer.handle_stash``).
``EngineCoreProcess`` offers the front end (``LLMEngine``) what it calls on an
in-process ``EngineCore``: ``add_request``, ``abort_requests``, ``make_stats``,
``kv_block_counts``, ``take_kv_load_latencies``, ``take_kv_events``, ``check_health``,
``shutdown``. It differs in one way: the core steps on its own, so there is
no ``step()``; each step's ``CoreStep`` goes to the sink given to
``attach`` (the busy-loop thread's queue), from a reader thread, in order.
If the process dies, the sink gets one ``CoreDied`` and nothing after it.
"""

from __future__ import annotations

import importlib
import itertools
import logging
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import Protocol

from engine.config import EngineConfig
from engine.core.core_proc import (
    AbortRequests,
    CoreFailed,
    CoreReady,
    CoreStep,
    EngineCoreStart,
    UtilityCall,
    UtilityResult,
)
from engine.kv_transfer.handle_stash import StashedKV, remote_kv_data, with_remote_kv_data
from engine.sched.kv_cache_manager import PrefixCacheStats
from engine.sched.kv_events import KVEventBatch
from engine.sched.request import Request
from engine.sched.scheduler import SchedulerStats

logger = logging.getLogger(__name__)

HEALTH_CHECK_TIMEOUT_S = 30.0
SHUTDOWN_TIMEOUT_S = 10.0

# What starts a core, by host kind (``core_host_kind``): a function (config) -> (the front end's end of the
# pipe, CoreHost).
CORE_HOST_IMPORT_PATHS = {
    "child": "engine.core.core_client:start_child_process",
    "actor": "cluster.core_actor:start_core_actor",
}


class CoreHost(Protocol):
    """What an engine core runs in, as ``EngineCoreProcess`` sees it (it talks to the core over the pipe)."""

    def poll(self) -> int | None:
        """None while the core runs, else its exit code; never waits."""

    def wait(self, timeout_s: float) -> int | None:
        """Its exit code once it has ended within ``timeout_s``, else None."""

    def kill(self) -> None:
        """Ends it now and frees what it holds (its process; Ray worker actors it owns). Idempotent."""

    def stash_kv(self, entries: dict[str, object]) -> None:
        """Puts KV handles' data in the core's stash, by request id; returns once they are there.
        Raises where the host cannot (a child process holds no Ray references)."""

    def claim_kv(self, keys: list[str]) -> dict[str, object]:
        """Takes KV handles' data out of the core's stash; a key with none is absent."""


def core_host_kind(config: EngineConfig) -> str:
    """Where ``config``'s core runs: "actor" when it drives Ray worker actors or moves KV through Ray (only
    a Ray worker can), else "child"."""
    if config.parallel_config.executor_backend == "ray" or config.kv_transfer_config is not None:
        return "actor"
    return "child"


def start_core(config: EngineConfig) -> tuple[Connection, CoreHost]:
    """Starts a core host for ``config`` (``core_host_kind``); the core then waits for EngineCoreStart."""
    module_name, _, function_name = CORE_HOST_IMPORT_PATHS[core_host_kind(config)].partition(":")
    return getattr(importlib.import_module(module_name), function_name)(config)


class CoreDied:
    """What the sink gets once the core process is gone (``reason`` says how)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


class EngineCoreProcess:
    """Starts the engine core in another process; ``wait_ready`` waits for its model to load.

    ``add_request``/``abort_requests``/``check_health``/``shutdown`` may be called
    from any thread; ``make_stats``/``kv_block_counts``/``take_kv_load_latencies``
    read the latest ``CoreStep`` passed to ``take_step`` (the busy-loop thread's).
    """

    def __init__(self, config: EngineConfig, executor_class: type | None = None, kv_events: bool = False) -> None:
        """``kv_events``: the core reports its prefix cache's changes (``take_kv_events``)."""
        self._send_lock = threading.Lock()
        self._conn, self.host = start_core(config)
        self.pid: int | None = None  # the core's process id, known once ready
        self._send(EngineCoreStart(config, executor_class, kv_events))
        self._calls: dict[int, Future] = {}
        self._call_ids = itertools.count()
        self._reader: threading.Thread | None = None
        self._is_shut_down = False
        self.num_blocks: int | None = None  # known once ready
        self._latest: CoreStep | None = None
        self._kv_load_latencies: list[float] = []
        self._kv_events = KVEventBatch()

    def wait_ready(self) -> None:
        """Blocks until the core has loaded its model (the caller sets itself up meanwhile).

        Raises RuntimeError, with the child's traceback, if it failed to start."""
        try:
            message = self._conn.recv()
        except EOFError:
            code = self.host.wait(SHUTDOWN_TIMEOUT_S)
            raise RuntimeError(f"The engine core process exited at start-up (code {code}).") from None
        if isinstance(message, CoreFailed):
            self.host.wait(SHUTDOWN_TIMEOUT_S)
            raise RuntimeError(f"The engine core failed to start:\n{message.error}")
        assert isinstance(message, CoreReady)
        self.pid, self.num_blocks = message.pid, message.num_blocks

    def attach(self, sink: Callable[[object], None]) -> None:
        """After ``wait_ready``: delivers every CoreStep (then one CoreDied at the end) to ``sink``,
        from a reader thread."""
        self._reader = threading.Thread(target=self._read, args=(sink,), name="EngineCore-reader", daemon=True)
        self._reader.start()

    # ----------------------------------------------------------------- commands

    def add_request(self, request: Request) -> None:
        data = remote_kv_data(request.kv_transfer_params)
        if data is not None:  # a decode request's KV handle goes by the host (engine.kv_transfer.handle_stash)
            self.host.stash_kv({request.request_id: data})
            request.kv_transfer_params = with_remote_kv_data(request.kv_transfer_params, StashedKV(request.request_id))
        self._send(request)

    def abort_requests(self, request_ids) -> None:
        self._send(AbortRequests(list(request_ids)))

    def check_health(self) -> None:
        """Raises if the process is gone or the executor's own check fails (a Ray worker lost)."""
        code = self.host.poll()
        if code is not None:
            raise RuntimeError(f"The engine core process is gone (exit code {code}).")
        self.call("check_health", timeout_s=HEALTH_CHECK_TIMEOUT_S)

    def check_integrity(self) -> None:
        """Raises AssertionError unless the core's KV cache is consistent (``KVCacheManager.check_integrity``)."""
        self.call("check_integrity", timeout_s=HEALTH_CHECK_TIMEOUT_S)

    def call(self, method: str, timeout_s: float):
        """Runs ``EngineCore.<method>()`` in the core between steps; returns its value or raises its error."""
        future: Future = Future()
        call_id = next(self._call_ids)
        self._calls[call_id] = future
        try:
            self._send(UtilityCall(call_id, method))
            return future.result(timeout=timeout_s)
        finally:
            self._calls.pop(call_id, None)

    def _send(self, message) -> None:
        with self._send_lock:
            self._conn.send(message)

    # ------------------------------------------------------------------- state

    def take_step(self, step: CoreStep) -> list:
        """Makes ``step`` the state the readers below see; returns its outputs (busy-loop thread)."""
        self._latest = step
        self._kv_load_latencies.extend(step.kv_load_latencies)
        if step.kv_events:
            self._kv_events.merge(step.kv_events)
        self._claim_kv_handles(step.outputs)
        return step.outputs

    def _claim_kv_handles(self, outputs: list) -> None:
        """Gives a prefill's outputs their KV handles' data back from the core's stash, in one call a step."""
        stashed = [output for output in outputs if isinstance(remote_kv_data(output.kv_transfer_params), StashedKV)]
        if not stashed:
            return
        try:
            claimed = self.host.claim_kv([output.request_id for output in stashed])
        except Exception:  # the core is going; its CoreDied follows
            logger.exception("Taking KV handles from the engine core failed; their requests lose their KV.")
            claimed = {}
        for output in stashed:
            data = claimed.get(output.request_id)
            output.kv_transfer_params = with_remote_kv_data(output.kv_transfer_params, data)

    def make_stats(self) -> SchedulerStats:
        if self._latest is None:
            return SchedulerStats(0, 0, 0.0, 0, PrefixCacheStats())
        return self._latest.scheduler_stats

    def kv_block_counts(self) -> tuple[int, int]:
        return (self.num_blocks - 1, self.num_blocks - 1) if self._latest is None else self._latest.kv_block_counts

    def take_kv_load_latencies(self) -> list[float]:
        latencies, self._kv_load_latencies = self._kv_load_latencies, []
        return latencies

    def take_kv_events(self) -> KVEventBatch:
        """The prefix cache's changes in the steps taken since the last call (empty without ``kv_events``)."""
        batch, self._kv_events = self._kv_events, KVEventBatch()
        return batch

    # ---------------------------------------------------------------- lifetime

    def _read(self, sink: Callable[[object], None]) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                sink(CoreDied(f"The engine core process exited (code {self.host.wait(SHUTDOWN_TIMEOUT_S)})."))
                return
            if isinstance(message, UtilityResult):
                self._resolve(message)
            elif isinstance(message, CoreFailed):
                sink(CoreDied(f"The engine core failed:\n{message.error}"))
                return
            else:
                sink(message)

    def _resolve(self, result: UtilityResult) -> None:
        future = self._calls.get(result.call_id)
        if future is None:
            return  # the caller timed out
        if result.error is not None:
            future.set_exception(RuntimeError(result.error))
        else:
            future.set_result(result.value)

    def shutdown(self) -> None:
        """Asks the core to stop, waits for it (killing it after SHUTDOWN_TIMEOUT_S). Idempotent."""
        if self._is_shut_down:
            return
        self._is_shut_down = True
        try:
            self._send(None)
        except OSError:
            pass  # already gone
        if self.host.wait(SHUTDOWN_TIMEOUT_S) is None:
            logger.warning("The engine core process did not stop in %.0f s; killing it.", SHUTDOWN_TIMEOUT_S)
        self.host.kill()
        self._conn.close()


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
