"""Plain data that crosses the boundary between the engine core and workers.

Everything here is a dataclass of builtins so it pickles cheaply across
processes and Ray actors. The scheduler only hands out token counts and block
ids; the model runner builds tensors from them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.sampling_params import SamplingParams
from engine.sched.kv_transfer import KVConnectorMetadata, KVTransferOutput

if TYPE_CHECKING:
    from engine.lora_request import LoRARequest
    from engine.pooling_params import PoolingParams
    from engine.sched.request import Request


@dataclass
class NewRequestData:
    """A request the workers have not seen (or dropped when it was preempted)."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # non-empty only for a request resumed after preemption
    sampling_params: SamplingParams | None
    block_ids: tuple[list[int], ...]  # one list per KV cache group (engine.sched.kv_cache_groups)
    num_computed_tokens: int  # tokens whose KV is already cached (prefix-cache hit), before this step
    lora_request: LoRARequest | None = None  # multi-LoRA: the request's adapter (None: the base model)
    pooling_params: PoolingParams | None = None  # a pooling request's (its sampling_params are None)


@dataclass
class CachedRequestData:
    """Deltas for requests the workers already hold, one list entry per request."""

    req_ids: list[str] = field(default_factory=list)
    # The tokens this step computes, at positions num_computed_tokens[i] onward (draft tokens aside:
    # those are in SchedulerOutput.scheduled_spec_decode_tokens). Workers write them into their copy
    # of the sequence (which lacks the tokens sampled since the last step).
    new_token_ids: list[list[int]] = field(default_factory=list)
    new_block_ids: list[tuple[list[int], ...]] = field(default_factory=list)  # per request, one list per group
    num_computed_tokens: list[int] = field(default_factory=list)  # before this step

    def __len__(self) -> int:
        return len(self.req_ids)


@dataclass
class SchedulerOutput:
    """One step's schedule: how many tokens each request computes, and the deltas workers need."""

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests the workers must drop before this step: preempted here, or finished since the last step.
    preempted_req_ids: set[str]
    finished_req_ids: set[str]
    kv_connector_metadata: KVConnectorMetadata | None = None  # only with KV transfer configured
    # Structured outputs: the requests sampled this step under a grammar, and the tokens each may
    # sample: ``grammar_bitmask[i]`` (a CPU int32 tensor [len(ids), ceil(vocab / 32)], bit b of word w
    # allowing token 32 * w + b) is ``structured_output_req_ids[i]``'s. Built by the engine core.
    structured_output_req_ids: list[str] = field(default_factory=list)
    grammar_bitmask: Any = None
    # Speculative decoding: the draft tokens each request verifies this step. They are its last
    # len(drafts) scheduled tokens (after those in the deltas) and it is sampled at each of them:
    # 1 + len(drafts) logits rows, whose grammar bitmask rows (if any) follow one another likewise.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class LogprobsLists:
    """Top logprobs for some positions: row i holds (token ids, logprobs, rank of the first id)."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]


@dataclass
class ModelRunnerOutput:
    """What one step of the model produced, for the requests of a SchedulerOutput.

    ``sampled_token_ids[i]`` belongs to ``req_ids[i]``; it is empty for a
    request whose prefill chunk did not reach the end of its prompt. With
    speculative decoding it holds the accepted draft tokens and one more (the
    target's own), and ``draft_token_ids`` the drafts proposed for the next step.
    ``pooler_output`` holds the vector of each pooling request whose prompt this step completed.
    """

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    logprobs: dict[str, LogprobsLists] | None = None
    prompt_logprobs: dict[str, LogprobsLists] | None = None
    kv_transfer_output: KVTransferOutput | None = None
    draft_token_ids: dict[str, list[int]] | None = None
    lora_counts: LoRAWorkerCounts | None = None  # with enable_lora
    pooler_output: dict[str, list[float]] | None = None


@dataclass(frozen=True)
class LoRAWorkerCounts:
    """The output rank's multi-LoRA counts since start: adapters swapped into a device slot, and adapters a
    step read from disk itself (the host LRU had dropped them; normally they load off the step's path)."""

    num_slot_swaps: int = 0
    num_step_loads: int = 0


@dataclass(slots=True)
class EngineCoreOutput:
    """What one request got from one step: new tokens, and whether it finished."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length" or "abort" once finished
    stop_reason: int | str | None = None
    new_logprobs: LogprobsLists | None = None
    new_prompt_logprobs: LogprobsLists | None = None
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None  # time.monotonic() when the request was first admitted to run
    kv_transfer_params: dict | None = None  # a prefill engine's finished request: where its KV went
    pooling_output: list[float] | None = None  # a pooling request's vector (it finishes with it)

    @classmethod
    def of(
        cls,
        request: Request,
        new_token_ids: list[int],
        new_logprobs: LogprobsLists | None = None,
        new_prompt_logprobs: LogprobsLists | None = None,
        pooling_output: list[float] | None = None,
    ) -> EngineCoreOutput:
        """What ``request`` got from a step, its state (finish, cached tokens, first scheduling) as it is now."""
        return cls(
            request.request_id,
            new_token_ids,
            request.get_finish_reason(),
            request.stop_reason,
            new_logprobs,
            new_prompt_logprobs,
            request.num_cached_tokens,
            request.first_scheduled_time,
            pooling_output=pooling_output,
        )

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def __reduce__(self):
        # One per running request per step crosses to the front end's process: pickled as the class and
        # its fields in order, much faster both ways than a slots dataclass's default.
        return EngineCoreOutput, (
            self.request_id,
            self.new_token_ids,
            self.finish_reason,
            self.stop_reason,
            self.new_logprobs,
            self.new_prompt_logprobs,
            self.num_cached_tokens,
            self.first_scheduled_time,
            self.kv_transfer_params,
            self.pooling_output,
        )
