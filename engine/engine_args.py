"""The flat, vLLM-style keyword arguments a user writes, turned into an EngineConfig.

``LLM(model=..., max_model_len=..., ...)`` and the ``engine_kwargs`` block of
a serve YAML are both validated here: unknown keys are an error naming the
key, and each value lands in the one per-concern config that owns it.
"""

from __future__ import annotations

import json
import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.config import (CacheConfig, DeviceConfig, EngineConfig, KVTransferConfig, ModelConfig, ParallelConfig,
                           SchedulerConfig)


class EngineArgs(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", protected_namespaces=())

    model: str
    tokenizer: str | None = None
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    max_model_len: int | None = Field(None, ge=2, description="Defaults to the checkpoint's max_position_embeddings.")
    seed: int = 0
    attention_backend: Literal["auto", "torch", "triton"] = "auto"
    enforce_eager: bool = Field(False, description="CUDA: run every step eagerly (no CUDA graphs).")
    cuda_graph_batch_sizes: list[int] | None = Field(None, description="CUDA: decode batch sizes to capture.")
    # Scheduler
    max_num_seqs: int = Field(256, ge=1)
    max_num_batched_tokens: int | None = Field(None, ge=1, description="Defaults to max(2048, max_num_seqs).")
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = Field(0, ge=0)
    max_num_queued_reqs: int | None = Field(None, ge=1, description="Refuse new requests past this many waiting.")
    stream_interval: int = Field(1, ge=1, description="Tokens per streamed output; >1 cuts per-token overhead.")
    # Cache
    block_size: int = Field(16, ge=1)
    num_gpu_blocks_override: int | None = Field(None, ge=2, description="Fix the KV pool size (blocks).")
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: Literal["sha256", "blake2b"] = "sha256"
    kv_cache_memory_bytes: int | None = Field(None, ge=1)
    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0)
    cpu_kv_cache_fraction: float = Field(0.25, gt=0.0, le=0.9)
    # Parallelism and device
    tensor_parallel_size: int = Field(1, ge=1)
    pipeline_parallel_size: int = Field(1, ge=1)
    distributed_executor_backend: Literal["uni", "ray"] | None = None
    num_cpus_per_worker: float = Field(1.0, ge=0.0, description="Ray executor: CPUs each worker reserves.")
    execute_timeout_s: float = Field(300.0, gt=0, description="Ray executor: longest a step may take.")
    ray_compiled_graph: bool | None = Field(None, description="Ray executor: compiled graph or actor tasks.")
    # Front end (not part of EngineConfig): the async engine keeps latency statistics and logs throughput.
    disable_log_stats: bool = False
    device: Literal["auto", "cpu", "cuda"] = "auto"
    num_threads: int | None = Field(None, ge=1)
    # Disaggregated prefill: this engine's role and transport (the PD app sets it for each pool).
    kv_transfer_config: KVTransferConfig | None = None

    def create_parallel_config(self) -> ParallelConfig:
        """Needs no checkpoint: the Serve app builder sizes a replica's placement group from it."""
        return ParallelConfig(tensor_parallel_size=self.tensor_parallel_size,
                              pipeline_parallel_size=self.pipeline_parallel_size,
                              distributed_executor_backend=self.distributed_executor_backend,
                              num_cpus_per_worker=self.num_cpus_per_worker, execute_timeout_s=self.execute_timeout_s,
                              ray_compiled_graph=self.ray_compiled_graph)

    def create_engine_config(self) -> EngineConfig:
        """Validates every part (reads the checkpoint's config.json for the context length)."""
        if self.kv_transfer_config is not None and (self.tensor_parallel_size, self.pipeline_parallel_size) != (1, 1):
            raise ValueError("KV transfer (disaggregated prefill) supports tensor_parallel_size=1 and "
                             "pipeline_parallel_size=1 engines only.")
        if self.cuda_graph_batch_sizes and max(self.cuda_graph_batch_sizes) > self.max_num_seqs:
            raise ValueError(f"cuda_graph_batch_sizes go up to {max(self.cuda_graph_batch_sizes)}, past max_num_seqs "
                             f"({self.max_num_seqs}): no decode step is that large.")
        max_position = _max_position_embeddings(self.model)
        max_model_len = self.max_model_len or max_position
        if max_model_len > max_position:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's max_position_embeddings "
                             f"({max_position}).")
        return EngineConfig(
            model_config=ModelConfig(model=self.model, tokenizer=self.tokenizer, dtype=self.dtype,
                                     max_model_len=max_model_len, seed=self.seed,
                                     attention_backend=self.attention_backend, enforce_eager=self.enforce_eager,
                                     cuda_graph_batch_sizes=self.cuda_graph_batch_sizes),
            cache_config=CacheConfig(block_size=self.block_size, num_blocks=self.num_gpu_blocks_override,
                                     enable_prefix_caching=self.enable_prefix_caching,
                                     prefix_caching_hash_algo=self.prefix_caching_hash_algo,
                                     kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                                     gpu_memory_utilization=self.gpu_memory_utilization,
                                     cpu_kv_cache_fraction=self.cpu_kv_cache_fraction),
            scheduler_config=SchedulerConfig(
                max_num_batched_tokens=self.max_num_batched_tokens or max(2048, self.max_num_seqs),
                max_num_seqs=self.max_num_seqs, max_model_len=max_model_len, policy=self.scheduling_policy,
                enable_chunked_prefill=self.enable_chunked_prefill,
                long_prefill_token_threshold=self.long_prefill_token_threshold,
                max_num_queued_reqs=self.max_num_queued_reqs, stream_interval=self.stream_interval),
            parallel_config=self.create_parallel_config(),
            device_config=DeviceConfig(device=self.device, num_threads=self.num_threads),
            kv_transfer_config=self.kv_transfer_config,
        )


def _max_position_embeddings(model_dir: str) -> int:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"{model_dir!r} is not a model directory: it has no config.json.")
    with open(path, encoding="utf-8") as f:
        return int(json.load(f).get("max_position_embeddings", 2048))
