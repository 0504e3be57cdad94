"""The plain-torch paged attention backend against a naive dense reference."""

from __future__ import annotations

import random

import pytest
import torch

from engine.attention import AttentionMetadata, build_attention_metadata, get_attention_backend
from engine.attention.torch_paged import TorchPagedAttention
from engine.kernels.cpu import load_cpu_kernels


def _reference(q, k_full, v_full, ctx, scale, window=None):
    """Dense causal attention of one request: q [Q, H, D] over k/v [S, Hk, D] -> [Q, H*D] (float64); with a
    ``window``, query position p sees keys p - window < k <= p only."""
    h, hk = q.shape[1], k_full.shape[1]
    k = k_full.double().repeat_interleave(h // hk, dim=1)  # [S, H, D]
    v = v_full.double().repeat_interleave(h // hk, dim=1)
    scores = torch.einsum("qhd,shd->hqs", q.double(), k) * scale  # [H, Q, S]
    q_pos = torch.arange(ctx, ctx + q.shape[0])[:, None]
    k_pos = torch.arange(k.shape[0])[None, :]
    scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
    if window is not None:
        scores = scores.masked_fill(k_pos <= q_pos - window, float("-inf"))
    out = torch.einsum("hqs,shd->qhd", scores.softmax(-1), v)
    return out.reshape(q.shape[0], -1)


class Batch:
    """Requests with random K/V history living in a paged cache with random, non-contiguous blocks."""

    def __init__(
        self,
        specs,
        *,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        block_size=4,
        num_blocks=64,
        dtype=torch.float32,
        seed=0,
    ):
        g = torch.Generator().manual_seed(seed)
        rnd = random.Random(seed)
        self.backend = get_attention_backend("torch")
        shape = self.backend.get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)
        self.cache = torch.zeros(shape, dtype=dtype)
        free = list(range(1, num_blocks))  # block 0 is the null block
        rnd.shuffle(free)
        self.specs, self.block_size, self.dtype = specs, block_size, dtype
        self.k, self.v, self.tables = [], [], []
        for ctx, qlen in specs:  # (cached context length, new tokens)
            seq = ctx + qlen
            self.k.append(torch.randn(seq, num_kv_heads, head_dim, generator=g).to(dtype))
            self.v.append(torch.randn(seq, num_kv_heads, head_dim, generator=g).to(dtype))
            self.tables.append([free.pop() for _ in range(-(-seq // block_size))])
        self.q = [torch.randn(qlen, num_heads, head_dim, generator=g).to(dtype) for _, qlen in specs]
        self.spare_block = free.pop()
        self._write_context()

    def _write_context(self):
        for i, (ctx, _) in enumerate(self.specs):
            if ctx:
                md = build_attention_metadata([ctx], [ctx], [self.tables[i]], self.block_size)
                TorchPagedAttention.write_kv(self.cache, self.k[i][:ctx], self.v[i][:ctx], md.slot_mapping)

    def metadata(self) -> AttentionMetadata:
        return build_attention_metadata(
            [q for _, q in self.specs], [c + q for c, q in self.specs], self.tables, self.block_size
        )

    def run(self, scale=0.3, window=None):
        md = self.metadata()
        new_k = torch.cat([k[c:] for k, (c, _) in zip(self.k, self.specs)])
        new_v = torch.cat([v[c:] for v, (c, _) in zip(self.v, self.specs)])
        return self.backend.forward(self.cache, torch.cat(self.q), new_k, new_v, md, scale, window=window), md

    def reference(self, scale=0.3, window=None):
        return torch.cat(
            [_reference(q, k, v, c, scale, window) for q, k, v, (c, _) in zip(self.q, self.k, self.v, self.specs)]
        )

    def free_blocks_before(self, window):
        """What a sliding-window KV cache group does: the blocks wholly before every query's window are freed,
        and may be another request's by now; here they all are one block full of NaN, so a read of one shows."""
        for table, (ctx, _) in zip(self.tables, self.specs):
            num_freed = max(0, ctx - window + 1) // self.block_size  # before the first new token's window
            table[:num_freed] = [self.spare_block] * num_freed
        self.cache[:, self.spare_block] = float("nan")


MIXED = [(0, 7), (5, 1), (12, 6), (0, 1), (9, 1), (3, 5), (30, 1), (16, 16)]


@pytest.mark.parametrize("use_cpu_kernel", [True, False], ids=["native-decode", "torch-decode"])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (8, 1)])
@pytest.mark.parametrize("block_size", [4, 16])
def test_mixed_batch_matches_dense_reference(num_heads, num_kv_heads, block_size, use_cpu_kernel):
    b = Batch(MIXED, num_heads=num_heads, num_kv_heads=num_kv_heads, block_size=block_size)
    b.backend = TorchPagedAttention(use_cpu_kernel=use_cpu_kernel)
    out, _ = b.run()
    assert out.shape == (sum(q for _, q in MIXED), num_heads * 8)
    torch.testing.assert_close(out.double(), b.reference(), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(load_cpu_kernels() is None, reason="the native CPU kernels did not build")
def test_short_queries_go_to_the_native_kernel_as_one_row_per_token():
    # A speculative step: decodes beside requests verifying drafts (1 + k tokens after a long context).
    specs = [(3, 1), (40, 5), (7, 3), (0, 1), (100, 8), (2, 2), (20, 9)]
    b = Batch(specs, block_size=8, num_blocks=128)
    md = b.metadata()
    md.max_verify_query_len = 8  # a step verifying up to 7 drafts per request
    new_k = torch.cat([k[c:] for k, (c, _) in zip(b.k, specs)])
    new_v = torch.cat([v[c:] for v, (c, _) in zip(b.v, specs)])
    out = b.backend.forward(b.cache, torch.cat(b.q), new_k, new_v, md, 0.3)
    plan = md.backend_plan[None]  # full attention's plan
    expected_lens = [4, *range(41, 46), 8, 9, 10, 1, *range(101, 109), 3, 4]  # each token's causal length
    assert plan.native_decode.seq_lens.tolist() == expected_lens
    assert [p.end - p.start for p in plan.prefills] == [9]  # longer than MAX_NATIVE_QUERY_LEN
    torch.testing.assert_close(out.double(), b.reference(), atol=1e-5, rtol=1e-5)
    _, md = b.run()  # not a speculative step: each query longer than one token is a prefill
    assert len(md.backend_plan[None].native_decode.seq_lens) == 2 and len(md.backend_plan[None].prefills) == 5


@pytest.mark.parametrize("use_cpu_kernel", [True, False], ids=["native-decode", "torch-decode"])
@pytest.mark.parametrize("block_size,window", [(4, 6), (16, 20), (8, 1)])
def test_a_sliding_window_matches_the_dense_masked_reference(block_size, window, use_cpu_kernel):
    """Prefills (fresh and over a context), decodes and speculative rows, each query over its last ``window``
    keys only; the blocks wholly before the windows are the null block, full of NaN, and never read."""
    specs = [(0, 30), (5, 1), (37, 6), (0, 1), (61, 1), (3, 5), (100, 1), (16, 16), (44, 3)]
    b = Batch(specs, block_size=block_size, num_blocks=160)
    b.backend = TorchPagedAttention(use_cpu_kernel=use_cpu_kernel)
    b.free_blocks_before(window)
    out, md = b.run(window=window)
    torch.testing.assert_close(out.double(), b.reference(window=window), atol=1e-5, rtol=1e-5)
    md.max_verify_query_len = 8  # the same batch as a speculative step: short queries as decode rows
    new_k = torch.cat([k[c:] for k, (c, _) in zip(b.k, specs)])
    new_v = torch.cat([v[c:] for v, (c, _) in zip(b.v, specs)])
    out = b.backend.forward(b.cache, torch.cat(b.q), new_k, new_v, md, 0.3, window=window)
    torch.testing.assert_close(out.double(), b.reference(window=window), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head_dim", [32, 64, 24])  # the vector paths and the generic one
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_native_decode_kernel_applies_a_window(head_dim, dtype):
    specs = [(ctx, 1) for ctx in (0, 3, 15, 16, 17, 40, 63, 100)]
    b = Batch(specs, head_dim=head_dim, block_size=16, dtype=dtype, num_blocks=128)
    b.free_blocks_before(21)
    out, _ = b.run(window=21)
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.double(), b.reference(window=21), atol=tolerance, rtol=tolerance)


def test_decodes_first_and_small_decode_chunks():
    specs = [(3, 1), (40, 1), (7, 1), (0, 1), (20, 4)]
    b = Batch(specs)
    b.backend = TorchPagedAttention(decode_chunk_elems=256)  # forces one decode per chunk
    out, md = b.run()
    assert md.num_decodes == 4
    torch.testing.assert_close(out.double(), b.reference(), atol=1e-5, rtol=1e-5)


def test_the_native_decode_kernel_builds_here():
    """CI machines have a compiler: the fast path must be what the tests above exercise."""
    assert load_cpu_kernels() is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [32, 64, 128, 24])  # the AVX-512 sizes and the generic path
@pytest.mark.parametrize("num_heads,num_kv_heads,block_size", [(8, 2, 16), (14, 2, 32), (4, 4, 16), (4, 2, 8)])
def test_native_decode_kernel_matches_dense_reference(dtype, head_dim, num_heads, num_kv_heads, block_size):
    specs = [(ctx, 1) for ctx in (0, 3, 15, 16, 17, 40, 63, 100)]
    b = Batch(
        specs,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        num_blocks=128,
    )
    out, _ = b.run()
    assert out.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.double(), b.reference(), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("use_cpu_kernel", [True, False], ids=["native-decode", "torch-decode"])
def test_bfloat16(use_cpu_kernel):
    b = Batch(MIXED, dtype=torch.bfloat16)
    b.backend = TorchPagedAttention(use_cpu_kernel=use_cpu_kernel)
    out, _ = b.run()
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), b.reference(), atol=3e-2, rtol=3e-2)


def test_writes_only_the_given_slots():
    b = Batch([(0, 6), (0, 1), (0, 3)])
    before = b.cache.clone()
    out, md = b.run()
    flat_before = before.view(2, -1, *before.shape[3:])
    flat_after = b.cache.view(2, -1, *b.cache.shape[3:])
    written = torch.zeros(flat_after.shape[1], dtype=torch.bool)
    written[md.slot_mapping] = True
    assert torch.equal(flat_after[:, ~written], flat_before[:, ~written])
    assert torch.equal(flat_after[0, md.slot_mapping], torch.cat(b.k))
    assert torch.equal(flat_after[1, md.slot_mapping], torch.cat(b.v))
    assert not b.cache[:, 0].any(), "null block 0 was written"


def test_request_reads_blocks_filled_in_the_same_step():
    """B's cached prefix lives in blocks that A writes during this very forward."""
    g = torch.Generator().manual_seed(1)
    backend = get_attention_backend()
    cache = torch.zeros(backend.get_kv_cache_shape(16, 4, 2, 8))
    k = torch.randn(11, 2, 8, generator=g)
    v = torch.randn(11, 2, 8, generator=g)
    qa, qb = torch.randn(8, 4, 8, generator=g), torch.randn(3, 4, 8, generator=g)
    # A: prefill tokens 0..7 into blocks [5, 2]; B: shares them as context, new tokens 8..10 in block 9.
    md = build_attention_metadata([8, 3], [8, 11], [[5, 2], [5, 2, 9]], 4)
    out = backend.forward(cache, torch.cat([qa, qb]), k, v, md, 0.5)
    torch.testing.assert_close(out[8:].double(), _reference(qb, k, v, 8, 0.5), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[:8].double(), _reference(qa, k[:8], v[:8], 0, 0.5), atol=1e-5, rtol=1e-5)


def test_metadata_builder():
    md = build_attention_metadata([3, 1], [3, 6], [[7], [4, 2]], 4)
    assert md.query_start_loc.tolist() == [0, 3, 4]
    assert md.seq_lens.tolist() == [3, 6]
    assert md.context_lens.tolist() == [0, 5] and md.context_lens_cpu == [0, 5]
    assert md.block_tables.tolist() == [[7, 0], [4, 2]]
    assert md.slot_mapping.tolist() == [28, 29, 30, 2 * 4 + 1]
    assert (md.max_query_len, md.max_seq_len, md.num_actual_tokens, md.num_decodes) == (3, 6, 4, 0)
    assert md.slot_mapping.dtype == torch.int64 and md.block_tables.dtype == torch.int32
    with pytest.raises(ValueError):
        build_attention_metadata([3], [9], [[1, 2]], 4)  # 2 blocks of 4 cannot hold 9 tokens


def test_metadata_without_cpu_lists():
    """A runner may leave the Python-side lists empty: the backend derives them."""
    b = Batch(MIXED)
    md = b.metadata()
    md.query_lens_cpu, md.seq_lens_cpu, md.num_decodes = [], [], -1
    new_k = torch.cat([k[c:] for k, (c, _) in zip(b.k, b.specs)])
    new_v = torch.cat([v[c:] for v, (c, _) in zip(b.v, b.specs)])
    out = b.backend.forward(b.cache, torch.cat(b.q), new_k, new_v, md, 0.3)
    torch.testing.assert_close(out.double(), b.reference(), atol=1e-5, rtol=1e-5)


def test_backend_registry():
    backend = get_attention_backend("torch")
    assert backend.get_kv_cache_shape(10, 16, 2, 64) == (2, 10, 16, 2, 64)
    caches = backend.allocate_kv_caches(3, 10, 16, 2, 64, torch.bfloat16)
    assert len(caches) == 3 and caches[0].dtype == torch.bfloat16 and not caches[0].any()
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_attention_backend("nope")


def test_auto_picks_triton_on_cuda_and_the_torch_reference_elsewhere():
    from engine.attention import resolve_backend_name

    assert resolve_backend_name("auto", torch.device("cuda")) == "triton"
    assert resolve_backend_name("auto", torch.device("cpu")) == "torch"
    assert resolve_backend_name("triton", torch.device("cpu")) == "triton"  # an explicit choice wins
    assert resolve_backend_name("torch", torch.device("cuda")) == "torch"


@pytest.mark.parametrize("head_dim", [64, 24])
def test_native_decode_kernel_reads_strided_queries_and_writes_into_out(head_dim):
    """q as a view into a packed qkv output, out as a slice of a bigger buffer (the layer's calls)."""
    specs = [(ctx, 1) for ctx in (5, 16, 33)]
    b = Batch(specs, num_heads=4, num_kv_heads=2, head_dim=head_dim, block_size=16, dtype=torch.bfloat16)
    b.run()  # writes the new keys/values
    md = b.metadata()
    q = torch.cat(b.q)  # [3, 4, D]
    packed = torch.cat([q.reshape(3, -1), torch.randn(3, 2 * 2 * head_dim).bfloat16()], dim=1)
    q_view = packed[:, : 4 * head_dim].view(3, 4, head_dim)
    assert not q_view.is_contiguous()
    out = torch.full((5, 4, head_dim), 7.0, dtype=torch.bfloat16)
    kernels = load_cpu_kernels()
    kernels.paged_decode_attention(q_view, b.cache, md.block_tables, md.seq_lens, 0.3, out[1:4])
    want = kernels.paged_decode_attention(q, b.cache, md.block_tables, md.seq_lens, 0.3)
    assert torch.equal(out[1:4], want)
    assert (out[0] == 7).all() and (out[4] == 7).all()
