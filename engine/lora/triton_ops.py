"""Batched LoRA as Triton kernels (the GPU path; ``LinearLoRA`` chooses them on CUDA), vLLM's punica shape.

A step's tokens are grouped by adapter slot once (``plan_lora_tokens``: a slot per token, -1 for the
base model, sorted into per-slot runs on the device), then every adapted layer runs two launches:

* ``lora_shrink``: ``out[t] = x[t] @ A[slot(t)].T``, [tokens, in] -> [tokens, width], width being every
  packed projection's rank block side by side (the layout of ``engine.lora.layers``); float32 out;
* ``lora_expand``: per output slice (q/k/v of a packed QKV, gate/up, or the one projection),
  ``y[t, offset:offset + size] += shrunk[t, p*R:(p+1)*R] @ B[slot(t), offset:offset + size, p*R:(p+1)*R].T``,
  reading only that slice's rank block of B (the torch path multiplies the zeros too).

The grid is fixed by the token count and ``max_loras`` (a program whose slot has fewer tokens exits),
so nothing waits on the host. Tokens of no adapter are neither read nor written. Each output element
belongs to one program (one slot per token, disjoint slices): no atomics.

On a CPU the kernels run through Triton's interpreter (tests only: it is slow).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.kernels.triton_common import MIN_DOT_ROWS, dot_options

BLOCK_TOKENS = 16  # rows per program: a decode step's group is often a handful of tokens
MAX_BLOCK_N = 64
MAX_BLOCK_K = 64


@dataclass
class LoRATokenPlan:
    """One step's tokens grouped by slot: ``order`` [tokens] token rows sorted by slot (base-model rows
    first), ``starts`` / ``counts`` [max_loras] where each slot's run begins in ``order`` and how long
    it is (0: the slot has no token this step). All on the tokens' device."""

    order: torch.Tensor
    starts: torch.Tensor
    counts: torch.Tensor
    num_tokens: int


def plan_lora_tokens(token_slots: torch.Tensor, max_loras: int) -> LoRATokenPlan:
    """Groups tokens by ``token_slots`` [tokens] (a slot in [0, max_loras), or -1: no LoRA)."""
    shifted = token_slots.to(torch.int64) + 1  # -1 -> bucket 0, dropped below
    order = torch.argsort(shifted, stable=True).to(torch.int32)
    counts = torch.bincount(shifted, minlength=max_loras + 1)
    starts = torch.cumsum(counts, 0) - counts
    return LoRATokenPlan(order, starts[1:].to(torch.int32), counts[1:].to(torch.int32), len(token_slots))


def _block(size: int, cap: int) -> int:
    return max(MIN_DOT_ROWS, min(cap, triton.next_power_of_2(size)))


