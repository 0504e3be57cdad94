"""A Serve deployment's options, as written under ``deployment_config``: Serve's names, checks and defaults.

    deployment_config:
      num_replicas: auto                      # or a count, or autoscaling_config: {...} (every Serve key)
      max_ongoing_requests: 256
      ray_actor_options: {num_cpus: 1}
      user_config: {...}                      # any option ``Deployment.options`` takes
      logging_config: {log_level: DEBUG}

Serval declares none of these options: the names are the parameters of Serve's ``Deployment.options``
(the call the builders make), the values are checked by that call at validation time (Serve's
``DeploymentConfig``, ``AutoscalingConfig``, ``ReplicaConfig``), and an option left out keeps Serve's
default, except the few ``SERVAL_DEFAULTS`` an LLM server needs (as Ray Serve LLM keeps its own
``DEFAULT_DEPLOYMENT_OPTIONS``). Serve's nested models ignore unknown keys; here they are an error naming
the key, so a typo fails the deploy instead of being dropped.
"""

from __future__ import annotations

import copy
import inspect
import types
import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, RootModel, model_validator
from ray import serve
from ray.serve._private.config import DeploymentConfig as ServeDeploymentConfig
from ray.serve.deployment import Deployment

from deployments.autoscaling import TTFT_POLICY, TTFTPolicyOptions
from deployments.kv_index import KVRouterOptions

# Every option Serve's Deployment.options takes, by its name there.
SERVE_OPTIONS = frozenset(
    name
    for name in inspect.signature(Deployment.options).parameters
    if name not in ("self", "func_or_class") and not name.startswith("_")
)
# Where Serval's deployments differ from Serve's defaults (5 ongoing requests; 20 s to drain): a replica
# batches hundreds of streams, and a draining one lets its streams finish.
SERVAL_DEFAULTS: dict[str, Any] = {"max_ongoing_requests": 256, "graceful_shutdown_timeout_s": 60.0}
KV_ROUTER_CLASS = "deployments.routing:KVAwareRouter"
# KVAwareRouter learns the replicas' KV events from their routing stats: polled far more often than Serve's 10 s.
KV_ROUTER_STATS_PERIOD_S = 0.5


class _Probe:
    """What Serve's own option checks run on (``Deployment.options`` needs a deployment)."""


_PROBE = serve.deployment(_Probe)


def _nested_models(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation allows (``X | None``, ``Union[dict, X]``, ``list[X]``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType, list):
        return [model for arg in typing.get_args(annotation) for model in _nested_models(arg)]
    return []


def unknown_keys(model: type[BaseModel], value: Any, path: str) -> list[str]:
    """Keys of ``value`` (and of its nested dicts) that Serve's ``model`` has no field for."""
    if not isinstance(value, dict):
        return [key for item in value for key in unknown_keys(model, item, path)] if isinstance(value, list) else []
    found = [f"{path}.{key}" for key in value if key not in model.model_fields]
    for key, item in value.items():
        if key in model.model_fields:
            for nested in _nested_models(model.model_fields[key].annotation):
                found += unknown_keys(nested, item, f"{path}.{key}")
    return found


def check_serve_options(options: dict[str, Any], where: str) -> None:
    """Raises ValueError naming what Serve would refuse (or silently drop) in ``options``."""
    unknown = sorted(set(options) - SERVE_OPTIONS)
    if unknown:
        raise ValueError(f"{where}: {unknown} are not Serve deployment options; Serve's are {sorted(SERVE_OPTIONS)}.")
    fields = ServeDeploymentConfig.model_fields
    dropped = [
        found
        for key, value in options.items()
        if key in fields
        for nested in _nested_models(fields[key].annotation)
        for found in unknown_keys(nested, value, f"{where}.{key}")
    ]
    if dropped:
        raise ValueError(f"Unknown keys {dropped}: not fields of Serve's deployment config.")
    try:
        _PROBE.options(**copy.deepcopy(options))
    except (TypeError, ValueError, ImportError) as exc:  # pydantic's ValidationError is a ValueError; a class path
        raise ValueError(f"{where}: Serve refuses these options: {exc}") from None


class DeploymentConfig(RootModel[dict[str, Any]]):
    """Options of one Serve deployment (``Deployment.options``' keyword arguments, checked by Serve)."""

    model_config = ConfigDict(frozen=True)

    @model_validator(mode="after")
    def _serve_accepts_them(self) -> DeploymentConfig:
        check_serve_options(self.root, "deployment_config")
        self.ttft_policy_options()
        router = self.root.get("request_router_config") or {}
        if self.uses_kv_router():
            try:
                KVRouterOptions.model_validate(router.get("request_router_kwargs") or {})
            except ValueError as exc:
                raise ValueError(f"Bad request_router_kwargs for {KV_ROUTER_CLASS}: {exc}") from None
        return self

    def get(self, name: str, default: Any = None) -> Any:
        return self.root.get(name, default)

    def to_options(self) -> dict[str, Any]:
        """Keyword arguments for ``Deployment.options``: these options over ``SERVAL_DEFAULTS`` (a copy)."""
        options = {**SERVAL_DEFAULTS, **copy.deepcopy(self.root)}
        if self.uses_kv_router():
            options["request_router_config"].setdefault("request_routing_stats_period_s", KV_ROUTER_STATS_PERIOD_S)
        return options

    def uses_kv_router(self) -> bool:
        router_class = (self.root.get("request_router_config") or {}).get("request_router_class", "")
        return router_class.replace(":", ".") == KV_ROUTER_CLASS.replace(":", ".")

    def ttft_policy_options(self) -> TTFTPolicyOptions | None:
        """The options of ``TTFTPolicy`` when it scales this deployment (``deployments.autoscaling``)."""
        policy = (self.root.get("autoscaling_config") or {}).get("policy") or {}
        if str(policy.get("policy_function", "")).replace(":", ".") != TTFT_POLICY.replace(":", "."):
            return None
        try:
            return TTFTPolicyOptions.model_validate(policy.get("policy_kwargs") or {})
        except ValueError as exc:
            raise ValueError(f"Bad policy_kwargs for {TTFT_POLICY}: {exc}") from None
