"""What a user writes under ``args:`` of a Serve application, with Ray Serve LLM's vocabulary.

    applications:
    - name: llm
      import_path: deployments.app:build_openai_app
      args:
        llm_configs:
        - model_loading_config: {model_id: tiny-llama, model_source: models/tiny-llama}
          engine_kwargs: {max_model_len: 2048, max_num_seqs: 64}
          deployment_config: {num_replicas: 1, max_ongoing_requests: 256, ray_actor_options: {num_cpus: 1}}
        api_keys: [sk-...]                        # optional; or SERVAL_API_KEY in the cluster's environment
        request_limits: {max_n: 8}                # optional; engine/entrypoints/openai/limits.py lists them

An LLM config's optional ``lora_config`` serves PEFT LoRA adapters over its model (``LoraConfig``).

Every model rejects unknown keys, and ``engine_kwargs`` is checked against
``EngineArgs`` here, so a typo fails the deploy with a message naming the key
instead of surfacing later inside a replica.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from deployments.autoscaling import TTFT_POLICY, TTFTPolicyOptions
from deployments.kv_index import KVRouterOptions
from engine.config import LoRAConfig
from engine.engine_args import EngineArgs
from engine.entrypoints.openai.lora_models import check_adapter_name
from engine.entrypoints.openai.server_options import ServerOptions

# Relative model sources are resolved against the Serval checkout (the directory holding deployments/),
# so that the same YAML works from `make serve`, `serve deploy` and replicas whose cwd is elsewhere.
SERVAL_ROOT = Path(__file__).resolve().parent.parent
SERVER_NAME_PREFIX = "LLMServer:"
DEFAULT_MIGRATION_LIMIT = 3  # LLMServingArgs.migration_limit's default, also the ingress's own


class _StrictModel(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", protected_namespaces=())


class ModelLoadingConfig(_StrictModel):
    model_id: str = Field(min_length=1, description="The name clients pass as `model`.")
    model_source: str | None = Field(
        None, description="Local checkpoint directory or .gguf file; defaults to model_id."
    )

    def resolved_source(self) -> str:
        return resolve_checkout_path(self.model_source or self.model_id)


def resolve_checkout_path(path: str) -> str:
    """``path`` with ``~`` expanded; a relative one resolves against the Serval checkout (as YAML paths do)."""
    source = Path(os.path.expanduser(path))
    return str(source if source.is_absolute() else SERVAL_ROOT / source)


class AutoscalingPolicy(_StrictModel):
    """Serve's ``autoscaling_config.policy`` (its names; see ray.serve.config.AutoscalingPolicy)."""

    policy_function: str = Field(description="module:function or module:Class (a class gets policy_kwargs).")
    policy_kwargs: dict[str, Any] = Field(default_factory=dict, description="The policy class's options.")

    def ttft_options(self) -> TTFTPolicyOptions | None:
        """``TTFTPolicy``'s options when this names it."""
        if self.policy_function.replace(":", ".") != TTFT_POLICY.replace(":", "."):
            return None
        try:
            return TTFTPolicyOptions.model_validate(self.policy_kwargs)
        except ValueError as exc:
            raise ValueError(f"Bad policy_kwargs for {TTFT_POLICY}: {exc}") from None

    @model_validator(mode="after")
    def _check_ttft_policy_options(self) -> AutoscalingPolicy:
        self.ttft_options()
        return self


class AutoscalingConfig(_StrictModel):
    """Serve's autoscaling knobs (a subset with its names); see ray.serve.config.AutoscalingConfig."""

    min_replicas: int = Field(1, ge=0)
    initial_replicas: int | None = Field(None, ge=0)
    max_replicas: int = Field(1, ge=1)
    target_ongoing_requests: float = Field(2.0, gt=0)
    upscale_delay_s: float = Field(30.0, ge=0)
    downscale_delay_s: float = Field(600.0, ge=0)
    metrics_interval_s: float = Field(10.0, gt=0)
    look_back_period_s: float = Field(30.0, gt=0)
    policy: AutoscalingPolicy | None = Field(None, description="None: Serve's (ongoing requests per replica).")


KV_ROUTER_CLASS = "deployments.routing:KVAwareRouter"


