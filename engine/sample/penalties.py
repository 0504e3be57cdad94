"""Presence, frequency and repetition penalties (vLLM semantics).

* repetition penalty ``r``: for every token seen in the prompt *or* the output,
  a positive logit is divided by ``r`` and a non-positive one multiplied by ``r``;
* frequency penalty ``f``: ``logit -= f * count`` (count in the output only);
* presence penalty ``p``: ``logit -= p`` if the token occurs in the output.
"""

from __future__ import annotations

import torch

from engine.sample.metadata import SamplingMetadata


def token_bin_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Per-row occurrence counts ``[num_reqs, vocab]`` of ``token_ids`` padded with ``vocab_size``."""
    counts = torch.zeros((token_ids.shape[0], vocab_size + 1), dtype=torch.int64, device=token_ids.device)
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids))
    return counts[:, :vocab_size]


def pad_output_token_ids(output_token_ids: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """Output ids as ``[num_reqs, max_len]`` int64 padded with ``vocab_size``."""
    max_len = max((len(ids) for ids in output_token_ids), default=0)
    padded = torch.full((len(output_token_ids), max_len), vocab_size, dtype=torch.int64)
    for row, ids in enumerate(output_token_ids):
        if ids:
            padded[row, : len(ids)] = torch.as_tensor(ids, dtype=torch.int64)
    return padded.to(device)


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Applies the three penalties to ``logits`` in place; no-op without penalties."""
    if meta.is_no_penalties:
        return logits
    vocab_size = logits.shape[1]
    output_ids = pad_output_token_ids(meta.output_token_ids, vocab_size, logits.device)
    output_counts = token_bin_counts(output_ids, vocab_size)
    is_in_output = output_counts > 0
    is_in_prompt = token_bin_counts(meta.prompt_token_ids, vocab_size) > 0
    factors = torch.where(is_in_prompt | is_in_output, meta.repetition_penalties.unsqueeze(1), 1.0)
    logits.copy_(torch.where(logits > 0, logits / factors, logits * factors))
    logits -= meta.frequency_penalties.unsqueeze(1) * output_counts.to(logits.dtype)
    logits -= meta.presence_penalties.unsqueeze(1) * is_in_output.to(logits.dtype)
    return logits
