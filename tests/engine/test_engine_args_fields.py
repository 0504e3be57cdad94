"""EngineArgs and the per-concern configs declare each knob once and agree on it."""

import json
from collections import Counter

import pytest
from pydantic import ValidationError

from engine.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    PoolerConfig,
    SchedulerConfig,
    SpeculativeConfig,
    StructuredOutputsConfig,
)
from engine.engine_args import DERIVED_DEFAULTS, ROUTED_CONFIGS, ROUTES, UNROUTED_FIELDS, EngineArgs

CONFIGS = (ModelConfig, SchedulerConfig, CacheConfig, ParallelConfig, DeviceConfig, LoRAConfig)
# The user-facing names (vLLM's) that are not the config's: the YAML keys and LLM(...) kwargs rely on them.
EXPECTED_RENAMES = {
    "num_gpu_blocks_override": (CacheConfig, "num_blocks"),
    "scheduling_policy": (SchedulerConfig, "policy"),
}
EXPECTED_UNROUTED = {
    "disable_log_stats",
    "kv_transfer_config",
    "structured_outputs_config",
    "speculative_config",
    "pooler_config",
}

# A value different from the default for every EngineArgs field but model, each valid together.
NON_DEFAULTS = dict(
    tokenizer="tok",
    generation_config="vllm",
    dtype="bfloat16",
    quantization="int8",
    chat_template="{{ messages[0].content }}",
    seed=7,
    reasoning_parser="qwen3",
    runner="pooling",
    attention_backend="torch",
    enforce_eager=True,
    cuda_graph_batch_sizes=(1, 2),
    max_num_batched_tokens=4096,
    max_num_seqs=8,
    max_model_len=1024,
    scheduling_policy="priority",
    enable_chunked_prefill=False,
    long_prefill_token_threshold=64,
    max_num_queued_reqs=5,
    stream_interval=3,
    block_size=32,
    num_gpu_blocks_override=100,
    enable_prefix_caching=False,
    prefix_caching_hash_algo="blake2b",
    kv_cache_dtype="bfloat16",
    kv_cache_memory_bytes=1 << 20,
    gpu_memory_utilization=0.5,
    cpu_kv_cache_fraction=0.5,
    tensor_parallel_size=1,
    pipeline_parallel_size=1,
    distributed_executor_backend="ray",
    num_cpus_per_worker=2.0,
    worker_resources=[{"CPU": 0.5, "memory": 1e9}],
    execute_timeout_s=10.0,
    ray_compiled_graph=False,
    engine_core_process=False,
    device="cpu",
    num_threads=2,
    core_niceness=5,
    enable_lora=True,
    max_loras=2,
    max_lora_rank=8,
    max_cpu_loras=4,
    disable_log_stats=True,
    kv_transfer_config=KVTransferConfig(kv_role="kv_both"),
    structured_outputs_config=StructuredOutputsConfig(
        disable_any_whitespace=True, num_compile_threads=2, enable_in_reasoning=True
    ),
    speculative_config=SpeculativeConfig(method="ngram", num_speculative_tokens=3, max_model_len=1024),
    pooler_config=PoolerConfig(pooling_type="MEAN", normalize=False),
)
# tensor_parallel_size / pipeline_parallel_size stay 1 (KV transfer refuses more); their routing is checked below.
AT_DEFAULT = {"tensor_parallel_size", "pipeline_parallel_size"}


def test_every_engine_args_field_maps_to_exactly_one_config_field_or_is_front_end_only():
    assert ROUTED_CONFIGS == CONFIGS
    assert set(EngineArgs.model_fields) == set(ROUTES) | EXPECTED_UNROUTED
    assert set(UNROUTED_FIELDS) == EXPECTED_UNROUTED and not set(UNROUTED_FIELDS) & set(ROUTES)
    for name, (config, field_name) in ROUTES.items():
        assert field_name in config.model_fields, name
        assert (name == field_name) == (name not in EXPECTED_RENAMES), name
    assert {name: route for name, route in ROUTES.items() if name != route[1]} == EXPECTED_RENAMES


