"""What a caller hands the engine for one request besides its ``SamplingParams`` (vLLM's ``vllm.inputs``).

``PromptType``: the prompt. ``RequestOptions``: everything else that is per request, in one frozen record
built once where the request is made (an HTTP call: ``OpenAIServing``; a prefill: ``PrefillServer``) and
carried whole to ``Processor.make_request``, which makes the core's ``Request`` from it (vLLM's
``EngineCoreRequest``). A field added here reaches the core or fails loudly; none is dropped on the way.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from engine.lora_request import LoRARequest

PromptType = str | Mapping  # "text", or {"prompt_token_ids": [...]} / {"prompt": "text"}


@dataclass(frozen=True)
class RequestOptions:
    """``priority``: the scheduler's order under ``scheduling_policy="priority"`` (lower first).
    ``cache_salt``: blocks of this request's prefix are shared only with requests of the same salt.
    ``kv_transfer_params``: disaggregated prefill (``engine.sched.kv_transfer``), given to every child of
    ``n`` > 1. ``lora_request``: the adapter to run with (multi-LoRA; None: the base model)."""

    priority: int = 0
    cache_salt: str | None = None
    kv_transfer_params: dict | None = None
    lora_request: LoRARequest | None = None


# A request with no options: the default of every entry point.
PLAIN_REQUEST = RequestOptions()
