"""``EngineClient``: what a server may call on an engine (vLLM's ``EngineClient``).

The OpenAI layer (``engine/entrypoints/openai``) and the Serve deployments
depend on this protocol only, never on a concrete engine, so anything that
serves one model's requests can stand behind them:

* ``AsyncLLM``: the colocated engine (its front end on the server's event loop);
* ``deployments.pd_servers.RemotePrefillEngine``: a decode engine that has a
  prefill replica compute each prompt's KV first.

Every member is used from ONE event loop (the server's). The errors a client
raises, and what the OpenAI layer turns them into (``errors.from_exception``):

* ``ValueError``: bad input (an empty or too long prompt, ids outside the
  vocabulary, a request id in use); nothing was queued, every other request
  runs on undisturbed (HTTP 400).
* ``EngineOverloadedError``: too many requests already wait; nothing was
  queued, retrying later may work (HTTP 503).
* ``EngineDeadError``: the engine can no longer serve any request; every open
  stream and every later call raise it (HTTP 500; Serve replaces the replica).

Anything else a call raises is a bug or an infrastructure failure (HTTP 500).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from engine.inputs import PLAIN_REQUEST, PromptType, RequestOptions

if TYPE_CHECKING:  # annotations only: the engine modules import this one
    from engine.config import ModelConfig
    from engine.metrics import EngineStats
    from engine.pooling_params import PoolingParams
    from engine.request_output import EmbeddingRequestOutput, RequestOutput
    from engine.sampling_params import SamplingParams


class EngineDeadError(RuntimeError):
    """The busy loop died (or the engine was shut down): no request can be served any more."""


class EngineOverloadedError(RuntimeError):
    """``max_num_queued_reqs`` requests are already waiting; the caller should retry later (HTTP 503)."""


@runtime_checkable
class EngineClient(Protocol):
    """One model's engine as a server sees it: stream a request (or pool one), stop it, ask about the engine.

    ``isinstance(obj, EngineClient)`` checks only that every member exists; the
    promises below are each implementation's to keep.
    """

    # The replica's one Hugging Face tokenizer, which the event loop may use (chat templates, ``/tokenize``)
    # to read only: the engine's front end uses it too, so nothing may turn its truncation or padding on.
    # A plain attribute, not a property, so an implementation may simply assign it.
    tokenizer: Any

    @property
    def max_model_len(self) -> int:
        """The context length: prompt plus generated tokens of one request, at most."""

    @property
    def vocab_size(self) -> int:
        """Token ids in ``[0, vocab_size)`` are valid; any other id in a prompt is a ValueError."""

    @property
    def model_config(self) -> ModelConfig:
        """The served checkpoint's configuration (``model``: its path, the ``/v1/models`` root)."""

    def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str,
        options: RequestOptions = PLAIN_REQUEST,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Streams the request's outputs as ``sampling_params.output_kind`` says; the last has finished=True.
        ``options``: the request's priority, cache salt, KV transfer
        and LoRA adapter, carried whole to the engine; a client that cannot serve adapters raises ValueError
        for ``options.lora_request``, and one that does its own KV transfer for ``options.kv_transfer_params``.

        Nothing runs until the first ``__anext__``, which raises ValueError (bad
        input, ``request_id`` in use), EngineOverloadedError or EngineDeadError
        before any output; on those nothing was queued. Later, EngineDeadError
        ends the stream if the engine dies. Closing or cancelling the generator
        before its last output aborts the request and frees its KV blocks.
        """

    def encode(
        self,
        prompt: PromptType,
        pooling_params: PoolingParams,
        request_id: str,
        options: RequestOptions = PLAIN_REQUEST,
    ) -> AsyncGenerator[EmbeddingRequestOutput, None]:
        """A pooling request (embeddings): yields its one output once the prompt is pooled, nothing if it is
        aborted first. Errors and closing as for ``generate``; an engine whose ``runner`` serves no embeddings
        raises ValueError."""

    async def abort(self, request_id: str) -> None:
        """Stops the request before the next step; its stream ends with finish_reason "abort".
        An unknown or finished ``request_id`` changes nothing."""

    async def check_health(self) -> None:
        """Returns if the engine can serve; raises EngineDeadError (or what a lost worker raised) if not."""

    def get_stats(self) -> EngineStats:
        """The latest published snapshot of the engine's counters; cheap, never blocks."""
