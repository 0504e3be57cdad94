"""``Endpoint``: the calls a router may make on a served model (Ray Serve LLM's ``CallMethod``).

A router names the endpoint by this Enum, never by a method name: ``OpenAIServing.call`` dispatches on it, and
it crosses the Ray ingress / LLM-server boundary as is (an Enum pickles by name).
"""

from __future__ import annotations

from enum import Enum


class Endpoint(Enum):
    COMPLETIONS = "completions"
    CHAT = "chat"
    RESPONSES = "responses"
    TOKENIZE = "tokenize"
    DETOKENIZE = "detokenize"
    LOAD_LORA_ADAPTER = "load_lora_adapter"
    UNLOAD_LORA_ADAPTER = "unload_lora_adapter"

    @property
    def generates(self) -> bool:
        """Whether the endpoint runs engine requests (completions, chat, responses): the calls a router
        tokenizes to route."""
        return self in (Endpoint.COMPLETIONS, Endpoint.CHAT, Endpoint.RESPONSES)

    @property
    def resumable(self) -> bool:
        """Whether the endpoint's streams can be continued on another server (``continuation``): completions and
        chat; a Responses stream's event state (item ids, sequence numbers) does not travel."""
        return self in (Endpoint.COMPLETIONS, Endpoint.CHAT)
