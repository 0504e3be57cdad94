"""Engine configuration: one frozen, validated model per concern.

Every config rejects unknown keys (``extra="forbid"``) so a typo in a YAML file is an error at deploy time
instead of a silently ignored setting. Each engine knob's type, default, bounds and one-line description are
declared here and only here: ``EngineArgs`` (the keys a user writes) is generated from these fields
(``engine/engine_args.py``, which lists the few vLLM names that differ from the field names).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from engine.reasoning import ReasoningParserName


class _FrozenConfig(BaseModel):
    # protected_namespaces=() allows fields named model_* (ModelConfig.model).
    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True, protected_namespaces=())


class SchedulerConfig(_FrozenConfig):
    """How the scheduler spends each step's token budget."""

    max_num_batched_tokens: int = Field(2048, ge=1, description="Token budget of one step.")
    max_num_seqs: int = Field(256, ge=1, description="Most requests running at once.")
    # The one home of the context length: the scheduler, the front end and the workers all read it here.
    max_model_len: int = Field(2048, ge=2, description="Longest sequence (prompt + output).")
    policy: Literal["fcfs", "priority"] = Field(
        "fcfs", description="Admission and preemption order: arrival (fcfs) or (priority, arrival)."
    )
    enable_chunked_prefill: bool = Field(
        True, description="Split a prompt over steps when it does not fit the step's token budget."
    )
    long_prefill_token_threshold: int = Field(
        0, ge=0, description="Most tokens one request gets per step; 0 means no cap."
    )
    # Enforced by the async front end (AsyncLLM), not by the scheduler: past it, new requests are refused.
    max_num_queued_reqs: int | None = Field(
        None, ge=1, description="Most requests waiting to run (queued, not yet scheduled); None = unlimited."
    )
    # Enforced by the front end's output processor (vLLM's stream_interval).
    stream_interval: int = Field(
        1, ge=1, description="Streamed outputs carry this many new tokens (the first token and the end go at once)."
    )

    @model_validator(mode="after")
    def _budget_fits_a_prompt(self) -> SchedulerConfig:
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than max_model_len "
                f"({self.max_model_len}) while chunked prefill is off: long prompts could never be scheduled. "
                "Raise max_num_batched_tokens or enable chunked prefill."
            )
        return self


class CacheConfig(_FrozenConfig):
    """The paged KV cache: block geometry, pool size and prefix caching.

    ``num_blocks`` may be left unset when the worker sizes the pool from a
    memory budget; the scheduler needs it set.
    """

    block_size: int = Field(16, ge=1, description="Tokens per KV cache block.")
    num_blocks: int | None = Field(
        None, ge=2, description="Blocks in the pool, including the null block; None: sized from memory."
    )
    enable_prefix_caching: bool = Field(True, description="Reuse the KV blocks of a prompt prefix seen before.")
    prefix_caching_hash_algo: Literal["sha256", "blake2b"] = Field(
        "sha256", description="Hash chaining the prefix cache's block keys."
    )
    kv_cache_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="Element type of the KV cache; auto: the model's dtype. Under a float32 model (a GGUF file's "
        "default) bfloat16 or float16 halve the cache's bytes, which every decode step reads (llama.cpp keeps "
        "f16 K and V by default); the torch attention backend only.",
    )
    kv_cache_memory_bytes: int | None = Field(None, ge=1, description="Exact KV budget; overrides the fractions.")
    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0, description="GPU: share of device memory to use.")
    cpu_kv_cache_fraction: float = Field(0.25, gt=0.0, le=0.9, description="CPU: share of free RAM for KV.")


