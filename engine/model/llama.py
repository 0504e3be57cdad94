"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3 differ only by flags in ``Architecture``).

Parameter names follow Hugging Face (``model.layers.N.self_attn...``), except that
q/k/v are packed into ``qkv_proj`` and gate/up into ``gate_up_proj``;
``load_weights`` maps checkpoint names onto them. With pipeline parallelism a
model holds one stage: its share of the layers, plus the embedding on the first
stage and the final norm and LM head on the last.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from engine.attention.backend import AttentionBackend
from engine.attention.metadata import AttentionMetadata
from engine.distributed.parallel_state import get_pp_indices
from engine.model.architecture import Architecture
from engine.model.layers.attention import SelfAttention
from engine.model.layers.cpu_prepack import NO_NATIVE_ROWS, native_rows_of_step
from engine.model.layers.linear import LMHead, VocabEmbedding
from engine.model.layers.mlp import GatedMLP
from engine.model.layers.norm import RMSNorm
from engine.model.layers.rotary import RotaryEmbedding
from engine.model.loader import load_named_weights
from engine.sched.kv_cache_groups import layer_slots

# (packed param name part, checkpoint name part, shard id)
PACKED_MODULES = [
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
]
_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.")


class DecoderLayer(nn.Module):
    """Layer ``index`` of the stack; its attention takes the layer's window (``Architecture.attention_window``)."""

    norm_class = RMSNorm  # every norm's, the q/k norms' included

    def __init__(
        self,
        cfg: Architecture,
        index: int,
        rotary: RotaryEmbedding,
        backend: AttentionBackend,
        tp_rank: int,
        tp_size: int,
    ):
        super().__init__()
        self.self_attn = SelfAttention(
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            rotary,
            backend,
            qkv_bias=cfg.qkv_bias,
            o_bias=cfg.o_proj_bias,
            window=cfg.attention_window(index),
            qk_norm_eps=cfg.rms_norm_eps if cfg.has_qk_norm else None,
            norm_class=self.norm_class,
            scale=cfg.attention_scale,
            tp_rank=tp_rank,
            tp_size=tp_size,
        )
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, cfg.hidden_act, tp_rank, tp_size)
        self.input_layernorm = self.norm_class(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = self.norm_class(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, positions, hidden, residual, kv_cache, attn_metadata, cos_sin, native_rows=NO_NATIVE_ROWS
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) -> (mlp output, residual stream before it); the next norm adds them (vLLM's layout)."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, attn_metadata, cos_sin, native_rows)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden, native_rows), residual

    def native_decode_unfit(self) -> str | None:
        """Why ``engine.worker.native_decode``'s stack (rms norms, qkv with at most a bias, rope, paged
        attention, o_proj, SwiGLU, no other bias) does not compute this layer; None when it does."""
        attn, mlp = self.self_attn, self.mlp
        if attn.q_norm is not None:
            return "has q/k norms"
        if attn.o_proj.bias is not None or mlp.gate_up_proj.bias is not None or mlp.down_proj.bias is not None:
            return "has o_proj or MLP biases"
        if not mlp.is_silu:
            return "has an MLP activation other than SwiGLU's"
        return None


class PPMissingLayer(nn.Module):
    """Stands in for a decoder layer another pipeline stage holds, so layer indices keep HF's names."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("this decoder layer belongs to another pipeline stage")


class LlamaModel(nn.Module):
    """The decoder stack of one pipeline stage: layers ``[start_layer, end_layer)``.

    ``embed_tokens`` exists on the first stage only, ``norm`` on the last only
    (``None`` elsewhere); other stages' layers are parameterless ``PPMissingLayer``s. One rotary per rope
    the layers use (``Architecture.rope_of``: Gemma 3's sliding layers have their own); ``rotary``: layer 0's.
    ``kv_cache_groups``: the whole model's layers grouped by attention window; each local layer reads its
    group's attention metadata (``layer_groups``) and cache slot (``layer_cache_slots``).
    """

    layer_class = DecoderLayer

    def __init__(
        self,
        cfg: Architecture,
        backend: AttentionBackend,
        tp_rank: int = 0,
        tp_size: int = 1,
        pp_rank: int = 0,
        pp_size: int = 1,
    ):
        super().__init__()
        self.start_layer, self.end_layer = get_pp_indices(cfg.num_hidden_layers, pp_rank, pp_size)
        ropes = [cfg.rope_of(index) for index in range(cfg.num_hidden_layers)]
        distinct = [rope for index, rope in enumerate(ropes) if rope not in ropes[:index]]
        self.rotaries = tuple(RotaryEmbedding(cfg.head_dim, rope, cfg.max_position_embeddings) for rope in distinct)
        self.rotary = self.rotaries[0]
        is_first_stage, is_last_stage = pp_rank == 0, pp_rank == pp_size - 1
        self.embed_tokens = (
            VocabEmbedding(cfg.vocab_size, cfg.hidden_size, tp_rank, tp_size) if is_first_stage else None
        )
        self.layers = nn.ModuleList(
            self.layer_class(cfg, index, self.rotaries[distinct.index(ropes[index])], backend, tp_rank, tp_size)
            if self.start_layer <= index < self.end_layer
            else PPMissingLayer()
            for index in range(cfg.num_hidden_layers)
        )
        # A plain tuple, not a registered submodule: the layers stay named model.layers.N.
        self.local_layers = tuple(self.layers[self.start_layer : self.end_layer])
        self.kv_cache_groups = cfg.kv_cache_groups()
        slots = layer_slots(self.kv_cache_groups)
        self.layer_groups = tuple(slots[i][0] for i in range(self.start_layer, self.end_layer))
        self.layer_cache_slots = tuple(slots[i][1] for i in range(self.start_layer, self.end_layer))
        self.norm = self.layer_class.norm_class(cfg.hidden_size, cfg.rms_norm_eps) if is_last_stage else None

    def forward(self, input_ids, positions, kv_caches, attn_metadata, intermediate=None):
        cos_sins = {id(r): r.cos_sin_for(positions, attn_metadata.max_seq_len - 1) for r in self.rotaries}  # [T, 2, D]
        native_rows = native_rows_of_step(attn_metadata.max_verify_query_len)  # a verify step's few rows
        if intermediate is None:
            hidden, residual = self.embed_tokens(input_ids), None  # [T, hidden]
        else:
            hidden, residual = intermediate
        for layer, kv_cache, group in zip(self.local_layers, kv_caches, self.layer_groups, strict=True):
            metadata, cos_sin = attn_metadata.for_group(group), cos_sins[id(layer.self_attn.rotary)]
            hidden, residual = layer(positions, hidden, residual, kv_cache, metadata, cos_sin, native_rows)
        if self.norm is None:
            return hidden, residual
        return self.norm(hidden, residual)[0]


class LlamaForCausalLM(nn.Module):
    """Interface used by the model runner (one pipeline stage of one tensor-parallel rank).

    * ``forward(input_ids [T], positions [T], kv_caches, attn_metadata, intermediate=None)``: tokens of
      all requests flattened (see ``engine/attention/metadata.py``); ``kv_caches`` holds one tensor per
      layer *of this stage* shaped ``backend.get_kv_cache_shape(num_blocks, block_size, num_kv_heads_local,
      head_dim)`` (``make_kv_caches`` allocates them). The first stage reads ``input_ids``; a later stage
      ignores them and takes ``intermediate = (hidden, residual)`` from the previous stage instead. The
      last stage returns hidden states [T, hidden_size]; any other stage returns ``(hidden, residual)``,
      each [T, hidden_size], for the next one.
    * ``compute_logits(hidden [n, hidden_size], native_rows=NO_NATIVE_ROWS) -> [n, vocab_size]`` float32
      (last stage only; with ``tp_size > 1`` a collective that every TP rank of the stage must call);
      ``native_rows``: the step's fact for the LM head's product (``cpu_prepack``).
    * ``native_decode_unfit()``: why ``engine.worker.native_decode``'s stack cannot run this model's
      decode steps, None when it can.
    * ``arch_config``: the ``Architecture``; ``num_local_layers``: the layers this stage holds.
    * ``kv_cache_groups``: the model's KV cache groups (``engine.sched.kv_cache_groups``): ``attn_metadata``
      is group 0's and carries the others' (``AttentionMetadata.for_group``); ``kv_caches`` holds one tensor
      per layer, layers of one cache slot sharing it (``num_kv_cache_tensors`` distinct ones on this stage).
    * ``wants_weight(name)``: whether this rank loads checkpoint tensor ``name`` (others are never read).
    """

    model_class = LlamaModel

    def __init__(
        self,
        arch_config: Architecture,
        backend: AttentionBackend,
        tp_rank: int = 0,
        tp_size: int = 1,
        pp_rank: int = 0,
        pp_size: int = 1,
    ):
        super().__init__()
        self.arch_config = arch_config
        self.backend = backend
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.pp_rank, self.pp_size = pp_rank, pp_size
        self.model = self.model_class(arch_config, backend, tp_rank, tp_size, pp_rank, pp_size)
        self.lm_head = None
        if pp_rank == pp_size - 1:
            # Tied with pp_size > 1: the embedding lives on the first stage, so the last stage holds its
            # own copy, loaded from model.embed_tokens.weight (load_weights renames it).
            tied = self.model.embed_tokens if arch_config.tie_word_embeddings else None
            self.lm_head = LMHead(arch_config.vocab_size, arch_config.hidden_size, tp_rank, tp_size, tied_to=tied)

    @property
    def num_local_layers(self) -> int:
        return self.model.end_layer - self.model.start_layer

    @property
    def kv_cache_groups(self):
        return self.model.kv_cache_groups

    @property
    def num_kv_cache_tensors(self) -> int:
        return len(set(self.model.layer_cache_slots))

    @property
    def num_kv_heads_local(self) -> int:
        return self.model.local_layers[0].self_attn.num_kv_heads

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
        intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return self.model(input_ids, positions, kv_caches, attn_metadata, intermediate)

    def compute_logits(self, hidden: torch.Tensor, native_rows: range = NO_NATIVE_ROWS) -> torch.Tensor:
        return self.lm_head(hidden, native_rows).float()

    def native_decode_unfit(self) -> str | None:
        if self.tp_size > 1 or self.pp_size > 1:
            return f"tensor or pipeline parallel (tp {self.tp_size}, pp {self.pp_size})"
        for index, layer in enumerate(self.model.local_layers):
            reason = layer.native_decode_unfit()
            if reason is not None:
                return f"layer {index} {reason}"
        return None

    def get_kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Shape of one layer's cache on this rank."""
        return self.backend.get_kv_cache_shape(
            num_blocks, block_size, self.num_kv_heads_local, self.arch_config.head_dim
        )

    def make_kv_caches(
        self,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> list[torch.Tensor]:
        """Zeroed caches, one per layer of this stage, layers of one cache slot sharing theirs (dtype/device
        default to the model's)."""
        w = self.model.local_layers[0].input_layernorm.weight
        slots = sorted(set(self.model.layer_cache_slots))
        tensors = self.backend.allocate_kv_caches(
            len(slots),
            num_blocks,
            block_size,
            self.num_kv_heads_local,
            self.arch_config.head_dim,
            dtype or w.dtype,
            device or w.device,
        )
        by_slot = dict(zip(slots, tensors))
        return [by_slot[slot] for slot in self.model.layer_cache_slots]

    def wants_weight(self, name: str) -> bool:
        """Whether checkpoint tensor ``name`` belongs to this stage.

        Only other stages' weights are refused; names this model does not know
        are wanted, so that loading reports them as unexpected.
        """
        layer_index = _layer_index(name)
        if layer_index is not None:
            out_of_range = layer_index >= self.arch_config.num_hidden_layers
            return out_of_range or self.model.start_layer <= layer_index < self.model.end_layer
        is_tied = self.arch_config.tie_word_embeddings
        if name.startswith("lm_head."):
            return self.lm_head is not None and not is_tied  # a tied checkpoint may carry a copy: unused
        if name.startswith("model.embed_tokens."):
            return self.model.embed_tokens is not None or (is_tied and self.lm_head is not None)
        if name.startswith("model.norm."):
            return self.model.norm is not None
        return True

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load (checkpoint name, tensor) pairs of this stage; raises listing missing / unexpected names.

        Pairs ``wants_weight`` refuses are skipped, so the full checkpoint may be passed.
        """
        load_named_weights(self, self.stage_weights(weights), PACKED_MODULES, skip_suffixes=["rotary_emb.inv_freq"])

    def stage_weights(self, weights: Iterable[tuple[str, object]]) -> Iterator[tuple[str, object]]:
        """The (name, tensor) pairs of this stage, under the names its parameters load them by."""
        head_copies_embedding = self.arch_config.tie_word_embeddings and self.model.embed_tokens is None
        for name, tensor in weights:
            if not self.wants_weight(name):
                continue
            if head_copies_embedding and name == "model.embed_tokens.weight":
                name = "lm_head.weight"
            yield name, tensor


def _layer_index(name: str) -> int | None:
    """N of ``model.layers.N.…``; None for weights outside the decoder layers."""
    match = _LAYER_NAME.match(name)
    return int(match.group(1)) if match else None
