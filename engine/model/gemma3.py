"""Gemma 3's text decoder (``Gemma3ForCausalLM``, and the language model of ``Gemma3ForConditionalGeneration``).

The Llama decoder with Gemma's differences, as transformers computes them (``modeling_gemma3``):

* every norm (the q/k norms included) is ``GemmaRMSNorm``: x * (1 + w), in float32;
* four norms a layer: the attention's output is normed before it joins the residual stream
  (``post_attention_layernorm``), and the MLP sits between ``pre_feedforward_layernorm`` and
  ``post_feedforward_layernorm``;
* the MLP is GeGLU (``hidden_activation: gelu_pytorch_tanh``), the scores scale by
  ``query_pre_attn_scalar ** -0.5``, the sliding layers rotate by their own base (``Architecture.rope_of``),
  all set in ``Architecture`` and built by the Llama layers;
* the embedding is scaled by sqrt(hidden_size), rounded to the model's dtype first;
* ``final_logit_softcapping``, when set: logits -> cap * tanh(logits / cap). ``attn_logit_softcapping`` (on the
  scores) is refused: no attention backend computes it.

A ``Gemma3ForConditionalGeneration`` checkpoint serves as text only: its language model's weights
(``model.language_model.*`` as transformers 5 saves them, ``language_model.model.*`` as 4.x did) load under
``Gemma3ForCausalLM``'s names, and its vision tower and projector are never read.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

from engine.attention.backend import AttentionBackend
from engine.model.architecture import Architecture
from engine.model.layers.cpu_prepack import NO_NATIVE_ROWS
from engine.model.layers.norm import GemmaRMSNorm
from engine.model.layers.rotary import RotaryEmbedding
from engine.model.llama import DecoderLayer, LlamaForCausalLM, LlamaModel

# A multimodal checkpoint's language-model names -> Gemma3ForCausalLM's (transformers 5, then 4.x).
_TEXT_PREFIXES = (
    (re.compile(r"^model\.language_model\."), "model."),
    (re.compile(r"^language_model\.model\."), "model."),
    (re.compile(r"^language_model\.lm_head\."), "lm_head."),
)
_VISION_PREFIXES = ("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.", "multi_modal_projector.")


class Gemma3DecoderLayer(DecoderLayer):
    norm_class = GemmaRMSNorm

    def __init__(
        self,
        cfg: Architecture,
        index: int,
        rotary: RotaryEmbedding,
        backend: AttentionBackend,
        tp_rank: int,
        tp_size: int,
    ):
        super().__init__(cfg, index, rotary, backend, tp_rank, tp_size)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, positions, hidden, residual, kv_cache, attn_metadata, cos_sin, native_rows=NO_NATIVE_ROWS
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) -> (the normed MLP output, the residual stream before it), as ``DecoderLayer``."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, attn_metadata, cos_sin, native_rows)
        hidden, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(hidden), residual)
        return self.post_feedforward_layernorm(self.mlp(hidden, native_rows)), residual

    def native_decode_unfit(self) -> str | None:
        return "is Gemma's (four norms a layer, each x * (1 + w); GeGLU)"


class Gemma3Model(LlamaModel):
    """``LlamaModel`` of ``Gemma3DecoderLayer``s whose embedding is scaled by sqrt(hidden_size)."""

    layer_class = Gemma3DecoderLayer

    def __init__(self, cfg: Architecture, backend: AttentionBackend, *args, **kwargs):
        super().__init__(cfg, backend, *args, **kwargs)
        # transformers multiplies in the model's dtype (built under it: get_model's default dtype), by the scale
        # rounded to it (bfloat16: 25.25 for 640).
        self.embed_scale = float(torch.tensor(cfg.hidden_size**0.5).to(torch.get_default_dtype()))

    def forward(self, input_ids, positions, kv_caches, attn_metadata, intermediate=None):
        if intermediate is None:
            intermediate = (self.embed_tokens(input_ids) * self.embed_scale, None)
        return super().forward(input_ids, positions, kv_caches, attn_metadata, intermediate)


class Gemma3ForCausalLM(LlamaForCausalLM):
    """``LlamaForCausalLM``'s interface over ``Gemma3Model``; logits soft-capped where the config says."""

    model_class = Gemma3Model

    def __init__(self, arch_config: Architecture, backend: AttentionBackend, *args, **kwargs):
        if arch_config.attn_logit_softcapping is not None:
            raise NotImplementedError(
                f"attn_logit_softcapping={arch_config.attn_logit_softcapping}: no attention backend caps the "
                "attention scores (Gemma 3 sets none; this checkpoint's config does)"
            )
        super().__init__(arch_config, backend, *args, **kwargs)
        self.logit_cap = arch_config.final_logit_softcapping

    def compute_logits(self, hidden: torch.Tensor, native_rows: range = NO_NATIVE_ROWS) -> torch.Tensor:
        logits = super().compute_logits(hidden, native_rows)
        if self.logit_cap is None:
            return logits
        return torch.tanh(logits / self.logit_cap) * self.logit_cap

    def wants_weight(self, name: str) -> bool:
        text_name = _text_name(name)
        return text_name is not None and super().wants_weight(text_name)

    def stage_weights(self, weights: Iterable[tuple[str, object]]) -> Iterator[tuple[str, object]]:
        text_weights = ((_text_name(name), tensor) for name, tensor in weights)
        return super().stage_weights((name, tensor) for name, tensor in text_weights if name is not None)


def _text_name(name: str) -> str | None:
    """The ``Gemma3ForCausalLM`` name of checkpoint tensor ``name``; None for a vision tower's or projector's."""
    if name.startswith(_VISION_PREFIXES):
        return None
    for pattern, replacement in _TEXT_PREFIXES:
        name, count = pattern.subn(replacement, name)
        if count:
            return name
    return name
