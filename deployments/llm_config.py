"""What a user writes under ``args:`` of a Serve application, with Ray Serve LLM's vocabulary.

    applications:
    - name: llm
      import_path: serval.serve:build_openai_app     # or deployments.app:build_openai_app
      args:
        llm_configs:
        - model_loading_config: {model_id: tiny-llama, model_source: models/tiny-llama}
          engine_kwargs: {max_model_len: 2048, max_num_seqs: 64}
          deployment_config: {num_replicas: 1, max_ongoing_requests: 256, ray_actor_options: {num_cpus: 1}}
          accelerator_type: H100                  # optional: a GPU type (CUDA), placement_config.py
          placement_group_config: {bundle_per_worker: {CPU: 1, GPU: 1}, strategy: PACK}   # optional
          runtime_env: {env_vars: {...}}          # optional: the replica's and its engine workers'
        api_keys: [sk-...]                        # optional; or SERVAL_API_KEY in the cluster's environment
        request_limits: {max_n: 8}                # optional; engine/entrypoints/openai/limits.py lists them

An LLM config's optional ``lora_config`` serves PEFT LoRA adapters over its model (``LoraConfig``);
``deployment_config`` takes every Serve deployment option (``deployment_options.py``).

Every model rejects unknown keys, and ``engine_kwargs`` is checked against
``EngineArgs`` here, so a typo fails the deploy with a message naming the key
instead of surfacing later inside a replica. Ray Serve LLM keys Serval cannot
honour get a message saying so (``RAY_SERVE_LLM_ONLY``).
"""

from __future__ import annotations

import re
from typing import Annotated, Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from deployments.autoscaling import TTFT_POLICY
from deployments.config_errors import KeysOf, from_file
from deployments.deployment_options import KV_ROUTER_CLASS, DeploymentConfig
from deployments.model_paths import SERVAL_ROOT as SERVAL_ROOT
from deployments.model_paths import ResolvesPaths, refuse_cloud_uri, resolve_path, search_bases
from deployments.placement_config import PlacementGroupConfig, check_accelerator_type
from engine.config import LoRAConfig
from engine.engine_args import EngineArgs
from engine.entrypoints.openai.lora_models import check_adapter_name
from engine.entrypoints.openai.server_options import ServerOptions

SERVER_NAME_PREFIX = "LLMServer:"
ENGINE_KEYS_LISTED = "they are EngineArgs' fields: `serval serve --help` lists them as flags"
DEFAULT_MIGRATION_LIMIT = 3  # LLMServingArgs.migration_limit's default, also the ingress's own
# Ray Serve LLM's LLMConfig keys with no Serval meaning: key -> why, and what to do instead.
RAY_SERVE_LLM_ONLY = {
    "llm_engine": "Serval serves with its own engine (engine/); leave llm_engine out.",
    "accelerator_config": "Serval infers the device from accelerator_type, placement_group_config and "
    "engine_kwargs.device; leave accelerator_config out.",
    "server_cls": "Serval's builders choose the server class; leave server_cls out.",
    "experimental_configs": "Serval has no experimental_configs; engine_kwargs.stream_interval batches "
    "streamed tokens, ingress_deployment_config sizes the ingress.",
    "log_engine_metrics": "Serval's engine metrics are always exported (serval_* and vllm:* names); "
    "leave log_engine_metrics out.",
    "callback_config": "Serval has no initialization callbacks; leave callback_config out.",
}