class RequestRouterConfig(_StrictModel):
    """Serve's ``request_router_config`` (its names; see ray.serve.config.RequestRouterConfig)."""

    request_router_class: str = Field(KV_ROUTER_CLASS, description="module:Class of a Serve RequestRouter.")
    request_router_kwargs: dict[str, Any] = Field(default_factory=dict, description="The router's options.")
    request_routing_stats_period_s: float = Field(
        0.5, gt=0, description="How often Serve polls each replica's record_routing_stats (KV events, load)."
    )
    request_routing_stats_timeout_s: float = Field(10.0, gt=0)

    def is_kv_router(self) -> bool:
        return self.request_router_class.replace(":", ".") == KV_ROUTER_CLASS.replace(":", ".")

    @model_validator(mode="after")
    def _check_kv_router_options(self) -> RequestRouterConfig:
        if self.is_kv_router():
            try:
                KVRouterOptions.model_validate(self.request_router_kwargs)
            except ValueError as exc:
                raise ValueError(f"Bad request_router_kwargs for {KV_ROUTER_CLASS}: {exc}") from None
        return self


class DeploymentConfig(_StrictModel):
    """Options of one Serve deployment, passed to ``Deployment.options`` under the same names."""

    num_replicas: int | Literal["auto"] | None = Field(None, description="None: 1, or autoscaling's choice.")
    max_ongoing_requests: int = Field(256, ge=1, description="Requests one replica takes at once.")
    max_queued_requests: int = Field(-1, ge=-1, description="Requests a caller queues per deployment; -1: no cap.")
    autoscaling_config: AutoscalingConfig | None = None
    request_router_config: RequestRouterConfig | None = None
    ray_actor_options: dict[str, Any] = Field(default_factory=dict)
    health_check_period_s: float = Field(10.0, gt=0)
    health_check_timeout_s: float = Field(30.0, gt=0)
    graceful_shutdown_timeout_s: float = Field(
        60.0, ge=0, description="How long a draining replica waits for its in-flight streams (scale-down, redeploys)."
    )

    @model_validator(mode="after")
    def _one_way_to_scale(self) -> DeploymentConfig:
        if isinstance(self.num_replicas, int) and self.autoscaling_config is not None:
            raise ValueError("Set either num_replicas or autoscaling_config, not both.")
        return self

    def to_options(self) -> dict[str, Any]:
        """Keyword arguments for ``Deployment.options`` (unset fields keep Serve's defaults)."""
        options = self.model_dump(exclude_none=True)
        if self.autoscaling_config is not None:
            options["autoscaling_config"] = self.autoscaling_config.model_dump(exclude_none=True)
        return options

    def uses_kv_router(self) -> bool:
        return self.request_router_config is not None and self.request_router_config.is_kv_router()

    def ttft_policy_options(self) -> TTFTPolicyOptions | None:
        """The options of ``TTFTPolicy`` when it scales this deployment (``deployments.autoscaling``)."""
        policy = self.autoscaling_config.policy if self.autoscaling_config is not None else None
        return policy.ttft_options() if policy is not None else None


class LoraConfig(_StrictModel):
    """Multi-LoRA: Ray Serve LLM's ``lora_config`` keys plus vLLM's static ``lora_modules``.

    Setting it turns the engine's ``enable_lora`` on and sets its ``max_cpu_loras`` (so leave both out of
    ``engine_kwargs``; ``max_loras`` and ``max_lora_rank`` stay there). Requests name an adapter as
    ``"<model id>:<adapter>"`` or by its own name (``deployments.lora``).
    """

    dynamic_lora_loading_path: str | None = Field(
        None,
        description="A directory whose subdirectories are PEFT adapters, each named by its directory's name and "
        "loaded on its first request; also turns on POST /v1/load_lora_adapter and /v1/unload_lora_adapter.",
    )
    max_num_adapters_per_replica: int = Field(
        16,
        ge=1,
        le=1024,
        description="Adapters one replica holds (Serve's multiplexing LRU, and the engine's max_cpu_loras).",
    )
    lora_modules: dict[str, str] = Field(
        default_factory=dict, description="vLLM's static adapters: name -> PEFT directory, held for the app's life."
    )

    @field_validator("lora_modules")
    @classmethod
    def _adapter_names(cls, modules: dict[str, str]) -> dict[str, str]:
        for name in modules:
            check_adapter_name(name)
        return modules

    @model_validator(mode="after")
    def _static_adapters_fit(self) -> LoraConfig:
        if len(self.lora_modules) > self.max_num_adapters_per_replica:
            raise ValueError(
                f"lora_modules names {len(self.lora_modules)} adapters, more than max_num_adapters_per_replica "
                f"({self.max_num_adapters_per_replica})."
            )
        return self

    def engine_kwargs(self) -> dict[str, Any]:
        """What this config sets in the engine."""
        return {"enable_lora": True, "max_cpu_loras": self.max_num_adapters_per_replica}

    def resolved_modules(self) -> dict[str, str]:
        return {name: resolve_checkout_path(path) for name, path in self.lora_modules.items()}

    def resolved_dynamic_path(self) -> str | None:
        path = self.dynamic_lora_loading_path
        return None if path is None else resolve_checkout_path(path)