class ModelConfig(_FrozenConfig):
    """Which checkpoint to serve and how to run it."""

    model: str = Field(..., description="A local Hugging Face checkpoint directory or a .gguf file.")
    tokenizer: str | None = Field(
        None, description="Tokenizer directory (or .gguf file); defaults to the model's (a .gguf file's embedded one)."
    )
    generation_config: str = Field(
        "auto",
        description="Default sampling parameters of requests that leave them unset: auto: the model's "
        "generation_config.json (a .gguf file's general.sampling.* keys); vllm: none (vLLM's own defaults); "
        "or a directory holding a generation_config.json.",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weights and activations; auto: the checkpoint's dtype (float32 if it records none)."
    )
    quantization: Literal["gguf", "int8", "none"] | None = Field(
        None,
        description="How linear weights are stored and multiplied: gguf: as the .gguf file's blocks (Q8_0, Q4_0/1, "
        "Q5_0/1, Q4_K, Q5_K, Q6_K); int8: a float checkpoint's linears quantized to Q8_0 as they load (vLLM's "
        "W8A16 idea); none: every weight dequantized to dtype; None: gguf for a .gguf file of blocks, else none.",
    )
    chat_template: str | None = Field(None, description="A Jinja chat template, or its file, over the tokenizer's.")
    seed: int = Field(0, description="Seed of the sampler's random draws.")
    reasoning_parser: ReasoningParserName | None = Field(
        None, description="How the model marks its reasoning (<think>...</think>: engine/reasoning.py); None: none."
    )
    runner: Literal["auto", "generate", "pooling"] = Field(
        "auto",
        description="What the engine serves (vLLM's --runner): generate; pooling: embeddings (pooler_config); auto: "
        "both (every architecture served is a causal decoder, whose final hidden states pool).",
    )
    attention_backend: Literal["auto", "torch", "triton"] = Field(
        "auto", description="auto: triton on CUDA devices, torch (the reference) elsewhere."
    )
    enforce_eager: bool = Field(False, description="CUDA: run every step eagerly (never capture or replay graphs).")
    cuda_graph_batch_sizes: tuple[int, ...] | None = Field(
        None,
        description="CUDA: decode batch sizes to capture; None = 1, 2, 4, then every 8 up to max_num_seqs "
        "(at most 512). A decode step pads to the next captured size.",
    )

    @field_validator("cuda_graph_batch_sizes")
    @classmethod
    def _sorted_sizes(cls, sizes: tuple[int, ...] | None) -> tuple[int, ...] | None:
        if sizes is not None and (not sizes or min(sizes) < 1):
            raise ValueError("cuda_graph_batch_sizes needs at least one size, each >= 1")
        return None if sizes is None else tuple(sorted(set(sizes)))

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer or self.model


class PoolerConfig(_FrozenConfig):
    """Embeddings (vLLM's ``pooler_config``): how a pooling request's final hidden states become one vector."""

    pooling_type: Literal["LAST", "MEAN", "CLS"] = Field(
        "LAST", description="LAST: the last prompt token's final hidden state; MEAN: the prompt's mean; CLS: the first."
    )
    normalize: bool = Field(True, description="L2-normalize each vector unless its request says otherwise.")


