"""The flat, vLLM-style keyword arguments a user writes, turned into an EngineConfig.

``LLM(model=..., max_model_len=..., ...)`` and the ``engine_kwargs`` block of
a serve YAML are both validated here: unknown keys are an error naming the
key, and each value lands in the one per-concern config that owns it.

No knob is declared here: every EngineArgs field is generated from the config
field it routes to (same type, default, bounds and description). The tables
below hold only what differs: vLLM's names where they are not the configs',
the defaults worked out when the engine config is built, and the fields no
per-concern config holds.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, create_model
from pydantic.fields import FieldInfo

from engine.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    KVTransferConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    StructuredOutputsConfig,
)

# The configs whose every field is an EngineArgs field, in EngineArgs' field order.
ROUTED_CONFIGS: tuple[type[BaseModel], ...] = (
    ModelConfig,
    SchedulerConfig,
    CacheConfig,
    ParallelConfig,
    DeviceConfig,
    LoRAConfig,
)

# vLLM's name, where it differs from the field's: EngineArgs field -> (config, its field).
RENAMED_FIELDS: dict[str, tuple[type[BaseModel], str]] = {
    "num_gpu_blocks_override": (CacheConfig, "num_blocks"),
    "scheduling_policy": (SchedulerConfig, "policy"),
}

# Fields whose EngineArgs default is None, worked out by create_engine_config: field -> what None means.
DERIVED_DEFAULTS: dict[str, str] = {
    "max_num_batched_tokens": "None: max(2048, max_num_seqs).",
    "max_model_len": "None: the checkpoint's max_position_embeddings.",
}

# Fields no per-concern config holds: (annotation, FieldInfo) each.
UNROUTED_FIELDS: dict[str, tuple[Any, FieldInfo]] = {
    # The front end's: the async engine keeps latency statistics and logs throughput unless told not to.
    "disable_log_stats": (bool, Field(False, description="Front end: keep no statistics, log no throughput.")),
    # Disaggregated prefill: this engine's role and transport (the PD app sets it for each pool).
    "kv_transfer_config": (KVTransferConfig | None, Field(None, description="Disaggregated prefill only.")),
    "structured_outputs_config": (
        StructuredOutputsConfig,
        Field(
            StructuredOutputsConfig(),
            description="Structured outputs: backend, disable_any_whitespace, enable_in_reasoning.",
        ),
    ),
    "speculative_config": (
        SpeculativeConfig | None,
        Field(None, description="Speculative decoding: method (ngram, draft_model), num_speculative_tokens, ..."),
    ),
}


def _routes() -> dict[str, tuple[type[BaseModel], str]]:
    vllm_name = {route: name for name, route in RENAMED_FIELDS.items()}
    return {
        vllm_name.get((config, field_name), field_name): (config, field_name)
        for config in ROUTED_CONFIGS
        for field_name in config.model_fields
    }


# Every EngineArgs field a config holds -> (that config, its field name); one entry per config field.
ROUTES: dict[str, tuple[type[BaseModel], str]] = _routes()


def _engine_args_field(name: str, info: FieldInfo) -> tuple[Any, FieldInfo]:
    """The config field ``info`` as EngineArgs field ``name``: its bounds kept, a derived one None by default."""
    derived = name in DERIVED_DEFAULTS
    annotation = info.annotation | None if derived else info.annotation
    if info.metadata:  # the bounds (ge, gt, le, ...)
        annotation = Annotated[(annotation, *info.metadata)]
    description = f"{info.description} {DERIVED_DEFAULTS[name]}" if derived else info.description
    return annotation, Field(None if derived else info.default, description=description)


class _EngineArgsBase(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", protected_namespaces=())

    def _routed_values(self, config: type[BaseModel]) -> dict[str, Any]:
        """This config's fields' values, keyed by the config's names (derived ones as given: maybe None)."""
        return {field_name: getattr(self, name) for name, (owner, field_name) in ROUTES.items() if owner is config}

    def create_parallel_config(self) -> ParallelConfig:
        """Needs no checkpoint: the Serve app builder sizes a replica's placement group from it."""
        return ParallelConfig(**self._routed_values(ParallelConfig))

    def create_engine_config(self) -> EngineConfig:
        """Validates every part (reads the checkpoint's config.json for the context length)."""
        if self.kv_transfer_config is not None and (self.tensor_parallel_size, self.pipeline_parallel_size) != (1, 1):
            raise ValueError(
                "KV transfer (disaggregated prefill) supports tensor_parallel_size=1 and "
                "pipeline_parallel_size=1 engines only."
            )
        if self.cuda_graph_batch_sizes and max(self.cuda_graph_batch_sizes) > self.max_num_seqs:
            raise ValueError(
                f"cuda_graph_batch_sizes go up to {max(self.cuda_graph_batch_sizes)}, past max_num_seqs "
                f"({self.max_num_seqs}): no decode step is that large."
            )
        if self.tensor_parallel_size > 1:
            _check_tensor_parallel_split(_hf_config(self.model), self.tensor_parallel_size)
        max_position = _max_position_embeddings(self.model)
        max_model_len = self.max_model_len or max_position
        if max_model_len > max_position:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's max_position_embeddings ({max_position})."
            )
        derived = {
            "max_num_batched_tokens": self.max_num_batched_tokens or max(2048, self.max_num_seqs),
            "max_model_len": max_model_len,
        }
        return EngineConfig(
            model_config=ModelConfig(**self._routed_values(ModelConfig)),
            cache_config=CacheConfig(**self._routed_values(CacheConfig)),
            scheduler_config=SchedulerConfig(**{**self._routed_values(SchedulerConfig), **derived}),
            parallel_config=self.create_parallel_config(),
            device_config=DeviceConfig(**self._routed_values(DeviceConfig)),
            kv_transfer_config=self.kv_transfer_config,
            structured_outputs_config=self.structured_outputs_config,
            speculative_config=self._checked_speculative_config(max_model_len),
            lora_config=LoRAConfig(**self._routed_values(LoRAConfig)),
        )

    def _checked_speculative_config(self, max_model_len: int) -> SpeculativeConfig | None:
        """The speculative config with its draft checked against the target (each error names the field)."""
        spec = self.speculative_config
        if spec is None:
            return None
        if self.pipeline_parallel_size > 1:
            raise ValueError("speculative_config: pipeline_parallel_size > 1 is not supported with speculation.")
        if spec.max_model_len is not None and spec.max_model_len > max_model_len:
            raise ValueError(
                f"speculative_config.max_model_len ({spec.max_model_len}) exceeds the target's "
                f"max_model_len ({max_model_len})."
            )
        if spec.model is not None:
            target_vocab, draft_vocab = _vocab_size(self.model), _vocab_size(spec.model)
            if draft_vocab != target_vocab:
                raise ValueError(
                    f"speculative_config.model {spec.model!r} has a vocabulary of {draft_vocab} tokens, "
                    f"the target {target_vocab}: a draft must share the target's tokenizer."
                )
            draft_len = _max_position_embeddings(spec.model)
            if draft_len < (spec.max_model_len or max_model_len):
                raise ValueError(
                    f"speculative_config.model {spec.model!r} holds {draft_len} positions, fewer than the "
                    f"{spec.max_model_len or max_model_len} it would draft up to: set speculative_config.max_model_len."
                )
        return spec.model_copy(update={"max_model_len": spec.max_model_len or max_model_len})


