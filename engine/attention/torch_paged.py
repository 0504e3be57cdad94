"""Paged attention in plain torch (the CPU backend; also runs on any torch device).

KV cache per layer: [2, num_blocks, block_size, num_kv_heads, head_dim]
(index 0 = keys, 1 = values). Block 0 is the reserved null block: it is never
written (the runner never maps a slot into it) and pads block tables. Caches
must hold finite values everywhere (``allocate_kv_caches`` zeroes them), since
padded key positions are masked but still multiplied.

Forward plan (see ``backend.py`` for the contract):

1. write the K/V of every new token at ``slot_mapping`` (one ``index_copy_``);
2. decodes (requests with one new token): on CPU, one call of the compiled
   kernel (``engine/kernels/csrc/decode_attention.cpp``) that reads keys and values through the
   block table; in a speculative step, a query of up to ``MAX_NATIVE_QUERY_LEN`` tokens (1 + drafts,
   ``AttentionMetadata.max_verify_query_len``) joins that call as one row per token, each with its own
   causal length. Elsewhere, or without
   a compiler: sorted by length, gathered into padded [n, S, Hk, D] tensors (``index_select`` over whole blocks, the
   fast gather on CPU) in chunks bounded by ``decode_chunk_elems``, one masked
   SDPA call per chunk, in float32 (bf16 products with a single query row are
   pathologically slow on CPUs);
3. prefills (longer chunks, with or without cached context): one SDPA call per
   request, ``is_causal`` when nothing is cached, an explicit mask otherwise.

A sliding window (``window``) narrows each query's keys to its last ``window`` positions: the kernel
starts there, and the torch paths gather from the block holding the window's first key on, and mask.

Everything that depends only on the batch layout and the window (the decode chunks, their
block indices and masks) is planned once per step and window, on the first layer with that window,
and cached on the metadata (``backend_plan``: window -> plan) for the other layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.backend import AttentionBackend
from engine.attention.metadata import AttentionMetadata
from engine.kernels.cpu import load_cpu_kernels, product_dtype

# A speculative step's queries of at most this many tokens go to the CPU decode kernel, a row per token (``_plan``).
MAX_NATIVE_QUERY_LEN = 8


@dataclass
class _DecodeChunk:
    tokens: slice | torch.Tensor  # the chunk's query tokens in the batch
    block_ids: torch.Tensor  # [n * num_blocks] flattened, for index_select (each row from its first window block)
    num_reqs: int
    num_blocks: int
    mask: torch.Tensor  # [n, 1, 1, S] True where a key exists and is in the window


@dataclass
class _NativeDecode:
    """All decodes of the step, for the compiled CPU kernel (reads the block table directly)."""

    tokens: slice | torch.Tensor
    block_tables: torch.Tensor  # [n, max_blocks] int32
    seq_lens: torch.Tensor  # [n] int32
    window: int  # the kernel's: 0 for full attention


@dataclass
class _Prefill:
    start: int
    end: int
    seq_len: int
    first_key: int  # the position of the first key read: the first block the window needs (0 without one)
    block_ids: torch.Tensor | None  # the request's blocks from first_key's on, when it has cached context
    mask: torch.Tensor | None  # [Q, S - first_key] causal (and window) mask; None = plain causal


@dataclass
class _StepPlan:
    native_decode: _NativeDecode | None
    decode_chunks: list[_DecodeChunk]  # the plain-torch decode path, when the kernel is not used
    prefills: list[_Prefill]


class TorchPagedAttention(AttentionBackend):
    name = "torch"
    accepts_written_kv = True

    def __init__(self, decode_chunk_elems: int = 1 << 24, use_cpu_kernel: bool = True):
        # Upper bound on gathered K (or V) elements per decode SDPA call.
        self.decode_chunk_elems = decode_chunk_elems
        self.use_cpu_kernel = use_cpu_kernel

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_dim)

    @staticmethod
    def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store k, v [T, Hk, D] at flat slots [T] of the cache."""
        _, num_blocks, block_size, hk, d = kv_cache.shape
        flat = kv_cache.view(2, num_blocks * block_size, hk, d)  # [2, slots, Hk, D]
        flat[0].index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
        flat[1].index_copy_(0, slot_mapping, v.to(kv_cache.dtype))

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
        q, k, v = q[:n], k[:n], v[:n]
        if not kv_is_written:
            self.write_kv(kv_cache, k, v, md.slot_mapping[:n])
        if md.backend_plan is None:
            md.backend_plan = {}
        plan = md.backend_plan.get(window)
        if plan is None:
            plan = md.backend_plan[window] = self._plan(
                md, kv_cache.shape[2], kv_cache.shape[3] * kv_cache.shape[4], window
            )
        out = torch.empty_like(q)  # [T, H, D]
        if plan.native_decode is not None:
            self._native_decode(kv_cache, q, plan.native_decode, scale, out)
        for chunk in plan.decode_chunks:
            out[chunk.tokens] = self._decode_chunk(kv_cache, q[chunk.tokens], chunk, scale)
        for prefill in plan.prefills:
            s, e = prefill.start, prefill.end
            out[s:e] = self._prefill(kv_cache, q[s:e], k[s:e], v[s:e], prefill, scale)
        return out.reshape(n, -1)  # [T, H*D]

    @staticmethod
    def _native_decode(
        kv_cache: torch.Tensor, q: torch.Tensor, native: _NativeDecode, scale: float, out: torch.Tensor
    ) -> None:
        """Every decode of the step in one kernel call (the compiled CPU kernel here), into ``out``."""
        if isinstance(native.tokens, slice):  # the usual case: the kernel writes straight into out
            load_cpu_kernels().paged_decode_attention(
                q[native.tokens],
                kv_cache,
                native.block_tables,
                native.seq_lens,
                scale,
                out[native.tokens],
                native.window,
            )
        else:
            out[native.tokens] = load_cpu_kernels().paged_decode_attention(
                q[native.tokens], kv_cache, native.block_tables, native.seq_lens, scale, None, native.window
            )

    def _has_native_decode(self, device: torch.device) -> bool:
        return self.use_cpu_kernel and device.type == "cpu" and load_cpu_kernels() is not None

    # ------------------------------------------------------------------ planning

    def _plan(self, md: AttentionMetadata, block_size: int, row_elems: int, window: int | None) -> _StepPlan:
        query_lens, seq_lens = md.host_lens()
        starts = [0]
        for query_len in query_lens:
            starts.append(starts[-1] + query_len)
        device = md.block_tables.device
        native = self._has_native_decode(device)
        # With the kernel, a speculative step's short queries (1 + k tokens) are that many decode rows: token j
        # of q attends to the keys up to its own position, which this step's K/V write has already filled.
        # (Not in other steps: a prefix hit's last few prompt tokens then match the full prompt's bit for bit.)
        max_decode_len = min(md.max_verify_query_len, MAX_NATIVE_QUERY_LEN) if native else 1
        decodes = [i for i, query_len in enumerate(query_lens) if query_len <= max_decode_len]
        native_decode, chunks = None, []
        if decodes and native:
            native_decode = self._plan_native_decode(decodes, starts, query_lens, seq_lens, md, window or 0)
        elif decodes:
            chunks = [
                self._plan_decode_chunk(chunk, starts, seq_lens, md.block_tables, block_size, window, device)
                for chunk in self._decode_chunks(decodes, seq_lens, block_size, row_elems, window)
            ]
        prefills = [
            self._plan_prefill(i, starts, query_lens[i], seq_lens[i], md.block_tables, block_size, window, device)
            for i, query_len in enumerate(query_lens)
            if query_len > max_decode_len
        ]
        return _StepPlan(native_decode, chunks, prefills)

    @staticmethod
    def _plan_native_decode(
        decodes: list[int],
        starts: list[int],
        query_lens: list[int],
        seq_lens: list[int],
        md: AttentionMetadata,
        window: int,
    ) -> _NativeDecode:
        """One kernel row per query token of ``decodes``: row (i, j) reads request i's first
        ``seq_lens[i] - query_lens[i] + 1 + j`` keys through its block table."""
        if decodes == list(range(len(decodes))) and starts[len(decodes)] == len(decodes):  # running decodes first
            tokens: slice | torch.Tensor = slice(0, len(decodes))
            block_tables, row_seq_lens = md.block_tables[: len(decodes)], md.seq_lens[: len(decodes)]
            return _NativeDecode(
                tokens, block_tables.to(torch.int32).contiguous(), row_seq_lens.to(torch.int32), window
            )
        rows, token_ids, lens = [], [], []
        for i in decodes:
            first = seq_lens[i] - query_lens[i] + 1
            rows.extend([i] * query_lens[i])
            token_ids.extend(range(starts[i], starts[i] + query_lens[i]))
            lens.extend(range(first, seq_lens[i] + 1))
        block_tables = md.block_tables[torch.tensor(rows, dtype=torch.long)]
        tokens = torch.tensor(token_ids, dtype=torch.long)
        lens_tensor = torch.tensor(lens, dtype=torch.int32)
        return _NativeDecode(tokens, block_tables.to(torch.int32).contiguous(), lens_tensor, window)

    def _decode_chunks(
        self, decodes: list[int], seq_lens: list[int], block_size: int, row_elems: int, window: int | None
    ) -> list[list[int]]:
        """Group decode requests (sorted by length) so each padded gather stays under the budget."""
        order = sorted(decodes, key=lambda i: seq_lens[i])
        chunks: list[list[int]] = []
        current: list[int] = []
        for i in order:
            padded = _num_blocks_read(seq_lens[i], window, block_size) * block_size
            if current and (len(current) + 1) * padded * row_elems > self.decode_chunk_elems:
                chunks.append(current)
                current = []
            current.append(i)
        return chunks + [current] if current else chunks

    @staticmethod
    def _plan_decode_chunk(
        chunk: list[int],
        starts: list[int],
        seq_lens: list[int],
        block_tables: torch.Tensor,
        block_size: int,
        window: int | None,
        device,
    ) -> _DecodeChunk:
        first = chunk[0]
        is_contiguous = chunk == list(range(first, first + len(chunk))) and starts[first + len(chunk)] - starts[
            first
        ] == len(chunk)
        tokens = (
            slice(starts[first], starts[first] + len(chunk))
            if is_contiguous
            else torch.tensor([starts[i] for i in chunk], dtype=torch.long, device=device)
        )
        lens = torch.tensor([seq_lens[i] for i in chunk], device=device)  # [n]
        first_keys = torch.tensor([first_key(seq_lens[i] - 1, window) for i in chunk], device=device)  # [n]
        num_blocks = max(_num_blocks_read(seq_lens[i], window, block_size) for i in chunk)
        # Row r reads its blocks from the one holding its first key; past its last block, padding (masked).
        first_blocks = first_keys // block_size
        columns = (first_blocks[:, None] + torch.arange(num_blocks, device=device)).clamp(max=block_tables.shape[1] - 1)
        rows = torch.tensor(chunk, dtype=torch.long, device=device)
        block_ids = block_tables[rows[:, None], columns].reshape(-1).long()
        positions = first_blocks[:, None] * block_size + torch.arange(num_blocks * block_size, device=device)  # [n, S]
        mask = (positions < lens[:, None]) & (positions >= first_keys[:, None])
        return _DecodeChunk(tokens, block_ids, len(chunk), num_blocks, mask[:, None, None, :])

    @staticmethod
    def _plan_prefill(
        i: int,
        starts: list[int],
        query_len: int,
        seq_len: int,
        block_tables: torch.Tensor,
        block_size: int,
        window: int | None,
        device,
    ) -> _Prefill:
        context_len, start = seq_len - query_len, starts[i]
        if context_len == 0 and (window is None or window >= seq_len):  # plain causal over the chunk's own keys
            return _Prefill(start, start + query_len, seq_len, 0, None, None)
        first = first_key(context_len, window) // block_size * block_size  # 0 without context: the chunk's keys
        block_ids = block_tables[i, first // block_size : -(-seq_len // block_size)].long() if context_len else None
        mask = _mask(torch.arange(context_len, seq_len, device=device), first, seq_len, window)
        return _Prefill(start, start + query_len, seq_len, first, block_ids, mask)

    # ------------------------------------------------------------------ compute

    @staticmethod
    def _gather(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """cache [num_blocks, block_size, Hk, D] -> [len(block_ids) * block_size, Hk, D]."""
        num_blocks, block_size, hk, d = cache.shape
        rows = cache.view(num_blocks, block_size * hk * d).index_select(0, block_ids)
        return rows.view(-1, hk, d)

    def _decode_chunk(self, kv_cache: torch.Tensor, q: torch.Tensor, chunk: _DecodeChunk, scale: float) -> torch.Tensor:
        """q [n, H, D] -> [n, H, D]: each row attends to its own cached sequence."""
        n, hk = chunk.num_reqs, kv_cache.shape[3]
        keys = self._gather(kv_cache[0], chunk.block_ids).view(n, -1, hk, q.shape[2]).transpose(1, 2)  # [n, Hk, S, D]
        vals = self._gather(kv_cache[1], chunk.block_ids).view(n, -1, hk, q.shape[2]).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q.float().unsqueeze(2),
            keys.float(),
            vals.float(),
            attn_mask=chunk.mask,
            scale=scale,
            enable_gqa=q.shape[1] != hk,
        )  # [n, H, 1, D]
        return out.squeeze(2).to(q.dtype)

    def _prefill(
        self, kv_cache: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefill: _Prefill, scale: float
    ) -> torch.Tensor:
        """One request: q [Q, H, D] (new tokens k, v [Q, Hk, D]) over its seq_len keys -> [Q, H, D]."""
        hk = kv_cache.shape[3]
        if prefill.block_ids is None:  # as the cache holds them, which a later chunk or a prefix hit reads back
            keys, vals = k.to(kv_cache.dtype), v.to(kv_cache.dtype)
        else:
            num_keys = prefill.seq_len - prefill.first_key
            keys = self._gather(kv_cache[0], prefill.block_ids)[:num_keys]  # [S - first_key, Hk, D]
            vals = self._gather(kv_cache[1], prefill.block_ids)[:num_keys]
        dtype = product_dtype(q.dtype, q.device)  # float32 for bf16 on CPUs without bf16 matrix instructions
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0).to(dtype),
            keys.transpose(0, 1).unsqueeze(0).to(dtype),
            vals.transpose(0, 1).unsqueeze(0).to(dtype),
            attn_mask=prefill.mask,
            is_causal=prefill.mask is None,
            scale=scale,
            enable_gqa=q.shape[1] != hk,
        )  # [1, H, Q, D]
        return out[0].transpose(0, 1).to(q.dtype)


def first_key(position: int, window: int | None) -> int:
    """The first key position a query at ``position`` attends: ``position - window + 1`` (at least 0), or 0."""
    return 0 if window is None else max(0, position - window + 1)


def _num_blocks_read(seq_len: int, window: int | None, block_size: int) -> int:
    """Blocks a decode of ``seq_len`` keys reads: from the one holding its window's first key to its last."""
    return -(-seq_len // block_size) - first_key(seq_len - 1, window) // block_size


def _mask(query_positions: torch.Tensor, first: int, seq_len: int, window: int | None) -> torch.Tensor:
    """[Q, seq_len - first]: True where query position q sees key position k (``first`` on): causal, and
    ``q - window < k`` with a window."""
    key_positions = torch.arange(first, seq_len, device=query_positions.device)
    mask = key_positions[None, :] <= query_positions[:, None]
    if window is not None:
        mask &= key_positions[None, :] > query_positions[:, None] - window
    return mask
