"""One request and the state the engine core keeps for it.

A ``Request`` is owned by the scheduler: only the scheduler and the KV cache
manager mutate it. Workers never see it; they get plain data in
``SchedulerOutput``.
"""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING, Protocol

from engine.sampling_params import RequestKind, SamplingParams

if TYPE_CHECKING:
    from engine.lora_request import LoRARequest
    from engine.pooling_params import PoolingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Everything from here on is finished; keep FINISHED_* last.
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6  # the core could not serve it (its grammar did not compile); stop_reason says why

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status >= RequestStatus.FINISHED_STOPPED


# The OpenAI finish_reason of each finished status.
FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Grammar(Protocol):
    """A structured-output request's grammar as the scheduler drives it (``engine.structured_output``)."""

    def accept_token(self, token_id: int) -> bool:
        """Advances past ``token_id``; False, changing nothing, if the grammar does not allow it."""

    def is_terminated(self) -> bool:
        """The grammar is complete and has accepted its stop token: the request is finished."""


def check_prompt_not_empty(num_prompt_tokens: int) -> None:
    """Raises ValueError for a prompt of no tokens (the one place this rule and its message live)."""
    if num_prompt_tokens == 0:
        raise ValueError("The prompt is empty; at least one token is required.")


def check_prompt_fits(num_prompt_tokens: int, max_model_len: int) -> None:
    """Raises ValueError unless at least one token fits after the prompt."""
    if num_prompt_tokens >= max_model_len:
        raise ValueError(
            f"The prompt has {num_prompt_tokens} tokens, but max_model_len is {max_model_len}: "
            "at least one token must fit after the prompt."
        )


class Request:
    """A prompt, the tokens generated for it so far, and its scheduling state.

    ``num_computed_tokens`` counts the tokens whose KV is in the cache (or is
    being written by the step just scheduled). ``all_token_ids`` is the prompt
    followed by the output; ``block_hashes`` holds the chained hash of every
    full block of ``all_token_ids`` computed so far (filled by the KV cache
    manager).

    ``kind``: a GENERATE request has ``sampling_params``; an EMBED request (``pooling_params`` given,
    ``sampling_params`` None) is a prefill that samples nothing and finishes with its pooled vector.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams | None,
        eos_token_id: int | None,
        priority: int = 0,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        kv_transfer_params: dict | None = None,
        lora_request: LoRARequest | None = None,
        pooling_params: PoolingParams | None = None,
    ) -> None:
        check_prompt_not_empty(len(prompt_token_ids))
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params, self.pooling_params = sampling_params, pooling_params
        self.kind = RequestKind.GENERATE if pooling_params is None else RequestKind.EMBED
        self.eos_token_id = eos_token_id
        self.priority = priority
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.cache_salt = cache_salt
        # Disaggregated prefill: {"do_remote_decode": True} on the prefill side, {"remote_kv": KVHandle} on
        # the decode side (see ``kv_connector``); the connector consumes the handle when it plans the load.
        self.kv_transfer_params = dict(kv_transfer_params) if kv_transfer_params else None
        # Multi-LoRA: the adapter this request runs with (None: the base model); its name keys the prefix cache.
        self.lora_request = lora_request

        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.num_computed_tokens = 0
        # Set by the scheduler from max_tokens and max_model_len when added (a pooling request samples none).
        self.max_tokens = 0 if sampling_params is None else sampling_params.max_tokens
        self.stop_reason: int | str | None = None
        self.block_hashes: list[bytes] = []
        self.num_cached_tokens = -1  # prefix-cache hit on first scheduling; -1 = not yet scheduled
        self.first_scheduled_time: float | None = None  # time.monotonic() when first admitted to run
        self.num_preemptions = 0
        # Structured outputs: set by the engine core once the grammar is compiled, before scheduling.
        self.grammar: Grammar | None = None
        # Speculative decoding: the draft tokens proposed after the last step, verified by the next one
        # that schedules this request (never part of all_token_ids until the target accepts them).
        self.spec_token_ids: list[int] = []

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def lora_int_id(self) -> int:
        """The adapter's id; 0 for the base model."""
        return 0 if self.lora_request is None else self.lora_request.lora_int_id

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def append_output_token_id(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def get_finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, prompt={self.num_prompt_tokens}, "
            f"output={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )


def lora_slot_blocked(request: Request, running: list[Request], max_loras: int) -> bool:
    """Multi-LoRA admission: True when ``request``'s adapter is not among the running requests' and
    those already hold ``max_loras`` distinct adapters (the device's slots), so it must wait.
    ``max_loras`` 0: LoRA is off, nothing is ever blocked."""
    if not max_loras or not request.lora_int_id:
        return False
    active = {r.lora_int_id for r in running if r.lora_int_id}
    return request.lora_int_id not in active and len(active) >= max_loras