EngineArgs = create_model(
    "EngineArgs",
    __base__=_EngineArgsBase,
    __module__=__name__,
    __doc__="The engine's keyword arguments (vLLM's names), validated; ``create_engine_config`` builds the configs.",
    **{
        name: _engine_args_field(name, config.model_fields[field_name]) for name, (config, field_name) in ROUTES.items()
    },
    **UNROUTED_FIELDS,
)


def _check_tensor_parallel_split(hf_config: dict, tp_size: int) -> None:
    """ValueError unless every tensor-parallel split of the model is whole (heads, KV heads, MLP, vocab)."""
    cfg = {**(hf_config.get("text_config") or {}), **hf_config}
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    splits = {
        "attention heads": heads,
        "MLP columns (intermediate_size)": cfg["intermediate_size"],
        "vocabulary entries": cfg["vocab_size"],
    }
    for what, count in splits.items():
        if count % tp_size:
            raise ValueError(
                f"tensor_parallel_size={tp_size} does not divide the model's {count} {what}: "
                f"choose a tensor_parallel_size that {count} is divisible by."
            )
    if kv_heads % tp_size and tp_size % kv_heads:
        raise ValueError(
            f"tensor_parallel_size={tp_size} splits neither the model's {kv_heads} KV heads evenly nor "
            f"replicates them whole: it must divide {kv_heads} or be a multiple of it."
        )


def _hf_config(model: str) -> dict:
    from engine.model.source import open_model_source  # torch-free until a checkpoint is read

    return open_model_source(model).hf_config


def _max_position_embeddings(model: str) -> int:
    return int(_hf_config(model).get("max_position_embeddings", 2048))


def _vocab_size(model: str) -> int:
    return int(_hf_config(model)["vocab_size"])
