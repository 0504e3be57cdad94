"""The front end's client of an engine core in another process (CHILD_PROCESS or RAY_ACTOR).

The core runs ``engine.core.core_proc`` in a ``CoreHost`` (``engine.core.core_hosts``); this end pickles
commands onto the pipe and a reader thread hands the core's messages on. KV handles' data goes by the host,
not the pipe (``engine.kv_transfer.handle_stash``). If the process dies, the sink hears it once.
"""

from __future__ import annotations

import logging
import threading

from engine.config import EngineConfig
from engine.core.core_client import SHUTDOWN_TIMEOUT_S, BackgroundCoreClient, CorePlacement
from engine.core.core_hosts import start_core_host
from engine.core.core_proc import CoreFailed, CoreReady, CoreStep, EngineCoreStart
from engine.kv_transfer.handle_stash import StashedKV, remote_kv_data, with_remote_kv_data
from engine.sched.request import Request

logger = logging.getLogger(__name__)

HEALTH_CHECK_TIMEOUT_S = 30.0


class ProcCoreClient(BackgroundCoreClient):
    """Starts the core's host at construction; ``wait_ready`` waits for its model to load (the caller sets
    itself up meanwhile), then gives its process ``core_niceness`` where set."""

    def __init__(
        self,
        config: EngineConfig,
        placement: CorePlacement,
        executor_class: type | None = None,
        kv_events: bool = False,
    ) -> None:
        super().__init__()
        self._niceness = config.device_config.core_niceness
        self._send_lock = threading.Lock()
        self._conn, self.host = start_core_host(placement.value, config)
        self._send(EngineCoreStart(config, executor_class, kv_events))
        self._reader: threading.Thread | None = None
        self._is_shut_down = False

    def wait_ready(self) -> None:
        """Raises RuntimeError, with the core's traceback, if it failed to start."""
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
        if self._niceness is not None and not self.host.set_niceness(self._niceness):
            logger.warning(
                "The engine core (pid %d) keeps its niceness: setting %d is not allowed.", self.pid, self._niceness
            )

    def _start_delivery(self) -> None:
        self._reader = threading.Thread(target=self._read, name="EngineCore-reader", daemon=True)
        self._reader.start()

    def add_request(self, request: Request) -> None:
        data = remote_kv_data(request.kv_transfer_params)
        if data is not None:  # a decode request's KV handle goes by the host (engine.kv_transfer.handle_stash)
            self.host.stash_kv({request.request_id: data})
            request.kv_transfer_params = with_remote_kv_data(request.kv_transfer_params, StashedKV(request.request_id))
        self._send(request)

    def check_health(self) -> None:
        code = self.host.poll()
        if code is not None:
            raise RuntimeError(f"The engine core process is gone (exit code {code}).")
        self.call("check_health", timeout_s=HEALTH_CHECK_TIMEOUT_S)

    def _send(self, command: object) -> None:
        with self._send_lock:
            self._conn.send(command)

    def take_step(self, step: CoreStep) -> list:
        self._claim_kv_handles(step.outputs)
        return super().take_step(step)

    def _claim_kv_handles(self, outputs: list) -> None:
        """Gives a prefill's outputs their KV handles' data back from the core's stash, in one call a step."""
        stashed = [output for output in outputs if isinstance(remote_kv_data(output.kv_transfer_params), StashedKV)]
        if not stashed:
            return
        try:
            claimed = self.host.claim_kv([output.request_id for output in stashed])
        except Exception:  # the core is going; its on_died follows
            logger.exception("Taking KV handles from the engine core failed; their requests lose their KV.")
            claimed = {}
        for output in stashed:
            data = claimed.get(output.request_id)
            output.kv_transfer_params = with_remote_kv_data(output.kv_transfer_params, data)

    def _read(self) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                self._sink.on_died(f"The engine core process exited (code {self.host.wait(SHUTDOWN_TIMEOUT_S)}).")
                return
            self._on_message(message)
            if isinstance(message, CoreFailed):
                return

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