class LLMConfig(_StrictModel):
    """One served model: where it comes from, how its engine runs and how it is deployed."""

    model_loading_config: ModelLoadingConfig
    engine_kwargs: dict[str, Any] = Field(default_factory=dict)
    lora_config: LoraConfig | None = Field(None, description="Multi-LoRA adapters over this model.")
    deployment_config: DeploymentConfig = Field(default_factory=DeploymentConfig)
    runtime_env: dict[str, Any] | None = None

    @field_validator("engine_kwargs")
    @classmethod
    def _engine_kwargs_are_engine_args(cls, engine_kwargs: dict[str, Any]) -> dict[str, Any]:
        if "model" in engine_kwargs:
            raise ValueError("Set the checkpoint in model_loading_config.model_source, not engine_kwargs.model.")
        # Field-level check only (no checkpoint access: the deploying machine may not hold the model).
        EngineArgs.model_validate({"model": "-", **engine_kwargs})
        return engine_kwargs

    @model_validator(mode="after")
    def _kv_router_follows_the_engine(self) -> LLMConfig:
        """``KVAwareRouter`` hashes prompts as the engine does: its block size and hash come from
        ``engine_kwargs`` (set there, not in the router's options), and it needs prefix caching."""
        if not self.deployment_config.uses_kv_router():
            return self
        router = self.deployment_config.request_router_config
        engine_args = EngineArgs.model_validate({"model": "-", **self.engine_kwargs})
        if not engine_args.enable_prefix_caching:
            raise ValueError(f"{KV_ROUTER_CLASS} routes on prefix-cache hits; enable_prefix_caching is off.")
        kwargs = router.request_router_kwargs
        for key, value in (("block_size", engine_args.block_size), ("hash_algo", engine_args.prefix_caching_hash_algo)):
            if key in kwargs and kwargs[key] != value:
                raise ValueError(f"request_router_kwargs.{key} comes from engine_kwargs; leave it out.")
            kwargs[key] = value  # the dict is ours (validated copy); the model stays frozen
        return self

    @model_validator(mode="after")
    def _lora_knobs_set_once(self) -> LLMConfig:
        """``lora_config`` sets ``enable_lora`` and ``max_cpu_loras``; the engine's other checks run on the result."""
        if self.lora_config is None:
            return self
        if self.model_id in self.lora_config.lora_modules:
            raise ValueError(f"lora_config.lora_modules names the base model's id {self.model_id!r}.")
        doubled = sorted(set(self.lora_config.engine_kwargs()) & set(self.engine_kwargs))
        if doubled:
            raise ValueError(f"lora_config sets {doubled}; leave them out of engine_kwargs.")
        engine_args = EngineArgs.model_validate(
            {"model": "-", **self.engine_kwargs, **self.lora_config.engine_kwargs()}
        )
        try:
            LoRAConfig(**{name: getattr(engine_args, name) for name in LoRAConfig.model_fields})
        except ValueError as exc:
            raise ValueError(f"lora_config.max_num_adapters_per_replica is the engine's max_cpu_loras: {exc}") from None
        return self

    @model_validator(mode="after")
    def _ttft_policy_sees_ttfts(self) -> LLMConfig:
        if self.deployment_config.ttft_policy_options() is not None and self.engine_kwargs.get("disable_log_stats"):
            raise ValueError(f"{TTFT_POLICY} scales on the engine's TTFTs; disable_log_stats turns them off.")
        return self

    def uses_kv_router(self) -> bool:
        return self.deployment_config.uses_kv_router()

    @property
    def model_id(self) -> str:
        return self.model_loading_config.model_id

    def engine_args(self) -> EngineArgs:
        engine_kwargs = dict(self.engine_kwargs)
        if self.lora_config is not None:
            engine_kwargs.update(self.lora_config.engine_kwargs())
        draft = engine_kwargs.get("speculative_config")
        if isinstance(draft, dict) and draft.get("model"):  # the draft checkpoint resolves like model_source
            engine_kwargs["speculative_config"] = {**draft, "model": resolve_checkout_path(draft["model"])}
        return EngineArgs(model=self.model_loading_config.resolved_source(), **engine_kwargs)

    def server_deployment_name(self) -> str:
        """``LLMServer:<model id>`` with characters Serve and URLs dislike replaced."""
        return SERVER_NAME_PREFIX + re.sub(r"[^A-Za-z0-9_.-]", "--", self.model_id)


