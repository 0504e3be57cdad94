"""Structured outputs on the output rank: the step's grammar bitmask applied to the logits.

Runs before the sampler, so masked tokens are out of reach of every later stage: they get
``-inf``, a logprob of ``-inf``, and can be neither drawn nor the argmax.
"""

from __future__ import annotations

import torch


def apply_grammar_bitmask(
    logits: torch.Tensor, sampled_req_ids: list[str], bitmask_req_ids: list[str], bitmask: torch.Tensor
) -> None:
    """Sets to ``-inf``, in place, each grammar row's disallowed tokens; other rows are left as they are.

    ``logits`` ``[len(sampled_req_ids), vocab]``: row ``i`` is ``sampled_req_ids[i]``'s.
    ``bitmask`` ``[len(bitmask_req_ids), ceil(vocab / 32)]`` int32: row ``j`` is
    ``bitmask_req_ids[j]``'s, each of which is sampled this step.
    """
    import xgrammar as xgr  # here, not at the top: 1-2 s (transformers) at every engine start otherwise

    row_of = {req_id: row for row, req_id in enumerate(sampled_req_ids)}
    rows = [row_of[req_id] for req_id in bitmask_req_ids]
    if rows != list(range(len(sampled_req_ids))):  # the grammar rows are not every row in order: spread them
        spread = torch.full((logits.shape[0], bitmask.shape[1]), -1, dtype=torch.int32)
        spread[rows] = bitmask
        bitmask = spread
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True), indices=rows)
