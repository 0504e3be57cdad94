"""Gemma 3's text model against transformers' on tiny random checkpoints (float32): logits equal in prefill,
chunks and mixed batches (``check_fidelity``), for ``Gemma3ForCausalLM`` and for a
``Gemma3ForConditionalGeneration`` checkpoint (its language model; the vision tower is not read).

Every Gemma-specific field is set off its default so that an engine ignoring it fails: norms not at their
zero init, a score scale other than head_dim's, two rope bases, logits soft-capped. Windows are wider than
every prompt here (tests/engine/test_llm_sliding_window.py runs one shorter than its prompts). The transformers
4.x spelling of the rope fields gives the same architecture as 5.x's, and what no backend computes is refused.
"""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma3TextConfig

from engine.model import Architecture, get_model
from tests.engine.model.test_model_forward import PagedRunner, _tokens, check_fidelity, hf_logits

TINY_GEMMA = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=1,  # Gemma 3 270M's single KV head
    head_dim=32,
    vocab_size=256,
    max_position_embeddings=128,
    query_pre_attn_scalar=24,
    sliding_window=64,  # wider than every prompt below
    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
    },
    final_logit_softcapping=3.0,
)


def _jitter_norms(model) -> None:
    """Gemma's norms start at 0 (a scale of 1 + 0): move them so their loading and formula are tested."""
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)


def make_gemma3(path, **overrides):
    from transformers import Gemma3ForCausalLM

    torch.manual_seed(0)
    model = Gemma3ForCausalLM(Gemma3TextConfig(**{**TINY_GEMMA, **overrides})).eval()
    _jitter_norms(model)
    model.save_pretrained(path)
    return model


def test_gemma3_logits_match_hf(tmp_path):
    hf = make_gemma3(tmp_path)
    arch = Architecture.from_model(tmp_path)
    assert arch.layer_types[1] == "full_attention" and arch.rope_of(0)["rope_theta"] == 100.0
    assert arch.rope_of(1)["rope_theta"] == 1_000_000.0 and arch.attention_scale == 24**-0.5
    check_fidelity(str(tmp_path), hf)


def test_gemma3_conditional_generation_serves_its_language_model(tmp_path):
    """transformers 5 saves the text model under ``model.language_model.``; the vision tower is skipped. No logit
    cap: transformers' Gemma3ForConditionalGeneration applies none, whatever its text config says (Gemma 3's
    checkpoints set none)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig

    vision = SiglipVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
    )
    text = Gemma3TextConfig(**{**TINY_GEMMA, "final_logit_softcapping": None})
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
    torch.manual_seed(0)
    hf = Gemma3ForConditionalGeneration(config).eval()
    _jitter_norms(hf)
    hf.save_pretrained(tmp_path)
    model = get_model(str(tmp_path), torch.float32)
    assert model.arch_config.architecture == "Gemma3ForConditionalGeneration"
    tokens = _tokens(20, seed=2)
    runner = PagedRunner(model)
    runner.add(0, tokens)
    got = torch.cat([runner.step([(0, 13)])[0], runner.step([(0, 1)])[0], runner.step([(0, 6)])[0]])
    torch.testing.assert_close(got, hf_logits(hf, tokens), atol=1e-4, rtol=1e-4)


def test_transformers_4_rope_fields_give_the_same_architecture():
    """4.x wrote rope_theta (full layers), rope_local_base_freq (sliding) and sliding_window_pattern."""
    legacy = {
        **{k: v for k, v in TINY_GEMMA.items() if k not in ("rope_parameters", "layer_types")},
        "architectures": ["Gemma3ForCausalLM"],
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 100.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},  # the full layers' only, as in Gemma 3 4B
        "sliding_window_pattern": 2,
        "num_hidden_layers": 3,
    }
    current = {**Gemma3TextConfig(**legacy).to_dict(), "architectures": ["Gemma3ForCausalLM"]}
    old, new = Architecture.from_hf_config(legacy), Architecture.from_hf_config(current)
    assert old.layer_types == new.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    for layer in range(3):
        assert old.rope_of(layer) == new.rope_of(layer), layer
    assert new.rope_of(1) == {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0}
    assert new.rope_of(0) == {"rope_type": "default", "rope_theta": 100.0}


def test_attention_softcapping_is_refused(tmp_path):
    make_gemma3(tmp_path, attn_logit_softcapping=50.0)
    with pytest.raises(NotImplementedError, match="attn_logit_softcapping=50.0: no attention backend caps"):
        get_model(str(tmp_path), torch.float32)


@pytest.mark.parametrize("tp_rank", [0, 1])
def test_a_single_kv_head_is_replicated_under_tensor_parallelism(tmp_path, tp_rank):
    """Gemma 3 270M has one KV head: under TP=2 each rank holds it whole beside its half of the q heads."""
    hf = make_gemma3(tmp_path)
    model = get_model(str(tmp_path), torch.float32, tp_rank=tp_rank, tp_size=2)
    attn, weights = model.model.layers[0].self_attn, hf.state_dict()
    q = 2 * 32  # 2 of 4 q heads of dim 32
    want = torch.cat(
        [
            weights["model.layers.0.self_attn.q_proj.weight"][tp_rank * q : (tp_rank + 1) * q],
            weights["model.layers.0.self_attn.k_proj.weight"],
            weights["model.layers.0.self_attn.v_proj.weight"],
        ]
    )
    assert (attn.num_heads, attn.num_kv_heads) == (2, 1)
    torch.testing.assert_close(attn.qkv_proj.weight, want, rtol=0, atol=0)
    torch.testing.assert_close(attn.k_norm.weight, weights["model.layers.0.self_attn.k_norm.weight"], rtol=0, atol=0)
