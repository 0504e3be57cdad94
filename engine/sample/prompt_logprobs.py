"""Prompt logprobs, chunk by chunk: each prompt token's logprob given the tokens before it.

A prompt may be computed over several steps (chunked prefill) and, after a
preemption, again from position 0; :class:`PromptLogprobs` remembers how far
each request's logprobs went out, so every position is reported exactly once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.sample.logprobs import compute_prompt_logprobs
from engine.sched.step_outputs import LogprobsLists


@dataclass(frozen=True)
class PromptChunk:
    """Positions ``start .. end - 1`` of one request, computed this step at hidden rows ``row`` onward."""

    req_id: str
    prompt_token_ids: Sequence[int]
    num_logprobs: int  # SamplingParams.prompt_logprobs (-1 = whole vocabulary)
    start: int
    end: int
    row: int


class PromptLogprobs:
    """Turns each step's hidden states at prompt positions into the logprobs not sent yet."""

    def __init__(self) -> None:
        # Prompt positions whose logprobs went out, per request; kept across a preemption (the
        # recompute would otherwise send them again) until ``forget``.
        self._num_sent: dict[str, int] = {}

    def forget(self, req_id: str) -> None:
        """The request finished: nothing more will be asked for it."""
        self._num_sent.pop(req_id, None)

    def compute(
        self,
        chunks: Sequence[PromptChunk],
        hidden: torch.Tensor,
        compute_logits: Callable[[torch.Tensor], torch.Tensor],
        is_output_rank: bool,
    ) -> dict[str, LogprobsLists] | None:
        """Logprobs for the chunks' prompt positions not sent yet; None when there are none.

        ``compute_logits`` runs on every chunk with positions to report (with
        tp_size > 1 a collective: every rank of the last stage calls this the
        same way); only ``is_output_rank`` gets results, the others None.
        """
        result = {}
        for chunk in chunks:
            # After a preemption the prompt is recomputed from position 0: skip what was sent.
            start = max(chunk.start, self._num_sent.get(chunk.req_id, 0))
            # Positions start..last predict prompt tokens start+1..last+1 (the last prompt
            # position predicts the first output token, which is not a prompt logprob).
            last = min(chunk.end, len(chunk.prompt_token_ids) - 1) - 1
            if start > last:
                continue
            offset = chunk.row + start - chunk.start
            logits = compute_logits(hidden[offset : offset + last - start + 1])
            self._num_sent[chunk.req_id] = last + 1
            if not is_output_rank:
                continue
            next_ids = torch.tensor(chunk.prompt_token_ids[start + 1 : last + 2], device=hidden.device)
            tensors = compute_prompt_logprobs(logits, next_ids, chunk.num_logprobs)
            result[chunk.req_id] = LogprobsLists(
                tensors.token_ids.tolist(), tensors.logprobs.tolist(), tensors.ranks.tolist()
            )
        return result or None
