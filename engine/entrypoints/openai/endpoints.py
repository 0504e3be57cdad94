"""``Endpoint``: the calls a router may make on a served model (Ray Serve LLM's ``CallMethod``).

A router names the endpoint by this Enum, never by a method name: ``OpenAIServing.call`` dispatches on it, and
it crosses the Ray ingress / LLM-server boundary as is (an Enum pickles by name).
"""

from __future__ import annotations

from enum import Enum

from engine.entrypoints.openai.errors import ApiStyle


class Endpoint(Enum):
    COMPLETIONS = "completions"
    CHAT = "chat"
    MESSAGES = "messages"  # Anthropic's Messages API: a chat request, answered in Anthropic's shapes
    RESPONSES = "responses"  # OpenAI's Responses API: served as a chat request, answered as Responses items
    TOKENIZE = "tokenize"
    DETOKENIZE = "detokenize"
    EMBEDDINGS = "embeddings"
    LOAD_LORA_ADAPTER = "load_lora_adapter"
    UNLOAD_LORA_ADAPTER = "unload_lora_adapter"

    @property
    def generates(self) -> bool:
        """Whether the endpoint runs engine requests (completions, chat, messages, responses): the calls a router
        tokenizes to route."""
        return self in (Endpoint.COMPLETIONS, Endpoint.CHAT, Endpoint.MESSAGES, Endpoint.RESPONSES)

    @property
    def resumable(self) -> bool:
        """Whether the endpoint's streams can be continued on another server (``continuation``): completions,
        chat and messages; a Responses stream's event state (item ids, sequence numbers) does not travel."""
        return self in (Endpoint.COMPLETIONS, Endpoint.CHAT, Endpoint.MESSAGES)

    @property
    def renders_chat(self) -> bool:
        """Whether its request is a ``ChatCompletionRequest`` whose messages go through the chat template."""
        return self in (Endpoint.CHAT, Endpoint.MESSAGES)

    @property
    def style(self) -> ApiStyle:
        """Whose shapes its errors (and a stream's end) take: Anthropic's for the Messages API, else OpenAI's."""
        return ApiStyle.ANTHROPIC if self is Endpoint.MESSAGES else ApiStyle.OPENAI
