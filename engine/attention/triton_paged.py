"""The Triton attention backend (the GPU path; ``attention_backend: auto`` picks it on CUDA).

Same cache layout as the torch backend: per layer ``[2, num_blocks, block_size, num_kv_heads, head_dim]``.
Forward (contract in ``backend.py``):

1. the step's K/V into their slots (``engine/kernels/triton_cache.py``; negative slots are skipped);
2. a decode-only step (every request has one new token): the split-K decode kernel
   (``triton_decode.py``), which needs nothing from the host but the split count, so the step can be
   captured in a CUDA graph (``engine/worker/cuda_graphs.py``);
3. any other step: one launch of the mixed-batch kernel (``triton_prefill.py``) over every request,
   decodes included; its tiles are planned once per step, on the first layer.

On a CPU the kernels run through Triton's interpreter (tests only: it is slow).
"""

from __future__ import annotations

import torch

from engine.attention.backend import AttentionBackend
from engine.attention.metadata import AttentionMetadata
from engine.kernels.triton_cache import write_kv_cache
from engine.kernels.triton_decode import choose_num_splits, paged_decode_attention
from engine.kernels.triton_prefill import paged_prefill_attention, plan_prefill_tiles


class TritonPagedAttention(AttentionBackend):
    name = "triton"
    supports_cuda_graphs = True  # decode-only steps: no host sync, shapes fixed by the batch size

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_dim)

    def forward(
        self,
        kv_cache: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_metadata: AttentionMetadata,
        scale: float,
        kv_is_written: bool = False,
        window: int | None = None,
    ) -> torch.Tensor:
        md = attn_metadata
        n = md.num_actual_tokens
        q = q[:n].contiguous()
        if not kv_is_written:
            write_kv_cache(
                kv_cache,
                k[:n].to(kv_cache.dtype).contiguous(),
                v[:n].to(kv_cache.dtype).contiguous(),
                md.slot_mapping[:n],
            )
        num_kv_heads = kv_cache.shape[3]
        if md.max_query_len == 1:  # rows are requests; a CUDA graph's padded rows have seq_len 0
            num_splits = choose_num_splits(n, num_kv_heads, md.max_seq_len)
            out = paged_decode_attention(q, kv_cache, md.block_tables, md.seq_lens, scale, num_splits, window)
        else:
            if md.backend_plan is None:
                md.backend_plan = plan_prefill_tiles(md.host_lens()[0], q.shape[1] // num_kv_heads, q.device)
            out = paged_prefill_attention(
                q, kv_cache, md.block_tables, md.query_start_loc, md.seq_lens, md.backend_plan, scale, window
            )
        return out.reshape(n, -1)  # [T, H*D]
