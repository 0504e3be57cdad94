"""The Triton paged-KV kernels against their torch references, on random inputs of many shapes.

On a machine without CUDA they run through Triton's interpreter (set before the kernels are
imported); on a GPU the same tests run natively.
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from engine.attention.metadata import PAD_SLOT_ID  # noqa: E402
from engine.kernels import triton_cache, triton_decode, triton_prefill  # noqa: E402 - after TRITON_INTERPRET

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1e-2}


def random_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, generator):
    return torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=generator).to(DEVICE, dtype)


@pytest.mark.parametrize(
    "block_size, num_kv_heads, head_dim, dtype",
    [(16, 2, 64, torch.float32), (32, 8, 128, torch.bfloat16), (16, 1, 128, torch.bfloat16)],
)
def test_write_kv_cache_equals_the_reference(block_size, num_kv_heads, head_dim, dtype):
    generator = torch.Generator().manual_seed(0)
    cache = random_cache(12, block_size, num_kv_heads, head_dim, dtype, generator)
    expected = cache.clone()
    num_tokens = 37
    slots = torch.randperm(11 * block_size, generator=generator)[:num_tokens] + block_size  # no null block
    slots[::5] = PAD_SLOT_ID  # padded rows of a CUDA graph batch: skipped
    slots = slots.to(DEVICE)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator).to(DEVICE, dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator).to(DEVICE, dtype)
    triton_cache.write_kv_cache(cache, key, value, slots)
    triton_cache.write_kv_cache_reference(expected, key, value, slots)
    assert torch.equal(cache, expected)  # a copy: bit-exact, and the skipped slots' blocks untouched


def relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    return float((out.float() - expected.float()).norm() / expected.float().norm())


def shuffled_block_tables(num_reqs, max_blocks, generator):
    """Each request gets its own shuffled blocks (block 0, the null block, is never handed out)."""
    block_ids = torch.randperm(num_reqs * max_blocks, generator=generator) + 1
    return block_ids.view(num_reqs, max_blocks).to(torch.int32).to(DEVICE)


SHAPES = [  # block_size, head_dim, num_heads, num_kv_heads, dtype
    (16, 64, 4, 4, torch.float32),  # MHA
    (16, 128, 8, 2, torch.float32),  # GQA 4
    (32, 64, 8, 1, torch.bfloat16),  # GQA 8
    (32, 128, 4, 1, torch.bfloat16),  # GQA 4, bf16
    (16, 64, 14, 2, torch.bfloat16),  # GQA 7 (Qwen2-0.5B): a group that is no power of two
]


@pytest.mark.parametrize("block_size, head_dim, num_heads, num_kv_heads, dtype", SHAPES)
@pytest.mark.parametrize("num_splits", [1, 4])
def test_paged_decode_attention_equals_the_reference(block_size, head_dim, num_heads, num_kv_heads, dtype, num_splits):
    generator = torch.Generator().manual_seed(1)
    # Context lengths on, just past and well past block boundaries in one batch, and 0 (a padded row).
    seq_lens = torch.tensor(
        [1, block_size, block_size + 1, 0, 3 * block_size - 1, 9 * block_size + 7], dtype=torch.int32
    )
    max_blocks = -(-int(seq_lens.max()) // block_size)
    cache = random_cache(1 + len(seq_lens) * max_blocks, block_size, num_kv_heads, head_dim, dtype, generator)
    block_tables = shuffled_block_tables(len(seq_lens), max_blocks, generator)
    query = torch.randn(len(seq_lens), num_heads, head_dim, generator=generator).to(DEVICE, dtype)
    scale = head_dim**-0.5
    seq_lens = seq_lens.to(DEVICE)
    out = triton_decode.paged_decode_attention(query, cache, block_tables, seq_lens, scale, num_splits)
    expected = triton_decode.paged_decode_attention_reference(query, cache, block_tables, seq_lens, scale)
    assert relative_error(out, expected) < TOLERANCE[dtype]
    assert not out[3].any()  # the empty sequence: zeros, not NaN


def test_split_counts_fill_the_gpu_and_stay_powers_of_two():
    assert triton_decode.choose_num_splits(1, 8, 4096) == 32  # batch 1: split the long context
    assert triton_decode.choose_num_splits(256, 8, 4096) == 1  # enough programs already
    assert triton_decode.choose_num_splits(1, 8, 100) == 1  # too short to split
    assert all(n & (n - 1) == 0 for n in (triton_decode.choose_num_splits(b, 2, 2048) for b in range(1, 300)))


@pytest.mark.parametrize("block_size, head_dim, num_heads, num_kv_heads, dtype", SHAPES)
def test_paged_prefill_attention_equals_the_reference(block_size, head_dim, num_heads, num_kv_heads, dtype):
    """A mixed batch: fresh prompts, chunks over a cached prefix (crossing block boundaries), decodes."""
    generator = torch.Generator().manual_seed(2)
    requests = [  # (new tokens, sequence length after the step)
        (5, 5),
        (1, 40),
        (17, 17 + 3 * block_size),
        (70, 70),
        (1, block_size),
        (33, 34 + block_size),
        (1, 1),
    ]
    query_lens = [q for q, _ in requests]
    max_blocks = max(-(-s // block_size) for _, s in requests)
    cache = random_cache(1 + len(requests) * max_blocks, block_size, num_kv_heads, head_dim, dtype, generator)
    block_tables = shuffled_block_tables(len(requests), max_blocks, generator)
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=generator).to(DEVICE, dtype)
    starts = torch.tensor([0] + list(itertools.accumulate(query_lens)), dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor([s for _, s in requests], dtype=torch.int32, device=DEVICE)
    tiles = triton_prefill.plan_prefill_tiles(query_lens, num_heads // num_kv_heads, DEVICE)
    scale = head_dim**-0.5
    out = triton_prefill.paged_prefill_attention(query, cache, block_tables, starts, seq_lens, tiles, scale)
    expected = triton_prefill.paged_prefill_attention_reference(query, cache, block_tables, starts, seq_lens, scale)
    assert relative_error(out, expected) < TOLERANCE[dtype]


def poison_blocks_before(cache, block_tables, first_keys):
    """A sliding-window group's freed blocks: each row's blocks wholly before its ``first_keys`` become one
    extra block full of NaN (``cache`` gets it appended), so a kernel that reads one returns NaN."""
    block_size = cache.shape[2]
    poisoned = torch.cat([cache, torch.full_like(cache[:, :1], float("nan"))], dim=1)
    tables = block_tables.clone()
    for row, first_key in enumerate(first_keys):
        tables[row, : first_key // block_size] = cache.shape[1]
    return poisoned, tables


@pytest.mark.parametrize("block_size, head_dim, num_heads, num_kv_heads, dtype", [SHAPES[1], SHAPES[3]])
def test_windowed_decode_and_prefill_equal_the_references(block_size, head_dim, num_heads, num_kv_heads, dtype):
    """A sliding window: each query over its last ``window`` keys; the blocks before them are never read."""
    generator = torch.Generator().manual_seed(3)
    window, scale = block_size + 5, head_dim**-0.5
    requests = [(1, 1), (1, 9 * block_size + 7), (40, 40), (17, 17 + 3 * block_size), (1, 2 * block_size)]
    query_lens, lens = [q for q, _ in requests], [s for _, s in requests]
    max_blocks = max(-(-s // block_size) for s in lens)
    cache = random_cache(1 + len(requests) * max_blocks, block_size, num_kv_heads, head_dim, dtype, generator)
    block_tables = shuffled_block_tables(len(requests), max_blocks, generator)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=generator).to(DEVICE, dtype)
    starts = torch.tensor([0] + list(itertools.accumulate(query_lens)), dtype=torch.int32, device=DEVICE)
    tiles = triton_prefill.plan_prefill_tiles(query_lens, num_heads // num_kv_heads, DEVICE)
    first_keys = [max(0, s - q - window + 1) for q, s in requests]  # each request's first query's window
    poisoned, tables = poison_blocks_before(cache, block_tables, first_keys)
    out = triton_prefill.paged_prefill_attention(query, poisoned, tables, starts, seq_lens, tiles, scale, window)
    expected = triton_prefill.paged_prefill_attention_reference(
        query, cache, block_tables, starts, seq_lens, scale, window
    )
    assert relative_error(out, expected) < TOLERANCE[dtype]
    decode_query = query[starts[1:].long() - 1]  # each request's last token, as a decode
    poisoned, tables = poison_blocks_before(cache, block_tables, [max(0, s - window) for s in lens])
    out = triton_decode.paged_decode_attention(decode_query, poisoned, tables, seq_lens, scale, 4, window)
    expected = triton_decode.paged_decode_attention_reference(
        decode_query, cache, block_tables, seq_lens, scale, window
    )
    assert relative_error(out, expected) < TOLERANCE[dtype]


def test_prefill_tiles_cover_every_query_token_once():
    tiles = triton_prefill.plan_prefill_tiles([1, 20, 9, 3], queries_per_kv=7, device="cpu")
    assert tiles.queries_per_tile == 9  # 64 rows // 7 heads per KV head
    assert tiles.req.tolist() == [0, 1, 1, 1, 2, 3]
    assert tiles.first_query.tolist() == [0, 0, 9, 18, 0, 0]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_the_triton_backend_generates_the_torch_backends_greedy_tokens(tiny_checkpoint, arch):
    """The whole engine on the Triton backend: mixed prefill/decode steps, prompts chunked by a small token
    budget, prefix-cache hits (the prompts share prefixes): the same greedy tokens as the torch backend."""
    tokens = {backend: _greedy_tokens(tiny_checkpoint(arch), backend) for backend in ("torch", "triton")}
    assert tokens["triton"] == tokens["torch"]


def test_the_triton_backend_keeps_sliding_windows_and_kv_cache_groups(tiny_checkpoint, tmp_path):
    """Qwen2 with layer 0 full and layer 1 sliding (window 20, two KV cache groups) on prompts past the window."""
    from tests.engine.test_llm_sliding_window import SLIDING, write_sliding_checkpoint

    path = write_sliding_checkpoint(tiny_checkpoint("qwen2"), tmp_path / "qwen2", SLIDING["qwen2"])
    tokens = {backend: _greedy_tokens(path, backend, (3, 40, 70, 45)) for backend in ("torch", "triton")}
    assert tokens["triton"] == tokens["torch"]


def _greedy_tokens(path: str, backend: str, lengths=(3, 17, 40, 21)) -> list[list[int]]:
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    prompts = [{"prompt_token_ids": list(range(5, 5 + length))} for length in lengths]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    llm = LLM(
        path,
        attention_backend=backend,
        max_model_len=128,
        dtype="float32",
        num_gpu_blocks_override=32,
        max_num_seqs=4,
        max_num_batched_tokens=16,
    )
    return [output.outputs[0].token_ids for output in llm.generate(prompts, params)]
