"""The architecture of a checkpoint, read once from its Hugging Face ``config.json`` (or a GGUF file's metadata).

``Architecture`` is the only view of the HF config the rest of the engine
sees: a frozen dataclass with every field the model code, the KV cache sizing
and the tokenizer glue need, normalised across transformers 4.x / 5.x spellings
(5.x writes ``rope_parameters`` holding ``rope_theta``, per layer type for Gemma 3;
4.x writes top-level ``rope_theta`` plus an optional ``rope_scaling`` dict, sometimes
with ``type`` instead of ``rope_type``, and Gemma 3's ``rope_local_base_freq``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.sched.kv_cache_groups import KVCacheGroup, kv_cache_groups

# Rope types this engine implements (see layers/rotary.py).
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")

# Architectures whose q/k/v projections always carry a bias (o_proj never does).
_QKV_BIAS_ARCHS = ("Qwen2ForCausalLM",)
_QK_NORM_ARCHS = ("Qwen3ForCausalLM", "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
_PER_LAYER_TYPE = frozenset({"full_attention", "sliding_attention"})  # rope_parameters' keys, when per layer type

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float": torch.float32,
    "half": torch.float16,
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
}


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """``"bfloat16"`` / ``"torch.bfloat16"`` / ``torch.bfloat16`` -> ``torch.bfloat16``."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def _rope_params(cfg: dict[str, Any], layer_type: str = "full_attention") -> dict[str, Any]:
    """Merge ``rope_parameters`` / ``rope_scaling`` / ``rope_theta`` into one flat dict: the rope of the layers of
    ``layer_type``, which only Gemma 3 tells apart (5.x: ``rope_parameters`` per layer type; 4.x: ``rope_scaling``
    and ``rope_theta`` for the full-attention layers, ``rope_local_base_freq`` for the sliding ones).

    The result always has ``rope_type`` and ``rope_theta``; llama3 and yarn also
    get ``original_max_position_embeddings`` (defaulting like transformers does).
    """
    full = layer_type == "full_attention"
    parameters = cfg.get("rope_parameters") or {}
    if _PER_LAYER_TYPE.intersection(parameters):
        parameters = parameters.get(layer_type) or {}
    params = dict(cfg.get("rope_scaling") or {}) if full else {}
    params.update(parameters)
    params.setdefault("rope_type", params.get("type", "default"))
    params.pop("type", None)
    if params.get("rope_theta") is None:
        params["rope_theta"] = cfg.get("rope_theta" if full else "rope_local_base_freq", 10000.0)
    if params["rope_type"] in ("llama3", "yarn"):
        params.setdefault(
            "original_max_position_embeddings",
            cfg.get("original_max_position_embeddings", cfg.get("max_position_embeddings")),
        )
    if params["rope_type"] not in SUPPORTED_ROPE_TYPES:
        raise NotImplementedError(
            f"rope_type {params['rope_type']!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}"
        )
    if params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) not in (None, 1.0):
        raise NotImplementedError("partial_rotary_factor != 1 is not supported")
    return params


def _sliding_rope(cfg: dict[str, Any]) -> dict[str, Any]:
    """The rope of the sliding-attention layers where it differs from the others' (Gemma 3); else ``{}``."""
    if not _PER_LAYER_TYPE.intersection(cfg.get("rope_parameters") or {}) and "rope_local_base_freq" not in cfg:
        return {}
    sliding = _rope_params(cfg, "sliding_attention")
    return {} if sliding == _rope_params(cfg) else sliding


def _first_id(value: Any) -> int | None:
    return value[0] if isinstance(value, list) and value else value


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (value,)


