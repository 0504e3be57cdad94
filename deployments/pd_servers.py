"""The two pools of a disaggregated prefill/decode (PD) app, and the decode side's remote-prefill client.

A request's path: ingress -> a decode replica (``PDDecodeServer``, Serve's
router picks it) -> the OpenAI serving logic, whose engine is a
``RemotePrefillEngine``: it first has a prefill replica (``PrefillServer``,
picked by Serve's router over the prefill pool) compute the prompt's KV and
return its handle, then adds the request to the decode replica's own engine
with that handle. The decode engine's scheduler loads the blocks it does not
already hold in its prefix cache and decodes from there; tokens stream back
from the decode replica as in colocated serving.

Failures: a prefill that raises or takes longer than ``prefill_timeout_s``
fails the request with 503 (or, with ``fallback_to_local_prefill``, the
decode replica prefills it itself). A client that goes away cancels the
prefill call, which aborts the prefill request. The prefill side frees its
blocks as soon as it has copied them out; a handle nobody loads is released
by Ray's reference counting.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator

from ray import serve
from ray.serve.handle import DeploymentHandle

from deployments.llm_config import LLMConfig
from deployments.llm_server import LLMServer
from deployments.metrics import RemotePrefillMetrics
from deployments.pd_config import PDOptions
from engine.async_llm import AsyncLLM
from engine.config import ModelConfig
from engine.engine_client import EngineClient
from engine.entrypoints.openai.errors import ServiceUnavailableError
from engine.inputs import PLAIN_REQUEST, PromptType, RequestOptions
from engine.metrics import EngineStats
from engine.pooling_params import PoolingParams
from engine.request_output import EmbeddingRequestOutput, RequestOutput
from engine.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("ray.serve")

# The prefill side's own token is discarded (the decode side samples the first token), so it is greedy.
PREFILL_PARAMS = SamplingParams(
    max_tokens=1, temperature=0.0, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY
)


class RemotePrefillError(ServiceUnavailableError):
    """The prefill pool failed or timed out on a request (HTTP 503)."""


class PrefillServer(LLMServer):
    """One prefill replica: computes prompts' KV and hands it off (its engine is the KV producer)."""

    def __init__(self, llm_config: LLMConfig) -> None:
        super().__init__(llm_config, metrics_model_name=f"{llm_config.model_id}:prefill")

    async def prefill(self, prompt_token_ids: list[int], request_id: str, cache_salt: str | None = None) -> dict:
        """Prefills the prompt; returns its ``kv_transfer_params`` (the KV handle) for the decode side.

        Raises ValueError on a prompt this engine refuses. Cancelling the call aborts the request.
        """
        final: RequestOutput | None = None
        async for output in self.engine.generate(
            {"prompt_token_ids": prompt_token_ids},
            PREFILL_PARAMS,
            request_id,
            RequestOptions(cache_salt=cache_salt, kv_transfer_params={"do_remote_decode": True}),
        ):
            final = output
        if final is None or not final.kv_transfer_params:
            reason = final.outputs[0].finish_reason if final is not None else "no output"
            raise RuntimeError(f"Prefill of {request_id!r} ended without KV ({reason}).")
        return final.kv_transfer_params


