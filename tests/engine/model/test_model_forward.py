"""Model definitions + loading vs Hugging Face transformers on tiny random checkpoints (float32)."""

from __future__ import annotations

import json
import os
import random

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from engine.attention import build_attention_metadata
from engine.kernels.cpu import use_cpu_kernels
from engine.model import Architecture, WeightLoadingError, get_model
from engine.model.layers.rotary import RotaryEmbedding, compute_inv_freq

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=128,
)
ARCHS = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "mistral": (MistralConfig, MistralForCausalLM, {"head_dim": 16}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 32}),  # explicit head_dim != hidden/heads
}
TOL = dict(atol=1e-4, rtol=1e-4)


def make_checkpoint(path, arch="llama", *, tie=False, shard=False, **overrides):
    """Save a random tiny HF model to ``path``; return the HF model (eval, float32)."""
    config_cls, model_cls, extra = ARCHS[arch]
    config = config_cls(**{**TINY, **extra, "tie_word_embeddings": tie, **overrides})
    torch.manual_seed(0)
    model = model_cls(config).eval()
    with torch.no_grad():  # make biases / norms non-trivial so their loading is tested
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path, safe_serialization=True, **({"max_shard_size": "100KB"} if shard else {}))
    return model


def hf_logits(hf, tokens):
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0]


class PagedRunner:
    """Minimal model runner: feeds scheduled chunks of known token lists through a paged cache. ``blocks[rid]`` are
    the request's blocks in KV cache group 0; a model with more groups (sliding-window layers) gets blocks of its
    own in each (``group_blocks``), none ever freed."""

    def __init__(self, model, block_size=4, num_blocks=96, seed=0):
        self.model, self.block_size = model, block_size
        self.caches = model.make_kv_caches(num_blocks, block_size)
        self.free = list(range(1, num_blocks))
        random.Random(seed).shuffle(self.free)  # non-contiguous block ids, block 0 reserved
        self.tokens, self.done, self.blocks, self.group_blocks = {}, {}, {}, {}
        self.groups = len(model.model.kv_cache_groups)

    def add(self, rid, tokens, share_prefix_blocks_of=None, shared_blocks=0):
        self.tokens[rid], self.done[rid] = tokens, 0
        self.blocks[rid] = list(self.blocks[share_prefix_blocks_of][:shared_blocks]) if share_prefix_blocks_of else []
        shared = self.group_blocks[share_prefix_blocks_of] if share_prefix_blocks_of else [[]] * (self.groups - 1)
        self.group_blocks[rid] = [list(blocks[:shared_blocks]) for blocks in shared]
        if shared_blocks:
            self.done[rid] = shared_blocks * self.block_size  # prefix-cache hit

    def step(self, schedule):
        """schedule: [(rid, num_new_tokens)] in batch order -> {rid: logits [n, vocab]}."""
        ids, pos, qlens, slens, tables = [], [], [], [], []
        for rid, n in schedule:
            start, end = self.done[rid], self.done[rid] + n
            assert end <= len(self.tokens[rid]), "test schedule runs past the prompt"
            for blocks in [self.blocks[rid], *self.group_blocks[rid]]:
                while len(blocks) * self.block_size < end:
                    blocks.append(self.free.pop())
            ids += self.tokens[rid][start:end]
            pos += range(start, end)
            qlens.append(n), slens.append(end), tables.append(self.blocks[rid])
            self.done[rid] = end
        md = build_attention_metadata(qlens, slens, tables, self.block_size)
        md.group_views = tuple(
            build_attention_metadata(qlens, slens, [self.group_blocks[rid][g] for rid, _ in schedule], self.block_size)
            for g in range(self.groups - 1)
        )
        with torch.inference_mode():
            hidden = self.model(torch.tensor(ids), torch.tensor(pos), self.caches, md)
            logits = self.model.compute_logits(hidden)
        assert logits.dtype == torch.float32
        out, at = {}, 0
        for rid, n in schedule:
            out[rid], at = logits[at : at + n], at + n
        return out


