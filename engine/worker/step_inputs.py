"""One step's flattened batch: token ids, positions, slot mapping and block tables as tensors.

``build_step_inputs`` only reads the persistent request state; it changes
nothing (``InputBatch.advance`` is where ``num_computed_tokens`` moves), so the
same state can be flattened twice in one step, as a failed KV load's recompute
does before the step's own forward.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from engine.attention.metadata import AttentionMetadata
from engine.worker.request_state import BlockTable, CachedRequestState


@dataclass
class StepInputs:
    """One step's flattened batch; rows of ``sample_indices`` are where logits are read."""

    req_ids: list[str]
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    attn_metadata: AttentionMetadata
    sampled_req_ids: list[str]  # requests that get a token this step, in logits-row order
    sample_indices: torch.Tensor  # [num_sampled] index of each one's last token in the batch
    token_offsets: list[int]  # where each request's tokens start in the batch (len num_reqs + 1)
    starts: list[int]  # each request's first position in this batch (its num_computed_tokens before it)
    query_lens: list[int]  # tokens each request computes in this batch


def build_step_inputs(
    requests: Mapping[str, CachedRequestState],
    block_table: BlockTable,
    num_scheduled_tokens: Mapping[str, int],
    block_size: int,
    device: torch.device,
    starts: Mapping[str, int] | None = None,
) -> StepInputs:
    """Flattens ``num_scheduled_tokens[r]`` tokens of each request ``r`` into one batch.

    Request ``r``'s tokens start at ``starts[r]`` when given, else at its
    ``num_computed_tokens``. Reads the states; on return nothing has changed.
    """
    req_ids = list(num_scheduled_tokens)
    input_ids: list[int] = []
    positions: list[int] = []
    query_lens: list[int] = []
    seq_lens: list[int] = []
    slots: list[int] = []
    first_positions: list[int] = []
    token_offsets = [0]
    sampled_req_ids: list[str] = []
    sample_indices: list[int] = []
    for req_id in req_ids:
        state = requests[req_id]
        num_new = num_scheduled_tokens[req_id]
        start = state.num_computed_tokens if starts is None else starts[req_id]
        end = start + num_new
        input_ids.extend(state.token_ids[start:end])
        positions.extend(range(start, end))
        first_positions.append(start)
        query_lens.append(num_new)
        seq_lens.append(end)
        slots.append(state.slot)
        token_offsets.append(token_offsets[-1] + num_new)
        if end == len(state.token_ids):  # the prompt is done: this request gets a token
            sampled_req_ids.append(req_id)
            sample_indices.append(token_offsets[-1] - 1)
    positions_tensor, metadata = _position_tensors(
        block_table, slots, positions, query_lens, seq_lens, token_offsets, len(input_ids), block_size, device
    )
    return StepInputs(
        req_ids=req_ids,
        input_ids=torch.tensor(input_ids, dtype=torch.long, device=device),
        positions=positions_tensor,
        attn_metadata=metadata,
        sampled_req_ids=sampled_req_ids,
        sample_indices=torch.tensor(sample_indices, dtype=torch.long, device=device),
        token_offsets=token_offsets,
        starts=first_positions,
        query_lens=query_lens,
    )


def _position_tensors(
    block_table: BlockTable,
    slots: list[int],
    positions: list[int],
    query_lens: list[int],
    seq_lens: list[int],
    token_offsets: list[int],
    num_tokens: int,
    block_size: int,
    device: torch.device,
) -> tuple[torch.Tensor, AttentionMetadata]:
    """(positions, attention metadata): the batch's block tables and each token's KV slot."""
    # numpy for the index arithmetic: a few microseconds per op instead of torch's tens, and the
    # tensors below share its memory (no copies on CPU).
    positions_np = np.array(positions, dtype=np.int64)
    slots_np = np.array(slots, dtype=np.int64)
    max_num_blocks = -(-max(seq_lens) // block_size)
    block_tables = block_table.table.numpy()[slots_np, :max_num_blocks]  # [num_reqs, max_num_blocks]
    # Each token's KV slot: its request's block for that position, offset within the block.
    token_rows = np.repeat(np.arange(len(slots)), query_lens)  # [num_tokens]
    token_blocks = block_tables[token_rows, positions_np // block_size].astype(np.int64)
    slot_mapping = token_blocks * block_size + positions_np % block_size
    metadata = AttentionMetadata(
        num_actual_tokens=num_tokens,
        query_start_loc=torch.tensor(token_offsets, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.from_numpy(block_tables).to(device),
        slot_mapping=torch.from_numpy(slot_mapping).to(device),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
    )
    return torch.from_numpy(positions_np).to(device), metadata
