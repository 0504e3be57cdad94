"""GQA self-attention: packed qkv projection, optional per-head q/k RMSNorm, rope, paged attention, o_proj."""

from __future__ import annotations

import torch
from torch import nn

from engine.attention.backend import AttentionBackend
from engine.attention.metadata import AttentionMetadata
from engine.model.layers.linear import QKVParallelLinear, RowParallelLinear
from engine.model.layers.norm import RMSNorm
from engine.model.layers.rotary import RotaryEmbedding


class SelfAttention(nn.Module):
    """[T, hidden] -> [T, hidden]. HF ``q_proj``/``k_proj``/``v_proj`` load into ``qkv_proj`` shards q/k/v."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 rotary: RotaryEmbedding, backend: AttentionBackend, *, qkv_bias: bool = False,
                 o_bias: bool = False, qk_norm_eps: float | None = None, tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        self.qkv_proj = QKVParallelLinear(hidden_size, head_dim, num_heads, num_kv_heads,
                                          bias=qkv_bias, tp_rank=tp_rank, tp_size=tp_size)
        self.num_heads = self.qkv_proj.num_heads        # per rank
        self.num_kv_heads = self.qkv_proj.num_kv_heads  # per rank
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden_size, bias=o_bias,
                                        tp_rank=tp_rank, tp_size=tp_size)
        self.q_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm_eps is not None else None
        self.k_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm_eps is not None else None
        self.rotary = rotary  # shared by all layers; holds no parameters or buffers
        self.backend = backend

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: AttentionMetadata, cos_sin: torch.Tensor | None = None) -> torch.Tensor:
        t = hidden.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(hidden).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)     # [T, H, D]
        k = k.view(t, self.num_kv_heads, self.head_dim)  # [T, Hk, D]
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k, cos_sin)
        out = self.backend.forward(kv_cache, q, k, v, attn_metadata, self.scale)  # [T, H*D]
        return self.o_proj(out)
