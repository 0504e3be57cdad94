"""The engine core in its own process (vLLM's ``EngineCoreProc``): the busy loop away from the server's GIL.

The process is a child of the front end's (``python -m engine.core.core_proc``), or, for a core that drives
Ray worker actors (TP/PP), a Ray actor (``cluster.core_actor``); ``engine.core.core_client`` starts either.
The protocol, over one duplex pipe (pickled messages, in order both ways):

    parent -> core   EngineCoreStart first, then Request (add), AbortRequests,
                     UtilityCall, None (shut down)
    core -> parent   CoreReady once the model is loaded (or CoreFailed and exit),
                     CoreStep after every step that produced something and after
                     every batch of commands applied while idle,
                     UtilityResult for each UtilityCall.

One ``CoreStep`` carries the outputs of all requests of one step plus the
scheduler's statistics as they stand after it (and, with
``EngineCoreStart.kv_events``, the prefix cache's changes, ``engine.sched.kv_events``), so the parent learns everything
in one message per step, never one per token. The core steps while it has
work and blocks on the pipe when it has none; commands are applied between
steps (continuous batching). The process exits when told to, when its parent
goes (the pipe closes, or a watchdog sees it gone), or
when a step raises (it sends CoreFailed first).

KV handles (disaggregated prefill) hold Ray references, which never cross the pipe: they go by Ray
calls to the core's actor, and the pipe carries their keys (``engine.kv_transfer.handle_stash``).

The core trusts its input: the front end (``engine.frontend.processor``)
has validated every request before it is sent.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

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
    error: str | None = None  # the exception's traceback, when the call raised


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


def run_engine_core(conn: Connection, parent_pid: int | None) -> None:
    """The core's entry point: builds the core, reports ready, and runs the busy loop until told to stop.

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
    try:
        kv_feed = core.scheduler.kv_cache_manager.kv_event_feed() if start.kv_events else None
        EngineCoreLoop(core, conn, kv_feed).run()
    except BaseException:
        logger.exception("The engine core process died.")
        try:
            conn.send(CoreFailed(traceback.format_exc()))
        except OSError:
            pass  # the parent is gone
    finally:
        core.shutdown()


class EngineCoreLoop:
    """The busy loop of the core process: apply commands, step while there is work, report each step."""

    def __init__(self, core, conn: Connection, kv_feed=None) -> None:
        """``kv_feed``: a ``KVEventFeed`` whose batches ride in each CoreStep (None: no events)."""
        self.core = core
        self.conn = conn
        self.kv_feed = kv_feed

    def run(self) -> None:
        while True:
            has_work = self.core.has_unfinished_requests()
            commands = self._receive(block=not has_work)
            if commands is None:
                return  # shut down, or the parent is gone
            if self.core.has_unfinished_requests():
                outputs = self.core.step()
                self._report(outputs)
            elif commands or not has_work:
                self._report([])  # idle: the state the commands (or a quiet interval) left

    def _receive(self, block: bool) -> list | None:
        """Applies every command waiting (first waiting for one if ``block``); None once told to stop."""
        applied = []
        if not self.conn.poll(IDLE_REPORT_INTERVAL_S if block else 0):
            return applied
        while True:
            try:
                command = self.conn.recv()
            except EOFError:
                return None
            if command is None:
                return None
            self._apply(command)
            applied.append(command)
            if not self.conn.poll(0):
                return applied

    def _apply(self, command) -> None:
        if isinstance(command, Request):
            unstash_request(command)  # its KV handle came by the core actor (engine.kv_transfer.handle_stash)
            self.core.add_request(command)
        elif isinstance(command, AbortRequests):
            self.core.abort_requests(command.request_ids)
        elif isinstance(command, UtilityCall):
            self.conn.send(self._call(command))
        else:
            raise TypeError(f"Unknown engine-core command {command!r}")

    def _call(self, call: UtilityCall) -> UtilityResult:
        try:
            return UtilityResult(call.call_id, getattr(self.core, call.method)())
        except Exception:
            return UtilityResult(call.call_id, error=traceback.format_exc())

    def _report(self, outputs: list[EngineCoreOutput]) -> None:
        core = self.core
        kv_events = None if self.kv_feed is None else self.kv_feed.take()
        stash_outputs(outputs)  # a prefill's KV handles go by the core actor, not the pipe
        self.conn.send(
            CoreStep(outputs, core.make_stats(), core.kv_block_counts(), core.take_kv_load_latencies(), kv_events)
        )


if (
    __name__ == "__main__"
):  # python -m engine.core.core_proc <socket fd> <parent pid> (engine.core.core_client starts it)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s engine-core %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the parent, which shuts this down
    # Through the module's import name: what crosses the pipe must pickle as engine.core.core_proc.*, not __main__.*
    from engine.core import core_proc

    core_proc.run_engine_core(Connection(int(sys.argv[1])), int(sys.argv[2]))
