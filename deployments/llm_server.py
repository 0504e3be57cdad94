"""The LLM-server deployment: one data-parallel copy of one model.

Each replica owns an ``AsyncLLM`` (the engine core's busy loop runs in a
child process of the replica, ``engine.core.core_proc``) and the OpenAI serving
logic for its model. The
ingress reaches it through a Serve handle; Serve's router balances requests
across the replicas.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

import ray
from ray import serve

from deployments.autoscaling import TTFTWindow
from deployments.kv_index import PUBLISHED_BATCHES, publication
from deployments.llm_config import LLMConfig
from deployments.lora import build_lora_models, hold_adapters, hold_multiplexed_adapter
from deployments.metrics import LoRAMetrics, RayStatLogger
from deployments.node_address import bind_replica_grpc_to_node_ip
from deployments.routing_hints import precomputed_prompt
from engine.async_llm import AsyncLLM
from engine.engine_client import EngineClient
from engine.entrypoints.openai.call_options import PLAIN_CALL, CallOptions
from engine.entrypoints.openai.endpoints import Endpoint
from engine.entrypoints.openai.serving import OpenAIServing, StreamItem

logger = logging.getLogger("ray.serve")


def route_engine_stats_log_to_replica_log() -> None:
    """The engine's periodic throughput line (``engine.metrics``, INFO) goes where Serve logs this replica."""
    stats_logger = logging.getLogger("engine.metrics")
    stats_logger.setLevel(logging.INFO)
    stats_logger.handlers = list(logger.handlers)
    stats_logger.propagate = not stats_logger.handlers


def replica_num_cpus() -> int:
    """This replica's CPU share (its ``num_cpus``), rounded, at least 1: what its engine may use. Left to
    itself, torch would take every core of the node, however many replicas share it."""
    return max(1, int(ray.get_runtime_context().get_assigned_resources().get("CPU", 0.0) + 0.5))


