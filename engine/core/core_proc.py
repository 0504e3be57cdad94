"""The engine core's loop, ``EngineCoreProc`` (vLLM's name), and the protocol it speaks.

One loop, wherever the core runs (``engine.core.core_client.CorePlacement``): in a child process of the
front end's (``python -m engine.core.core_proc``), in a Ray actor (``cluster.core_actor``) for a core that
drives Ray worker actors (TP/PP) or moves KV blocks through Ray, on a thread of the front end's process, or
turned one step at a time by the offline ``LLM``. The protocol (in order both ways; pickled over a pipe
between processes, passed as they are within one):

    front end -> core   EngineCoreStart first (a process only), then Request (add), AbortRequests,
                        UtilityCall, None (shut down)
    core -> front end   CoreReady once the model is loaded (or CoreFailed and exit),
                        CoreStep after every step that produced something, after every batch of
                        commands applied while idle, and every IDLE_REPORT_INTERVAL_S while idle,
                        UtilityResult for each UtilityCall, CoreFailed if a step raised.

One ``CoreStep`` carries the outputs of all requests of one step plus the scheduler's statistics as they
stand after it (and, with ``kv_events``, the prefix cache's changes, ``engine.sched.kv_events``), so the
front end learns everything in one message per step, never one per token. The core steps while it has
work and blocks on its commands when it has none; commands are applied between steps (continuous
batching). A process exits when told to, when its parent goes (the pipe closes, or a watchdog sees it
gone), or when a step raises (it sends CoreFailed first).

KV handles (disaggregated prefill) hold Ray references, which never cross a pipe: they go by Ray calls to
the core's actor, and the pipe carries their keys (``engine.kv_transfer.handle_stash``).

The core trusts its input: the front end (``engine.frontend.processor``) has validated every request
before it is sent.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Protocol

from engine.config import EngineConfig
from engine.kv_transfer.handle_stash import stash_outputs, unstash_request
from engine.sched.kv_events import KVEventBatch
from engine.sched.request import Request
from engine.sched.scheduler import SchedulerStats
from engine.sched.step_outputs import EngineCoreOutput

logger = logging.getLogger(__name__)

# While idle the core still reports its state this often (the front end's gauges stay fresh).
IDLE_REPORT_INTERVAL_S = 2.0


@dataclass
class EngineCoreStart:
    """What the core is built from: the first message."""

    config: EngineConfig
    executor_class: type | None = None  # None: the config's
    kv_events: bool = False  # report the prefix cache's changes in each CoreStep (a KV-aware router's feed)


@dataclass
class AbortRequests:
    request_ids: list[str]


@dataclass
class UtilityCall:
    """Calls ``EngineCore.<method>()`` between steps; its result comes back as a UtilityResult."""

    call_id: int
    method: str


@dataclass
class UtilityResult:
    call_id: int
    value: object = None
    error: BaseException | None = None  # what the call raised (a RuntimeError in its place if it cannot pickle)
    traceback: str | None = None  # the core's traceback of it


@dataclass
class CoreReady:
    pid: int
    num_blocks: int


@dataclass
class CoreFailed:
    """The core died (start-up or a step raised): ``error`` is the traceback."""

    error: str


@dataclass
class CoreStep:
    """One step's outputs (possibly none) and the core's state after it."""

    outputs: list[EngineCoreOutput]
    scheduler_stats: SchedulerStats
    kv_block_counts: tuple[int, int]  # (usable blocks, free blocks)
    kv_load_latencies: list[float] = field(default_factory=list)
    kv_events: KVEventBatch | None = None  # the prefix cache's changes since the last CoreStep (if asked)


def exit_with_parent(parent_pid: int, interval_s: float = 1.0) -> None:
    """A daemon thread ends this process once its parent is gone (even mid-step, even by SIGKILL).

    Not ``PR_SET_PDEATHSIG``: that fires when the parent's *thread* that started this
    process exits, and a server may well start it from a short-lived thread.
    """

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(interval_s)
        os._exit(1)

    threading.Thread(target=watch, name="EngineCore-parent-watch", daemon=True).start()


class CoreChannel(Protocol):
    """The core's end of its link to the front end: a ``multiprocessing`` ``Connection`` between processes,
    a ``QueueChannel`` within one."""

    def poll(self, timeout: float) -> bool:
        """Whether a command waits (waiting up to ``timeout`` seconds for one)."""

    def recv(self) -> object:
        """The next command; raises EOFError once the front end has gone."""

    def send(self, message: object) -> None:
        """Hands ``message`` to the front end."""


class QueueChannel:
    """A ``CoreChannel`` within one process: commands wait in memory, messages go to ``deliver`` as they are
    (nothing pickled), on the core's thread."""

    def __init__(self, deliver) -> None:
        self._commands: deque = deque()
        self._ready = threading.Condition()
        self.send = deliver

    def put(self, command: object) -> None:
        """From any thread: queues a command for the core."""
        with self._ready:
            self._commands.append(command)
            self._ready.notify()

    def poll(self, timeout: float) -> bool:
        with self._ready:
            return self._ready.wait_for(lambda: bool(self._commands), timeout)

    def recv(self) -> object:
        with self._ready:
            return self._commands.popleft()


