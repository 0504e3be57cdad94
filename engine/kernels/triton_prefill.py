"""Triton paged attention for a mixed batch, beside its torch reference.

Any mix of requests: prefill chunks whose queries attend causally to their cached prefix plus the
chunk itself, and decodes (a chunk of one token). Every key, the chunk's own included, is read from
the paged cache, so the caller writes the step's K/V first.

A program takes ``QUERIES_PER_TILE`` consecutive query tokens of one request and every query head of
one KV head: its ``TILE_ROWS`` rows are (token, head in group) pairs, so keys are read once per group
(GQA). It walks the request's keys, ``KV_TILE`` positions at a time through the block table, up to
the tile's last causal position (with a sliding window, from the tile holding its first query's first key),
with an online softmax.
The host lists the tiles (request, first query token) once per step (``plan_prefill_tiles``), so the
kernel needs no search over the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from engine.kernels.triton_common import KV_TILE, MIN_DOT_ROWS, dot_options, load_kv_tile, online_softmax_step

TILE_ROWS = 64


@dataclass
class PrefillTiles:
    """The programs of one step: tile ``t`` covers request ``req[t]``'s query tokens from ``first_query[t]``."""

    req: torch.Tensor  # [num_tiles] int32
    first_query: torch.Tensor  # [num_tiles] int32, relative to the request's first new token
    queries_per_tile: int


