"""Triton kernels for the paged KV cache (the GPU path, issue 8; first part), each beside its torch reference.

KV cache per layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (0 = keys, 1 = values), the
torch backend's layout. On a CPU the kernels run through Triton's interpreter (``TRITON_INTERPRET=1``,
set before this module is imported), which is how CI tests them.

* ``write_kv_cache``: each new token's K and V into its slot (``slot = block * block_size + offset``).
* ``paged_decode_attention``: one query token per sequence attends to its whole cached context, read
  through the block table; GQA by mapping each query head to its KV head; an online softmax over
  the blocks, so no [seq_len] score row is materialized.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, cache_ptr, slot_ptr, stride_token, stride_kv, stride_slot,
                     ROW: tl.constexpr, ROW_POW2: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token)
    offsets = tl.arange(0, ROW_POW2)
    mask = offsets < ROW
    key = tl.load(k_ptr + token * stride_token + offsets, mask=mask)
    value = tl.load(v_ptr + token * stride_token + offsets, mask=mask)
    tl.store(cache_ptr + slot * stride_slot + offsets, key, mask=mask)
    tl.store(cache_ptr + stride_kv + slot * stride_slot + offsets, value, mask=mask)


def write_kv_cache(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """``key``, ``value`` [T, H, D] (contiguous) into ``kv_cache`` at ``slot_mapping`` [T]."""
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    row = num_heads * head_dim  # one token's K (or V) is one contiguous row of the cache
    _write_kv_kernel[(num_tokens,)](key, value, kv_cache, slot_mapping, key.stride(0), kv_cache.stride(0),
                                    kv_cache.stride(2), ROW=row, ROW_POW2=triton.next_power_of_2(row))


def write_kv_cache_reference(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             slot_mapping: torch.Tensor) -> None:
    num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
    flat = kv_cache.view(2, num_blocks * block_size, *kv_cache.shape[3:])  # [2, slots, H, D]
    flat[0, slot_mapping] = key
    flat[1, slot_mapping] = value


@triton.jit
def _decode_kernel(q_ptr, cache_ptr, block_table_ptr, seq_lens_ptr, out_ptr, scale,
                   stride_q_seq, stride_q_head, stride_kv, stride_block, stride_slot, stride_head,
                   stride_table, QUERIES_PER_KV: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // QUERIES_PER_KV
    seq_len = tl.load(seq_lens_ptr + seq)
    dims = tl.arange(0, HEAD_DIM)
    slots = tl.arange(0, BLOCK_SIZE)
    query = tl.load(q_ptr + seq * stride_q_seq + head * stride_q_head + dims).to(tl.float32)
    running_max = tl.full((), float("-inf"), tl.float32)
    running_sum = tl.zeros((), tl.float32)
    acc = tl.zeros((HEAD_DIM,), tl.float32)
    num_blocks = (seq_len + BLOCK_SIZE - 1) // BLOCK_SIZE  # not tl.cdiv: a jit helper the interpreter may not wrap
    for index in range(0, num_blocks):
        block = tl.load(block_table_ptr + seq * stride_table + index)
        base = block * stride_block + kv_head * stride_head
        offsets = base + slots[:, None] * stride_slot + dims[None, :]  # [BLOCK_SIZE, HEAD_DIM]
        valid = index * BLOCK_SIZE + slots < seq_len
        keys = tl.load(cache_ptr + offsets, mask=valid[:, None], other=0.0).to(tl.float32)
        scores = tl.sum(keys * query[None, :], axis=1) * scale  # [BLOCK_SIZE]
        scores = tl.where(valid, scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=0))
        correction = tl.exp(running_max - new_max)
        weights = tl.exp(scores - new_max)
        values = tl.load(cache_ptr + stride_kv + offsets, mask=valid[:, None], other=0.0).to(tl.float32)
        acc = acc * correction + tl.sum(weights[:, None] * values, axis=0)
        running_sum = running_sum * correction + tl.sum(weights, axis=0)
        running_max = new_max
    out = acc / running_sum
    tl.store(out_ptr + seq * stride_q_seq + head * stride_q_head + dims, out.to(out_ptr.dtype.element_ty))


def paged_decode_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """``query`` [N, Hq, D] (one token per sequence) over the cached context; returns [N, Hq, D].

    ``block_tables`` [N, max_blocks] int32, ``seq_lens`` [N] int32 (the query token's KV included);
    ``head_dim`` and ``block_size`` must be powers of two.
    """
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    out = torch.empty_like(query)
    _decode_kernel[(num_seqs, num_heads)](
        query, kv_cache, block_tables, seq_lens, out, scale, query.stride(0), query.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), block_tables.stride(0),
        QUERIES_PER_KV=num_heads // num_kv_heads, BLOCK_SIZE=block_size, HEAD_DIM=head_dim)
    return out


def paged_decode_attention_reference(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                                     seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    num_heads, num_kv_heads, block_size = query.shape[1], kv_cache.shape[3], kv_cache.shape[2]
    outputs = []
    for seq, seq_len in enumerate(seq_lens.tolist()):
        blocks = block_tables[seq, :-(-seq_len // block_size)].long()
        keys = kv_cache[0, blocks].flatten(0, 1)[:seq_len].float()  # [S, Hk, D]
        values = kv_cache[1, blocks].flatten(0, 1)[:seq_len].float()
        keys = keys.repeat_interleave(num_heads // num_kv_heads, dim=1)  # [S, Hq, D]
        values = values.repeat_interleave(num_heads // num_kv_heads, dim=1)
        scores = torch.einsum("hd,shd->hs", query[seq].float(), keys) * scale  # [Hq, S]
        outputs.append(torch.einsum("hs,shd->hd", scores.softmax(-1), values))  # [Hq, D]
    return torch.stack(outputs).to(query.dtype)