def _tokens(n, seed):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def check_fidelity(model_dir, hf, block_size=4):
    model = get_model(model_dir, torch.float32)
    prompts = {r: _tokens(n, seed=r) for r, n in enumerate([21, 13, 12, 30])}
    refs = {r: hf_logits(hf, t) for r, t in prompts.items()}

    # (a) full prefill of one prompt
    r = PagedRunner(model, block_size)
    r.add(0, prompts[0])
    torch.testing.assert_close(r.step([(0, 21)])[0], refs[0], **TOL)

    # (b) the same prompt in chunks across forwards (random block ids)
    r = PagedRunner(model, block_size, seed=1)
    r.add(0, prompts[0])
    for start, n in [(0, 5), (5, 1), (6, 9), (15, 6)]:
        torch.testing.assert_close(r.step([(0, n)])[0], refs[0][start : start + n], **TOL)

    # (c) mixed batches: chunked prefills with cached context beside single-token decodes
    r = PagedRunner(model, block_size, seed=2)
    schedules = [  # request 3 arrives in the second step
        [(0, 12), (1, 8), (2, 7)],
        [(1, 1), (2, 1), (0, 5), (3, 7)],
        [(0, 1), (3, 10), (1, 1), (2, 1)],
        [(3, 1), (0, 1), (1, 1)],
        [(2, 1), (3, 12), (0, 1), (1, 1)],
    ]
    for sched in schedules:
        for rid, _ in sched:
            if rid not in r.tokens:
                r.add(rid, prompts[rid])
        starts = {rid: r.done[rid] for rid, _ in sched}
        got = r.step(sched)
        for rid, n in sched:
            torch.testing.assert_close(got[rid], refs[rid][starts[rid] : starts[rid] + n], **TOL)


@pytest.mark.parametrize("native_ops", [True, False], ids=["native-ops", "torch-ops"])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_logits_match_hf(tmp_path, arch, native_ops):
    hf = make_checkpoint(tmp_path, arch)
    with use_cpu_kernels(native_ops):
        check_fidelity(str(tmp_path), hf, block_size=4)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tied_embeddings_sharded_block16(tmp_path, arch):
    hf = make_checkpoint(tmp_path, arch, tie=True, shard=True)
    assert os.path.exists(tmp_path / "model.safetensors.index.json")
    weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert "lm_head.weight" not in weight_map and len(set(weight_map.values())) > 1
    model = get_model(str(tmp_path), torch.float32)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    check_fidelity(str(tmp_path), hf, block_size=16)


def test_prefix_blocks_filled_in_same_step(tmp_path):
    """B reuses A's first two blocks as cached prefix while A fills them in the same forward."""
    hf = make_checkpoint(tmp_path, "llama")
    model = get_model(str(tmp_path), torch.float32)
    a = _tokens(10, seed=5)
    b = a[:8] + _tokens(5, seed=6)
    r = PagedRunner(model, block_size=4)
    r.add("a", a)
    r.blocks["a"] = [r.free.pop(), r.free.pop(), r.free.pop()]  # allocated up front for sharing
    r.add("b", b, share_prefix_blocks_of="a", shared_blocks=2)
    got = r.step([("a", 10), ("b", 5)])
    torch.testing.assert_close(got["a"], hf_logits(hf, a), **TOL)
    torch.testing.assert_close(got["b"], hf_logits(hf, b)[8:], **TOL)


ROPES = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 3.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    "yarn_mscale": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 32,
        "mscale": 0.7,
        "mscale_all_dim": 0.9,
        "beta_fast": 16,
        "beta_slow": 2,
        "truncate": False,
    },
}


def _hf_rope_config(rope):
    return LlamaConfig(**TINY, rope_parameters={**rope, "rope_theta": 5000.0})


@pytest.mark.parametrize("name", list(ROPES))
def test_rope_matches_hf_init_functions(name):
    config = _hf_rope_config(ROPES[name])
    arch = Architecture.from_hf_config({**config.to_dict(), "architectures": ["LlamaForCausalLM"]})
    assert arch.rope_type == ROPES[name]["rope_type"] and arch.rope_theta == 5000.0
    hf_fn = ROPE_INIT_FUNCTIONS[arch.rope_type]
    want, want_factor = hf_fn(config, "cpu")
    got, got_factor = compute_inv_freq(arch.rope_scaling, arch.head_dim, arch.max_position_embeddings)
    torch.testing.assert_close(got, want)
    assert got_factor == pytest.approx(want_factor)
    if name == "dynamic":  # beyond max_position_embeddings: row p uses seq_len = p + 1
        rotary = RotaryEmbedding(arch.head_dim, arch.rope_scaling, arch.max_position_embeddings)
        for p in (128, 200, 333):
            inv, _ = hf_fn(config, "cpu", seq_len=p + 1)
            freqs = torch.cat([p * inv, p * inv])
            cos_sin = rotary.cos_sin_for(torch.tensor([p]))[0]
            torch.testing.assert_close(cos_sin, torch.stack([freqs.cos(), freqs.sin()]))


