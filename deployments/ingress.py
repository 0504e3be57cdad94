"""The app's HTTP ingress: either an ``OpenAiIngress`` deployment routing by ``model`` to each model's
LLM-server deployment, or, for an app of one model, that model's LLM servers themselves
(``IngressLLMServer``).

Both serve the engine's own OpenAI app (``api_server.build_app``, the same
the in-process server uses); only the router differs. ``OpenAiIngress``
reaches the LLM servers through Serve handles, whose router balances across
each model's replicas; an ``IngressLLMServer`` replica serves its own engine
(``LocalModelRouter``), and Serve's proxy balances HTTP across the replicas.
The second saves a hop per streamed chunk (a pickled item over gRPC to
another replica's event loop, on a small node a process competing for
the cores), which is why one-model apps use it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from ray import serve
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle
from ray.util import metrics as ray_metrics

from deployments.llm_config import DEFAULT_MIGRATION_LIMIT, LLMConfig
from deployments.llm_server import LLMServer
from deployments.lora import multiplexed_model_id
from deployments.metrics import MigrationMetrics
from deployments.metrics_export import scrape_serval_metrics
from deployments.migration import MigratingCall
from deployments.node_address import bind_replica_grpc_to_node_ip
from deployments.response_store import RayResponseStore
from deployments.routing_hints import PromptTokenizer, make_hint, session_id, session_middleware
from engine.entrypoints.openai import api_server
from engine.entrypoints.openai.api_server import LocalModelRouter
from engine.entrypoints.openai.call_options import CallOptions
from engine.entrypoints.openai.continuation import Continuation
from engine.entrypoints.openai.endpoints import Endpoint
from engine.entrypoints.openai.errors import RETRY_AFTER_S, from_exception, make_error
from engine.entrypoints.openai.server_options import ServerOptions
from engine.entrypoints.openai.serving import StreamItem
from engine.model.source import load_tokenizer

ENDPOINT_TAG_KEYS = ("model_name", "replica", "endpoint")


class RayModelRouter:
    """``api_server.ModelRouter`` over Serve handles, one LLM-server deployment per model id.

    For a deployment whose router is ``KVAwareRouter`` each chat / completion call carries a
    ``RoutingHint`` (``deployments.routing_hints``); the first call asks the deployment whether it is one.
    """

    def __init__(
        self,
        servers: dict[str, DeploymentHandle],
        migration_limit: int = DEFAULT_MIGRATION_LIMIT,
        migration_metrics: MigrationMetrics | None = None,
    ) -> None:
        """``migration_limit``: how many times one request may move to another replica after the one
        serving it died (``deployments.migration``; 0: never)."""
        self.servers = servers
        self.migration_limit = migration_limit
        self.migration_metrics = migration_metrics
        self.streams = {model_id: handle.options(stream=True) for model_id, handle in servers.items()}
        self._tokenizers: dict[str, asyncio.Task] = {}  # model id -> its PromptTokenizer, or None: no hints
        self._tokenize_thread = ThreadPoolExecutor(1, thread_name_prefix="routing-hints")

    async def _prompt_tokenizer(self, model_id: str) -> PromptTokenizer | None:
        if model_id not in self._tokenizers:
            self._tokenizers[model_id] = asyncio.ensure_future(self._load_prompt_tokenizer(model_id))
        try:
            return await asyncio.shield(self._tokenizers[model_id])
        except Exception:  # noqa: BLE001 - no replica answered yet: no hint this time, ask again next time
            self._tokenizers.pop(model_id, None)
            return None

    async def _load_prompt_tokenizer(self, model_id: str) -> PromptTokenizer | None:
        info = await self.servers[model_id].routing_info.remote()
        if not info["kv_routed"]:
            return None
        tokenizer = await asyncio.to_thread(load_tokenizer, info["tokenizer_path"], info["chat_template"])
        return PromptTokenizer(tokenizer)

    async def _routing_kwargs(self, model_id: str, endpoint: Endpoint, request: BaseModel) -> dict[str, Any]:
        if not endpoint.generates:
            return {}
        tokenizer = await self._prompt_tokenizer(model_id)
        if tokenizer is None:
            return {}
        # Off the event loop (a long prompt takes milliseconds), on one thread: a fast tokenizer used from
        # several threads at once can raise "Already borrowed".
        hint = await asyncio.get_running_loop().run_in_executor(
            self._tokenize_thread, make_hint, tokenizer, endpoint, request, session_id.get(), model_id
        )
        return {"routing_hint": hint}

    def model_ids(self) -> list[str]:
        return list(self.servers)

    async def call(self, model_id: str, endpoint: Endpoint, request: BaseModel) -> AsyncGenerator[StreamItem, None]:
        """The LLM server's items, moved to another replica if the one serving them dies (``MigratingCall``).
        Failing to reach one is one error item (503 when Serve sheds load); closing this generator cancels
        the call on the replica, which aborts its engine requests."""
        routing_kwargs = await self._routing_kwargs(model_id, endpoint, request)
        stream = self.streams[model_id]
        if adapter := multiplexed_model_id(model_id, request):  # prefer replicas holding the LoRA adapter
            stream = stream.options(multiplexed_model_id=adapter)

        def open_call(continuation: Continuation | None, track: bool) -> Any:
            options = CallOptions(continuation=continuation, track=track)
            return stream.call.remote(endpoint, request, options, **routing_kwargs)

        def on_migration(kind: str) -> None:
            if self.migration_metrics is not None:
                self.migration_metrics.record(model_id, kind)

        call = MigratingCall(endpoint, request, open_call, self.migration_limit, on_migration)
        try:
            async with contextlib.aclosing(call.items()) as items:
                async for item in items:
                    yield item
        except BackPressureError as exc:
            yield make_error(
                f"Too many requests queued for {model_id!r}; retry later. ({exc})", 503, retry_after=RETRY_AFTER_S
            )
        except Exception as exc:  # noqa: BLE001 - a replica that raised: answer, keep serving
            yield from_exception(exc)

    async def model_card(self, model_id: str) -> BaseModel:
        return await self.servers[model_id].model_card.remote()

    async def adapter_cards(self, model_id: str) -> list[BaseModel]:
        """One replica's LoRA adapters (those under ``dynamic_lora_loading_path`` are listed by every replica)."""
        return await self.servers[model_id].adapter_cards.remote()

    async def check_health(self, model_id: str) -> None:
        await self.servers[model_id].check_health.remote()