def run_engine_core(conn: Connection, parent_pid: int | None) -> None:
    """A core process's entry point: builds the core from EngineCoreStart, reports ready, runs the loop.

    ``parent_pid``: exit when that parent process is gone (a child process); None where something else
    ends this process with its owner (a Ray actor: Ray kills it with the replica that created it).
    """
    if parent_pid is not None:
        exit_with_parent(parent_pid)
    from engine.core.engine_core import EngineCore

    try:
        start: EngineCoreStart = conn.recv()
        core = EngineCore(start.config, start.executor_class)
    except EOFError:
        return  # the parent went away before sending the config
    except BaseException:
        conn.send(CoreFailed(traceback.format_exc()))
        return
    conn.send(CoreReady(os.getpid(), core.cache_config.num_blocks))
    # Between processes KV handles' data goes by the core's actor, not the pipe (engine.kv_transfer.handle_stash).
    EngineCoreProc(core, conn, start.kv_events, stash_kv=True).run()


class EngineCoreProc:
    """The core's loop: apply commands, step while there is work, report each step (the module's protocol).

    ``run`` loops on ``channel`` until told to stop, then shuts the core down; the offline ``LLM`` drives the
    same loop by hand instead: ``apply`` each command, then ``step``.
    """

    def __init__(self, core, channel: CoreChannel, kv_events: bool = False, stash_kv: bool = False) -> None:
        """``kv_events``: each CoreStep carries the prefix cache's changes. ``stash_kv``: the outputs' KV
        handles' data stays in the core's stash, their keys go out (a pipe: ``engine.kv_transfer.handle_stash``)."""
        self.core = core
        self.channel = channel
        self.kv_feed = core.scheduler.kv_cache_manager.kv_event_feed() if kv_events else None
        self.stash_kv = stash_kv

    def run(self) -> None:
        """Until told to stop or the front end goes; a step that raises sends CoreFailed. Shuts the core down."""
        try:
            while True:
                has_work = self.core.has_unfinished_requests()
                commands = self._receive(block=not has_work)
                if commands is None:
                    return  # shut down, or the front end is gone
                if self.core.has_unfinished_requests():
                    self.channel.send(self.step())
                elif commands or not has_work:
                    self.channel.send(self.report([]))  # idle: the state the commands (or a quiet interval) left
        except BaseException:
            logger.exception("The engine core died.")
            try:
                self.channel.send(CoreFailed(traceback.format_exc()))
            except OSError:
                pass  # the front end is gone
        finally:
            self.core.shutdown()

    def step(self) -> CoreStep:
        """One step of the core; the CoreStep that reports it."""
        return self.report(self.core.step())

    def _receive(self, block: bool) -> list | None:
        """Applies every command waiting (first waiting for one if ``block``); None once told to stop."""
        applied = []
        if not self.channel.poll(IDLE_REPORT_INTERVAL_S if block else 0):
            return applied
        while True:
            try:
                command = self.channel.recv()
            except EOFError:
                return None
            if command is None:
                return None
            reply = self.apply(command)
            if reply is not None:
                self.channel.send(reply)
            applied.append(command)
            if not self.channel.poll(0):
                return applied

    def apply(self, command) -> UtilityResult | None:
        """Applies one command; a UtilityCall's result is returned (to be sent back)."""
        if isinstance(command, Request):
            unstash_request(command)  # its KV handle came by the core actor (engine.kv_transfer.handle_stash)
            self.core.add_request(command)
        elif isinstance(command, AbortRequests):
            self.core.abort_requests(command.request_ids)
        elif isinstance(command, UtilityCall):
            return self._call(command)
        else:
            raise TypeError(f"Unknown engine-core command {command!r}")
        return None

    def _call(self, call: UtilityCall) -> UtilityResult:
        try:
            return UtilityResult(call.call_id, getattr(self.core, call.method)())
        except Exception as error:
            try:
                pickle.dumps(error)
            except Exception:
                error = RuntimeError(repr(error))
            return UtilityResult(call.call_id, error=error, traceback=traceback.format_exc())

    def report(self, outputs: list[EngineCoreOutput]) -> CoreStep:
        """``outputs`` with the core's state now."""
        core = self.core
        kv_events = None if self.kv_feed is None else self.kv_feed.take()
        if self.stash_kv:
            stash_outputs(outputs)
        return CoreStep(outputs, core.get_stats(), core.kv_block_counts(), core.take_kv_load_latencies(), kv_events)


if __name__ == "__main__":  # python -m engine.core.core_proc <socket fd> <parent pid> (from engine.core.core_hosts)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s engine-core %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the parent, which shuts this down
    # Through the module's import name: what crosses the pipe must pickle as engine.core.core_proc.*, not __main__.*
    from engine.core import core_proc

    core_proc.run_engine_core(Connection(int(sys.argv[1])), int(sys.argv[2]))
