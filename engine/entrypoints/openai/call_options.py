"""``CallOptions``: how one endpoint call is served, besides its request (one frozen value, every endpoint);
``request_options``: the ``RequestOptions`` its engine requests run with.

A router fills in what it knows (a prompt it tokenized to route, a stream to continue, whether to track the
stream for migration); ``OpenAIServing`` adds the LoRA adapter the request's ``model`` names. The default,
``PLAIN_CALL``, is a plain call: render and tokenize here, start afresh, no tracking, the base model.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.entrypoints.openai.continuation import Continuation
from engine.entrypoints.openai.protocol import SamplingRequest
from engine.inputs import RequestOptions
from engine.lora_request import LoRARequest


@dataclass(frozen=True)
class PrecomputedPrompt:
    """A request's prompt already rendered and tokenized by its caller with this model's tokenizer and the
    servings' own rendering (``chat_template.render_chat``; a router that tokenizes to route, such as the Ray
    ingress): the serving uses it instead of rendering and tokenizing again.

    Chat: ``text`` is the rendered conversation and ``token_ids`` its tokens. Completions: ``token_ids`` are the
    tokens of the request's first prompt when that prompt is text (``text`` unused). The serving trusts it: a
    caller must pass the prompt of this very request, or answer for a different prompt.
    """

    token_ids: list[int]
    text: str | None = None


@dataclass(frozen=True)
class CallOptions:
    """``precomputed``: the prompt as the caller rendered and tokenized it (chat needs its ``text``).
    ``continuation``: continue that stream (``continuation`` module) instead of starting one; the prompt is not
    rendered again. ``track``: each streamed ``SSEChunk`` carries its ``StreamDelta`` (what a router needs to
    continue the stream elsewhere). ``lora_request``: the adapter to run with (None: the base model). Endpoints
    that run no engine request (tokenize, detokenize, the adapter routes) ignore them."""

    precomputed: PrecomputedPrompt | None = None
    continuation: Continuation | None = None
    track: bool = False
    lora_request: LoRARequest | None = None


# A plain call (render and tokenize here, start afresh, untracked, the base model): every endpoint's default.
PLAIN_CALL = CallOptions()


def request_options(request: SamplingRequest, options: CallOptions) -> RequestOptions:
    """What the engine requests of a call run with, built once as the call is served: the body's priority and
    cache salt, the call's adapter (vLLM's per-request fields of ``EngineCoreRequest``)."""
    return RequestOptions(priority=request.priority, cache_salt=request.cache_salt, lora_request=options.lora_request)