@pytest.mark.parametrize("name", list(ROPES))
def test_rope_scaled_models_match_hf(tmp_path, name):
    hf = make_checkpoint(tmp_path, "llama", num_hidden_layers=1, rope_parameters={**ROPES[name], "rope_theta": 5000.0})
    model = get_model(str(tmp_path), torch.float32)
    toks = _tokens(40, seed=3)
    r = PagedRunner(model)
    r.add(0, toks)
    got = torch.cat([r.step([(0, 25)])[0], r.step([(0, 1)])[0], r.step([(0, 14)])[0]])
    torch.testing.assert_close(got, hf_logits(hf, toks), **TOL)


def test_legacy_rope_scaling_config_fields():
    """transformers 4.x wrote rope_theta at top level and rope_scaling with "type"."""
    cfg = {
        **TINY,
        "architectures": ["LlamaForCausalLM"],
        "rope_theta": 500000.0,
        "rope_scaling": {"type": "linear", "factor": 4.0},
    }
    arch = Architecture.from_hf_config(cfg)
    assert (arch.rope_type, arch.rope_theta, arch.rope_scaling["factor"]) == ("linear", 500000.0, 4.0)
    assert arch.head_dim == 16 and not arch.tie_word_embeddings


def test_arch_config_fields(tmp_path):
    make_checkpoint(tmp_path, "qwen3", tie=True)
    arch = Architecture.from_model(tmp_path)
    assert arch.architecture == "Qwen3ForCausalLM" and arch.has_qk_norm and arch.head_dim == 32
    assert arch.tie_word_embeddings and arch.num_key_value_heads == 2 and arch.rope_type == "default"
    assert arch.torch_dtype == torch.float32
    qwen2 = Architecture.from_hf_config({**Qwen2Config(**TINY).to_dict(), "architectures": ["Qwen2ForCausalLM"]})
    assert qwen2.qkv_bias and not qwen2.o_proj_bias and not qwen2.has_qk_norm


def test_bfloat16_close_to_float32(tmp_path):
    make_checkpoint(tmp_path, "qwen2")
    toks = _tokens(12, seed=4)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = get_model(str(tmp_path), dtype)
        assert model.model.embed_tokens.weight.dtype == dtype
        r = PagedRunner(model)
        r.add(0, toks)
        out[dtype] = torch.cat([r.step([(0, 11)])[0], r.step([(0, 1)])[0]])
    torch.testing.assert_close(out[torch.bfloat16], out[torch.float32], atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_bfloat16_native_ops_match_torch_ops(tmp_path, arch):
    """In bf16 the fused CPU ops round like the torch layers: both paths give (nearly) the same logits."""
    make_checkpoint(
        tmp_path,
        arch,
        hidden_size=128,
        intermediate_size=200,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
    )
    model = get_model(str(tmp_path), torch.bfloat16)
    toks = _tokens(40, seed=5)
    out = {}
    for native_ops in (True, False):
        with use_cpu_kernels(native_ops):
            r = PagedRunner(model, block_size=16)
            r.add(0, toks)
            out[native_ops] = torch.cat([r.step([(0, 37)])[0], r.step([(0, 1)])[0], r.step([(0, 1)])[0]])
    torch.testing.assert_close(out[True], out[False], atol=2e-2, rtol=2e-2)


def _edit_weights(path, fn):
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    fn(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def test_missing_weight_is_reported(tmp_path):
    make_checkpoint(tmp_path, "llama")
    _edit_weights(tmp_path, lambda t: (t.pop("model.layers.1.self_attn.k_proj.weight"), t.pop("model.norm.weight")))
    with pytest.raises(
        WeightLoadingError,
        match=r"missing weights.*model\.layers\.1\.self_attn\.k_proj\.weight"
        r".*model\.norm\.weight.*unexpected weights none",
    ):
        get_model(str(tmp_path), torch.float32)


def test_unexpected_weight_is_reported(tmp_path):
    make_checkpoint(tmp_path, "llama")
    _edit_weights(tmp_path, lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.zeros(2)}))
    with pytest.raises(WeightLoadingError, match=r"missing weights none.*unexpected.*model\.layers\.0\.mlp\.extra"):
        get_model(str(tmp_path), torch.float32)


