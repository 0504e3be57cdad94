"""Sampling a step in which requests verify draft tokens (speculative decoding), on the output rank.

Contract: request ``i`` of the step's sampled requests owns ``1 + num_draft_tokens[i]`` consecutive
logits rows (its drafts' positions, then the one after its last draft), grammar masks already
applied. ``DraftVerifier`` builds one sampler row per logits row, each seeing the request's outputs
plus the drafts before its position (so penalties, bad words and min_tokens hold at every
position), and hands them to the ``RejectionSampler``: greedy requests keep exactly the target's
argmax, sampled ones follow the target's distribution (lossless). It returns, per request, the
accepted drafts and one more token, and their logprobs where asked. It changes no state.
"""

from __future__ import annotations

import torch

from engine.sample import SamplingMetadata
from engine.sample.rejection_sampler import RejectionSampler
from engine.sched.step_outputs import LogprobsLists
from engine.worker.request_state import CachedRequestState


class DraftVerifier:
    def __init__(self, vocab_size: int, eos_token_ids: list[int], device: torch.device) -> None:
        self.vocab_size, self.eos_token_ids, self.device = vocab_size, eos_token_ids, device
        self.rejection_sampler = RejectionSampler()

    def __call__(
        self, states: list[CachedRequestState], num_draft_tokens: list[int], logits: torch.Tensor
    ) -> tuple[list[list[int]], dict[str, LogprobsLists] | None]:
        """(tokens per state: accepted drafts + one; logprobs of the states that asked, by request id)."""
        rows = []
        for state, num_drafts in zip(states, num_draft_tokens):
            outputs, drafts = state.output_token_ids, state.spec_token_ids
            params = state.sampling_params
            for position in range(num_drafts + 1):
                rows.append((params, state.prompt_token_ids, outputs + drafts[:position], state.generator))
        metadata = SamplingMetadata.from_requests(
            rows,
            self.vocab_size,
            self.eos_token_ids,
            device=self.device,
            bad_words_token_ids=[row[0].bad_words_token_ids for row in rows],
        )
        drafts = [state.spec_token_ids[:num] for state, num in zip(states, num_draft_tokens)]
        num_logprobs = [state.sampling_params.logprobs for state in states]
        output = self.rejection_sampler(logits, num_draft_tokens, drafts, None, metadata, num_logprobs)
        if output.logprobs is None:
            return output.token_ids, None
        logprobs = {s.req_id: row for s, row in zip(states, output.logprobs) if row is not None}
        return output.token_ids, logprobs
