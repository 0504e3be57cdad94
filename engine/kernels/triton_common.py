"""What the Triton kernels share: reading a tile of keys through the block table and one step of the online
softmax (attention), a little-endian fp16 read from bytes (the quantized GEMMs), and the options of their
``tl.dot`` calls."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

MIN_DOT_ROWS = 16  # tl.dot needs at least 16 rows (and columns)
# Key positions the attention kernels read per iteration, whatever the cache's block size: each
# position finds its block through the block table, so a tile spans several blocks (or a part of one).
KV_TILE = 64


def dot_options(dtype: torch.dtype) -> dict:
    """``PRECISION`` and ``UPCAST`` for the kernels' ``tl.dot``s.

    float32 inputs keep full precision (Triton would use TF32 by default). Triton's interpreter computes
    16-bit ``tl.dot`` wrongly (version 3.9: garbage), so interpreted kernels upcast to float32 first; on
    a GPU 16-bit inputs go to the tensor cores as they are.
    """
    upcast = is_interpreted() and dtype != torch.float32
    return {"PRECISION": "ieee" if dtype == torch.float32 or upcast else "tf32", "UPCAST": upcast}


def is_interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def load_fp16(ptr, mask):
    """The little-endian fp16 at ``ptr`` (two bytes, any alignment) as float32; 0 where ``mask`` is off."""
    low = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    high = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return (low | (high << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def load_kv_tile(
    cache_ptr,
    block_table_row_ptr,
    first_position,
    first_key,
    seq_len,
    kv_head,
    stride_kv,
    stride_block,
    stride_slot,
    stride_head,
    BLOCK_SIZE: tl.constexpr,
    KV_TILE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Keys and values [KV_TILE, HEAD_DIM] of one sequence at positions ``first_position + 0..KV_TILE-1``
    (zeros before ``first_key``, where a sliding window's blocks may be freed, and at and past ``seq_len``),
    and those positions [KV_TILE]."""
    positions = first_position + tl.arange(0, KV_TILE)
    is_key = (positions >= first_key) & (positions < seq_len)
    # Each position's block, through the table (a tile spans KV_TILE / BLOCK_SIZE blocks, or part of one);
    # int64: a large cache has more than 2**31 elements.
    blocks = tl.load(block_table_row_ptr + positions // BLOCK_SIZE, mask=is_key, other=0).to(tl.int64)
    offsets = (
        blocks[:, None] * stride_block
        + (positions % BLOCK_SIZE)[:, None] * stride_slot
        + kv_head * stride_head
        + tl.arange(0, HEAD_DIM)[None, :]
    )  # [KV_TILE, HEAD_DIM]
    keys = tl.load(cache_ptr + offsets, mask=is_key[:, None], other=0.0)
    values = tl.load(cache_ptr + stride_kv + offsets, mask=is_key[:, None], other=0.0)
    if UPCAST:
        keys = keys.to(tl.float32)
        values = values.to(tl.float32)
    return keys, values, positions


@triton.jit
def online_softmax_step(query, keys, values, is_visible, scale, running_max, running_sum, acc, PRECISION: tl.constexpr):
    """Folds one tile of keys into each query row's (running max, sum of weights, unnormalized output).

    ``is_visible`` [rows, KV_TILE] masks keys out; a row that has seen no visible key yet (a sliding window
    starting in a later tile) keeps (-inf, 0, 0)."""
    scores = tl.dot(query, tl.trans(keys), input_precision=PRECISION) * scale  # [rows, KV_TILE]
    scores = tl.where(is_visible, scores, float("-inf"))
    new_max = tl.maximum(running_max, tl.max(scores, axis=1))
    shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # no key yet: every weight exp(-inf) = 0
    correction = tl.exp(running_max - shift)
    weights = tl.exp(scores - shift[:, None])
    acc = acc * correction[:, None] + tl.dot(weights.to(values.dtype), values, input_precision=PRECISION)
    running_sum = running_sum * correction + tl.sum(weights, axis=1)
    return new_max, running_sum, acc
