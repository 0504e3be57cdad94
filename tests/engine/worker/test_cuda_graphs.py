"""Decode steps through the CUDA-graph runner (padded to a captured size) against plain eager forwards.

On a GPU the graphs are captured and replayed; on a CPU the runner does everything but the capture
(static buffers, padding, slot -1 and seq_len 0 rows) with the Triton kernels in the interpreter.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine.attention.metadata import build_attention_metadata
from engine.model import get_model
from engine.worker.cuda_graphs import DecodeGraphRunner, default_batch_sizes

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK_SIZE = 16
MAX_MODEL_LEN = 128


def test_default_batch_sizes_follow_vllm_and_stop_at_max_num_seqs():
    assert default_batch_sizes(1) == [1]
    assert default_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert default_batch_sizes(256)[-3:] == [240, 248, 256]
    assert default_batch_sizes(4096)[-1] == 512


@pytest.fixture
def model(tiny_checkpoint):
    return get_model(tiny_checkpoint("llama"), dtype=torch.float32, device=DEVICE, attn_backend="triton")


def _prefill(model, kv_caches, lengths, block_tables, rng):
    ids = torch.tensor([rng.randrange(5, 512) for _ in range(sum(lengths))], device=DEVICE)
    positions = torch.cat([torch.arange(n) for n in lengths]).to(DEVICE)
    metadata = build_attention_metadata(lengths, lengths, block_tables, BLOCK_SIZE, device=DEVICE)
    model(ids, positions, kv_caches, metadata)


@pytest.mark.slow  # captured decode graphs replayed against eager forwards (Triton interpreted on CPU): ~20 s
def test_padded_decode_steps_equal_eager_forwards_and_write_only_their_own_slots(model):
    rng = random.Random(0)
    lengths = [3, 17, 40, 16, 1, 31]
    max_blocks = MAX_MODEL_LEN // BLOCK_SIZE
    block_tables = [list(range(1 + i * max_blocks, 1 + (i + 1) * max_blocks)) for i in range(len(lengths))]
    kv_caches = model.make_kv_caches(1 + len(lengths) * max_blocks, BLOCK_SIZE)
    _prefill(model, kv_caches, lengths, block_tables, rng)
    runner = DecodeGraphRunner(
        model,
        kv_caches,
        [1, 2, 4, 8],
        max_blocks,
        MAX_MODEL_LEN,
        torch.device(DEVICE),
        use_cuda_graphs=DEVICE == "cuda",
    )
    runner.capture()
    for num_reqs in (1, 3, 6, 5):  # replayed as sizes 1, 4, 8, 8
        seq_lens = [length + 1 for length in lengths[:num_reqs]]
        metadata = build_attention_metadata([1] * num_reqs, seq_lens, block_tables[:num_reqs], BLOCK_SIZE, DEVICE)
        ids = torch.tensor([rng.randrange(5, 512) for _ in range(num_reqs)], device=DEVICE)
        positions = torch.tensor(lengths[:num_reqs], device=DEVICE)
        eager_caches = [cache.clone() for cache in kv_caches]
        expected = model(ids, positions, eager_caches, metadata)
        assert runner.fits(metadata)
        hidden = runner.replay(ids, positions, metadata)
        torch.testing.assert_close(hidden, expected, rtol=1e-5, atol=1e-5)
        # The same K/V landed in the same slots, and the padded rows wrote nothing (the null block included).
        for cache, eager_cache in zip(kv_caches, eager_caches):
            torch.testing.assert_close(cache, eager_cache, rtol=1e-5, atol=1e-6)
        lengths[:num_reqs] = seq_lens


def test_mixed_and_oversized_steps_are_left_to_eager(model):
    kv_caches = model.make_kv_caches(8, BLOCK_SIZE)
    runner = DecodeGraphRunner(model, kv_caches, [1, 2], 8, MAX_MODEL_LEN, torch.device(DEVICE), use_cuda_graphs=False)
    mixed = build_attention_metadata([1, 3], [5, 3], [[1], [2]], BLOCK_SIZE, DEVICE)
    too_big = build_attention_metadata([1, 1, 1], [2, 2, 2], [[1], [2], [3]], BLOCK_SIZE, DEVICE)
    assert not runner.fits(mixed) and not runner.fits(too_big)
    assert runner.padded_size(1) == 1 and runner.padded_size(2) == 2


def _grouped_metadata(query_lens, seq_lens, tables_per_group):
    """One step's metadata with each KV cache group's own block tables (group 0's, the others its views)."""
    metadata, *views = [
        build_attention_metadata(query_lens, seq_lens, tables, BLOCK_SIZE, device=DEVICE) for tables in tables_per_group
    ]
    metadata.group_views = tuple(views)
    return metadata


def test_each_kv_cache_group_replays_with_its_own_block_tables(tiny_checkpoint, tmp_path):
    """Qwen2 with a full and a sliding layer (two groups, sharing one cache tensor): a decode step through the
    runner's per-group static buffers equals the eager forward, and writes the same slots."""
    from tests.engine.test_llm_sliding_window import SLIDING, write_sliding_checkpoint

    path = write_sliding_checkpoint(tiny_checkpoint("qwen2"), tmp_path / "qwen2", SLIDING["qwen2"])
    model = get_model(path, dtype=torch.float32, device=DEVICE, attn_backend="triton")
    assert len(model.kv_cache_groups) == 2
    rng, lengths, max_blocks = random.Random(1), [30, 45], MAX_MODEL_LEN // BLOCK_SIZE
    tables = [
        [list(range(1 + (2 * g + i) * max_blocks, 1 + (2 * g + i + 1) * max_blocks)) for i in range(2)]
        for g in range(2)
    ]
    kv_caches = model.make_kv_caches(1 + 4 * max_blocks, BLOCK_SIZE)
    ids = torch.tensor([rng.randrange(5, 512) for _ in range(sum(lengths))], device=DEVICE)
    positions = torch.cat([torch.arange(n) for n in lengths]).to(DEVICE)
    model(ids, positions, kv_caches, _grouped_metadata(lengths, lengths, tables))
    runner = DecodeGraphRunner(
        model, kv_caches, [1, 4], max_blocks, MAX_MODEL_LEN, torch.device(DEVICE), use_cuda_graphs=DEVICE == "cuda"
    )
    runner.capture()
    metadata = _grouped_metadata([1, 1], [n + 1 for n in lengths], tables)
    ids, positions = torch.tensor([7, 9], device=DEVICE), torch.tensor(lengths, device=DEVICE)
    clones = {id(cache): cache.clone() for cache in kv_caches}  # the layers share one tensor: so do the clones
    eager_caches = [clones[id(cache)] for cache in kv_caches]
    expected = model(ids, positions, eager_caches, metadata)
    torch.testing.assert_close(runner.replay(ids, positions, metadata), expected, rtol=1e-5, atol=1e-5)
    for cache, eager_cache in zip(kv_caches, eager_caches):
        torch.testing.assert_close(cache, eager_cache, rtol=1e-5, atol=1e-6)
