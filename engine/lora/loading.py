"""``LoRALoading``: the engine core holds an adapter's first requests while its workers read it from disk.

A request naming an adapter the workers have not loaded yet does not reach the scheduler: ``hold``
starts the load on every worker (``Executor.load_lora``: each worker's loading thread, off the step's
path) and keeps the request; ``take_ready`` hands over the requests whose adapter is in, and finishes
those whose adapter failed to load (``FINISHED_ERROR``, the reason in ``stop_reason``) before they
take any KV. Every other request keeps stepping meanwhile: an adapter's load never stalls a step.

An adapter once loaded counts as loaded: if the workers' host LRU (``max_cpu_loras``) has dropped it
by a later request, the step that runs it reads it again (``LoRAManager.num_step_loads``). A failed
load is tried again by the adapter's next request.
"""

from __future__ import annotations

import concurrent.futures
from concurrent.futures import Future
from typing import Any

from engine.sched.request import Request, RequestStatus
from engine.sched.request_hold import RequestHold


class LoRALoading(RequestHold):
    def __init__(self, executor) -> None:
        """``executor``: an ``engine.executor.base.Executor`` of an engine with ``enable_lora``."""
        super().__init__()
        self._executor = executor
        self._loads: dict[int, Future] = {}  # adapter id -> its load (done: loaded, or failed)

    def hold(self, request: Request) -> bool:
        """Keeps ``request`` (True) while its adapter loads, starting the load if none runs; False: the
        request names no adapter, or a loaded one, and may be scheduled now."""
        lora_request = request.lora_request
        if lora_request is None:
            return False
        load = self._loads.get(lora_request.lora_int_id)
        if load is None or (load.done() and load.exception() is not None):
            load = self._loads[lora_request.lora_int_id] = self._executor.load_lora(lora_request)
        if load.done() and load.exception() is None:
            return False
        self._waiting[request.request_id] = request
        return True

    def take_ready(self) -> tuple[list[Request], list[Request]]:
        """(requests whose adapter is loaded; requests whose adapter failed to load, finished)."""
        ready, failed = [], []
        for request_id, request in list(self._waiting.items()):
            load = self._loads[request.lora_request.lora_int_id]
            if not load.done():
                continue
            del self._waiting[request_id]
            error = load.exception()
            if error is None:
                ready.append(request)
            else:
                request.status = RequestStatus.FINISHED_ERROR
                request.stop_reason = f"LoRA adapter {request.lora_request.lora_name!r} failed to load: {error}"
                failed.append(request)
        return ready, failed

    def wait(self, timeout_s: float) -> None:
        """Blocks until a waiting request's adapter load ends or ``timeout_s`` passes (nothing else to run)."""
        loads = {id(load): load for load in (self._loads[r.lora_request.lora_int_id] for r in self._waiting.values())}
        concurrent.futures.wait(loads.values(), timeout=timeout_s, return_when=concurrent.futures.FIRST_COMPLETED)


def check_lora_supported(config: Any) -> None:
    """Start-up check of an ``EngineConfig`` with ``enable_lora``: ValueError for what LoRA cannot run with."""
    if not config.lora_config.enable_lora:
        return
    if config.speculative_config is not None:
        raise ValueError(
            "enable_lora with speculative_config is not supported yet: the draft would propose without the "
            "request's adapter. Turn one of them off."
        )
    if config.kv_transfer_config is not None:
        raise ValueError("enable_lora with kv_transfer_config is not supported yet: KV would move without its adapter.")
    if config.parallel_config.pipeline_parallel_size > 1:
        raise ValueError("enable_lora supports pipeline_parallel_size=1 only for now.")
