"""Engine configuration: one frozen, validated model per concern.

Every config rejects unknown keys (``extra="forbid"``) so a typo in a YAML
file is an error at deploy time instead of a silently ignored setting. The
YAML keys a user writes map 1:1 to these field names.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _FrozenConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)


class SchedulerConfig(_FrozenConfig):
    """How the scheduler spends each step's token budget."""

    max_num_batched_tokens: int = Field(2048, ge=1, description="Token budget of one step.")
    max_num_seqs: int = Field(256, ge=1, description="Most requests running at once.")
    max_model_len: int = Field(2048, ge=2, description="Longest sequence (prompt + output).")
    policy: Literal["fcfs", "priority"] = "fcfs"
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = Field(
        0, ge=0, description="Most tokens one request gets per step; 0 means no cap.")

    @model_validator(mode="after")
    def _budget_fits_a_prompt(self) -> "SchedulerConfig":
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than max_model_len "
                f"({self.max_model_len}) while chunked prefill is off: long prompts could never be scheduled. "
                "Raise max_num_batched_tokens or enable chunked prefill.")
        return self


class CacheConfig(_FrozenConfig):
    """The paged KV cache: block geometry, pool size and prefix caching.

    ``num_blocks`` may be left unset when the worker sizes the pool from a
    memory budget; the scheduler needs it set.
    """

    block_size: int = Field(16, ge=1)
    num_blocks: int | None = Field(None, ge=2, description="Blocks in the pool, including the null block.")
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: Literal["sha256", "blake2b"] = "sha256"
    kv_cache_memory_bytes: int | None = Field(None, ge=1)
    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0)