class ParallelConfig(_FrozenConfig):
    tensor_parallel_size: int = Field(1, ge=1, description="Ranks each layer is split across.")
    pipeline_parallel_size: int = Field(1, ge=1, description="Stages the layers are split into.")
    distributed_executor_backend: Literal["uni", "ray"] | None = Field(
        None, description="uni: one in-process worker; ray: worker actors; None: uni for one device, else ray."
    )
    # The Ray executor's placement-group bundle per worker: this many CPUs, plus one GPU on CUDA.
    num_cpus_per_worker: float = Field(
        1.0,
        ge=0.0,
        description="CPUs each Ray worker reserves (on CPU devices also its torch threads unless num_threads is set).",
    )
    # A serve YAML's placement_group_config sets this (deployments.llm_config): its bundles are the workers'.
    worker_resources: list[dict[str, float]] | None = Field(
        None,
        description="Ray executor: each worker's resources (CPU, GPU, custom), in rank order; "
        "None: num_cpus_per_worker CPUs each, plus a GPU on CUDA.",
    )
    execute_timeout_s: float = Field(
        300.0, gt=0, description="Ray executor: a step taking longer means a hung worker; the engine fails."
    )
    # Compiled graph: shared-memory channels, the lowest per-step cost, but their readers spin while they
    # wait, which costs a core each (the driver for a whole step): right on GPU nodes, where each worker
    # has spare CPU. Tasks: the SchedulerOutput put once in the object store, one actor task per worker;
    # nothing spins, which matters when the workers' compute needs every core (CPU inference).
    ray_compiled_graph: bool | None = Field(
        None,
        description="Ray executor control path: compiled graph (True) or actor tasks (False); "
        "None: compiled graph when the workers use GPUs, tasks on CPUs.",
    )

    # vLLM's AsyncLLM runs its EngineCoreProc likewise: the server's event loop (intake, detokenization,
    # streaming) and the core's loop (schedule, forward, sample) then each have a GIL of their own.
    engine_core_process: bool = Field(
        True,
        description="Serving (AsyncLLM): the engine core (its loop, scheduler, executor) runs in another "
        "process: a child process, or with the Ray executor (TP/PP) a Ray actor beside the server. The offline "
        "LLM and KV transfer keep it in process.",
    )

    @model_validator(mode="after")
    def _one_resource_dict_per_worker(self) -> ParallelConfig:
        if self.worker_resources is not None and len(self.worker_resources) != self.world_size:
            raise ValueError(
                f"worker_resources has {len(self.worker_resources)} entries; the engine has {self.world_size} "
                "workers (tensor_parallel_size x pipeline_parallel_size), one each."
            )
        return self

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def executor_backend(self) -> str:
        """ "uni" for one device, "ray" for several unless the user chose."""
        return self.distributed_executor_backend or ("uni" if self.world_size == 1 else "ray")


class KVTransferConfig(_FrozenConfig):
    """Disaggregated prefill: this engine's role, and how its workers move KV blocks to the other side.

    ``object_store``: the prefill worker puts each block in Ray's object store and the decode
    worker gets the ones it lacks (any executor). ``ray_direct``: Ray Direct Transport, the decode
    side pulls the blocks it lacks straight from the prefill worker over ``tensor_transport``
    (gloo on CPU, nccl on GPU); both engines run Ray executor workers, and a pair of workers
    without a shared collective group falls back to the object store.
    """

    kv_role: Literal["kv_producer", "kv_consumer", "kv_both"]
    kv_connector: Literal["object_store", "ray_direct"] = "object_store"
    tensor_transport: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="ray_direct only: auto = nccl on GPU workers, gloo on CPU."
    )


class StructuredOutputsConfig(_FrozenConfig):
    """Structured outputs (vLLM's ``structured_outputs_config``): the grammar backend and JSON's whitespace."""

    backend: Literal["auto", "xgrammar"] = Field(
        "auto", description="Grammar backend; auto: xgrammar (the one built in)."
    )
    disable_any_whitespace: bool = Field(
        False,
        description="JSON constraints (schemas, json_object, tool calls) allow no whitespace between tokens; "
        "a request's structured_outputs.disable_any_whitespace overrides it.",
    )
    num_compile_threads: int = Field(
        1, ge=1, le=64, description="Threads compiling grammars beside the core's loop (never on the step's path)."
    )
    enable_in_reasoning: bool = Field(
        False, description="With a reasoning_parser: constraints apply to the reasoning too (not only after it)."
    )


