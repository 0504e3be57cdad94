"""Every GGUF weight type Serval reads, on a tiny Llama written as llama.cpp writes one, against transformers.

The tiny random checkpoint is written as a GGUF file the way llama.cpp's converter writes it (its tensor
names, q/k rows permuted for its rope, 1-D tensors in F32, the matrices in the type under test); transformers
loads that file with its own GGUF reader and is the reference: Serval's offline engine on the file (the
tokenizer from the checkpoint directory, as vLLM's ``tokenizer=``) must generate its greedy tokens exactly.
Types whose rounding errors are large (Q4_x, Q5_x) still match: both sides compute with the same weights.
Serval keeps Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 tensors as blocks (its quantized kernels, activations to 14
bits) and dequantizes the other types, where transformers dequantizes every tensor: the random model's near-uniform
logits would part greedy paths at the 8-bit activations of llama.cpp's arithmetic, and do not at these.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.model.source import HFDirectory
from tests.conftest import assert_pool_clean

TYPES = ("F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
PROMPTS = [[7, 8, 9, 10, 11, 12], [100, 150, 200, 250, 300, 350, 400, 450, 500]]  # the tiny vocabulary: 512
MAX_TOKENS = 12
HF_TO_GGUF = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf_name: str) -> str:
    stem, kind = hf_name.rsplit(".", 1)
    if stem.startswith("model.layers."):
        index, part = stem.removeprefix("model.layers.").split(".", 1)
        return f"blk.{index}.{HF_TO_GGUF[part]}.{kind}"
    return f"{HF_TO_GGUF[stem]}.{kind}"


def llama_cpp_permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's ``LlamaModel.permute`` (its rope pairs neighbouring dimensions)."""
    return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def write_gguf(model_dir: str, path: Path, kind: str) -> None:
    import gguf
    from gguf.quants import quantize

    qtype = gguf.GGMLQuantizationType[kind]
    config = json.loads((Path(model_dir) / "config.json").read_text())
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_dimension_count(config["head_dim"])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    for name, tensor in HFDirectory(model_dir).iter_weights():
        values = tensor.numpy()
        if (projection := name.split(".")[-2]) in heads:
            values = llama_cpp_permute(values, heads[projection])
        if values.ndim == 1:
            writer.add_tensor(gguf_name(name), values.astype(np.float32))
        else:
            data = quantize(values, qtype)
            writer.add_tensor(gguf_name(name), data, raw_shape=data.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint) -> str:
    return tiny_checkpoint("llama")


@pytest.mark.parametrize("kind", TYPES)
def test_serval_on_a_gguf_file_generates_transformers_greedy_tokens(checkpoint, tmp_path, kind):
    from transformers import AutoModelForCausalLM

    path = tmp_path / f"tiny-{kind}.gguf"
    write_gguf(checkpoint, path, kind)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    expected = []
    with torch.no_grad():
        for ids in PROMPTS:
            out = reference.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False, min_length=0)
            expected.append(out[0, len(ids) :].tolist())
    llm = LLM(
        model=str(path),
        tokenizer=checkpoint,
        dtype="float32",
        max_model_len=256,
        kv_cache_memory_bytes=8 << 20,
    )
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in PROMPTS], greedy, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    assert_pool_clean(llm)
    llm.shutdown()
