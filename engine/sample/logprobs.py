"""Logprobs of sampled / actual tokens plus the top-N alternatives.

Logprobs are computed from the *raw* model logits (``log_softmax`` before any
mask, penalty, temperature or filter), vLLM V1's default ``raw_logprobs``.
Layout of every result: column 0 is the chosen token (sampled, or the actual
next prompt token), columns 1..N the top-N tokens by logprob, descending.
Ranks are 1-based: ``1 + #tokens with a strictly larger logprob``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class LogprobsTensors(NamedTuple):
    token_ids: torch.Tensor  # [num_rows, N + 1] int64
    logprobs: torch.Tensor  # [num_rows, N + 1] float32
    ranks: torch.Tensor  # [num_rows] int64, rank of column 0


def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """``log_softmax`` over the vocab, in float32."""
    return logits.float().log_softmax(dim=-1)


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int) -> LogprobsTensors:
    """Column 0: ``token_ids`` and their logprobs and ranks; columns 1..N: the top-``num_logprobs``."""
    token_ids = token_ids.to(torch.int64).unsqueeze(1)
    token_logprobs = logprobs.gather(1, token_ids)
    ranks = (logprobs > token_logprobs).sum(dim=-1) + 1
    if num_logprobs > 0:
        top_logprobs, top_ids = logprobs.topk(num_logprobs, dim=-1)
        token_ids = torch.cat([token_ids, top_ids], dim=1)
        token_logprobs = torch.cat([token_logprobs, top_logprobs], dim=1)
    return LogprobsTensors(token_ids, token_logprobs, ranks)


def compute_prompt_logprobs(logits: torch.Tensor, next_token_ids: torch.Tensor, num_logprobs: int) -> LogprobsTensors:
    """Prompt logprobs for one chunk of one request's prompt positions.

    ``logits[j]`` is the model output at prompt position ``p + j`` and
    ``next_token_ids[j]`` the actual prompt token at ``p + j + 1`` (so a chunk
    covering the prompt's last position passes one row fewer: that position
    predicts the first output token). ``num_logprobs`` is
    ``SamplingParams.prompt_logprobs`` (-1 = whole vocabulary). Call once per
    chunked-prefill step and concatenate the rows.
    """
    num_logprobs = logits.shape[1] if num_logprobs == -1 else min(num_logprobs, logits.shape[1])
    return gather_logprobs(compute_logprobs(logits), next_token_ids, num_logprobs)