class _StrictModel(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", protected_namespaces=())


class ModelLoadingConfig(ResolvesPaths):
    model_id: str = Field(min_length=1, description="The name clients pass as `model`.")
    model_source: str | None = Field(
        None,
        description="Local checkpoint directory or .gguf file, or a Hugging Face id already in the local cache; "
        "defaults to model_id.",
    )
    tokenizer_source: str | None = Field(None, description="Where the tokenizer is; defaults to the model's.")

    @field_validator("model_source", "tokenizer_source", mode="before")
    @classmethod
    def _local_only(cls, value: Any, info: Any) -> Any:
        return refuse_cloud_uri(value, info.field_name)

    def resolved_source(self) -> str:
        return self.resolve(self.model_source or self.model_id)

    def resolved_tokenizer(self) -> str | None:
        return None if self.tokenizer_source is None else self.resolve(self.tokenizer_source)


class LoraConfig(ResolvesPaths):
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

    @field_validator("dynamic_lora_loading_path", mode="before")
    @classmethod
    def _local_directory(cls, value: Any) -> Any:
        return refuse_cloud_uri(value, "dynamic_lora_loading_path")

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
        return {name: self.resolve(path) for name, path in self.lora_modules.items()}

    def resolved_dynamic_path(self) -> str | None:
        path = self.dynamic_lora_loading_path
        return None if path is None else self.resolve(path)


class LLMConfig(_StrictModel):
    """One served model: where it comes from, how its engine runs and how it is deployed."""

    model_loading_config: ModelLoadingConfig
    engine_kwargs: Annotated[dict[str, Any], KeysOf.model(EngineArgs, ENGINE_KEYS_LISTED)] = Field(default_factory=dict)
    lora_config: LoraConfig | None = Field(None, description="Multi-LoRA adapters over this model.")
    deployment_config: DeploymentConfig = Field(default_factory=lambda: DeploymentConfig({}))
    runtime_env: dict[str, Any] | None = Field(None, description="The replica's (and its engine workers').")
    accelerator_type: str | None = Field(None, description="A Ray GPU type (H100, A10G, ...): CUDA on those nodes.")
    placement_group_config: PlacementGroupConfig | None = Field(
        None, description="Each replica's bundles (one per engine worker) and strategy."
    )

    @model_validator(mode="before")
    @classmethod
    def _ray_serve_llm_only_keys(cls, data: Any) -> Any:
        for key in sorted(set(data) & set(RAY_SERVE_LLM_ONLY)) if isinstance(data, dict) else ():
            raise ValueError(f"{key}: {RAY_SERVE_LLM_ONLY[key]}")
        return data

    @field_validator("accelerator_type")
    @classmethod
    def _gpu_type(cls, value: str | None) -> str | None:
        return None if value is None else check_accelerator_type(value)

    @field_validator("engine_kwargs")
    @classmethod
    def _engine_kwargs_are_engine_args(cls, engine_kwargs: dict[str, Any]) -> dict[str, Any]:
        if "model" in engine_kwargs:
            raise ValueError("Set the checkpoint in model_loading_config.model_source, not engine_kwargs.model.")
        if "tokenizer" in engine_kwargs:
            raise ValueError("Set the tokenizer in model_loading_config.tokenizer_source, not engine_kwargs.tokenizer.")
        # Field-level check only (no checkpoint access: the deploying machine may not hold the model).
        EngineArgs.model_validate({"model": "-", **engine_kwargs})
        return engine_kwargs

    @model_validator(mode="after")
    def _fix_search_bases(self) -> LLMConfig:
        """Relative paths resolve where the config is validated (``search_bases``), wherever they are used."""
        bases = search_bases((self.runtime_env or {}).get("working_dir"))
        for part in (self.model_loading_config, self.lora_config):
            if part is not None:
                part._bases = bases
        self._bases = bases
        return self

    @model_validator(mode="after")
    def _placement_is_the_llm_configs(self) -> LLMConfig:
        """Bundles come from ``placement_group_config`` (Ray Serve LLM's rule), the device from it or the
        accelerator type; the engine's world size and device are checked against them."""
        for key in ("placement_group_bundles", "placement_group_strategy"):
            if key in self.deployment_config.root:
                raise ValueError(f"deployment_config.{key}: set placement_group_config on the LLM config instead.")
        if "worker_resources" in self.engine_kwargs:
            raise ValueError("engine_kwargs.worker_resources: set placement_group_config's bundles instead.")
        if self.placement_group_config is not None:
            self.placement_group_config.check_engine_kwargs(self.engine_kwargs, self.accelerator_type)
        self.engine_args()  # the engine's own checks, and the bundles' against its workers
        if self.implies_cuda() and self.engine_kwargs.get("device") == "cpu":
            raise ValueError("accelerator_type / placement_group_config GPUs run the engine on CUDA; device is cpu.")
        return self

    @model_validator(mode="after")
    def _kv_router_follows_the_engine(self) -> LLMConfig:
        """``KVAwareRouter`` hashes prompts as the engine does: its block size and hash come from
        ``engine_kwargs`` (set there, not in the router's options), and it needs prefix caching."""
        if not self.uses_kv_router():
            return self
        engine_args = EngineArgs.model_validate({"model": "-", **self.engine_kwargs})
        if not engine_args.enable_prefix_caching:
            raise ValueError(f"{KV_ROUTER_CLASS} routes on prefix-cache hits; enable_prefix_caching is off.")
        kwargs = self.deployment_config.get("request_router_config").get("request_router_kwargs") or {}
        for key in self.router_engine_kwargs():
            if key in kwargs:
                raise ValueError(f"request_router_kwargs.{key} comes from engine_kwargs; leave it out.")
        return self

    @model_validator(mode="after")
    def _lora_knobs_agree(self) -> LLMConfig:
        """``lora_config`` sets ``enable_lora`` and ``max_cpu_loras``: engine_kwargs may repeat them (as Ray Serve
        LLM's examples do) but not contradict them; the engine's other checks run on the result."""
        if self.lora_config is None:
            if self.engine_kwargs.get("enable_lora"):
                raise ValueError("engine_kwargs.enable_lora needs a lora_config (where the adapters are).")
            return self
        if self.model_id in self.lora_config.lora_modules:
            raise ValueError(f"lora_config.lora_modules names the base model's id {self.model_id!r}.")
        for key, value in self.lora_config.engine_kwargs().items():
            if key in self.engine_kwargs and self.engine_kwargs[key] != value:
                raise ValueError(f"engine_kwargs.{key}={self.engine_kwargs[key]!r} contradicts lora_config ({value}).")
        lora_kwargs = {**self.engine_kwargs, **self.lora_config.engine_kwargs()}
        engine_args = EngineArgs.model_validate({"model": "-", **lora_kwargs})
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

    _bases: tuple[str, ...] | None = PrivateAttr(None)

    def uses_kv_router(self) -> bool:
        return self.deployment_config.uses_kv_router()

    def implies_cuda(self) -> bool:
        """A GPU accelerator type or GPU bundles: the engine runs on CUDA whatever the cluster shows yet."""
        return self.accelerator_type is not None or (
            self.placement_group_config is not None and self.placement_group_config.uses_gpus()
        )

    def router_engine_kwargs(self) -> dict[str, Any]:
        """What ``KVAwareRouter`` takes from the engine: its block size and prefix hash."""
        engine_args = EngineArgs.model_validate({"model": "-", **self.engine_kwargs})
        return {"block_size": engine_args.block_size, "hash_algo": engine_args.prefix_caching_hash_algo}

    @property
    def model_id(self) -> str:
        return self.model_loading_config.model_id

    def engine_args(self) -> EngineArgs:
        engine_kwargs = dict(self.engine_kwargs)
        if self.lora_config is not None:
            engine_kwargs.update(self.lora_config.engine_kwargs())
        draft = engine_kwargs.get("speculative_config")
        if isinstance(draft, dict) and draft.get("model"):  # the draft checkpoint resolves like model_source
            engine_kwargs["speculative_config"] = {**draft, "model": resolve_path(draft["model"], self._bases)}
        if self.model_loading_config.tokenizer_source is not None:
            engine_kwargs["tokenizer"] = self.model_loading_config.resolved_tokenizer()
        if self.implies_cuda():
            engine_kwargs["device"] = "cuda"
        model = self.model_loading_config.resolved_source()
        if self.placement_group_config is None:
            return EngineArgs(model=model, **engine_kwargs)
        engine_kwargs["distributed_executor_backend"] = "ray"
        world_size = EngineArgs(model=model, **engine_kwargs).create_parallel_config().world_size
        on_cuda = engine_kwargs.get("device") == "cuda"
        engine_kwargs["worker_resources"] = self.placement_group_config.worker_resources(world_size, on_cuda)
        return EngineArgs(model=model, **engine_kwargs)

    def server_deployment_name(self, prefix: str = SERVER_NAME_PREFIX) -> str:
        """``deployment_config.name``, else ``<prefix><model id>`` with characters Serve and URLs dislike replaced."""
        default = prefix + re.sub(r"[^A-Za-z0-9_.-]", "--", self.model_id)
        return self.deployment_config.get("name") or default


class LLMServingArgs(_StrictModel, ServerOptions):
    """The builder's ``args``: the models, options for the ingress deployment, and the server's own
    (``ServerOptions``: ``api_keys``, ``metrics_require_api_key``, ``request_limits``)."""

    llm_configs: list[LLMConfig | str] = Field(min_length=1, description="Configs, or paths to YAML files of one.")
    ingress_deployment_config: DeploymentConfig = Field(
        default_factory=lambda: DeploymentConfig({"ray_actor_options": {"num_cpus": 0.1}}),
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
        "(more output tokens/s under load), but nothing stands in front of a replica to move its "
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
        loaded = [
            from_file(load_llm_config_file, LLMConfig, c, i) if isinstance(c, str) else c for i, c in enumerate(configs)
        ]
        model_ids = [c.model_id for c in loaded]
        duplicates = sorted({m for m in model_ids if model_ids.count(m) > 1})
        if duplicates:
            raise ValueError(f"Duplicate model_id in llm_configs: {duplicates}.")
        return loaded


def load_llm_config_file(path: str) -> LLMConfig:
    """An LLM config from a YAML file (Ray Serve LLM's standalone form); a relative path resolves as model paths do."""
    with open(resolve_path(path), encoding="utf-8") as f:
        return LLMConfig.model_validate(yaml.safe_load(f))
