"""``Endpoint``: the calls a router may make on a served model (Ray Serve LLM's ``CallMethod``).

A router names the endpoint by this Enum, never by a method name: ``OpenAIServing.call`` dispatches on it, and
it crosses the Ray ingress / LLM-server boundary as is (an Enum pickles by name).
"""

from __future__ import annotations

from enum import Enum


class Endpoint(Enum):
    COMPLETIONS = "completions"
    CHAT = "chat"
    TOKENIZE = "tokenize"
    DETOKENIZE = "detokenize"
    EMBEDDINGS = "embeddings"
    LOAD_LORA_ADAPTER = "load_lora_adapter"
    UNLOAD_LORA_ADAPTER = "unload_lora_adapter"

    @property
    def generates(self) -> bool:
        """Whether the endpoint runs engine requests (chat, completions): the calls a router tokenizes to route,
        and the only ones whose streams can be continued elsewhere."""
        return self in (Endpoint.COMPLETIONS, Endpoint.CHAT)
