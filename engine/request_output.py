"""What users get back, with vLLM's class and field names."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One position: token id -> its logprob (the chosen token plus the top-N).
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)
    kv_transfer_params: dict | None = None  # disaggregated prefill: where a prefill engine put the prompt's KV


@dataclass
class EmbeddingOutput:
    """One pooling request's vector (vLLM's ``EmbeddingOutput``): float32 values, ``dimensions`` of them when
    the request cut it, L2-normalized unless it (or ``pooler_config``) said not to."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """What ``LLM.embed`` returns and ``AsyncLLM.encode`` yields (vLLM's names): one per prompt, once it is done."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
