"""The engine core in this process: INLINE (the caller turns its loop) and THREAD (a thread turns it)."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future

from engine.config import EngineConfig
from engine.core.core_client import SHUTDOWN_TIMEOUT_S, BackgroundCoreClient, CoreClient
from engine.core.core_proc import AbortRequests, CoreStep, EngineCoreProc, QueueChannel
from engine.core.engine_core import EngineCore
from engine.sched.request import Request
from engine.sched.scheduler import SchedulerStats

logger = logging.getLogger(__name__)


class InprocCoreClient(CoreClient):
    """INLINE: the core in the caller's thread; ``step()`` turns its loop once (vLLM's ``InprocClient``).

    Not thread-safe: one thread adds, aborts and steps. Commands apply at once, so its state is the live
    core's (``get_stats``, ``kv_block_counts``), not the latest step's.
    """

    def __init__(self, config: EngineConfig, executor_class: type | None = None, kv_events: bool = False) -> None:
        super().__init__()
        self.engine_core = EngineCore(config, executor_class)
        self.num_blocks = self.engine_core.cache_config.num_blocks
        self._proc = EngineCoreProc(self.engine_core, channel=None, kv_events=kv_events)

    def step(self) -> CoreStep:
        return self._proc.step()

    def add_request(self, request: Request) -> None:
        self._proc.apply(request)

    def abort_requests(self, request_ids) -> None:
        self._proc.apply(AbortRequests(list(request_ids)))

    def call(self, method: str, timeout_s: float = 30.0):
        return getattr(self.engine_core, method)()

    def get_stats(self) -> SchedulerStats:
        return self.engine_core.get_stats()

    def kv_block_counts(self) -> tuple[int, int]:
        return self.engine_core.kv_block_counts()

    def shutdown(self) -> None:
        self.engine_core.shutdown()


class ThreadCoreClient(BackgroundCoreClient):
    """THREAD: the core built and looping on a daemon thread of this process; commands and messages pass
    in memory (``QueueChannel``), the core's messages reach the sink on that thread."""

    def __init__(self, config: EngineConfig, executor_class: type | None = None, kv_events: bool = False) -> None:
        super().__init__()
        self._channel = QueueChannel(self._on_message)
        self._ready: Future = Future()  # the KV pool's size, or the start-up error
        self._attached = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(config, executor_class, kv_events), name="EngineCore", daemon=True
        )
        self._thread.start()
        self._is_shut_down = False

    def wait_ready(self) -> None:
        try:
            self.num_blocks = self._ready.result()
        except Exception as error:
            raise RuntimeError(f"The engine core failed to start: {error!r}") from error

    def _run(self, config: EngineConfig, executor_class: type | None, kv_events: bool) -> None:
        try:
            core = EngineCore(config, executor_class)
        except BaseException as error:
            self._ready.set_exception(error)
            return
        self.engine_core = core  # for tests in this process: it belongs to the core's thread
        self._ready.set_result(core.cache_config.num_blocks)
        self._attached.wait()  # what the core sends goes to the sink
        EngineCoreProc(core, self._channel, kv_events).run()

    def _start_delivery(self) -> None:
        self._attached.set()

    def _send(self, command: object) -> None:
        self._channel.put(command)

    def check_health(self) -> None:
        if not self._thread.is_alive():
            raise RuntimeError("The engine core's thread is gone.")
        super().check_health()

    def shutdown(self) -> None:
        """Stops the loop after its current step and waits for it (the core shuts down on its thread)."""
        if self._is_shut_down:
            return
        self._is_shut_down = True
        self._channel.put(None)
        self._attached.set()  # a core never attached still starts its loop, and stops at once
        self._thread.join(SHUTDOWN_TIMEOUT_S)
        if self._thread.is_alive():
            logger.warning("The engine core's thread did not stop in %.0f s.", SHUTDOWN_TIMEOUT_S)
