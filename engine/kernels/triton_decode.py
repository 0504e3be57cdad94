"""Triton paged attention for decode steps (one query token per sequence), beside its torch reference.

Each program takes one sequence, one KV head and one split of the sequence's keys: it loads every
query head that shares the KV head (GQA: the keys are read once for the whole group, and the group,
padded to 16 rows, feeds ``tl.dot``), reads its keys ``KV_TILE`` positions at a time through the block
table (with a sliding window, only the tiles from its window's first key on) and keeps an online
softmax. Split-K: a long context is cut into ``num_splits`` ranges of tiles
that run in parallel,
so a small batch still fills the GPU; a second kernel merges the splits' partial results
(running max, sum of weights, unnormalized output). A sequence of length 0 (a padded row of a
CUDA-graph batch) yields zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.triton_common import KV_TILE, MIN_DOT_ROWS, dot_options, load_kv_tile, online_softmax_step

TARGET_PROGRAMS = 512  # about 4 programs per SM of an H100/H200: enough to hide memory latency
MIN_TILES_PER_SPLIT = 2
MAX_SPLITS = 64


@triton.jit
def _first_key(seq_len, window):
    """The first key the query at ``seq_len - 1`` attends: its window's (``window`` > 0), else 0."""
    return tl.where((window > 0) & (seq_len > window), seq_len - window, 0)


@triton.jit
def _split_tile_range(first_key, seq_len, split, NUM_SPLITS: tl.constexpr, KV_TILE: tl.constexpr):
    """The tiles [first, end) of ``split``'s share of the keys [first_key, seq_len) (empty past its tiles)."""
    lead_tile = first_key // KV_TILE
    num_tiles = (seq_len + KV_TILE - 1) // KV_TILE
    tiles_per_split = (num_tiles - lead_tile + NUM_SPLITS - 1) // NUM_SPLITS
    first_tile = lead_tile + split * tiles_per_split
    return first_tile, tl.minimum(first_tile + tiles_per_split, num_tiles)


