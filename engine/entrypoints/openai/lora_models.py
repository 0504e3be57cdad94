"""The LoRA adapters one served model answers to, by name (vLLM's serving models, for LoRA; no Ray).

A request names an adapter as ``"<model id>:<adapter>"`` (Ray Serve LLM's form) or by the adapter's own name
(vLLM's). ``LoRAModels.resolve`` turns that name into the ``LoRARequest`` the engine takes, with one int id
per (name, path, contents) for this process's life: the engine keys device slots and its host LRU by that id (the
prefix cache by the name, alike on every replica), and refuses an id whose path or contents change; an adapter
rewritten in place and loaded again is a new id, never the old weights or their cached KV. Adapters join in three ways:

* static (``lora_modules``): checked at start, held for good;
* from the dynamic directory (``dynamic_lora_loading_path``): ``<dir>/<name>`` checked and held on the first
  request naming it, dropped least recently used past ``max_adapters`` (or when Serve's multiplexing drops it;
  a later request loads it again);
* ``load`` / ``unload`` (vLLM's ``/v1/load_lora_adapter``), only with dynamic loading on: held until unloaded.

Each adapter is checked once as it joins (``engine.lora.adapter.load_adapter``, off the event loop): a bad one
is a ValueError (400) for that request or load alone. An unknown name is ``AdapterNotFoundError`` (404).
"""

from __future__ import annotations

import asyncio
import re
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from engine.entrypoints.openai.responses import ModelCard
from engine.lora_request import LoRARequest

# A directory's name that cannot climb out of its parent; no ':' (it separates a model id from an adapter).
ADAPTER_NAME = re.compile(r"(?!\.\.?$)[A-Za-z0-9_.-]{1,128}")


def check_adapter_name(name: str) -> str:
    """``name`` if it can name an adapter, else ValueError."""
    if not isinstance(name, str) or not ADAPTER_NAME.fullmatch(name):
        raise ValueError(f"Bad LoRA adapter name {name!r}: use letters, digits, '_', '-' and '.' (not '.' or '..').")
    return name


def split_adapter(model: str, base_ids: list[str]) -> tuple[str, str] | None:
    """``(base id, adapter)`` when ``model`` is ``"<base id>:<adapter>"`` for one of ``base_ids``."""
    for base_id in base_ids:
        if model.startswith(base_id + ":") and len(model) > len(base_id) + 1:
            return base_id, model[len(base_id) + 1 :]
    return None


def adapter_name(model: str | None, base_id: str) -> str | None:
    """The adapter ``model`` names over the model ``base_id`` (either form), or None for the base model (the
    servers' resolution and the KV-aware router's hashing read a request's adapter alike)."""
    if model is None or model == base_id:
        return None
    split = split_adapter(model, [base_id])
    return split[1] if split is not None else model


class AdapterNotFoundError(LookupError):
    """No adapter of that name on this server (404 ``model_not_found``)."""

    def __init__(self, model: str) -> None:
        super().__init__(model)
        self.model = model


class LoRAEvents(Protocol):
    """What a metrics sink hears (``deployments.metrics.LoRAMetrics``)."""

    def adapters_changed(self, change: str, num_held: int) -> None:
        """``change``: ``loaded``, ``evicted`` (dropped least recently used) or ``unloaded``; ``num_held``: the
        adapters held after it."""

    def adapter_request(self, name: str) -> None:
        """A request named adapter ``name``."""


@dataclass(frozen=True)
class _Held:
    lora: LoRARequest
    pinned: bool  # static or loaded through the API: the LRU never drops it


