"""The OpenAI ingress deployment: HTTP in, routed by ``model`` to that model's LLM-server deployment.

Its routes call the engine's own OpenAI handlers (``api_server``, the same
the in-process server uses); only the router differs: it reaches the
LLM servers through Serve handles, whose router balances across each
model's replicas.
"""

# No ``from __future__ import annotations`` here: FastAPI reads the route methods' annotations after
# Serve rewrites their signatures, and string annotations would turn ``raw_request`` into a query field.
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from ray import serve
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException

from deployments.metrics_export import scrape_serval_metrics
from deployments.node_address import bind_replica_grpc_to_node_ip
from engine.entrypoints.openai import api_server
from engine.entrypoints.openai.errors import RETRY_AFTER_S, from_exception, make_error


class RayModelRouter:
    """``api_server.ModelRouter`` over Serve handles, one LLM-server deployment per model id."""

    def __init__(self, servers: dict[str, DeploymentHandle]) -> None:
        self.servers = servers
        self.streams = {model_id: handle.options(stream=True) for model_id, handle in servers.items()}

    def model_ids(self) -> list[str]:
        return list(self.servers)

    async def call(self, model_id: str, method_name: str, request: BaseModel) -> AsyncGenerator[Any, None]:
        """The LLM server's items. Failing to reach it is one error item (503 when Serve sheds load);
        closing this generator cancels the call on the replica, which aborts its engine requests."""
        response = self.streams[model_id].call.remote(method_name, request)
        try:
            async for item in response:
                yield item
        except BackPressureError as exc:
            yield make_error(
                f"Too many requests queued for {model_id!r}; retry later. ({exc})", 503, retry_after=RETRY_AFTER_S
            )
        except Exception as exc:  # noqa: BLE001 - a replica that raised or died: answer, keep serving
            yield from_exception(exc)
        finally:
            response.cancel()

    async def model_card(self, model_id: str) -> BaseModel:
        return await self.servers[model_id].model_card.remote()

    async def check_health(self, model_id: str) -> None:
        await self.servers[model_id].check_health.remote()


app = FastAPI(title="Serval: OpenAI-compatible API")
app.add_exception_handler(HTTPException, api_server.http_exception_handler)


@serve.ingress(app)
class OpenAiIngress:
    """The HTTP front door; ``llm_servers`` maps each model id to its LLM-server deployment.

    The routes are ``api_server.ROUTES`` as methods (Serve ships this class,
    and the app it wraps, to the replica by value: the router must live on
    ``self``).
    """

    def __init__(self, llm_servers: dict[str, DeploymentHandle]) -> None:
        bind_replica_grpc_to_node_ip()
        self.router = RayModelRouter(llm_servers)

    @app.post("/v1/completions")
    async def completions(self, raw_request: Request) -> Response:
        return await api_server.handle_completions(self.router, raw_request)

    @app.post("/v1/chat/completions")
    async def chat(self, raw_request: Request) -> Response:
        return await api_server.handle_chat(self.router, raw_request)

    @app.get("/v1/models")
    async def models(self, raw_request: Request) -> Response:
        return await api_server.handle_models(self.router, raw_request)

    @app.post("/tokenize")
    async def tokenize(self, raw_request: Request) -> Response:
        return await api_server.handle_tokenize(self.router, raw_request)

    @app.post("/detokenize")
    async def detokenize(self, raw_request: Request) -> Response:
        return await api_server.handle_detokenize(self.router, raw_request)

    @app.get("/health")
    async def health(self, raw_request: Request) -> Response:
        return await api_server.handle_health(self.router, raw_request)

    @app.get("/version")
    async def version(self, raw_request: Request) -> Response:
        return await api_server.handle_version(self.router, raw_request)

    @app.get("/metrics")
    async def metrics(self) -> Response:
        """Every LLM-server replica's ``serval_*`` metrics, in Prometheus' text format."""
        return Response(await scrape_serval_metrics(), media_type=CONTENT_TYPE_LATEST)