@triton.jit
def _load_query_group(
    q_ptr,
    seq,
    kv_head,
    q_strides,
    QUERIES_PER_KV: tl.constexpr,
    GROUP_ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """The query heads of one sequence that share ``kv_head``: their heads [GROUP_ROWS], which rows are
    heads (the rest pad the group for ``tl.dot``), and the rows [GROUP_ROWS, HEAD_DIM] (zeros as padding)."""
    group = tl.arange(0, GROUP_ROWS)
    is_head = group < QUERIES_PER_KV
    heads = kv_head * QUERIES_PER_KV + group
    dims = tl.arange(0, HEAD_DIM)
    query = tl.load(
        q_ptr + seq * q_strides[0] + heads[:, None] * q_strides[1] + dims[None, :], mask=is_head[:, None], other=0.0
    )
    if UPCAST:
        query = query.to(tl.float32)
    return heads, is_head, query


@triton.jit
def _attend_split(
    query,
    cache_ptr,
    table_row_ptr,
    seq_len,
    window,
    kv_head,
    split,
    scale,
    cache_strides,
    NUM_SPLITS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KV_TILE: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Online softmax of ``query`` [rows, HEAD_DIM] over ``split``'s tiles of the sequence's keys: per row
    (running max, sum of weights, unnormalized output); (-inf, 0, 0) for an empty split."""
    first_key = _first_key(seq_len, window)
    first_tile, end_tile = _split_tile_range(first_key, seq_len, split, NUM_SPLITS, KV_TILE)
    running_max = tl.full((query.shape[0],), float("-inf"), tl.float32)
    running_sum = tl.zeros((query.shape[0],), tl.float32)
    acc = tl.zeros((query.shape[0], query.shape[1]), tl.float32)
    for tile in range(first_tile, end_tile):
        keys, values, positions = load_kv_tile(
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
        is_visible = ((positions >= first_key) & (positions < seq_len))[None, :]
        running_max, running_sum, acc = online_softmax_step(
            query, keys, values, is_visible, scale, running_max, running_sum, acc, PRECISION
        )
    return running_max, running_sum, acc


@triton.jit
def _store_partials(part_out_ptr, part_stats_ptr, part, is_head, acc, running_max, running_sum):
    """Partials of (seq, head, split) at index ``part``: out [HEAD_DIM] unnormalized; stats = (max, sum)."""
    dims = tl.arange(0, acc.shape[1])
    tl.store(part_out_ptr + part[:, None] * acc.shape[1] + dims[None, :], acc, mask=is_head[:, None])
    tl.store(part_stats_ptr + part * 2, running_max, mask=is_head)
    tl.store(part_stats_ptr + part * 2 + 1, running_sum, mask=is_head)


@triton.jit
def _decode_split_kernel(
    q_ptr,
    cache_ptr,
    block_table_ptr,
    seq_lens_ptr,
    part_out_ptr,
    part_stats_ptr,
    scale,
    window,
    q_strides,  # (sequence, head)
    cache_strides,  # (kv, block, slot, head)
    stride_table,
    NUM_HEADS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    QUERIES_PER_KV: tl.constexpr,
    GROUP_ROWS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KV_TILE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    heads, is_head, query = _load_query_group(
        q_ptr, seq, kv_head, q_strides, QUERIES_PER_KV, GROUP_ROWS, HEAD_DIM, UPCAST
    )
    running_max, running_sum, acc = _attend_split(
        query,
        cache_ptr,
        block_table_ptr + seq * stride_table,
        seq_len,
        window,
        kv_head,
        split,
        scale,
        cache_strides,
        NUM_SPLITS,
        BLOCK_SIZE,
        KV_TILE,
        PRECISION,
        UPCAST,
    )
    part = (seq * NUM_HEADS + heads) * NUM_SPLITS + split  # [GROUP_ROWS]
    _store_partials(part_out_ptr, part_stats_ptr, part, is_head, acc, running_max, running_sum)


@triton.jit
def _merge_splits_kernel(
    part_out_ptr,
    part_stats_ptr,
    out_ptr,
    stride_out_seq,
    stride_out_head,
    NUM_HEADS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_POW2: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_POW2)
    is_split = splits < NUM_SPLITS
    dims = tl.arange(0, HEAD_DIM)
    part = (seq * NUM_HEADS + head) * NUM_SPLITS + splits  # [SPLITS_POW2]
    maxima = tl.load(part_stats_ptr + part * 2, mask=is_split, other=float("-inf"))
    sums = tl.load(part_stats_ptr + part * 2 + 1, mask=is_split, other=0.0)
    overall_max = tl.max(maxima, axis=0)
    overall_max = tl.where(overall_max == float("-inf"), 0.0, overall_max)  # an empty sequence
    weights = tl.where(sums > 0, tl.exp(maxima - overall_max), 0.0)  # an empty split weighs nothing
    total = tl.sum(sums * weights, axis=0)
    outs = tl.load(part_out_ptr + part[:, None] * HEAD_DIM + dims[None, :], mask=is_split[:, None], other=0.0)
    merged = tl.sum(outs * weights[:, None], axis=0) / tl.where(total > 0, total, 1.0)  # [HEAD_DIM]
    tl.store(out_ptr + seq * stride_out_seq + head * stride_out_head + dims, merged.to(out_ptr.dtype.element_ty))


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int) -> int:
    """Splits per sequence: enough programs to fill the GPU, each split still a few tiles long.
    A power of two, so few kernel variants get compiled."""
    max_tiles = -(-max_seq_len // KV_TILE)
    wanted = -(-TARGET_PROGRAMS // max(num_seqs * num_kv_heads, 1))
    splits = max(1, min(wanted, max_tiles // MIN_TILES_PER_SPLIT, MAX_SPLITS))
    return 1 << (splits.bit_length() - 1)  # round down to a power of two


def paged_decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int = 1,
    window: int | None = None,
) -> torch.Tensor:
    """``query`` [N, Hq, D] (one token per sequence) over its cached context; returns [N, Hq, D].

    ``block_tables`` [N, max_blocks] int32, ``seq_lens`` [N] int32 (the query token's own KV included;
    0 gives a zero row); ``head_dim`` and ``block_size`` powers of two, at least 16. ``window``: each query
    attends only its last ``window`` keys (blocks before them are never read); None: all.
    """
    num_seqs, num_heads, head_dim = query.shape
    out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    part_out = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=query.device)
    part_stats = torch.empty(num_seqs, num_heads, num_splits, 2, dtype=torch.float32, device=query.device)
    _launch_splits(query, kv_cache, block_tables, seq_lens, scale, window or 0, part_out, part_stats)
    _launch_merge(part_out, part_stats, out)
    return out


def _launch_splits(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int,
    part_out: torch.Tensor,
    part_stats: torch.Tensor,
) -> None:
    """Every split's partials into ``part_out`` [N, Hq, splits, D] and ``part_stats`` [N, Hq, splits, 2]."""
    num_seqs, num_heads, head_dim = query.shape
    num_splits = part_out.shape[2]
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    queries_per_kv = num_heads // num_kv_heads
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        query,
        kv_cache,
        block_tables,
        seq_lens,
        part_out,
        part_stats,
        scale,
        window,
        query.stride()[:2],
        kv_cache.stride()[:4],
        block_tables.stride(0),
        NUM_HEADS=num_heads,
        NUM_SPLITS=num_splits,
        QUERIES_PER_KV=queries_per_kv,
        GROUP_ROWS=max(MIN_DOT_ROWS, triton.next_power_of_2(queries_per_kv)),
        BLOCK_SIZE=block_size,
        KV_TILE=KV_TILE,
        HEAD_DIM=head_dim,
        **dot_options(query.dtype),
    )


def _launch_merge(part_out: torch.Tensor, part_stats: torch.Tensor, out: torch.Tensor) -> None:
    """``out`` [N, Hq, D] from the splits' partials."""
    num_seqs, num_heads, num_splits, head_dim = part_out.shape
    _merge_splits_kernel[(num_seqs, num_heads)](
        part_out,
        part_stats,
        out,
        out.stride(0),
        out.stride(1),
        NUM_HEADS=num_heads,
        NUM_SPLITS=num_splits,
        SPLITS_POW2=max(2, triton.next_power_of_2(num_splits)),
        HEAD_DIM=head_dim,
    )


def paged_decode_attention_reference(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    num_heads, num_kv_heads, block_size = query.shape[1], kv_cache.shape[3], kv_cache.shape[2]
    outputs = []
    for seq, seq_len in enumerate(seq_lens.tolist()):
        if seq_len == 0:
            outputs.append(torch.zeros(query.shape[1:], dtype=torch.float32, device=query.device))
            continue
        blocks = block_tables[seq, : -(-seq_len // block_size)].long()
        keys = kv_cache[0, blocks].flatten(0, 1)[:seq_len].float()  # [S, Hk, D]
        values = kv_cache[1, blocks].flatten(0, 1)[:seq_len].float()
        keys = keys.repeat_interleave(num_heads // num_kv_heads, dim=1)  # [S, Hq, D]
        values = values.repeat_interleave(num_heads // num_kv_heads, dim=1)
        scores = torch.einsum("hd,shd->hs", query[seq].float(), keys) * scale  # [Hq, S]
        if window is not None:
            scores[:, : max(0, seq_len - window)] = float("-inf")
        outputs.append(torch.einsum("hs,shd->hd", scores.softmax(-1), values))  # [Hq, D]
    return torch.stack(outputs).to(query.dtype)
