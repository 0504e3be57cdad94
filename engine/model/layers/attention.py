"""GQA self-attention: packed qkv projection, optional per-head q/k RMSNorm, rope, paged attention, o_proj."""

from __future__ import annotations

import torch
from torch import nn

from engine.attention.backend import AttentionBackend
from engine.attention.metadata import AttentionMetadata
from engine.kernels.cpu import fused_cpu_ops
from engine.model.layers.cpu_prepack import NO_NATIVE_ROWS
from engine.model.layers.linear import QKVParallelLinear, RowParallelLinear
from engine.model.layers.norm import RMSNorm
from engine.model.layers.rotary import RotaryEmbedding


class SelfAttention(nn.Module):
    """[T, hidden] -> [T, hidden]. HF ``q_proj``/``k_proj``/``v_proj`` load into ``qkv_proj`` shards q/k/v.

    ``window``: a sliding window (each query attends its last ``window`` positions, its own included), or None
    for full causal attention; the backend applies it. No default: whoever builds a layer says which
    (``Architecture.attention_window(layer)``), so no model gets full attention by forgetting it."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rotary: RotaryEmbedding,
        backend: AttentionBackend,
        *,
        window: int | None,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm_eps: float | None = None,
        norm_class: type[RMSNorm] = RMSNorm,
        scale: float | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
    ):
        """``norm_class``: the q/k norms' (with ``qk_norm_eps``); ``scale``: the scores' factor (default
        ``head_dim ** -0.5``)."""
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            hidden_size, head_dim, num_heads, num_kv_heads, bias=qkv_bias, tp_rank=tp_rank, tp_size=tp_size
        )
        self.num_heads = self.qkv_proj.num_heads  # per rank
        self.num_kv_heads = self.qkv_proj.num_kv_heads  # per rank
        self.head_dim = head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        self.o_proj = RowParallelLinear(
            num_heads * head_dim, hidden_size, bias=o_bias, tp_rank=tp_rank, tp_size=tp_size
        )
        self.q_norm = norm_class(head_dim, qk_norm_eps) if qk_norm_eps is not None else None
        self.k_norm = norm_class(head_dim, qk_norm_eps) if qk_norm_eps is not None else None
        self.rotary = rotary  # shared by all layers; holds no parameters or buffers
        self.backend = backend
        self.window = window

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
        cos_sin: torch.Tensor | None = None,
        native_rows: range = NO_NATIVE_ROWS,
    ) -> torch.Tensor:
        """``native_rows``: the step's fact for the products (``cpu_prepack``)."""
        t = hidden.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(hidden, native_rows).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)  # [T, H, D]
        k = k.view(t, self.num_kv_heads, self.head_dim)  # [T, Hk, D]
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self._can_fuse_rope_and_cache(q, kv_cache, attn_metadata):
            # One pass: rope on q and k in place, then k and v into their cache slots.
            table = self.rotary.table(attn_metadata.max_seq_len - 1, q.device)
            fused_cpu_ops(q).rotary_embedding_and_cache(
                positions, q, k, v, table, kv_cache, attn_metadata.slot_mapping[:t]
            )
            out = self.backend.forward(
                kv_cache, q, k, v, attn_metadata, self.scale, kv_is_written=True, window=self.window
            )
        else:
            q, k = self.rotary(positions, q, k, cos_sin)
            out = self.backend.forward(kv_cache, q, k, v, attn_metadata, self.scale, window=self.window)  # [T, H*D]
        return self.o_proj(out, native_rows)

    def _can_fuse_rope_and_cache(self, q: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata) -> bool:
        return (
            self.backend.accepts_written_kv
            and fused_cpu_ops(q) is not None
            and kv_cache.is_contiguous()
            and q.shape[0] == md.num_actual_tokens
            and md.slot_mapping.dtype == torch.int64
        )