def plan_prefill_tiles(query_lens: list[int], queries_per_kv: int, device: torch.device | str) -> PrefillTiles:
    """Cuts each request's new tokens into tiles of ``TILE_ROWS // queries_per_kv`` tokens."""
    if queries_per_kv > TILE_ROWS:
        raise ValueError(f"{queries_per_kv} query heads per KV head exceed the kernel's {TILE_ROWS} rows")
    queries_per_tile = TILE_ROWS // queries_per_kv
    lens = np.asarray(query_lens, dtype=np.int64)
    tiles_per_req = -(-lens // queries_per_tile)
    req = np.repeat(np.arange(len(lens)), tiles_per_req)  # [num_tiles]
    first_tile = np.cumsum(tiles_per_req) - tiles_per_req  # each request's first tile
    first_query = (np.arange(len(req)) - first_tile[req]) * queries_per_tile
    as_tensor = lambda a: torch.from_numpy(a.astype(np.int32)).to(device)  # noqa: E731
    return PrefillTiles(as_tensor(req), as_tensor(first_query), queries_per_tile)


@triton.jit
def _program_rows(
    tile_req_ptr,
    tile_query_ptr,
    query_start_ptr,
    seq_lens_ptr,
    window,
    QUERIES_PER_KV: tl.constexpr,
    QUERIES_PER_TILE: tl.constexpr,
    TILE_ROWS: tl.constexpr,
):
    """What this program computes: its tile's request, KV head and sequence length, its rows' (token in the
    batch, query head, whether the row is a query, absolute position), the first key its first query attends
    (with ``window`` > 0, that query's window's), and the tile's last query position."""
    tile, kv_head = tl.program_id(0), tl.program_id(1)
    req = tl.load(tile_req_ptr + tile)
    first_query = tl.load(tile_query_ptr + tile)
    query_start = tl.load(query_start_ptr + req)
    query_len = tl.load(query_start_ptr + req + 1) - query_start
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - query_len
    rows = tl.arange(0, TILE_ROWS)
    query_index = first_query + rows // QUERIES_PER_KV  # within the request's new tokens
    is_query = (rows < QUERIES_PER_TILE * QUERIES_PER_KV) & (query_index < query_len)
    heads = kv_head * QUERIES_PER_KV + rows % QUERIES_PER_KV
    query_position = context_len + query_index  # absolute: it sees keys 0..query_position
    last_query = tl.minimum(first_query + QUERIES_PER_TILE, query_len) - 1
    first_key = tl.where(window > 0, tl.maximum(context_len + first_query - window + 1, 0), 0)
    return (
        req,
        kv_head,
        seq_len,
        query_start + query_index,
        heads,
        is_query,
        query_position,
        first_key,
        context_len + last_query,
    )


@triton.jit
def _load_query_rows(q_ptr, tokens, heads, is_query, q_strides, HEAD_DIM: tl.constexpr, UPCAST: tl.constexpr):
    """The rows' offsets into the query (the output shares them) and the rows [TILE_ROWS, HEAD_DIM]."""
    dims = tl.arange(0, HEAD_DIM)
    q_offsets = tokens[:, None] * q_strides[0] + heads[:, None] * q_strides[1] + dims[None, :]
    query = tl.load(q_ptr + q_offsets, mask=is_query[:, None], other=0.0)
    if UPCAST:
        query = query.to(tl.float32)
    return q_offsets, query


@triton.jit
def _is_visible(key_position, query_position, window):
    """[rows, KV_TILE]: causal, and with ``window`` > 0 within it (a row whose window starts in a later tile
    sees nothing of this one)."""
    is_causal = key_position[None, :] <= query_position[:, None]
    return is_causal & ((window <= 0) | (key_position[None, :] > query_position[:, None] - window))


@triton.jit
def _attend_causal(
    query,
    query_position,
    first_key,
    last_position,
    cache_ptr,
    table_row_ptr,
    seq_len,
    window,
    kv_head,
    scale,
    cache_strides,
    BLOCK_SIZE: tl.constexpr,
    KV_TILE: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Each row's attention over the request's keys up to ``query_position`` (tiles up to ``last_position``);
    with ``window`` > 0 over its last ``window`` only, from ``first_key`` (its first row's) on."""
    running_max = tl.full((query.shape[0],), float("-inf"), tl.float32)
    running_sum = tl.zeros((query.shape[0],), tl.float32)
    acc = tl.zeros((query.shape[0], query.shape[1]), tl.float32)
    num_tiles = (last_position + KV_TILE) // KV_TILE  # tiles up to the last causal key
    for tile in range(first_key // KV_TILE, num_tiles):
        keys, values, key_position = load_kv_tile(
            cache_ptr,
            table_row_ptr,
            tile * KV_TILE,
            first_key,
            seq_len,
            kv_head,
            cache_strides[0],
            cache_strides[1],
            cache_strides[2],
            cache_strides[3],
            BLOCK_SIZE,
            KV_TILE,
            query.shape[1],
            UPCAST,
        )
        is_visible = _is_visible(key_position, query_position, window)
        running_max, running_sum, acc = online_softmax_step(
            query, keys, values, is_visible, scale, running_max, running_sum, acc, PRECISION
        )
    return acc / running_sum[:, None]


@triton.jit
def _prefill_kernel(
    q_ptr,
    cache_ptr,
    block_table_ptr,
    query_start_ptr,
    seq_lens_ptr,
    tile_req_ptr,
    tile_query_ptr,
    out_ptr,
    scale,
    window,
    q_strides,  # (token, head)
    cache_strides,  # (kv, block, slot, head)
    stride_table,
    QUERIES_PER_KV: tl.constexpr,
    QUERIES_PER_TILE: tl.constexpr,
    TILE_ROWS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KV_TILE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    req, kv_head, seq_len, tokens, heads, is_query, query_position, first_key, last_position = _program_rows(
        tile_req_ptr, tile_query_ptr, query_start_ptr, seq_lens_ptr, window, QUERIES_PER_KV, QUERIES_PER_TILE, TILE_ROWS
    )
    q_offsets, query = _load_query_rows(q_ptr, tokens, heads, is_query, q_strides, HEAD_DIM, UPCAST)
    out = _attend_causal(
        query,
        query_position,
        first_key,
        last_position,
        cache_ptr,
        block_table_ptr + req * stride_table,
        seq_len,
        window,
        kv_head,
        scale,
        cache_strides,
        BLOCK_SIZE,
        KV_TILE,
        PRECISION,
        UPCAST,
    )
    tl.store(out_ptr + q_offsets, out.to(out_ptr.dtype.element_ty), mask=is_query[:, None])


def paged_prefill_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    tiles: PrefillTiles,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """``query`` [T, Hq, D] (every request's new tokens, flattened; see ``engine/attention/metadata.py``);
    returns [T, Hq, D]: each new token's causal attention over its request's cached sequence (with ``window``,
    over its last ``window`` positions only; blocks wholly before them are never read).

    ``query_start_loc`` [R + 1] and ``seq_lens`` [R] int32, ``block_tables`` [R, max_blocks] int32,
    ``tiles`` from ``plan_prefill_tiles``; ``head_dim`` and ``block_size`` powers of two, at least 16.
    """
    query = query.contiguous()
    out = torch.empty_like(query)  # contiguous as query: the kernel stores through query's offsets
    if tiles.req.shape[0] > 0:
        _launch_prefill(query, kv_cache, block_tables, query_start_loc, seq_lens, tiles, scale, window or 0, out)
    return out


def _launch_prefill(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    tiles: PrefillTiles,
    scale: float,
    window: int,
    out: torch.Tensor,
) -> None:
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    _prefill_kernel[(tiles.req.shape[0], num_kv_heads)](
        query,
        kv_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        tiles.req,
        tiles.first_query,
        out,
        scale,
        window,
        query.stride()[:2],
        kv_cache.stride()[:4],
        block_tables.stride(0),
        QUERIES_PER_KV=num_heads // num_kv_heads,
        QUERIES_PER_TILE=tiles.queries_per_tile,
        TILE_ROWS=max(TILE_ROWS, MIN_DOT_ROWS),
        BLOCK_SIZE=block_size,
        KV_TILE=KV_TILE,
        HEAD_DIM=head_dim,
        **dot_options(query.dtype),
    )


def paged_prefill_attention_reference(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    num_heads, num_kv_heads, block_size = query.shape[1], kv_cache.shape[3], kv_cache.shape[2]
    starts = query_start_loc.tolist()
    out = torch.empty_like(query)
    for req, seq_len in enumerate(seq_lens.tolist()):
        start, end = starts[req], starts[req + 1]
        blocks = block_tables[req, : -(-seq_len // block_size)].long()
        keys = kv_cache[0, blocks].flatten(0, 1)[:seq_len].float().repeat_interleave(num_heads // num_kv_heads, 1)
        values = kv_cache[1, blocks].flatten(0, 1)[:seq_len].float().repeat_interleave(num_heads // num_kv_heads, 1)
        scores = torch.einsum("qhd,shd->hqs", query[start:end].float(), keys) * scale  # [Hq, Q, S]
        query_positions = torch.arange(seq_len - (end - start), seq_len, device=query.device)
        key_positions = torch.arange(seq_len, device=query.device)[None, :]
        visible = key_positions <= query_positions[:, None]  # [Q, S]
        if window is not None:
            visible &= key_positions > query_positions[:, None] - window
        scores = scores.masked_fill(~visible, float("-inf"))
        out[start:end] = torch.einsum("hqs,shd->qhd", scores.softmax(-1), values).to(query.dtype)
    return out
