"""The Triton paged-KV kernels against their torch references, on random inputs of many shapes.

On a machine without CUDA they run through Triton's interpreter (set before the kernels are
imported); on a GPU the same tests run natively.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from engine.kernels import triton_paged  # noqa: E402 - after TRITON_INTERPRET

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1e-2}


def random_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, generator):
    return torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=generator).to(DEVICE, dtype)


@pytest.mark.parametrize("block_size, num_kv_heads, head_dim, dtype", [
    (16, 2, 64, torch.float32), (32, 8, 128, torch.bfloat16), (16, 1, 128, torch.bfloat16)])
def test_write_kv_cache_equals_the_reference(block_size, num_kv_heads, head_dim, dtype):
    generator = torch.Generator().manual_seed(0)
    cache = random_cache(12, block_size, num_kv_heads, head_dim, dtype, generator)
    expected = cache.clone()
    num_tokens = 37
    slots = torch.randperm(11 * block_size, generator=generator)[:num_tokens].to(DEVICE) + block_size  # no null block
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator).to(DEVICE, dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator).to(DEVICE, dtype)
    triton_paged.write_kv_cache(cache, key, value, slots)
    triton_paged.write_kv_cache_reference(expected, key, value, slots)
    assert torch.equal(cache, expected)  # a copy: bit-exact


@pytest.mark.parametrize("block_size, head_dim, num_heads, num_kv_heads, dtype", [
    (16, 64, 4, 4, torch.float32),   # MHA
    (16, 128, 8, 2, torch.float32),  # GQA 4
    (32, 64, 8, 1, torch.bfloat16),  # GQA 8
    (32, 128, 4, 1, torch.bfloat16),  # GQA 4, bf16
])
def test_paged_decode_attention_equals_the_reference(block_size, head_dim, num_heads, num_kv_heads, dtype):
    generator = torch.Generator().manual_seed(1)
    # Context lengths on, just past and well past block boundaries, in one batch.
    seq_lens = torch.tensor([1, block_size, block_size + 1, 3 * block_size - 1, 5 * block_size + 7], dtype=torch.int32)
    max_blocks = -(-int(seq_lens.max()) // block_size)
    num_blocks = 1 + len(seq_lens) * max_blocks
    cache = random_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, generator)
    # Each sequence gets its own shuffled blocks (block 0, the null block, pads the table).
    block_ids = (torch.randperm(num_blocks - 1, generator=generator) + 1).view(len(seq_lens), max_blocks)
    block_tables = block_ids.to(torch.int32).to(DEVICE)
    query = torch.randn(len(seq_lens), num_heads, head_dim, generator=generator).to(DEVICE, dtype)
    scale = head_dim ** -0.5
    seq_lens = seq_lens.to(DEVICE)
    out = triton_paged.paged_decode_attention(query, cache, block_tables, seq_lens, scale)
    expected = triton_paged.paged_decode_attention_reference(query, cache, block_tables, seq_lens, scale)
    error = (out.float() - expected.float()).norm() / expected.float().norm()
    assert error < TOLERANCE[dtype], f"relative error {error:.2e}"


def test_the_triton_backend_generates_the_torch_backends_greedy_tokens(tiny_checkpoint):
    """The whole engine (mixed prefill/decode steps, prefix hits, several block lengths) on the Triton
    backend: the same greedy tokens as on the torch backend."""
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    prompts = [{"prompt_token_ids": list(range(5, 5 + length))} for length in (3, 17, 40)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    tokens = {}
    for backend in ("torch", "triton"):
        llm = LLM(tiny_checkpoint("llama"), attention_backend=backend, max_model_len=128, dtype="float32",
                  num_gpu_blocks_override=32)
        tokens[backend] = [output.outputs[0].token_ids for output in llm.generate(prompts, params)]
    assert tokens["triton"] == tokens["torch"]