@triton.jit
def _group_rows(order_ptr, starts_ptr, counts_ptr, slot, m_block, BLOCK_M: tl.constexpr):
    """This program's token rows [BLOCK_M] of ``slot``'s run and which of them exist."""
    count = tl.load(counts_ptr + slot)
    m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    is_row = m < count
    rows = tl.load(order_ptr + tl.load(starts_ptr + slot) + m, mask=is_row, other=0).to(tl.int64)
    return rows, is_row, count


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, out_ptr, order_ptr, starts_ptr, counts_ptr,
    in_features, width,
    stride_xt, stride_xk, stride_as, stride_ar, stride_ak, stride_ot,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    m_block, n_block, slot = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows, is_row, count = _group_rows(order_ptr, starts_ptr, counts_ptr, slot, m_block, BLOCK_M)
    if m_block * BLOCK_M >= count:
        return
    n = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    is_col = n < width
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    a_base = a_ptr + slot.to(tl.int64) * stride_as
    for k0 in range(0, in_features, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        is_k = k < in_features
        x = tl.load(x_ptr + rows[:, None] * stride_xt + k[None, :] * stride_xk, mask=is_row[:, None] & is_k[None, :])
        a = tl.load(a_base + n[None, :] * stride_ar + k[:, None] * stride_ak, mask=is_col[None, :] & is_k[:, None])
        if UPCAST:
            x, a = x.to(tl.float32), a.to(tl.float32)
        acc += tl.dot(x, a, input_precision=PRECISION)  # [M, K] @ [K, N]
    tl.store(out_ptr + rows[:, None] * stride_ot + n[None, :], acc, mask=is_row[:, None] & is_col[None, :])


@triton.jit
def _expand_kernel(
    s_ptr, b_ptr, y_ptr, slices_ptr, order_ptr, starts_ptr, counts_ptr,
    rank, num_slices,
    stride_st, stride_bs, stride_bo, stride_br, stride_yt, stride_yo,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    m_block, n_block, slot_slice = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    slot, piece = slot_slice // num_slices, slot_slice % num_slices
    rows, is_row, count = _group_rows(order_ptr, starts_ptr, counts_ptr, slot, m_block, BLOCK_M)
    offset, size = tl.load(slices_ptr + 2 * piece), tl.load(slices_ptr + 2 * piece + 1)
    if m_block * BLOCK_M >= count or n_block * BLOCK_N >= size:
        return
    n = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    is_col = n < size
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    b_base = b_ptr + slot.to(tl.int64) * stride_bs + (offset + n[None, :]) * stride_bo
    for k0 in range(0, rank, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        is_k = k < rank
        r = piece * rank + k  # this slice's rank block of the shrunk rows and of B's columns
        s = tl.load(s_ptr + rows[:, None] * stride_st + r[None, :], mask=is_row[:, None] & is_k[None, :])
        b = tl.load(b_base + r[:, None] * stride_br, mask=is_col[None, :] & is_k[:, None])
        b = b.to(tl.float32)  # the shrunk rows are float32: one precision for the product
        acc += tl.dot(s, b, input_precision=PRECISION)
    out = y_ptr + rows[:, None] * stride_yt + (offset + n[None, :]) * stride_yo
    mask = is_row[:, None] & is_col[None, :]
    y = tl.load(out, mask=mask)
    tl.store(out, (y.to(tl.float32) + acc).to(y.dtype), mask=mask)


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, plan: LoRATokenPlan) -> torch.Tensor:
    """[tokens, width] float32: each planned token's row of ``x`` [tokens, in] through its slot's ``lora_a``
    [max_loras, width, in]; rows of tokens without an adapter are zeros."""
    width = lora_a.shape[1]
    out = torch.zeros(x.shape[0], width, dtype=torch.float32, device=x.device)
    if x.shape[0] == 0:
        return out
    options = dot_options(x.dtype)
    grid = (triton.cdiv(x.shape[0], BLOCK_TOKENS), triton.cdiv(width, _block(width, MAX_BLOCK_N)), lora_a.shape[0])
    _shrink_kernel[grid](
        x, lora_a, out, plan.order, plan.starts, plan.counts,
        x.shape[1], width,
        x.stride(0), x.stride(1), lora_a.stride(0), lora_a.stride(1), lora_a.stride(2), out.stride(0),
        BLOCK_M=BLOCK_TOKENS, BLOCK_N=_block(width, MAX_BLOCK_N), BLOCK_K=_block(x.shape[1], MAX_BLOCK_K),
        PRECISION=options["PRECISION"], UPCAST=options["UPCAST"],
    )  # fmt: skip
    return out


def lora_expand(
    shrunk: torch.Tensor, lora_b: torch.Tensor, y: torch.Tensor, slices: torch.Tensor, rank: int, plan: LoRATokenPlan
) -> torch.Tensor:
    """Adds, in place, each planned token's delta into ``y`` [tokens, out] and returns it.

    ``shrunk``: ``lora_shrink``'s [tokens, num_slices * rank]; ``lora_b``: [max_loras, out, num_slices * rank];
    ``slices``: int32 [num_slices, 2] on the device, each slice's (offset, size) in ``y``'s columns, slice p
    reading rank block p.
    """
    if y.shape[0] == 0:
        return y
    num_slices = slices.shape[0]
    block_n = _block(y.shape[1], MAX_BLOCK_N)
    options = dot_options(torch.float32)  # the shrunk rows are float32
    grid = (triton.cdiv(y.shape[0], BLOCK_TOKENS), triton.cdiv(y.shape[1], block_n), lora_b.shape[0] * num_slices)
    _expand_kernel[grid](
        shrunk, lora_b, y, slices, plan.order, plan.starts, plan.counts,
        rank, num_slices,
        shrunk.stride(0), lora_b.stride(0), lora_b.stride(1), lora_b.stride(2), y.stride(0), y.stride(1),
        BLOCK_M=BLOCK_TOKENS, BLOCK_N=block_n, BLOCK_K=_block(rank, MAX_BLOCK_K),
        PRECISION=options["PRECISION"], UPCAST=options["UPCAST"],
    )  # fmt: skip
    return y
