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
the key and the nearest valid one (``config_errors``), so a typo fails the deploy instead of being dropped.
"""

from __future__ import annotations

import copy
import inspect
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, RootModel, ValidationError, model_validator
from ray import serve
from ray.serve._private.config import DeploymentConfig as ServeDeploymentConfig
from ray.serve.deployment import Deployment

from deployments.autoscaling import TTFT_POLICY, TTFTPolicyOptions
from deployments.config_errors import KeysOf, models_in, under
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


def unknown_keys(model: type[BaseModel], value: Any, loc: tuple[str | int, ...]) -> list[tuple[tuple, Any]]:
    """(location, value) of each key of ``value`` (and of its nested dicts and lists) that Serve's ``model``
    has no field for; locations are under ``loc``."""
    if isinstance(value, list):
        return [found for index, item in enumerate(value) for found in unknown_keys(model, item, (*loc, index))]
    if not isinstance(value, dict):
        return []
    found = [((*loc, key), item) for key, item in value.items() if key not in model.model_fields]
    for key, item in value.items():
        if key in model.model_fields:
            for nested in models_in(model.model_fields[key].annotation):
                found += unknown_keys(nested, item, (*loc, key))
    return found


def serve_option_keys() -> dict[str, Any]:
    """Each ``Deployment.options`` name -> what its value is (Serve's field, with its nested models)."""
    fields = ServeDeploymentConfig.model_fields
    return {name: fields.get(name, Any) for name in sorted(SERVE_OPTIONS)}


def check_serve_options(options: dict[str, Any], where: str) -> None:
    """Raises what Serve would refuse (or silently drop) in ``options``: pydantic's ValidationError with an
    ``extra_forbidden`` error at each unknown key's location (``config_errors`` suggests the nearest valid
    key), ValueError for values Serve refuses."""
    fields = ServeDeploymentConfig.model_fields
    unknown = [((key,), value) for key, value in options.items() if key not in SERVE_OPTIONS]
    unknown += [
        found
        for key, value in options.items()
        if key in fields
        for nested in models_in(fields[key].annotation)
        for found in unknown_keys(nested, value, (key,))
    ]
    if unknown:  # Serve's nested models would drop these keys without a word
        errors = [{"type": "extra_forbidden", "loc": loc, "input": value} for loc, value in unknown]
        raise ValidationError.from_exception_data(where, errors)
    try:
        _PROBE.options(**copy.deepcopy(options))
    except ValidationError as exc:  # Serve's models: locations are option names, as written
        raise under(exc) from None
    except (TypeError, ValueError, ImportError) as exc:  # a class path that does not import
        raise ValueError(f"Serve refuses these options: {exc}") from None


class DeploymentConfig(RootModel[Annotated[dict[str, Any], KeysOf(serve_option_keys)]]):
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
            except ValidationError as exc:  # KVAwareRouter's options, at their path
                raise under(exc, "request_router_config", "request_router_kwargs") from None
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
        except ValidationError as exc:  # TTFTPolicy's options, at their path
            raise under(exc, "autoscaling_config", "policy", "policy_kwargs") from None
