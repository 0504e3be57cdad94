"""Structured outputs on the output rank: the step's grammar bitmask applied to the logits.

Runs before the sampler, so masked tokens are out of reach of every later stage: they get
``-inf``, a logprob of ``-inf``, and can be neither drawn nor the argmax. On CPU the native op
(``apply_token_bitmask``: whole 32-token words at a time, rows in parallel; xgrammar's own CPU
kernel, slower, was a noticeable share of a small model's step), on CUDA xgrammar's kernel,
elsewhere a vectorized torch fallback.
"""

from __future__ import annotations

import torch

from engine.kernels.cpu import load_cpu_kernels

_BIT_SHIFTS = torch.arange(32, dtype=torch.int32)


def apply_grammar_bitmask(
    logits: torch.Tensor, sampled_req_ids: list[str], bitmask_req_ids: list[str], bitmask: torch.Tensor
) -> None:
    """Sets to ``-inf``, in place, each grammar row's disallowed tokens; other rows are left as they are.

    ``logits`` ``[len(sampled_req_ids), vocab]``: row ``i`` is ``sampled_req_ids[i]``'s.
    ``bitmask`` ``[len(bitmask_req_ids), ceil(vocab / 32)]`` int32 on the CPU: row ``j`` is
    ``bitmask_req_ids[j]``'s, each of which is sampled this step.
    """
    row_of = {req_id: row for row, req_id in enumerate(sampled_req_ids)}
    apply_grammar_bitmask_rows(logits, [row_of[req_id] for req_id in bitmask_req_ids], bitmask)


def grammar_rows(sampled_req_ids: list[str], num_draft_tokens: list[int], bitmask_req_ids: list[str]) -> list[int]:
    """The logits row of each bitmask row when request ``i`` of ``sampled_req_ids`` owns ``1 + num_draft_tokens[i]``
    consecutive logits rows, and each of ``bitmask_req_ids`` as many consecutive bitmask rows (speculative decoding)."""
    first_row, row = {}, 0
    for req_id, num_drafts in zip(sampled_req_ids, num_draft_tokens):
        first_row[req_id] = (row, num_drafts + 1)
        row += num_drafts + 1
    rows = []
    for req_id in bitmask_req_ids:
        start, count = first_row[req_id]
        rows.extend(range(start, start + count))
    return rows


def apply_grammar_bitmask_rows(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """Like ``apply_grammar_bitmask``, with bitmask row ``j`` applied to logits row ``rows[j]``."""
    if logits.device.type == "cpu":
        kernels = load_cpu_kernels() if logits.dtype == torch.float32 and logits.stride(1) == 1 else None
        if kernels is not None:
            kernels.apply_token_bitmask(logits, bitmask, torch.tensor(rows, dtype=torch.int64))
        else:
            allowed = ((bitmask.unsqueeze(-1) >> _BIT_SHIFTS) & 1).view(len(rows), -1)[:, : logits.shape[1]]
            logits[rows] = logits[rows].masked_fill(allowed == 0, float("-inf"))
        return
    import xgrammar as xgr  # its CUDA kernel (imported here: it pulls in transformers)

    spread = torch.full((logits.shape[0], bitmask.shape[1]), -1, dtype=torch.int32)
    spread[rows] = bitmask
    xgr.apply_token_bitmask_inplace(logits, spread.to(logits.device, non_blocking=True), indices=rows)
