"""Paged attention in plain torch (the CPU backend; also runs on any torch device).

KV cache per layer: [2, num_blocks, block_size, num_kv_heads, head_dim]
(index 0 = keys, 1 = values). Block 0 is the reserved null block: it is never
written (the runner never maps a slot into it) and pads block tables. Caches
must hold finite values everywhere (``allocate_kv_caches`` zeroes them), since
padded key positions are masked but still multiplied.

Forward plan (see ``backend.py`` for the contract):

1. write the K/V of every new token at ``slot_mapping`` (one ``index_copy_``);
2. decodes (requests with one new token): sorted by length, gathered from the
   block table into padded [n, S, Hk, D] tensors in chunks bounded by
   ``decode_chunk_elems``, one masked SDPA call per chunk;
3. prefills (chunks, with or without cached context): one SDPA call per
   request, ``is_causal`` when nothing is cached, an explicit mask otherwise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.backend import AttentionBackend, register_backend
from engine.attention.metadata import AttentionMetadata


def _cpu_lists(md: AttentionMetadata) -> tuple[list[int], list[int]]:
    """(query_lens, seq_lens) as Python lists, derived from tensors if the runner left them empty."""
    if md.seq_lens_cpu and md.query_lens_cpu:
        return md.query_lens_cpu, md.seq_lens_cpu
    qsl = md.query_start_loc.tolist()
    return [b - a for a, b in zip(qsl, qsl[1:])], md.seq_lens.tolist()


class TorchPagedAttention(AttentionBackend):
    name = "torch"

    def __init__(self, decode_chunk_elems: int = 1 << 24):
        # Upper bound on gathered K (or V) elements per decode SDPA call.
        self.decode_chunk_elems = decode_chunk_elems

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

    def forward(self, kv_cache: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                attn_metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        md = attn_metadata
        n = md.num_actual_tokens
        q, k, v = q[:n], k[:n], v[:n]
        self.write_kv(kv_cache, k, v, md.slot_mapping[:n])
        query_lens, seq_lens = _cpu_lists(md)
        starts = [0]
        for ql in query_lens:
            starts.append(starts[-1] + ql)
        out = torch.empty_like(q)  # [T, H, D]
        decodes = [i for i, ql in enumerate(query_lens) if ql == 1]
        if decodes:
            self._decodes(kv_cache, q, out, decodes, starts, seq_lens, md.block_tables, scale)
        for i, ql in enumerate(query_lens):
            if ql > 1:
                s = starts[i]
                out[s:s + ql] = self._prefill(kv_cache, q[s:s + ql], k[s:s + ql], v[s:s + ql],
                                              seq_lens[i], md.block_tables[i], scale)
        return out.reshape(n, -1)  # [T, H*D]

    def _decode_chunks(self, decodes: list[int], seq_lens: list[int], block_size: int,
                       row_elems: int) -> list[list[int]]:
        """Group decode requests (sorted by length) so each padded gather stays under the budget."""
        order = sorted(decodes, key=lambda i: seq_lens[i])
        chunks: list[list[int]] = []
        cur: list[int] = []
        for i in order:
            padded = -(-seq_lens[i] // block_size) * block_size
            if cur and (len(cur) + 1) * padded * row_elems > self.decode_chunk_elems:
                chunks.append(cur)
                cur = []
            cur.append(i)
        return chunks + [cur] if cur else chunks

    def _decodes(self, kv_cache, q, out, decodes, starts, seq_lens, block_tables, scale) -> None:
        block_size, hk, d = kv_cache.shape[2:]
        for chunk in self._decode_chunks(decodes, seq_lens, block_size, hk * d):
            contiguous = chunk == list(range(chunk[0], chunk[0] + len(chunk))) and \
                starts[chunk[0] + len(chunk)] - starts[chunk[0]] == len(chunk)
            if contiguous:
                tok = slice(starts[chunk[0]], starts[chunk[0]] + len(chunk))
            else:
                tok = torch.tensor([starts[i] for i in chunk], dtype=torch.long, device=q.device)
            max_len = max(seq_lens[i] for i in chunk)  # chunk is sorted: the last one
            nblk = -(-max_len // block_size)
            reqs = torch.tensor(chunk, dtype=torch.long, device=q.device)
            lens = torch.tensor([seq_lens[i] for i in chunk], device=q.device)
            res = self._decode_chunk(kv_cache, q[tok], block_tables[reqs, :nblk].long(), lens, scale)
            out[tok] = res

    @staticmethod
    def _decode_chunk(kv_cache, q, blocks, lens, scale) -> torch.Tensor:
        """q [n, H, D], blocks [n, nblk], lens [n] -> [n, H, D]."""
        n, nblk = blocks.shape
        _, _, block_size, hk, d = kv_cache.shape
        keys = kv_cache[0][blocks].view(n, nblk * block_size, hk, d).transpose(1, 2)  # [n, Hk, S, D]
        vals = kv_cache[1][blocks].view(n, nblk * block_size, hk, d).transpose(1, 2)
        pos = torch.arange(nblk * block_size, device=q.device)
        mask = (pos[None, :] < lens[:, None])[:, None, None, :]  # [n, 1, 1, S]
        o = F.scaled_dot_product_attention(q.unsqueeze(2), keys.to(q.dtype), vals.to(q.dtype), attn_mask=mask,
                                           scale=scale,
                                           enable_gqa=q.shape[1] != hk)  # [n, H, 1, D]
        return o.squeeze(2)

    @staticmethod
    def _prefill(kv_cache, q, k, v, seq_len: int, block_row: torch.Tensor, scale: float) -> torch.Tensor:
        """One request: q [Q, H, D] (new tokens k, v [Q, Hk, D]) over its seq_len keys -> [Q, H, D]."""
        ql = q.shape[0]
        ctx = seq_len - ql
        hk = kv_cache.shape[3]
        if ctx == 0:
            keys, vals, mask = k, v, None
        else:
            block_size, d = kv_cache.shape[2], kv_cache.shape[4]
            blocks = block_row[: -(-seq_len // block_size)].long()
            keys = kv_cache[0][blocks].view(-1, hk, d)[:seq_len]  # [S, Hk, D]
            vals = kv_cache[1][blocks].view(-1, hk, d)[:seq_len]
            key_pos = torch.arange(seq_len, device=q.device)
            q_pos = torch.arange(ctx, seq_len, device=q.device)
            mask = key_pos[None, :] <= q_pos[:, None]  # [Q, S]
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), keys.transpose(0, 1).unsqueeze(0).to(q.dtype),
            vals.transpose(0, 1).unsqueeze(0).to(q.dtype), attn_mask=mask, is_causal=mask is None,
            scale=scale, enable_gqa=q.shape[1] != hk)  # [1, H, Q, D]
        return o[0].transpose(0, 1)


register_backend("torch", TorchPagedAttention)