class SpeculativeConfig(_FrozenConfig):
    """Speculative decoding (vLLM's ``speculative_config``): who proposes draft tokens, and how many.

    ``method`` is implied by ``model`` (``draft_model``) when not given. The draft checkpoint's
    vocabulary and context length are checked against the target's when the engine config is
    built (``EngineArgs.create_engine_config``), where both are known.
    """

    method: Literal["ngram", "draft_model"] | None = Field(
        None, description="ngram (prompt lookup, no model) or draft_model; None: draft_model when model is set."
    )
    model: str | None = Field(None, description="draft_model: the draft's local checkpoint directory.")
    num_speculative_tokens: int = Field(..., ge=1, le=32, description="Draft tokens proposed per request per step.")
    prompt_lookup_min: int = Field(1, ge=1, description="ngram: shortest suffix n-gram matched in the context.")
    prompt_lookup_max: int | None = Field(
        None, ge=1, description="ngram: longest suffix n-gram tried first; None: prompt_lookup_min."
    )
    disable_by_batch_size: int | None = Field(
        None, ge=2, description="Speculate only while fewer than this many requests run; None: always."
    )
    max_model_len: int | None = Field(
        None, ge=2, description="Drafts stop at this sequence length; None: the target's max_model_len."
    )

    @model_validator(mode="after")
    def _method_and_model_agree(self) -> SpeculativeConfig:
        if self.method is None:
            if self.model is None:
                raise ValueError("speculative_config needs a method ('ngram' or 'draft_model') or a draft model.")
            object.__setattr__(self, "method", "draft_model")
        if self.method == "draft_model" and self.model is None:
            raise ValueError("speculative_config.model is required for method 'draft_model'.")
        if self.method == "ngram" and self.model is not None:
            raise ValueError("speculative_config.model is set, but method 'ngram' uses no draft model.")
        if self.prompt_lookup_max is None:
            object.__setattr__(self, "prompt_lookup_max", self.prompt_lookup_min)
        if self.prompt_lookup_max < self.prompt_lookup_min:
            raise ValueError(
                f"speculative_config.prompt_lookup_max ({self.prompt_lookup_max}) is smaller than "
                f"prompt_lookup_min ({self.prompt_lookup_min})."
            )
        return self


class LoRAConfig(_FrozenConfig):
    """Multi-LoRA (vLLM's ``enable_lora``): PEFT adapters over the base model, mixed in one batch.

    ``max_loras`` adapters live in device slots; the scheduler runs at most that many distinct
    adapters at once (a request whose adapter has no slot waits). ``max_cpu_loras`` more are kept
    loaded in host memory, least recently used dropped first.
    """

    enable_lora: bool = Field(False, description="Serve PEFT LoRA adapters named by requests' lora_request.")
    max_loras: int = Field(1, ge=1, description="LoRA: adapters on the device at once (one step's batch at most).")
    max_lora_rank: int = Field(16, ge=1, le=512, description="LoRA: highest adapter rank accepted.")
    max_cpu_loras: int | None = Field(
        None, ge=1, description="LoRA: adapters kept loaded in host memory (LRU); None: max_loras."
    )

    @model_validator(mode="after")
    def _cpu_holds_the_slots(self) -> LoRAConfig:
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) is smaller than max_loras ({self.max_loras}).")
        return self

    @property
    def cpu_capacity(self) -> int:
        return self.max_cpu_loras or self.max_loras


class DeviceConfig(_FrozenConfig):
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: cuda when available, else cpu.")
    num_threads: int | None = Field(
        None,
        ge=1,
        description="torch intra-op threads on CPU; None: all cores, or the Serve replica's num_cpus (its front "
        "end shares them).",
    )
    core_niceness: int | None = Field(
        None,
        ge=-20,
        le=19,
        description="Niceness of a serving engine-core child process (all its threads); None: inherited (in a "
        "Serve replica Ray's worker niceness, 15, as the replica's front end). Below the front end's, the core's "
        "forward goes first; with several replicas per node their front ends then starve (Serve's router stops "
        "hearing from them). Lowering it needs CAP_SYS_NICE; without, the core keeps its own.",
    )


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine needs, built once from EngineArgs (each part validated on its own).

    A plain dataclass: pydantic reserves the name ``model_config``.
    """

    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    device_config: DeviceConfig
    kv_transfer_config: KVTransferConfig | None = None  # disaggregated prefill only
    structured_outputs_config: StructuredOutputsConfig = StructuredOutputsConfig()
    speculative_config: SpeculativeConfig | None = None  # speculative decoding only
    lora_config: LoRAConfig = LoRAConfig()  # multi-LoRA; off by default
    pooler_config: PoolerConfig = PoolerConfig()  # embeddings (runner auto or pooling)