def test_every_config_field_is_reachable_from_exactly_one_engine_args_field():
    reached = Counter((config, field_name) for config, field_name in ROUTES.values())
    every_field = {(config, field_name) for config in CONFIGS for field_name in config.model_fields}
    assert set(reached) == every_field and set(reached.values()) == {1}


def test_max_model_len_lives_in_the_scheduler_config_only():
    assert [config for config in CONFIGS if "max_model_len" in config.model_fields] == [SchedulerConfig]


@pytest.mark.parametrize("name", sorted(ROUTES))
def test_defaults_bounds_and_docs_are_the_config_fields(name):
    config, field_name = ROUTES[name]
    args_field, config_field = EngineArgs.model_fields[name], config.model_fields[field_name]
    assert args_field.metadata == config_field.metadata  # the bounds
    assert config_field.description and args_field.description.startswith(config_field.description)
    if name in DERIVED_DEFAULTS:
        assert args_field.default is None and args_field.annotation == config_field.annotation | None
    else:
        assert args_field.annotation == config_field.annotation
        assert args_field.is_required() == config_field.is_required() and args_field.default == config_field.default


def test_a_bound_rejects_in_engine_args_naming_the_key():
    for key, bad in (
        ("block_size", 0),
        ("gpu_memory_utilization", 1.5),
        ("max_model_len", 1),
        ("num_gpu_blocks_override", 1),
        ("scheduling_policy", "lifo"),
    ):
        with pytest.raises(ValidationError, match=key):
            EngineArgs(model="m", **{key: bad})
    with pytest.raises(ValidationError, match="max_num_seq\n"):
        EngineArgs(model="m", max_num_seq=3)


def test_create_engine_config_routes_every_value_to_its_config_field(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    assert set(NON_DEFAULTS) | {"model"} == set(EngineArgs.model_fields)
    args = EngineArgs(model=str(tmp_path), **NON_DEFAULTS)
    for name in set(NON_DEFAULTS) - AT_DEFAULT:
        assert getattr(args, name) != EngineArgs.model_fields[name].default, name
    config = args.create_engine_config()
    parts = {
        ModelConfig: config.model_config,
        SchedulerConfig: config.scheduler_config,
        CacheConfig: config.cache_config,
        ParallelConfig: config.parallel_config,
        DeviceConfig: config.device_config,
        LoRAConfig: config.lora_config,
    }
    for name, (config_class, field_name) in ROUTES.items():
        assert getattr(parts[config_class], field_name) == getattr(args, name), name
    assert config.kv_transfer_config == NON_DEFAULTS["kv_transfer_config"]
    assert config.structured_outputs_config == NON_DEFAULTS["structured_outputs_config"]
    assert config.speculative_config == NON_DEFAULTS["speculative_config"]
    assert config.pooler_config == NON_DEFAULTS["pooler_config"]
    assert args.create_parallel_config() == config.parallel_config
    parallel_config = EngineArgs(model="m", tensor_parallel_size=2, pipeline_parallel_size=3).create_parallel_config()
    assert (parallel_config.tensor_parallel_size, parallel_config.pipeline_parallel_size) == (2, 3)


def test_derived_defaults_are_worked_out_from_the_checkpoint_and_max_num_seqs(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 512}))
    scheduler_config = EngineArgs(model=str(tmp_path), max_num_seqs=4096).create_engine_config().scheduler_config
    assert (scheduler_config.max_model_len, scheduler_config.max_num_batched_tokens) == (512, 4096)
    scheduler_config = EngineArgs(model=str(tmp_path)).create_engine_config().scheduler_config
    assert scheduler_config.max_num_batched_tokens == 2048
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings"):
        EngineArgs(model=str(tmp_path), max_model_len=1024).create_engine_config()