class LLMServer:
    """One replica: an ``AsyncLLM`` for ``llm_config`` and the OpenAI endpoints over it."""

    def __init__(self, llm_config: LLMConfig, metrics_model_name: str | None = None) -> None:
        """``metrics_model_name``: the ``model_name`` label of this replica's metrics (default: the model id)."""
        bind_replica_grpc_to_node_ip()
        route_engine_stats_log_to_replica_log()
        self.model_id = llm_config.model_id
        replica_id = serve.get_replica_context().replica_id.unique_id
        self.kv_routed = llm_config.uses_kv_router()
        self.ttft_window = TTFTWindow(llm_config.deployment_config.ttft_policy_options())
        self.engine = AsyncLLM.from_engine_args(
            llm_config.engine_args(),
            stat_loggers=[RayStatLogger(metrics_model_name or self.model_id, replica_id), self.ttft_window],
            num_cpus=replica_num_cpus(),
            kv_events=self.kv_routed,
        )
        self.tokenizer_path = self.engine.model_config.tokenizer_path
        # The last few numbered KV event batches, repeated in each publication (a router may miss a poll).
        self._kv_batches: deque = deque(maxlen=PUBLISHED_BATCHES)
        self._kv_seq = 0
        # LoRA adapters (lora_config): checked against the engine's max_lora_rank, held per Serve's multiplexing.
        lora_events = LoRAMetrics(metrics_model_name or self.model_id, replica_id)
        self.lora = build_lora_models(llm_config, self.engine.config.lora_config.max_lora_rank, lora_events)
        self._hold_adapter = None
        if self.lora is not None:
            self._hold_adapter = hold_adapters(self.lora, llm_config.lora_config.max_num_adapters_per_replica)
        self.serving = OpenAIServing(self.engine_client(), self.model_id, lora=self.lora)
        logger.info("LLMServer for %r ready (max_model_len %d).", self.model_id, self.engine.max_model_len)

    def engine_client(self) -> EngineClient:
        """What the OpenAI endpoints run requests on: the replica's own engine (a subclass may put a client in
        front of it, ``pd_servers.PDDecodeServer``). Called once, at the end of ``__init__``."""
        return self.engine

    async def call(
        self, endpoint: Endpoint, request: Any, options: CallOptions = PLAIN_CALL, routing_hint: Any = None
    ) -> AsyncIterator[StreamItem]:
        """Streams the items of one ``OpenAIServing`` endpoint (one item for non-streamed calls).

        The caller closing the stream (a client disconnect cancels the ingress
        request, and Serve cancels this call) closes the serving generator,
        which aborts the engine request and frees its KV blocks. ``routing_hint`` is for the
        deployment's request router (``deployments.routing``); the replica serves the prompt the ingress
        tokenized for it (``precomputed_prompt``), so chat templates and tokenizers run once per request.
        A call sent with a ``multiplexed_model_id`` holds that LoRA adapter (``deployments.lora``) first.
        ``options``: ``CallOptions`` (a stream to continue, tracking for ``deployments.migration``).
        """
        await hold_multiplexed_adapter(self._hold_adapter)  # the adapter Serve routed this call by, if any
        precomputed = precomputed_prompt(endpoint, routing_hint)
        if precomputed is not None:
            options = dataclasses.replace(options, precomputed=precomputed)
        async with contextlib.aclosing(self.serving.call(endpoint, request, options)) as items:
            async for item in items:
                yield item

    async def model_card(self) -> Any:
        return self.serving.model_card()

    async def adapter_cards(self) -> list:
        """This replica's LoRA adapters' ``/v1/models`` entries (``OpenAIServing.adapter_cards``)."""
        return self.serving.adapter_cards()

    async def stats(self) -> dict:
        """This replica's engine statistics, tagged with the replica's id."""
        replica_id = serve.get_replica_context().replica_id.unique_id
        return {
            "replica_id": replica_id,
            "model_id": self.model_id,
            "engine_core_pid": self.engine.engine_core_pid,
            **dataclasses.asdict(self.engine.get_stats()),
        }

    async def check_integrity(self) -> dict:
        """This replica's KV cache checked between steps (``AsyncLLM.check_integrity``): ``replica_id``, ``ok`` and
        the failed invariant as ``error`` (``serval bench soak`` runs it on every live replica afterwards)."""
        replica_id = serve.get_replica_context().replica_id.unique_id
        try:
            await self.engine.check_integrity()
        except AssertionError as error:
            return {"replica_id": replica_id, "ok": False, "error": str(error) or "AssertionError"}
        return {"replica_id": replica_id, "ok": True, "error": None}

    async def routing_info(self) -> dict:
        """What the ingress needs to give ``KVAwareRouter`` its hints: whether this deployment uses it,
        and the tokenizer to tokenize prompts with (and the chat template that replaces its own, if any)."""
        chat_template = self.engine.model_config.chat_template
        return {"kv_routed": self.kv_routed, "tokenizer_path": self.tokenizer_path, "chat_template": chat_template}

    def record_routing_stats(self) -> dict:
        """Serve polls this every ``request_routing_stats_period_s`` and hands the result to every
        handle's router: this replica's load and its KV event batches (``deployments.kv_index.publication``)."""
        stats = self.engine.get_stats()
        if self.kv_routed:
            batch = self.engine.take_kv_events()
            if batch:  # no new number for an empty batch: an unchanged publication is not broadcast again
                self._kv_seq += 1
                self._kv_batches.append((self._kv_seq, batch))
        return publication(list(self._kv_batches), stats.num_running_reqs, stats.num_waiting_reqs)

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve calls this under an ``autoscaling_config`` (its autoscaling-metrics task) and hands the values
        to the deployment's policy: ``TTFTPolicy`` reads this replica's recent TTFTs and its queues."""
        stats = self.engine.get_stats()
        return self.ttft_window.report(stats.num_running_reqs, stats.num_waiting_reqs)

    async def check_health(self) -> None:
        """Serve calls this periodically; raising marks the replica unhealthy and Serve replaces it."""
        await self.engine.check_health()

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