class RemotePrefillEngine(EngineClient):
    """The decode replica's ``EngineClient``: ``generate`` prefills remotely first, then decodes on the
    local ``AsyncLLM``, which answers every other member.
    """

    def __init__(
        self, engine: AsyncLLM, prefill_server: DeploymentHandle, options: PDOptions, metrics: RemotePrefillMetrics
    ) -> None:
        self.engine = engine
        self.prefill_server = prefill_server
        self.options = options
        self.metrics = metrics
        self.num_waiting_prefills = 0

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def model_config(self) -> ModelConfig:
        return self.engine.model_config

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str,
        options: RequestOptions = PLAIN_REQUEST,
    ) -> AsyncGenerator[RequestOutput, None]:
        """``AsyncLLM.generate`` after a remote prefill of ``prompt["prompt_token_ids"]``, ``options`` with the
        prefill's ``kv_transfer_params``.

        Besides ``EngineClient.generate``'s errors: RemotePrefillError (503) when the prefill pool fails
        or times out, unless ``fallback_to_local_prefill`` has the local engine prefill instead; ValueError
        for a ``lora_request`` (a PD app serves no adapters: ``pd_config`` refuses a ``lora_config``, and the
        prefill pool would compute the base model's KV) or ``kv_transfer_params`` (this client sets them).
        """
        if options.lora_request is not None:
            raise ValueError("Disaggregated prefill/decode serves no LoRA adapters.")
        if options.kv_transfer_params is not None:
            raise ValueError("The decode side's kv_transfer_params come from its remote prefill.")
        kv_transfer_params = await self._remote_prefill(prompt["prompt_token_ids"], request_id, options.cache_salt)
        decode_options = dataclasses.replace(options, kv_transfer_params=kv_transfer_params)
        async for output in self.engine.generate(prompt, sampling_params, request_id, decode_options):
            yield output

    def encode(
        self,
        prompt: PromptType,
        pooling_params: PoolingParams,
        request_id: str,
        options: RequestOptions = PLAIN_REQUEST,
    ) -> AsyncGenerator[EmbeddingRequestOutput, None]:
        """The local engine's: an embedding needs the prompt's hidden states, which a remote prefill's KV
        handle does not carry, so the decode replica computes it whole."""
        return self.engine.encode(prompt, pooling_params, request_id, options)

    async def _remote_prefill(
        self, prompt_token_ids: list[int], request_id: str, cache_salt: str | None
    ) -> dict | None:
        self.num_waiting_prefills += 1
        self.metrics.set_queue(self.num_waiting_prefills)
        start = time.monotonic()
        call = self.prefill_server.prefill.remote(prompt_token_ids, request_id, cache_salt)
        try:
            params = await asyncio.wait_for(call, timeout=self.options.prefill_timeout_s)
            self.metrics.observe_prefill(time.monotonic() - start)
            return params
        except asyncio.CancelledError:
            call.cancel()  # the client went away: abort the prefill request too
            raise
        except Exception as exc:  # noqa: BLE001 - any prefill failure: fall back or answer 503
            call.cancel()  # a timeout leaves it running otherwise
            reason = "timed out" if isinstance(exc, asyncio.TimeoutError) else f"failed: {exc}"
            self.metrics.count_failure()
            if self.options.fallback_to_local_prefill:
                logger.warning("Remote prefill of %s %s; prefilling locally.", request_id, reason)
                return None
            raise RemotePrefillError(f"The prefill pool {reason}") from exc
        finally:
            self.num_waiting_prefills -= 1
            self.metrics.set_queue(self.num_waiting_prefills)

    async def abort(self, request_id: str) -> None:
        """The local engine's abort: a request still waiting on its remote prefill is not in the local
        engine yet, so nothing changes for it (closing its ``generate`` stream cancels the prefill)."""
        await self.engine.abort(request_id)

    async def check_health(self) -> None:
        """The local engine's health (the prefill pool's replicas have their own health checks)."""
        await self.engine.check_health()

    def get_stats(self) -> EngineStats:
        """The local (decode) engine's snapshot."""
        return self.engine.get_stats()


class PDDecodeServer(LLMServer):
    """One decode replica: the OpenAI endpoints, each request prefilled by the prefill pool first."""

    def __init__(self, llm_config: LLMConfig, prefill_server: DeploymentHandle, options: dict) -> None:
        self.prefill_server = prefill_server
        self.pd_options = PDOptions.model_validate(options)
        super().__init__(llm_config)

    def engine_client(self) -> RemotePrefillEngine:
        """The endpoints' engine: each request prefilled by the prefill pool, then decoded here."""
        replica_id = serve.get_replica_context().replica_id.unique_id
        self.client = RemotePrefillEngine(
            self.engine, self.prefill_server, self.pd_options, RemotePrefillMetrics(self.model_id, replica_id)
        )
        return self.client

    async def check_health(self) -> None:
        await super().check_health()
        # Re-set between requests too: Ray stops exporting a gauge nobody sets (the queue would vanish when idle).
        self.client.metrics.set_queue(self.client.num_waiting_prefills)
