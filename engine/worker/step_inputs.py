"""One step's flattened batch: token ids, positions, slot mapping and block tables as tensors.

``build_step_inputs`` only reads the persistent request state; it changes
nothing (``InputBatch.advance`` is where ``num_computed_tokens`` moves), so the
same state can be flattened twice in one step, as a failed KV load's recompute
does before the step's own forward.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

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


@dataclass(slots=True)
class _FlatBatch:
    """The step's batch as Python lists, request after request, before any tensor is made."""

    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    query_lens: list[int] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)  # each request's block-table row
    starts: list[int] = field(default_factory=list)
    token_offsets: list[int] = field(default_factory=lambda: [0])
    sampled_req_ids: list[str] = field(default_factory=list)
    sample_indices: list[int] = field(default_factory=list)


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
    flat = _flatten(requests, req_ids, num_scheduled_tokens, starts)
    positions, metadata = _position_tensors(block_table, flat, block_size, device)
    return StepInputs(
        req_ids=req_ids,
        input_ids=torch.tensor(flat.input_ids, dtype=torch.long, device=device),
        positions=positions,
        attn_metadata=metadata,
        sampled_req_ids=flat.sampled_req_ids,
        sample_indices=torch.tensor(flat.sample_indices, dtype=torch.long, device=device),
        token_offsets=flat.token_offsets,
        starts=flat.starts,
        query_lens=flat.query_lens,
    )


def _flatten(
    requests: Mapping[str, CachedRequestState],
    req_ids: list[str],
    num_scheduled_tokens: Mapping[str, int],
    starts: Mapping[str, int] | None,
) -> _FlatBatch:
    """Each request's scheduled tokens and positions, one after another; the ones that get a token."""
    flat = _FlatBatch()
    # Locals: this loop runs once per scheduled request per step.
    input_ids, positions, query_lens, seq_lens = flat.input_ids, flat.positions, flat.query_lens, flat.seq_lens
    slots, first_positions, token_offsets = flat.slots, flat.starts, flat.token_offsets
    sampled_req_ids, sample_indices = flat.sampled_req_ids, flat.sample_indices
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
    return flat


def _position_tensors(
    block_table: BlockTable, flat: _FlatBatch, block_size: int, device: torch.device
) -> tuple[torch.Tensor, AttentionMetadata]:
    """(positions, attention metadata): the batch's block tables and each token's KV slot."""
    slots, positions, query_lens, seq_lens = flat.slots, flat.positions, flat.query_lens, flat.seq_lens
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
        num_actual_tokens=len(flat.input_ids),
        query_start_loc=torch.tensor(flat.token_offsets, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.from_numpy(block_tables).to(device),
        slot_mapping=torch.from_numpy(slot_mapping).to(device),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
    )
    return torch.from_numpy(positions_np).to(device), metadata