class CountedRouter:
    """An ``api_server.ModelRouter`` counting each call it passes on to ``router`` in ``serval_endpoint_requests``,
    by model and by ``Endpoint`` value (``completions``, ``chat``, ``embeddings``, ...): every API call that passed
    the request limits, whatever its outcome (the engine's ``serval_request_success`` counts those)."""

    def __init__(self, router: api_server.ModelRouter, replica: str) -> None:
        self.router = router
        self.replica = replica
        self.requests = ray_metrics.Counter(
            "serval_endpoint_requests", "API calls routed to a model, by endpoint.", ENDPOINT_TAG_KEYS
        )

    def call(self, model_id: str, endpoint: Endpoint, request: BaseModel) -> AsyncGenerator[StreamItem, None]:
        self.requests.inc(1, {"model_name": model_id, "replica": self.replica, "endpoint": endpoint.value})
        return self.router.call(model_id, endpoint, request)  # its own stream: no extra hop per item

    def model_ids(self) -> list[str]:
        return self.router.model_ids()

    async def model_card(self, model_id: str) -> BaseModel:
        return await self.router.model_card(model_id)

    async def adapter_cards(self, model_id: str) -> list[BaseModel]:
        return await self.router.adapter_cards(model_id)

    async def check_health(self, model_id: str) -> None:
        await self.router.check_health(model_id)


async def metrics() -> Response:
    """Every LLM-server replica's ``serval_*`` metrics, in Prometheus' text format."""
    return Response(await scrape_serval_metrics(), media_type=CONTENT_TYPE_LATEST)


def build_http_app(router: api_server.ModelRouter, server_options: ServerOptions) -> FastAPI:
    """The engine's OpenAI app over ``router`` (its calls counted: ``CountedRouter``), with the app's response
    store (its named actor, shared by every ingress replica: ``deployments.response_store``), plus ``GET /metrics``
    (every replica's, not one's). Built on a replica."""
    router = CountedRouter(router, serve.get_replica_context().replica_id.unique_id)
    store = RayResponseStore(serve.get_replica_context().app_name, server_options.response_store)
    app = api_server.build_app(router, server_options, store)
    app.add_api_route("/metrics", metrics, methods=["GET"])
    app.add_middleware(session_middleware)  # x-session-id, for KVAwareRouter
    return app


@serve.ingress()
class IngressLLMServer(LLMServer):
    """One model's LLM server that is also the app's HTTP ingress (a one-model app): each replica serves
    the OpenAI app over its own engine; its handle methods (``call``, ``stats``, ...) stay as they are."""

    def __init__(self, llm_config: LLMConfig, server_options: ServerOptions | None = None) -> None:
        super().__init__(llm_config)
        self.server_options = server_options or ServerOptions()

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_http_app(LocalModelRouter({self.model_id: self.serving}), self.server_options)


@serve.ingress()
class OpenAiIngress:
    """The HTTP front door; ``llm_servers`` maps each model id to its LLM-server deployment.

    Each replica serves the engine's own app (``api_server.build_app``: the
    routes, API keys and request limits of ``server_options``) over a router of
    Serve handles, plus ``GET /metrics``. Serve builds it on the replica
    (``__serve_build_asgi_app__``), where the handles, the options and the
    replica's environment (``SERVAL_API_KEY``) are.
    """

    def __init__(
        self,
        llm_servers: dict[str, DeploymentHandle],
        server_options: ServerOptions | None = None,
        migration_limit: int = DEFAULT_MIGRATION_LIMIT,
    ) -> None:
        bind_replica_grpc_to_node_ip()
        metrics = MigrationMetrics(serve.get_replica_context().replica_id.unique_id)
        self.router = RayModelRouter(llm_servers, migration_limit, metrics)
        self.server_options = server_options or ServerOptions()

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_http_app(self.router, self.server_options)