class LLMServingArgs(_StrictModel, ServerOptions):
    """The builder's ``args``: the models, options for the ingress deployment, and the server's own
    (``ServerOptions``: ``api_keys``, ``metrics_require_api_key``, ``request_limits``)."""

    llm_configs: list[LLMConfig | str] = Field(min_length=1, description="Configs, or paths to YAML files of one.")
    ingress_deployment_config: DeploymentConfig = Field(
        default_factory=lambda: DeploymentConfig(ray_actor_options={"num_cpus": 0.1}),
        description="The OpenAiIngress deployment's options (only with a separate ingress).",
    )
    migration_limit: int = Field(
        DEFAULT_MIGRATION_LIMIT,
        ge=0,
        le=100,
        description="How many times the OpenAiIngress moves one request to another replica after the one serving "
        "it died (a stream resumes from the tokens already sent; deployments/migration.py); 0: never.",
    )
    separate_ingress: bool = Field(
        True,
        description="True: an OpenAiIngress deployment routes to the LLM servers (needed for several models). "
        "False (one model): its LLM-server replicas serve HTTP themselves, a hop less per streamed chunk "
        "(+33 % output tok/s on a loaded 2-core machine), but nothing stands in front of a replica to move its "
        "requests when it dies (no migration_limit): its streams are cut. Scaling them reloads Serve's HAProxy "
        "(measured without a cut: docs/benchmarks.md, soak).",
    )

    @model_validator(mode="after")
    def _check_ingress_choice(self) -> LLMServingArgs:
        if not self.separate_ingress and len(self.llm_configs) > 1:
            raise ValueError("separate_ingress: false serves one model; several need the OpenAiIngress deployment.")
        if not self.separate_ingress and any(c.uses_kv_router() for c in self.llm_configs):
            raise ValueError(
                "KVAwareRouter runs in the OpenAiIngress (it needs the prompt's tokens); separate_ingress is false."
            )
        if self.ingress_deployment_config.ttft_policy_options() is not None:
            raise ValueError(f"{TTFT_POLICY} scales LLM servers (on their TTFTs), not the ingress.")
        if not self.separate_ingress and "ingress_deployment_config" in self.model_fields_set:
            raise ValueError("ingress_deployment_config configures the separate ingress; separate_ingress is false.")
        if not self.separate_ingress and "migration_limit" in self.model_fields_set and self.migration_limit > 0:
            raise ValueError("migration_limit: the OpenAiIngress moves requests, and separate_ingress is false.")
        return self

    @field_validator("llm_configs")
    @classmethod
    def _load_paths_and_check_ids(cls, configs: list[LLMConfig | str]) -> list[LLMConfig]:
        loaded = [load_llm_config_file(c) if isinstance(c, str) else c for c in configs]
        model_ids = [c.model_id for c in loaded]
        duplicates = sorted({m for m in model_ids if model_ids.count(m) > 1})
        if duplicates:
            raise ValueError(f"Duplicate model_id in llm_configs: {duplicates}.")
        return loaded


def load_llm_config_file(path: str) -> LLMConfig:
    resolved = Path(path) if Path(path).is_absolute() else SERVAL_ROOT / path
    with open(resolved, encoding="utf-8") as f:
        return LLMConfig.model_validate(yaml.safe_load(f))