def _sliding_layers(cfg: dict[str, Any]) -> tuple[int | None, tuple[str, ...]]:
    """The sliding window and the per-layer attention types, as transformers derives them.

    Explicit ``layer_types`` win; else Gemma's ``sliding_window_pattern`` (every n-th layer full); else a set
    ``sliding_window`` applies to every layer (Mistral), or for Qwen2 / Qwen3 only with ``use_sliding_window``
    and from layer ``max_window_layers`` on.
    """
    window, layers = cfg.get("sliding_window"), cfg["num_hidden_layers"]
    if cfg.get("use_sliding_window") is False:
        window = None
    if window is None:
        return None, ()
    if cfg.get("layer_types"):
        types = tuple(cfg["layer_types"])
    elif cfg.get("sliding_window_pattern"):
        pattern = cfg["sliding_window_pattern"]
        types = tuple("sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers))
    else:
        first = cfg.get("max_window_layers", 0) if "use_sliding_window" in cfg else 0
        types = tuple("sliding_attention" if i >= first else "full_attention" for i in range(layers))
    if len(types) != layers:
        raise ValueError(f"config.json has {len(types)} layer_types for {layers} layers")
    return (window, types) if "sliding_attention" in types else (None, ())


def _attention_fields(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    """The ``Architecture`` fields of the attention layers: biases, q/k norms, scale, windows, per-layer rope."""
    if cfg.get("use_bidirectional_attention"):
        raise NotImplementedError("use_bidirectional_attention (an encoder's attention) is not supported")
    attention_bias = bool(cfg.get("attention_bias", False))
    window, layer_types = _sliding_layers(cfg)
    sliding_rope = _sliding_rope(cfg)
    if sliding_rope and not layer_types:
        raise NotImplementedError("a rope of the sliding-attention layers' own without a sliding_window")
    return dict(
        qkv_bias=attention_bias or arch in _QKV_BIAS_ARCHS,
        o_proj_bias=attention_bias and arch not in _QKV_BIAS_ARCHS,
        has_qk_norm=arch in _QK_NORM_ARCHS,
        sliding_window=window,
        layer_types=layer_types,
        sliding_rope_scaling=sliding_rope,
        query_pre_attn_scalar=cfg.get("query_pre_attn_scalar"),
        attn_logit_softcapping=cfg.get("attn_logit_softcapping"),
    )


@dataclass(frozen=True)
class Architecture:
    """Architecture hyper-parameters of one decoder-only checkpoint (immutable)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_scaling: dict[str, Any] = field(default_factory=dict)  # full rope dict, incl. rope_type
    qkv_bias: bool = False  # bias on q/k/v projections
    o_proj_bias: bool = False  # bias on o_proj
    mlp_bias: bool = False  # bias on gate/up/down (llama's ``mlp_bias``)
    has_qk_norm: bool = False  # per-head RMSNorm on q and k before rope (qwen3)
    sliding_window: int | None = None  # the window of the layers ``layer_types`` names "sliding_attention"
    # Per layer, transformers' names: "full_attention" or "sliding_attention" (empty: every layer full).
    layer_types: tuple[str, ...] = ()
    # The rope of the "sliding_attention" layers where it differs from ``rope_scaling`` (Gemma 3's
    # rope_local_base_freq); empty: every layer rotates by ``rope_scaling`` (``rope_of``).
    sliding_rope_scaling: dict[str, Any] = field(default_factory=dict)
    query_pre_attn_scalar: float | None = None  # Gemma's: the scores scale by its ** -0.5 (``attention_scale``)
    final_logit_softcapping: float | None = None  # Gemma's: logits -> cap * tanh(logits / cap)
    attn_logit_softcapping: float | None = None  # Gemma 2's, on the attention scores (no model here computes it)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: torch.dtype | None = None  # dtype the checkpoint was saved in
    hidden_act: str = "silu"
    # Embeddings: the checkpoint was trained so that a prefix of its vector is one too (Matryoshka, vLLM's
    # ``is_matryoshka``), at any length or at these (``matryoshka_dimensions``); else ``dimensions`` is refused.
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None

    @property
    def rope_type(self) -> str:
        return self.rope_scaling.get("rope_type", "default")

    @property
    def attention_scale(self) -> float:
        """The factor of the attention scores q.k."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def rope_of(self, layer: int) -> dict[str, Any]:
        """The rope parameters of layer ``layer`` (``rope_scaling``'s form)."""
        sliding = self.layer_types and self.layer_types[layer] == "sliding_attention"
        return self.sliding_rope_scaling if sliding and self.sliding_rope_scaling else self.rope_scaling

    def attention_window(self, layer: int) -> int | None:
        """How many positions back layer ``layer`` attends (the query's own included); None: all of them."""
        sliding = self.layer_types and self.layer_types[layer] == "sliding_attention"
        return self.sliding_window if sliding else None

    def kv_cache_groups(self) -> tuple[KVCacheGroup, ...]:
        """The layers grouped by attention window, each group with its own KV blocks (``kv_cache_groups``)."""
        return kv_cache_groups([self.attention_window(i) for i in range(self.num_hidden_layers)])

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> Architecture:
        """Build from the parsed ``config.json`` dict; raises ``ValueError`` if it lacks fields."""
        cfg = dict(cfg.get("text_config") or {}, **{k: v for k, v in cfg.items() if k != "text_config"})
        archs = cfg.get("architectures") or []
        if not archs:
            raise ValueError("config.json has no 'architectures' entry")
        arch = archs[0]
        heads = cfg["num_attention_heads"]
        rope = _rope_params(cfg)
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            intermediate_size=cfg["intermediate_size"],
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope["rope_theta"]),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            rope_scaling=rope,
            **_attention_fields(cfg, arch),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            bos_token_id=_first_id(cfg.get("bos_token_id")),
            eos_token_ids=_eos_ids(cfg.get("eos_token_id")),
            torch_dtype=parse_dtype(cfg.get("dtype") or cfg.get("torch_dtype")),
            hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act", "silu"),  # Gemma's name first
            final_logit_softcapping=cfg.get("final_logit_softcapping"),
            is_matryoshka=bool(cfg.get("is_matryoshka") or cfg.get("matryoshka_dimensions")),
            matryoshka_dimensions=tuple(cfg["matryoshka_dimensions"]) if cfg.get("matryoshka_dimensions") else None,
        )

    @classmethod
    def from_model(cls, path: str | os.PathLike) -> Architecture:
        """The architecture of the model at ``path`` (a checkpoint directory or a .gguf file)."""
        from engine.model.source import open_model_source

        return cls.from_hf_config(open_model_source(os.fspath(path)).hf_config)
