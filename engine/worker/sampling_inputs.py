"""What the logits stages of a step read from the model runner's request states.

Contract: pure readers. Given the runner's ``CachedRequestState``s (and, for
prompt logprobs, the step's ``StepInputs``) they build the plain inputs of the
sampling side: the ``SamplingMetadata`` for the sampled rows, in logits-row
order, and the ``PromptChunk``s of the requests that asked for prompt
logprobs, in batch order. They change neither the states nor the inputs;
the sampler and ``PromptLogprobs`` do the rest. ``SamplingMetadataCache`` keeps
the last step's metadata while the batch and its rows stay the same.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence

import torch

from engine.sample import SamplingMetadata
from engine.sample.metadata import reads_output_tokens
from engine.sample.prompt_logprobs import PromptChunk
from engine.worker.request_state import CachedRequestState
from engine.worker.step_inputs import StepInputs


def sampling_metadata(
    states: Sequence[CachedRequestState], vocab_size: int, eos_token_ids: list[int], device: torch.device
) -> SamplingMetadata:
    """The sampler's per-row parameters; row ``i`` is ``states[i]``'s."""
    return SamplingMetadata.from_requests(
        [(s.sampling_params, s.prompt_token_ids, s.output_token_ids, s.generator) for s in states],
        vocab_size,
        eos_token_ids,
        device=device,
        bad_words_token_ids=[s.sampling_params.bad_words_token_ids for s in states],
    )


def is_step_invariant(state: CachedRequestState) -> bool:
    """Whether the state's sampler row stays the same from step to step: it reads none of its
    output tokens (penalties, bad words) and is past ``min_tokens``. The rest of a row (params,
    generator) is fixed for the state's lifetime."""
    params = state.sampling_params
    num_output_tokens = len(state.token_ids) - state.num_prompt_tokens
    return num_output_tokens >= params.min_tokens and not reads_output_tokens(params, params.bad_words_token_ids)


class SamplingMetadataCache:
    """``sampling_metadata`` that hands the last step's metadata out again while it still holds.

    Contract: ``get(states)`` returns metadata equal to ``sampling_metadata(states, ...)``. The
    previous one is reused when ``states`` are the same objects, in the same order, and each was
    step-invariant (``is_step_invariant``) when it was built; a state, once past ``min_tokens``,
    stays so. The sampler only reads the metadata, so sharing it across steps is safe.
    """

    def __init__(self, vocab_size: int, eos_token_ids: list[int], device: torch.device) -> None:
        self.vocab_size, self.eos_token_ids, self.device = vocab_size, eos_token_ids, device
        self._states: list[CachedRequestState] = []  # holds them, so their ids cannot be reused
        self._metadata: SamplingMetadata | None = None

    def get(self, states: Sequence[CachedRequestState]) -> SamplingMetadata:
        """The sampler's rows for ``states`` (row ``i`` is ``states[i]``'s)."""
        cached = self._states
        if self._metadata is not None and len(states) == len(cached) and all(map(operator.is_, states, cached)):
            return self._metadata
        metadata = sampling_metadata(states, self.vocab_size, self.eos_token_ids, self.device)
        if all(map(is_step_invariant, states)):
            self._states, self._metadata = list(states), metadata
        else:
            self._states, self._metadata = [], None
        return metadata


def prompt_chunks(requests: Mapping[str, CachedRequestState], inputs: StepInputs) -> list[PromptChunk]:
    """The batch's prompt positions of requests that asked for prompt logprobs."""
    chunks = []
    for req_id, start, num_tokens, row in zip(inputs.req_ids, inputs.starts, inputs.query_lens, inputs.token_offsets):
        state = requests[req_id]
        num_logprobs = None if state.sampling_params is None else state.sampling_params.prompt_logprobs
        if num_logprobs is not None:
            chunks.append(PromptChunk(req_id, state.prompt_token_ids, num_logprobs, start, start + num_tokens, row))
    return chunks
