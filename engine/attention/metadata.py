"""Per-step attention metadata, built by the model runner and shared by all layers.

Tokens of all requests in a step are flattened into one batch, request after
request (no padding). For request ``i``:

* its new tokens are ``query_start_loc[i] : query_start_loc[i+1]`` of the batch;
* ``seq_lens[i]`` counts the tokens of its sequence once this step is done
  (already-cached context + new tokens), so ``context_lens = seq_lens - query_lens``;
* the new token ``j`` sits at absolute position ``context_lens[i] + j`` and sees
  keys ``0 .. context_lens[i] + j`` (causal);
* ``block_tables[i, b]`` is the KV-cache block holding positions
  ``b*block_size .. (b+1)*block_size-1``; unused entries are 0 (the null block).

``slot_mapping[t] = block_id * block_size + offset`` is where token ``t``'s new
K/V are written. A model with several KV cache groups (``engine.sched.kv_cache_groups``: layers of
different windows) has block tables and a slot mapping per group: this metadata is group 0's, and
``group_views`` holds the others' (the same batch, their own tables); each layer reads its group's
(``for_group``). ``query_lens_cpu`` / ``seq_lens_cpu`` are the same numbers as
plain Python lists so backends can plan without device syncs. Requests may come
in any order: the torch backend treats every request with one new token as a
decode and batches those together (it is fastest when decodes come first, as a
contiguous slice, but does not require it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

# ``slot_mapping`` entry meaning "no slot": the token's K/V are not written (padded rows of a CUDA-graph
# batch; vLLM's ``PAD_SLOT_ID``). Defined here, not in the Triton kernel's module: importing Triton is slow,
# and every engine start paid for it (cuda_graphs imported it for this constant), also on a CPU.
PAD_SLOT_ID = -1


@dataclass
class AttentionMetadata:
    num_actual_tokens: int  # tokens in the batch (= query_start_loc[-1])
    query_start_loc: torch.Tensor  # int32 [num_reqs + 1], cumulative new-token counts
    seq_lens: torch.Tensor  # int32 [num_reqs], context + new tokens
    block_tables: torch.Tensor  # int32 [num_reqs, max_num_blocks_per_req], 0-padded
    slot_mapping: torch.Tensor  # int64 [num_tokens], where each new K/V is written
    max_query_len: int
    max_seq_len: int
    query_lens_cpu: list[int] = field(default_factory=list)  # new tokens per request
    seq_lens_cpu: list[int] = field(default_factory=list)  # == seq_lens.tolist()
    num_decodes: int = -1  # hint: requests [0, num_decodes) have query_len 1; -1 = unknown
    # Speculative verification: queries of up to this many tokens (1 + drafts) may run as one decode row per
    # token (the CPU backend's native kernel); outside such steps each longer query is one prefill. The step's
    # few-row float32 products read it too (engine.model.layers.cpu_prepack.native_rows_of_step).
    max_verify_query_len: int = 1
    # Whatever the backend derives from the batch layout on the first layer and reuses on the others.
    backend_plan: object | None = None
    # KV cache groups 1, 2, ...: the same step with their block tables and slot mappings (see the module docstring).
    group_views: tuple[AttentionMetadata, ...] = ()

    def for_group(self, group: int) -> AttentionMetadata:
        """The step's metadata for KV cache group ``group`` (this one is group 0's)."""
        if group == 0:
            return self
        if group > len(self.group_views):
            raise ValueError(f"this step's attention metadata has no block tables for KV cache group {group}")
        return self.group_views[group - 1]

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)

    def host_lens(self) -> tuple[list[int], list[int]]:
        """(query_lens, seq_lens) as Python lists, derived from the tensors if the builder left them empty."""
        if self.seq_lens_cpu and self.query_lens_cpu:
            return self.query_lens_cpu, self.seq_lens_cpu
        starts = self.query_start_loc.tolist()
        return [b - a for a, b in zip(starts, starts[1:])], self.seq_lens.tolist()

    @property
    def context_lens_cpu(self) -> list[int]:
        return [s - q for s, q in zip(self.seq_lens_cpu, self.query_lens_cpu)]

    @property
    def context_lens(self) -> torch.Tensor:
        return self.seq_lens - (self.query_start_loc[1:] - self.query_start_loc[:-1])

    def to(self, device: torch.device | str) -> AttentionMetadata:
        """A copy with the tensors moved to ``device`` (Python-side fields shared)."""
        move = lambda t: t.to(device, non_blocking=True)  # noqa: E731
        return AttentionMetadata(
            self.num_actual_tokens,
            move(self.query_start_loc),
            move(self.seq_lens),
            move(self.block_tables),
            move(self.slot_mapping),
            self.max_query_len,
            self.max_seq_len,
            self.query_lens_cpu,
            self.seq_lens_cpu,
            self.num_decodes,
            self.max_verify_query_len,
            group_views=tuple(view.to(device) for view in self.group_views),
        )  # the plan is rebuilt on the device


def _leading_decodes(query_lens: Sequence[int]) -> int:
    n = 0
    while n < len(query_lens) and query_lens[n] == 1:
        n += 1
    return n


def build_attention_metadata(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Build metadata from Python lists (one entry per request, in batch order).

    ``block_tables[i]`` lists request ``i``'s block ids, covering at least
    ``seq_lens[i]`` tokens; rows are 0-padded to the longest. The slot mapping
    is derived: new tokens of request ``i`` occupy positions
    ``seq_lens[i] - query_lens[i] .. seq_lens[i] - 1``.
    """
    if not (len(query_lens) == len(seq_lens) == len(block_tables)):
        raise ValueError("query_lens, seq_lens and block_tables need one entry per request")
    slots: list[int] = []
    for q, s, blocks in zip(query_lens, seq_lens, block_tables):
        if not 0 < q <= s or len(blocks) * block_size < s:
            raise ValueError(f"bad request: query_len={q} seq_len={s} blocks={len(blocks)}x{block_size}")
        slots.extend(blocks[p // block_size] * block_size + p % block_size for p in range(s - q, s))
    width = max((len(b) for b in block_tables), default=0)
    table = [list(b) + [0] * (width - len(b)) for b in block_tables]
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    return AttentionMetadata(
        num_actual_tokens=starts[-1],
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(list(seq_lens), dtype=torch.int32, device=device),
        block_tables=torch.tensor(table, dtype=torch.int32, device=device).reshape(len(table), width),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        max_query_len=max(query_lens, default=0),
        max_seq_len=max(seq_lens, default=0),
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=list(seq_lens),
        num_decodes=_leading_decodes(query_lens),
    )
