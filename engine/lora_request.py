"""``LoRARequest``: which adapter a request runs with (vLLM's shape; pure Python, crosses processes).

A record every layer reads (the scheduler keys prefix blocks by it, the worker picks slots by it), so it sits
beside ``sampling_params``, below them all, not in ``engine/lora``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT adapter directory, named, with a positive integer id unique per adapter.

    ``lora_int_id`` keys the worker's device slots and host LRU: two requests with the same id
    must name the same adapter. The prefix cache keys an adapter's blocks by its name instead
    (``engine.sched.block_hash.LoRAHashKeys``: alike on every replica, as the KV-aware router hashes).
    ``content_digest`` (``engine.lora.adapter.adapter_digest``; "" where the caller did not take one) tells
    an adapter rewritten in place at the same path from what was there before.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str
    content_digest: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest.lora_int_id must be a positive integer, got {self.lora_int_id!r}.")
        if not self.lora_name or not self.lora_path:
            raise ValueError("LoRARequest needs a lora_name and a lora_path.")
