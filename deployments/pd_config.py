"""What a user writes under ``args:`` of a disaggregated prefill/decode (PD) application.

    import_path: deployments.app:build_pd_openai_app
    args:
      prefill_config: {model_loading_config: {...}, engine_kwargs: {...}, deployment_config: {num_replicas: 2}}
      decode_config:  {model_loading_config: {...}, engine_kwargs: {...}, deployment_config: {num_replicas: 1}}
      kv_transfer_config: {kv_connector: object_store}
      prefill_timeout_s: 60
      fallback_to_local_prefill: false

``prefill_config`` and ``decode_config`` are ``llm_config`` entries of the
colocated app (the same keys), one per pool; both serve the same model id.
The builder gives each pool's engine its KV role; ``kv_transfer_config`` holds
what both share.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from deployments.llm_config import DeploymentConfig, LLMConfig, _StrictModel, load_llm_config_file
from engine.entrypoints.openai.server_options import ServerOptions

PREFILL_NAME_PREFIX = "PrefillServer:"


class PDTransferConfig(_StrictModel):
    """How KV blocks move from the prefill pool to the decode pool (``engine.config.KVTransferConfig``)."""

    kv_connector: Literal["object_store", "ray_direct"] = "object_store"
    tensor_transport: Literal["auto", "gloo", "nccl"] = "auto"


class PDOptions(_StrictModel):
    """What the decode side does around the remote prefill."""

    prefill_timeout_s: float = Field(60.0, gt=0, description="A prefill taking longer fails (or falls back).")
    fallback_to_local_prefill: bool = Field(
        False,
        description="On a prefill failure or timeout, prefill on the decode replica instead of failing "
        "the request with 503.",
    )


class PDServingArgs(PDOptions, ServerOptions):
    prefill_config: LLMConfig
    decode_config: LLMConfig
    kv_transfer_config: PDTransferConfig = Field(default_factory=PDTransferConfig)
    ingress_deployment_config: DeploymentConfig = Field(
        default_factory=lambda: DeploymentConfig(ray_actor_options={"num_cpus": 0.1})
    )

    @field_validator("prefill_config", "decode_config", mode="before")
    @classmethod
    def _load_path(cls, config: Any) -> Any:
        return load_llm_config_file(config) if isinstance(config, str) else config

    @model_validator(mode="after")
    def _one_model_no_own_roles(self) -> PDServingArgs:
        if self.prefill_config.model_id != self.decode_config.model_id:
            raise ValueError(
                f"prefill_config serves {self.prefill_config.model_id!r} but decode_config serves "
                f"{self.decode_config.model_id!r}: both pools must serve the same model_id."
            )
        for name, config in (("prefill_config", self.prefill_config), ("decode_config", self.decode_config)):
            kwargs = config.engine_kwargs
            if "kv_transfer_config" in kwargs:
                raise ValueError(
                    f"{name}.engine_kwargs.kv_transfer_config is set by the PD builder; "
                    "use the app's kv_transfer_config."
                )
            if config.lora_config is not None or kwargs.get("enable_lora"):
                raise ValueError(f"{name}: LoRA adapters with disaggregated prefill are not supported yet.")
            if kwargs.get("tensor_parallel_size", 1) != 1 or kwargs.get("pipeline_parallel_size", 1) != 1:
                raise ValueError(
                    f"{name}: disaggregated serving supports tensor_parallel_size=1 and "
                    "pipeline_parallel_size=1 engines only."
                )
        pools = (self.prefill_config, self.decode_config)
        block_sizes = {config.engine_kwargs.get("block_size", 16) for config in pools}
        if len(block_sizes) > 1:
            raise ValueError(f"Both pools must use the same block_size (KV moves block by block), got {block_sizes}.")
        return self

    @property
    def options(self) -> PDOptions:
        return PDOptions(
            prefill_timeout_s=self.prefill_timeout_s, fallback_to_local_prefill=self.fallback_to_local_prefill
        )

    def with_role(self, config: LLMConfig, role: str) -> LLMConfig:
        """``config`` whose engine plays ``role``; ``ray_direct`` also needs Ray executor workers (actors)."""
        kv_transfer_config = {"kv_role": role, **self.kv_transfer_config.model_dump()}
        engine_kwargs = {**config.engine_kwargs, "kv_transfer_config": kv_transfer_config}
        if self.kv_transfer_config.kv_connector == "ray_direct":
            engine_kwargs["distributed_executor_backend"] = "ray"
        return config.model_copy(update={"engine_kwargs": engine_kwargs})

    def prefill_deployment_name(self) -> str:
        return PREFILL_NAME_PREFIX + self.prefill_config.server_deployment_name().split(":", 1)[1]
