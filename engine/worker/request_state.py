"""The model runner's persistent view of the requests it is running.

The scheduler sends a request's full data once (``NewRequestData``) and deltas
afterwards (``CachedRequestData``); this module keeps what those build up: the
token ids, the block table row, the sampling generator. Nothing here is
rebuilt per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from engine.lora_request import LoRARequest
from engine.pooling_params import PoolingParams
from engine.sampling_params import RequestKind, SamplingParams


@dataclass
class CachedRequestState:
    """One request as this worker holds it; a pooling request (``kind`` EMBED) has ``pooling_params`` and no
    ``sampling_params``."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams | None
    token_ids: list[int]  # prompt + outputs known to this worker
    num_computed_tokens: int
    slot: int  # row of the block table
    generator: torch.Generator | None = None
    # Speculative decoding: the drafts this step verifies, computed after token_ids' last token.
    spec_token_ids: list[int] = field(default_factory=list)
    lora_request: LoRARequest | None = None  # multi-LoRA: its adapter (None: the base model)
    pooling_params: PoolingParams | None = None
    num_prompt_tokens: int = field(init=False)
    kind: RequestKind = field(init=False)

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.kind = RequestKind.GENERATE if self.pooling_params is None else RequestKind.EMBED

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    def write_tokens(self, start: int, token_ids: list[int]) -> None:
        """Places ``token_ids`` at positions ``start...`` (idempotent for tokens already known)."""
        end = start + len(token_ids)
        if end > len(self.token_ids):
            del self.token_ids[start:]
            self.token_ids.extend(token_ids)
        else:
            self.token_ids[start:end] = token_ids


class BlockTable:
    """One row of block ids per request slot in each KV cache group, kept across steps and updated by deltas.

    ``table_np[g, slot, b]`` is the block of group ``g`` holding positions ``b * block_size ..`` of the request
    in ``slot``. Block ids come one list per group; a sliding group's blocks the scheduler has freed since
    keep their old ids here, never read (the attention reads only its window's blocks).
    """

    def __init__(self, max_num_reqs: int, max_num_blocks_per_req: int, num_groups: int = 1) -> None:
        self.table_np = np.zeros((num_groups, max_num_reqs, max_num_blocks_per_req), dtype=np.int32)
        self.table = torch.from_numpy(self.table_np)  # the same memory, as a tensor
        self.num_blocks = [0] * max_num_reqs  # per slot, alike in every group
        self._free_slots = list(range(max_num_reqs - 1, -1, -1))

    def add_request(self, block_ids: tuple[list[int], ...]) -> int:
        """Takes a free slot for a request; returns it."""
        if not self._free_slots:
            raise RuntimeError("More concurrent requests than max_num_seqs.")
        slot = self._free_slots.pop()
        self.num_blocks[slot] = 0
        self.append(slot, block_ids)
        return slot

    def append(self, slot: int, block_ids: tuple[list[int], ...]) -> None:
        """Appends each group's new blocks (every group gets as many)."""
        count = len(block_ids[0])
        if not count:
            return
        start = self.num_blocks[slot]
        for g, ids in enumerate(block_ids):
            self.table_np[g, slot, start : start + count] = ids
        self.num_blocks[slot] = start + count

    def remove_request(self, slot: int) -> None:
        self._free_slots.append(slot)