class LoRAModels:
    """The adapters over the model ``base_id`` (at ``model_dir``), checked against ``max_lora_rank``."""

    def __init__(
        self,
        base_id: str,
        model_dir: str,
        max_lora_rank: int,
        modules: Mapping[str, str] | None = None,
        dynamic_path: str | None = None,
        max_adapters: int = 16,
        events: LoRAEvents | None = None,
    ) -> None:
        """Checks every static adapter of ``modules`` (name -> directory) now: ValueError for a bad one."""
        from engine.model.architecture import Architecture

        self.base_id = base_id
        self.max_lora_rank = max_lora_rank
        self.dynamic_path = dynamic_path
        self.max_adapters = max_adapters
        self.events = events
        self._arch = Architecture.from_model(model_dir)
        self._held: OrderedDict[str, _Held] = OrderedDict()  # least recently used first
        self._ids: dict[tuple[str, str, str], int] = {}  # (name, path, content digest) -> lora_int_id
        self._lock = asyncio.Lock()  # one adapter joins at a time: no name checked twice at once
        for name, path in (modules or {}).items():
            self._add(check_adapter_name(name), path, self._check(path), pinned=True)

    @property
    def dynamic_loading(self) -> bool:
        return self.dynamic_path is not None

    def adapter_name(self, model: str | None) -> str | None:
        """The adapter ``model`` names (either form), or None for the base model."""
        return adapter_name(model, self.base_id)

    async def resolve(self, model: str | None) -> LoRARequest | None:
        """The request's adapter (None: the base model); AdapterNotFoundError, or ValueError for a bad one."""
        name = self.adapter_name(model)
        if name is None:
            return None
        held = await self._hold(name, model)
        if self.events is not None:
            self.events.adapter_request(name)
        return held.lora

    async def hold(self, model: str) -> str:
        """Holds (and marks used) the adapter ``model`` names without a request (Serve's multiplexed loader);
        its name. AdapterNotFoundError for the base model or an unknown adapter, ValueError for a bad one."""
        name = self.adapter_name(model)
        if name is None:
            raise AdapterNotFoundError(model)
        await self._hold(name, model)
        return name

    async def _hold(self, name: str, model: str) -> _Held:
        held = self._held.get(name)
        if held is None:
            held = await self._load_dynamic(name, model)
        if name in self._held:
            self._held.move_to_end(name)
        return held

    async def _load_dynamic(self, name: str, model: str) -> _Held:
        if self.dynamic_path is None or not ADAPTER_NAME.fullmatch(name):
            raise AdapterNotFoundError(model)
        path = Path(self.dynamic_path) / name
        if not path.is_dir():
            raise AdapterNotFoundError(model)
        async with self._lock:
            if name not in self._held:  # not joined while this request waited
                digest = await asyncio.to_thread(self._check, str(path))
                self._add(name, str(path), digest, pinned=False)
            return self._held[name]

    async def load(self, name: str, path: str) -> str:
        """vLLM's ``/v1/load_lora_adapter``: held until unloaded; ``path`` relative to the dynamic directory.
        ValueError (400): dynamic loading off, a name in use, a bad adapter."""
        if not self.dynamic_loading:
            raise ValueError("Dynamic LoRA loading is off: set lora_config.dynamic_lora_loading_path.")
        check_adapter_name(name)
        path = str(Path(self.dynamic_path) / path)  # an absolute path stays as it is
        async with self._lock:
            if name in self._held:
                raise ValueError(f"The lora adapter '{name}' has already been loaded.")
            digest = await asyncio.to_thread(self._check, path)
            self._add(name, path, digest, pinned=True)
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload(self, name: str) -> str:
        """vLLM's ``/v1/unload_lora_adapter`` (a static adapter too, as vLLM does): requests naming it get 404
        from now on (those running finish). AdapterNotFoundError when it is not held."""
        if self._held.pop(name, None) is None:
            raise AdapterNotFoundError(name)
        if self.events is not None:
            self.events.adapters_changed("unloaded", len(self._held))
        return f"Success: LoRA adapter '{name}' removed successfully."

    def drop(self, name: str) -> None:
        """Forgets an adapter that joined from the dynamic directory (Serve's multiplexing evicted it); no-op
        for one held for good or not held."""
        held = self._held.get(name)
        if held is not None and not held.pinned:
            del self._held[name]
            if self.events is not None:
                self.events.adapters_changed("evicted", len(self._held))

    def cards(self, max_model_len: int | None = None) -> list[ModelCard]:
        """``/v1/models`` entries: each held adapter by its name, then each adapter of the dynamic directory not
        held as ``<model id>:<name>``; ``parent`` the model id, ``root`` the adapter's directory."""
        cards = [self._card(name, held.lora.lora_path, max_model_len) for name, held in self._held.items()]
        if self.dynamic_path is not None and Path(self.dynamic_path).is_dir():
            for path in sorted(Path(self.dynamic_path).iterdir()):
                if path.name not in self._held and ADAPTER_NAME.fullmatch(path.name) and path.is_dir():
                    cards.append(self._card(f"{self.base_id}:{path.name}", str(path), max_model_len))
        return cards

    def _card(self, model: str, path: str, max_model_len: int | None) -> ModelCard:
        return ModelCard(id=model, root=path, parent=self.base_id, max_model_len=max_model_len)

    def _check(self, path: str) -> str:
        """Reads and checks the adapter (ValueError naming the problem); its content digest."""
        import torch

        from engine.lora.adapter import adapter_digest, load_adapter

        load_adapter(path, self._arch, self.max_lora_rank, torch.float32)
        return adapter_digest(path)

    def _add(self, name: str, path: str, digest: str, pinned: bool) -> None:
        while len(self._held) >= self.max_adapters:
            unpinned = next((held for held in self._held if not self._held[held].pinned), None)
            if unpinned is None:
                raise ValueError(
                    f"This server holds {self.max_adapters} adapters (max_num_adapters_per_replica), all static "
                    "or loaded through /v1/load_lora_adapter: unload one first."
                )
            self.drop(unpinned)
        lora_id = self._ids.setdefault((name, path, digest), len(self._ids) + 1)
        self._held[name] = _Held(LoRARequest(name, lora_id, path, digest), pinned)
        if self.events is not None:
            self.events.adapters_changed("loaded", len(self._held))
