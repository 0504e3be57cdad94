"""Triton kernel for the KV-cache write (the GPU path), beside its torch reference.

KV cache per layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (0 = keys, 1 = values), the
layout every backend shares. On a CPU the kernel runs through Triton's interpreter
(``TRITON_INTERPRET=1``, set before Triton is first imported), which is how CI tests it.

A negative slot means "no slot": the token is skipped. Padded rows of a CUDA-graph batch use it, so a
replay never writes into a real block (vLLM's ``PAD_SLOT_ID``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, cache_ptr, slot_ptr, stride_token, stride_kv, stride_slot, ROW: tl.constexpr, ROW_POW2: tl.constexpr
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token)
    if slot >= 0:
        offsets = tl.arange(0, ROW_POW2)
        mask = offsets < ROW
        key = tl.load(k_ptr + token * stride_token + offsets, mask=mask)
        value = tl.load(v_ptr + token * stride_token + offsets, mask=mask)
        tl.store(cache_ptr + slot * stride_slot + offsets, key, mask=mask)
        tl.store(cache_ptr + stride_kv + slot * stride_slot + offsets, value, mask=mask)


def write_kv_cache(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """``key``, ``value`` [T, Hk, D] (contiguous, the cache's dtype) into ``kv_cache`` at ``slot_mapping`` [T];
    tokens whose slot is negative are skipped."""
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    row = num_heads * head_dim  # one token's K (or V) is one contiguous row of the cache
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        kv_cache,
        slot_mapping,
        key.stride(0),
        kv_cache.stride(0),
        kv_cache.stride(2),
        ROW=row,
        ROW_POW2=triton.next_power_of_2(row),
    )


def write_kv_cache_reference(
    kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
    flat = kv_cache.view(2, num_blocks * block_size, *kv_cache.shape[3:])  # [2, slots, Hk, D]
    keep = slot_mapping >= 0
    flat[0, slot_mapping[keep]] = key[keep]
    flat[1, slot_mapping[keep]] = value[keep]
