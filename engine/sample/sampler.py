"""The sampler: one token per request row from the step's logits (vLLM V1 order).

1. raw logprobs (if any row asked for logprobs) from the unprocessed logits;
2. allowed_token_ids, bad words, min_tokens, logit_bias;
3. presence / frequency / repetition penalties;
4. greedy rows: argmax of the processed logits;
5. random rows: temperature, min-p, top-k, top-p, one seeded draw.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.kernels.cpu import load_cpu_kernels
from engine.sample.filters import apply_min_p, apply_temperature, apply_top_k_top_p, random_sample
from engine.sample.logprobs import compute_logprobs, gather_logprobs
from engine.sample.masks import apply_all_masks
from engine.sample.metadata import SamplingMetadata
from engine.sample.penalties import apply_penalties
from engine.sched.step_outputs import LogprobsLists


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax of [n, V] logits (first maximal index; NaN counts as the maximum, as in torch).

    On CPU the native op: torch's CPU argmax is slow enough to be a noticeable slice of a small model's
    decode step.
    """
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2:
        kernels = load_cpu_kernels()
        if kernels is not None:
            return kernels.argmax_rows(logits)
    return logits.argmax(dim=-1)


@dataclass
class SamplerOutput:
    """``sampled_token_ids[i]`` is row ``i``'s token.

    With logprobs requested by any row (None otherwise):
    ``logprob_token_ids`` / ``logprobs`` are ``[num_reqs, N + 1]`` with
    ``N = metadata.max_num_logprobs``; column 0 is the sampled token, columns
    1..N the top-N raw-logit tokens, so a row that asked for ``k < N`` keeps
    columns ``0..k``. ``sampled_token_ranks[i]`` is the sampled token's
    1-based rank under the raw logits.
    """

    sampled_token_ids: torch.Tensor  # [num_reqs] int64
    logprob_token_ids: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    sampled_token_ranks: torch.Tensor | None = None

    def logprobs_lists(self, num_logprobs: Sequence[int | None]) -> list[LogprobsLists | None]:
        """Row ``i``'s logprobs as plain lists, cut to the ``num_logprobs[i]`` it asked for
        (``SamplingParams.logprobs``, -1 = all); None for a row that asked for none, or all rows
        when no row did."""
        if self.logprobs is None:
            return [None] * len(num_logprobs)
        ids, values, ranks = self.logprob_token_ids.tolist(), self.logprobs.tolist(), self.sampled_token_ranks.tolist()
        lists: list[LogprobsLists | None] = []
        for row, num in enumerate(num_logprobs):
            if num is None:
                lists.append(None)
                continue
            width = len(ids[row]) if num == -1 else num + 1
            lists.append(LogprobsLists([ids[row][:width]], [values[row][:width]], [ranks[row]]))
        return lists


class Sampler(torch.nn.Module):
    """Stateless; all per-request state (including generators) is in the metadata."""

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """Samples from ``logits`` ``[num_reqs, vocab]``; never modifies the caller's tensor."""
        if metadata.is_argmax_only:
            return SamplerOutput(sampled_token_ids=argmax(logits))
        raw_logprobs = None if metadata.max_num_logprobs is None else compute_logprobs(logits)
        logits = logits.to(torch.float32, copy=True)
        apply_all_masks(logits, metadata)
        apply_penalties(logits, metadata)
        sampled = self.sample(logits, metadata)
        if raw_logprobs is None:
            return SamplerOutput(sampled_token_ids=sampled)
        tensors = gather_logprobs(raw_logprobs, sampled, metadata.max_num_logprobs)
        return SamplerOutput(
            sampled_token_ids=sampled,
            logprob_token_ids=tensors.token_ids,
            logprobs=tensors.logprobs,
            sampled_token_ranks=tensors.ranks,
        )

    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Greedy rows take the argmax; random rows are filtered and drawn. Edits ``logits``."""
        greedy = None if metadata.all_random else argmax(logits)
        if metadata.all_greedy:
            return greedy
        apply_temperature(logits, metadata.temperature)
        if metadata.min_p is not None:
            apply_min_p(logits, metadata.min_p)
        apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)
        sampled = random_sample(logits.softmax(dim=-1), metadata.generators)
        if greedy is None:
            return sampled
        return torch.where(metadata.is_greedy_row, greedy, sampled)
