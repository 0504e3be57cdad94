"""``POST /v1/embeddings``'s request and response models (OpenAI's, with vLLM's extras).

``input`` is one text, a list of texts, one token-id list or a list of them (at most
``MAX_EMBEDDING_INPUTS``, OpenAI's cap); each becomes one pooling request. ``encoding_format`` "float"
returns each vector as a JSON list; "base64" as the base64 of its float32 little-endian bytes (what the
``openai`` client asks for by default and decodes). ``dimensions`` cuts each vector (only for a model
trained for it: the engine refuses it otherwise, 400). vLLM's extras: ``normalize`` turns L2 normalization
off or on per request; ``truncate_prompt_tokens`` keeps only each input's last k tokens (-1: the last
``max_model_len``) where a longer input would be a 400.
"""

from __future__ import annotations

import base64
import struct
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator

from engine.entrypoints.openai.protocol import PromptInput, check_prompt_input, prompt_batch
from engine.entrypoints.openai.protocol_base import OpenAIBaseModel
from engine.entrypoints.openai.responses import unix_time

MAX_EMBEDDING_INPUTS = 2048  # OpenAI's cap on the inputs of one request


class EmbeddingRequest(OpenAIBaseModel):
    """``POST /v1/embeddings``."""

    model: str | None = None
    input: PromptInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None
    # vLLM's extras
    add_special_tokens: bool = True
    normalize: bool | None = None  # None: the engine's pooler_config.normalize
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    priority: int = 0

    @field_validator("input", mode="before")
    @classmethod
    def _check_input_shape(cls, value: Any) -> Any:
        value = check_prompt_input(value, "input")
        is_batch = isinstance(value, list) and value and not isinstance(value[0], int)
        if is_batch and len(value) > MAX_EMBEDDING_INPUTS:
            raise ValueError(f"input holds {len(value)} inputs; at most {MAX_EMBEDDING_INPUTS} are allowed.")
        return value

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _check_truncation(cls, value: int | None) -> int | None:
        if value == 0:
            raise ValueError("truncate_prompt_tokens must be -1 (max_model_len) or a positive number of tokens.")
        return value

    def inputs(self) -> list[str] | list[list[int]]:
        """The batch: a list of texts or of token-id lists (one element for a single input)."""
        return prompt_batch(self.input, "input")


class EmbeddingData(BaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str  # a str: encoding_format "base64"

    @classmethod
    def of(cls, index: int, vector: list[float], encoding_format: str) -> EmbeddingData:
        if encoding_format == "base64":
            return cls(index=index, embedding=base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode())
        return cls(index=index, embedding=vector)


class EmbeddingUsage(BaseModel):
    """OpenAI's embeddings usage: no completion tokens."""

    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=unix_time)
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage
