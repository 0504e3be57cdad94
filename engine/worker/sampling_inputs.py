"""What the logits stages of a step read from the model runner's request states.

Contract: pure readers. Given the runner's ``CachedRequestState``s (and, for
prompt logprobs, the step's ``StepInputs``) they build the plain inputs of the
sampling side: the ``SamplingMetadata`` for the sampled rows, in logits-row
order, and the ``PromptChunk``s of the requests that asked for prompt
logprobs, in batch order. They change neither the states nor the inputs;
the sampler and ``PromptLogprobs`` do the rest.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from engine.sample import SamplingMetadata
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


def prompt_chunks(requests: Mapping[str, CachedRequestState], inputs: StepInputs) -> list[PromptChunk]:
    """The batch's prompt positions of requests that asked for prompt logprobs."""
    chunks = []
    for req_id, start, num_tokens, row in zip(inputs.req_ids, inputs.starts, inputs.query_lens, inputs.token_offsets):
        state = requests[req_id]
        num_logprobs = state.sampling_params.prompt_logprobs
        if num_logprobs is not None:
            chunks.append(PromptChunk(req_id, state.prompt_token_ids, num_logprobs, start, start + num_tokens, row))
    return chunks
