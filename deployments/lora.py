"""Multi-LoRA on Ray Serve: an LLM-server replica's adapters (``engine.entrypoints.openai.lora_models``) tied to
Serve's model multiplexing.

The ingress sends each request naming an adapter with ``multiplexed_model_id="<model id>:<adapter>"``
(``multiplexed_model_id``), so Serve's router prefers replicas that report holding it. A replica reports what
its ``serve.multiplexed`` loader returned (``hold_adapters``): each adapter a request held, at most
``max_num_adapters_per_replica``; past that Serve drops the least recently used, and the replica forgets it
(``AdapterLease.__del__``; a later request checks it again). Requests reaching a replica without the id (the
one-model app's own ingress) still resolve their adapter by name; only the routing preference is lost.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

from pydantic import BaseModel
from ray import serve

from deployments.llm_config import LLMConfig
from engine.entrypoints.openai.lora_models import AdapterNotFoundError, LoRAEvents, LoRAModels, adapter_name


def build_lora_models(llm_config: LLMConfig, max_lora_rank: int, events: LoRAEvents | None) -> LoRAModels | None:
    """The replica's adapters for ``llm_config.lora_config`` (None without one); ValueError for a bad static one."""
    lora_config = llm_config.lora_config
    if lora_config is None:
        return None
    return LoRAModels(
        llm_config.model_id,
        llm_config.model_loading_config.resolved_source(),
        max_lora_rank,
        lora_config.resolved_modules(),
        lora_config.resolved_dynamic_path(),
        lora_config.max_num_adapters_per_replica,
        events,
    )


class AdapterLease:
    """What the multiplexed loader returns for one adapter; Serve calls ``__del__`` when it drops it (once; the
    garbage collector's later call finds it released)."""

    def __init__(self, lora: LoRAModels, name: str, loop: asyncio.AbstractEventLoop) -> None:
        self.lora, self.name, self.loop = lora, name, loop
        self.released = False

    def __del__(self) -> None:
        if not self.released:
            self.released = True
            # Serve runs a sync __del__ on a thread: the adapters are the event loop's to change.
            with contextlib.suppress(RuntimeError):  # the loop is closed: the replica is going away
                self.loop.call_soon_threadsafe(self.lora.drop, self.name)


def hold_adapters(lora: LoRAModels, max_adapters: int) -> Callable[[str], Awaitable[AdapterLease]]:
    """Serve's multiplexed loader over ``lora``: ``await loader(multiplexed_model_id)`` holds that adapter (checked
    on its first use; AdapterNotFoundError or ValueError for an unknown or bad one) and reports it to Serve."""

    async def load(model: str) -> AdapterLease:
        name = await lora.hold(model)
        return AdapterLease(lora, name, asyncio.get_running_loop())

    return serve.multiplexed(max_num_models_per_replica=max_adapters)(load)


async def hold_multiplexed_adapter(loader: Callable[[str], Awaitable[AdapterLease]] | None) -> None:
    """Holds the adapter this call's ``multiplexed_model_id`` names, if any. An unknown or bad adapter is left to
    the serving, which answers the request with the error (404 / 400)."""
    model = serve.get_multiplexed_model_id()
    if model and loader is not None:
        with contextlib.suppress(AdapterNotFoundError, ValueError):
            await loader(model)


def multiplexed_model_id(model_id: str, request: BaseModel) -> str | None:
    """The ingress's ``multiplexed_model_id`` for a request to ``model_id``'s servers: ``"<model id>:<adapter>"``
    when its ``model`` names an adapter (either form, read as the servers read it: ``adapter_name``), else None."""
    model = getattr(request, "model", None)
    adapter = adapter_name(model, model_id) if isinstance(model, str) else None
    return None if adapter is None else f"{model_id}:{adapter}"
