"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3 differ only by flags in ``ModelArchConfig``).

Parameter names follow Hugging Face (``model.layers.N.self_attn...``), except that
q/k/v are packed into ``qkv_proj`` and gate/up into ``gate_up_proj``;
``load_weights`` maps checkpoint names onto them.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from engine.attention.backend import AttentionBackend
from engine.attention.metadata import AttentionMetadata
from engine.model.config import ModelArchConfig
from engine.model.layers.attention import SelfAttention
from engine.model.layers.linear import LMHead, VocabEmbedding
from engine.model.layers.mlp import SwiGLUMLP
from engine.model.layers.norm import RMSNorm
from engine.model.layers.rotary import RotaryEmbedding
from engine.model.loader import load_named_weights

# (packed param name part, checkpoint name part, shard id)
PACKED_MODULES = [
    ("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1),
]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelArchConfig, rotary: RotaryEmbedding, backend: AttentionBackend,
                 tp_rank: int, tp_size: int):
        super().__init__()
        self.self_attn = SelfAttention(
            cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, rotary, backend,
            qkv_bias=cfg.qkv_bias, o_bias=cfg.o_proj_bias,
            qk_norm_eps=cfg.rms_norm_eps if cfg.has_qk_norm else None, tp_rank=tp_rank, tp_size=tp_size)
        self.mlp = SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, cfg.hidden_act, tp_rank, tp_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, hidden, residual, kv_cache, attn_metadata, cos_sin
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) -> (mlp output, residual stream before it); the next norm adds them (vLLM's layout)."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, attn_metadata, cos_sin)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelArchConfig, backend: AttentionBackend, tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_scaling, cfg.max_position_embeddings)
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, tp_rank, tp_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, self.rotary, backend, tp_rank, tp_size) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids, positions, kv_caches, attn_metadata) -> torch.Tensor:
        cos_sin = self.rotary.cos_sin_for(positions, attn_metadata.max_seq_len - 1)  # [T, 2, D]
        hidden = self.embed_tokens(input_ids)  # [T, hidden]
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(positions, hidden, residual, kv_cache, attn_metadata, cos_sin)
        return self.norm(hidden, residual)[0]


class LlamaForCausalLM(nn.Module):
    """Interface used by the model runner.

    * ``forward(input_ids [T], positions [T], kv_caches, attn_metadata) -> hidden [T, hidden_size]``:
      tokens of all requests flattened (see ``engine/attention/metadata.py``); ``kv_caches`` holds one
      tensor per layer shaped ``backend.get_kv_cache_shape(num_blocks, block_size, num_kv_heads_local, head_dim)``
      (``make_kv_caches`` allocates them).
    * ``compute_logits(hidden [n, hidden_size]) -> [n, vocab_size]`` float32.
    * ``arch_config``: the ``ModelArchConfig``.
    """

    def __init__(self, arch_config: ModelArchConfig, backend: AttentionBackend, tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        self.arch_config = arch_config
        self.backend = backend
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.model = LlamaModel(arch_config, backend, tp_rank, tp_size)
        tied = self.model.embed_tokens if arch_config.tie_word_embeddings else None
        self.lm_head = LMHead(arch_config.vocab_size, arch_config.hidden_size, tp_rank, tp_size, tied_to=tied)

    @property
    def num_kv_heads_local(self) -> int:
        return self.model.layers[0].self_attn.num_kv_heads

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def get_kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Shape of one layer's cache on this rank."""
        return self.backend.get_kv_cache_shape(num_blocks, block_size, self.num_kv_heads_local,
                                               self.arch_config.head_dim)

    def make_kv_caches(self, num_blocks: int, block_size: int, dtype: torch.dtype | None = None,
                       device: torch.device | str | None = None) -> list[torch.Tensor]:
        """Zeroed caches, one per layer (dtype/device default to the model's)."""
        w = self.model.norm.weight
        return self.backend.allocate_kv_caches(
            self.arch_config.num_hidden_layers, num_blocks, block_size, self.num_kv_heads_local,
            self.arch_config.head_dim, dtype or w.dtype, device or w.device)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load (checkpoint name, tensor) pairs; raises listing missing / unexpected names."""
        skip = ["rotary_emb.inv_freq"]
        if self.arch_config.tie_word_embeddings:
            skip.append("lm_head.weight")
        load_named_weights(self, weights, PACKED_MODULES, skip_suffixes=skip)
