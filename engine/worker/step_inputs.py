"""One step's flattened batch: token ids, positions, slot mapping and block tables as tensors.

``build_step_inputs`` only reads the persistent request state; it changes
nothing (``InputBatch.advance`` is where ``num_computed_tokens`` moves), so the
same state can be flattened twice in one step, as a failed KV load's recompute
does before the step's own forward.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from engine.attention.metadata import AttentionMetadata
from engine.sampling_params import RequestKind
from engine.worker.request_state import BlockTable, CachedRequestState


@dataclass
class StepInputs:
    """One step's flattened batch; rows of ``sample_indices`` are where logits are read (pooling requests'
    rows are pooled instead: ``engine.worker.pooler``)."""

    req_ids: list[str]
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    attn_metadata: AttentionMetadata
    sampled_req_ids: list[str]  # requests that get a token this step, in logits-row order
    # The batch rows logits are read at: each sampled request's last token, preceded by one row per
    # draft it verifies (speculative decoding), so request i owns 1 + num_draft_tokens[i] rows.
    sample_indices: torch.Tensor  # [num_sample_rows]
    num_draft_tokens: list[int]  # per sampled request; all 0 without speculation
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
    states = [requests[req_id] for req_id in req_ids]
    query_lens = [num_scheduled_tokens[req_id] for req_id in req_ids]
    first = [s.num_computed_tokens for s in states] if starts is None else [starts[r] for r in req_ids]
    input_ids = _gather_token_ids(states, first, query_lens)
    # numpy for the index arithmetic: a few microseconds per op instead of torch's tens, and the
    # tensors below share its memory (no copies on CPU).
    starts_np = np.array(first, dtype=np.int64)  # [num_reqs]
    query_lens_np = np.array(query_lens, dtype=np.int64)  # [num_reqs]
    seq_lens_np = starts_np + query_lens_np  # [num_reqs]
    offsets_np = np.zeros(len(req_ids) + 1, dtype=np.int64)  # [num_reqs + 1]
    np.cumsum(query_lens_np, out=offsets_np[1:])
    sampled_rows, sample_indices, num_drafts = _sample_rows(states, seq_lens_np, offsets_np)
    slots = np.array([s.slot for s in states])  # [num_reqs]: each request's block-table row
    max_verify_query_len = 1 + int(num_drafts.max()) if len(num_drafts) else 1
    positions, metadata = _position_tensors(
        block_table, slots, starts_np, query_lens_np, seq_lens_np, offsets_np, block_size, device, max_verify_query_len
    )
    return StepInputs(
        req_ids=req_ids,
        input_ids=torch.from_numpy(np.array(input_ids, dtype=np.int64)).to(device),
        positions=positions,
        attn_metadata=metadata,
        sampled_req_ids=[req_ids[i] for i in sampled_rows.tolist()],
        sample_indices=torch.from_numpy(sample_indices).to(device),
        num_draft_tokens=num_drafts.tolist(),
        token_offsets=offsets_np.tolist(),
        starts=first,
        query_lens=query_lens,
    )


def _sample_rows(
    states: list[CachedRequestState], seq_lens: np.ndarray, offsets: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(sampled requests' batch rows [num_sampled], the batch rows logits are read at [num_sample_rows],
    drafts per sampled request [num_sampled]): a request whose prompt is done with this batch gets a
    token, read at its last row, and one more row per draft it verifies, just before it; a pooling request
    never does (its length never matches: -1)."""
    num_drafts = np.array([len(s.spec_token_ids) for s in states], dtype=np.int64)  # [num_reqs]
    generate = RequestKind.GENERATE
    lengths = [len(s.token_ids) if s.kind is generate else -1 for s in states]
    is_sampled = seq_lens == np.array(lengths, dtype=np.int64) + num_drafts
    sampled_rows = np.flatnonzero(is_sampled)  # [num_sampled]
    sample_indices = offsets[1:][sampled_rows] - 1  # [num_sampled]
    num_drafts = num_drafts[sampled_rows]
    if num_drafts.any():  # each sampled request's 1 + k last rows
        ends = np.repeat(sample_indices, num_drafts + 1)  # [num_sample_rows]
        back = np.repeat(np.cumsum(num_drafts + 1) - 1, num_drafts + 1) - np.arange(len(ends))
        sample_indices = ends - back
    return sampled_rows, sample_indices, num_drafts


def _gather_token_ids(states: list[CachedRequestState], starts: list[int], query_lens: list[int]) -> list[int]:
    """The batch's token ids, request after request (one Python step per request); a request's drafts
    follow its known tokens."""
    input_ids: list[int] = []
    append, extend = input_ids.append, input_ids.extend
    for state, start, num_new in zip(states, starts, query_lens):
        if num_new == 1:  # a decode
            append(state.token_ids[start])
        else:
            extend(state.token_ids[start : start + num_new])
            if state.spec_token_ids:
                extend(state.spec_token_ids)
    return input_ids


def _position_tensors(
    block_table: BlockTable,
    slots: np.ndarray,
    starts: np.ndarray,
    query_lens: np.ndarray,
    seq_lens: np.ndarray,
    offsets: np.ndarray,
    block_size: int,
    device: torch.device,
    max_verify_query_len: int,
) -> tuple[torch.Tensor, AttentionMetadata]:
    """(positions, attention metadata): each token's position, and per KV cache group each token's KV slot and
    the batch's block tables (group 0's metadata, the others' its ``group_views``). ``starts``, ``query_lens``,
    ``seq_lens`` are per request [num_reqs]; ``offsets`` [num_reqs + 1] the cumulative query lengths.
    """
    num_tokens = int(offsets[-1])
    max_seq_len = int(seq_lens.max())
    group_tables = block_table.table_np[:, slots, : -(-max_seq_len // block_size)]  # [groups, num_reqs, max_blocks]
    if num_tokens == len(slots):  # decodes only: one token per request, at its start
        token_rows, positions = np.arange(num_tokens), starts.copy()
    else:  # token t of request i sits at starts[i] + (t - offsets[i])
        token_rows = np.repeat(np.arange(len(slots)), query_lens)  # [num_tokens]
        positions = np.arange(num_tokens) + (starts - offsets[:-1])[token_rows]  # [num_tokens]
    group = AttentionMetadata(  # the fields every group shares; each its own tables and slots below
        num_actual_tokens=num_tokens,
        query_start_loc=torch.from_numpy(offsets.astype(np.int32)).to(device),
        seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(device),
        block_tables=torch.empty(0),
        slot_mapping=torch.empty(0),
        max_query_len=int(query_lens.max()),
        max_seq_len=max_seq_len,
        query_lens_cpu=query_lens.tolist(),
        seq_lens_cpu=seq_lens.tolist(),
        max_verify_query_len=max_verify_query_len,
    )
    metadata = []
    for block_tables in group_tables:
        # Each token's KV slot: its request's block for that position, offset within the block.
        token_blocks = block_tables[token_rows, positions // block_size].astype(np.int64)  # [num_tokens]
        slot_mapping = token_blocks * block_size + positions % block_size  # [num_tokens]
        tensors = torch.from_numpy(block_tables).to(device), torch.from_numpy(slot_mapping).to(device)
        metadata.append(dataclasses.replace(group, block_tables=tensors[0], slot_mapping=tensors[1]))
    metadata[0].group_views = tuple(metadata[1:])
    return torch.from_numpy(positions).to(device), metadata[0]
