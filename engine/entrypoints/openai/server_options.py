"""``ServerOptions``: the OpenAI server's app-wide options, declared once.

``build_app`` takes them; the Serve builders' args (``LLMServingArgs``,
``PDServingArgs``) inherit them, so the serve YAML's ``args`` hold them at
top level, with the same names, defaults, bounds and unknown-key check:

    args:
      api_keys: [sk-...]                 # or SERVAL_API_KEY in the serving processes' environment
      metrics_require_api_key: false
      request_limits: {max_n: 8, max_request_body_bytes: 1048576}
      response_store: {max_responses: 10000, ttl_s: 86400}   # /v1/responses' store: true
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from engine.entrypoints.openai.limits import RequestLimits
from engine.entrypoints.openai.response_store import ResponseStoreOptions


class ServerOptions(BaseModel):
    """Who may call the server (API keys), how much one request may ask for (``request_limits``) and how many
    stored responses the app keeps (``response_store``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    api_keys: list[Annotated[str, Field(min_length=1)]] = Field(
        default_factory=list,
        repr=False,  # keys stay out of logs and tracebacks
        description="Keys clients send as `Authorization: Bearer <key>`; empty: SERVAL_API_KEY's, if set, else none.",
    )
    metrics_require_api_key: bool = Field(
        False, description="Whether GET /metrics needs a key too (open by default, as in vLLM, for scrapers)."
    )
    request_limits: RequestLimits = Field(default_factory=RequestLimits)
    response_store: ResponseStoreOptions = Field(default_factory=ResponseStoreOptions)

    def server_options(self) -> ServerOptions:
        """These options alone (a subclass's other fields, a builder's model configs, left out)."""
        return ServerOptions(**{name: getattr(self, name) for name in ServerOptions.model_fields})