def test_tied_checkpoint_may_carry_lm_head(tmp_path):
    hf = make_checkpoint(tmp_path, "llama", tie=True)
    _edit_weights(tmp_path, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].clone()}))
    model = get_model(str(tmp_path), torch.float32)
    r = PagedRunner(model)
    r.add(0, _tokens(6, seed=0))
    torch.testing.assert_close(r.step([(0, 6)])[0], hf_logits(hf, _tokens(6, seed=0)), **TOL)


def test_untied_checkpoint_without_lm_head_fails(tmp_path):
    make_checkpoint(tmp_path, "llama", tie=False)
    _edit_weights(tmp_path, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(WeightLoadingError, match="lm_head.weight"):
        get_model(str(tmp_path), torch.float32)


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "n_embd": 8}))
    with pytest.raises(
        ValueError,
        match=r"unsupported model architecture 'GPT2LMHeadModel'.*LlamaForCausalLM.*"
        r"MistralForCausalLM.*Qwen2ForCausalLM.*Qwen3ForCausalLM",
    ):
        get_model(str(tmp_path), torch.float32)


@pytest.mark.parametrize("tp_rank", [0, 1])
def test_tensor_parallel_weight_loader_slices(tmp_path, tp_rank):
    """The TP seam: a rank loads only its slice of each column/row-parallel weight."""
    hf = make_checkpoint(tmp_path, "qwen2")
    model = get_model(str(tmp_path), torch.float32, tp_rank=tp_rank, tp_size=2)
    sd = hf.state_dict()
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    pre = "model.layers.0."
    q, kv = 2 * 16, 1 * 16  # per rank: 2 of 4 q heads, 1 of 2 kv heads, head_dim 16
    want_qkv = torch.cat(
        [
            sd[pre + "self_attn.q_proj.weight"][tp_rank * q : (tp_rank + 1) * q],
            sd[pre + "self_attn.k_proj.weight"][tp_rank * kv : (tp_rank + 1) * kv],
            sd[pre + "self_attn.v_proj.weight"][tp_rank * kv : (tp_rank + 1) * kv],
        ]
    )
    torch.testing.assert_close(attn.qkv_proj.weight, want_qkv)
    torch.testing.assert_close(
        attn.o_proj.weight, sd[pre + "self_attn.o_proj.weight"][:, tp_rank * q : (tp_rank + 1) * q]
    )
    half = 64
    torch.testing.assert_close(
        mlp.gate_up_proj.weight[half:], sd[pre + "mlp.up_proj.weight"][tp_rank * half : (tp_rank + 1) * half]
    )
    torch.testing.assert_close(model.lm_head.weight, sd["lm_head.weight"][tp_rank * 128 : (tp_rank + 1) * 128])
    assert model.get_kv_cache_shape(10, 4) == (2, 10, 4, 1, 16)


def test_prepacked_bf16_linears_match_plain_linears(tmp_path):
    """The oneDNN-prepacked bf16 path gives what F.linear gives (it only changes the weight layout); on a
    CPU without oneDNN bf16, the layer computes in float32 from a float32 copy of its weight."""
    from engine.kernels.cpu import has_bf16_matmul
    from engine.model.layers.linear import LinearBase
    from engine.model.layers.linear_method import process_weights_after_loading

    layer = LinearBase(64, 96, bias=True, tp_rank=0, tp_size=1).to(torch.bfloat16)
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(layer.bias)
    if not has_bf16_matmul():
        # No bf16 matrix instructions on this CPU (no AVX-512 BF16 / AMX): float32 products, bf16 output.
        x = torch.randn(7, 64, dtype=torch.bfloat16)
        assert process_weights_after_loading(layer) == 1 and layer.product.packed.dtype == torch.float32
        expected = F.linear(x.float(), layer.weight.float(), layer.bias.float()).to(torch.bfloat16)
        assert layer(x).dtype == torch.bfloat16 and torch.equal(layer(x), expected)
        return
    for num_rows in (1, 7, 64, 300):
        x = torch.randn(num_rows, 64, dtype=torch.bfloat16)
        expected = layer(x)
        assert process_weights_after_loading(layer) == 1 and layer.product.packed is not None
        torch.testing.assert_close(layer(x).float(), expected.float(), atol=2e-2, rtol=2e-2)
        layer.product = layer.quant_method.torch_product(layer.weight)  # back to F.linear
