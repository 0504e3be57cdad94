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

Ray Serve LLM's form, each pool's ``engine_kwargs.kv_transfer_config`` naming a vLLM connector
(``{kv_connector: NixlConnector, kv_role: kv_producer, engine_id: ...}``), is accepted when the roles fit
the pools: Serval moves the KV blocks with its own connector (``object_store`` unless the app's
``kv_transfer_config`` is given), and says so in the log.
"""

from __future__ import annotations

import copy
import logging
from typing import Any, Literal

import yaml
from pydantic import Field, model_validator

from deployments.deployment_options import DeploymentConfig
from deployments.llm_config import LLMConfig, _StrictModel
from deployments.model_paths import resolve_path
from engine.entrypoints.openai.server_options import ServerOptions

logger = logging.getLogger("ray.serve")

PREFILL_NAME_PREFIX = "PrefillServer:"
POOL_ROLES = {"prefill_config": ("kv_producer", "kv_both"), "decode_config": ("kv_consumer", "kv_both")}
# vLLM connectors of Ray Serve LLM's P/D examples whose job (moving a prompt's KV to the decode pool) Serval's
# own connectors do; others (LMCache's caching and offloading) have no Serval counterpart.
STANDS_IN_FOR = frozenset({"NixlConnector"})
POOL_TRANSFER_KEYS = frozenset({"kv_connector", "kv_role", "engine_id"})


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
        default_factory=lambda: DeploymentConfig({"ray_actor_options": {"num_cpus": 0.1}})
    )

    @model_validator(mode="before")
    @classmethod
    def _pools_in_ray_serve_llms_form(cls, data: Any) -> Any:
        """Loads pools given as YAML paths, and takes each pool's own ``kv_transfer_config`` (Ray Serve LLM's
        form) out of its engine_kwargs into the app's, checking it fits the pool."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        connectors = set()
        for pool, roles in POOL_ROLES.items():
            config = data.get(pool)
            if isinstance(config, str):
                with open(resolve_path(config), encoding="utf-8") as f:
                    config = yaml.safe_load(f)
            if isinstance(config, dict) and isinstance(
                (config.get("engine_kwargs") or {}).get("kv_transfer_config"), dict
            ):
                config = copy.deepcopy(config)
                connectors.add(_pool_connector(pool, roles, config["engine_kwargs"].pop("kv_transfer_config")))
            data[pool] = config
        if connectors:
            if "kv_transfer_config" in data:
                raise ValueError("Set kv_transfer_config either for the app or in each pool's engine_kwargs, not both.")
            if len(connectors) > 1:
                raise ValueError(f"The pools' kv_transfer_config name different connectors: {sorted(connectors)}.")
            data["kv_transfer_config"] = {"kv_connector": connectors.pop()}
        return data

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
        if self.prefill_deployment_name() == self.decode_config.server_deployment_name():
            raise ValueError(f"Both pools' deployments are named {self.prefill_deployment_name()!r}.")
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
        """``prefill_config``'s ``deployment_config.name``, else ``PrefillServer:<model id>``."""
        return self.prefill_config.server_deployment_name(PREFILL_NAME_PREFIX)


def _pool_connector(pool: str, roles: tuple[str, ...], transfer: dict[str, Any]) -> str:
    """The Serval connector for a pool's own ``kv_transfer_config`` (vLLM's keys); ValueError if it cannot fit."""
    unknown = sorted(set(transfer) - POOL_TRANSFER_KEYS)
    if unknown:
        raise ValueError(f"{pool}.engine_kwargs.kv_transfer_config: {unknown} are vLLM connector options Serval lacks.")
    if transfer.get("kv_role") not in roles:
        raise ValueError(f"{pool}.engine_kwargs.kv_transfer_config.kv_role must be one of {roles} for this pool.")
    connector = transfer.get("kv_connector", "object_store")
    if connector in STANDS_IN_FOR:
        logger.warning(
            "%s: kv_connector %s; Serval moves the KV blocks with its object_store connector.", pool, connector
        )
        return "object_store"
    if connector in PDTransferConfig.model_fields["kv_connector"].annotation.__args__:
        return connector
    raise ValueError(
        f"{pool}.engine_kwargs.kv_transfer_config.kv_connector {connector!r}: Serval's connectors are object_store "
        f"and ray_direct (NixlConnector is served by object_store); it has no cache offloading."
    )
