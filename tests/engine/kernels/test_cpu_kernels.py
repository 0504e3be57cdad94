"""The fused native CPU ops (engine/kernels/csrc/elementwise.cpp) against the plain-torch layers they replace,
and the paged decode attention kernel (csrc/decode_attention.cpp) against a dense float64 reference.

bf16 and float16: SiLU*mul and rope are bit-identical to torch, RMSNorm within one unit in the last
place (its mean of squares is summed in another order, so the normalised value can round the other
way; in float16, finer, the weight product can make that two units). float32: within a few float32 ulps. Row
widths and head sizes include ones that are not a multiple of either vector width (8 and 16 lanes),
so the tail handling of both paths is covered.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.attention.torch_paged import TorchPagedAttention
from engine.kernels.cpu import fused_cpu_ops, load_cpu_kernels, use_cpu_kernels
from engine.model.layers.norm import RMSNorm
from engine.model.layers.rotary import RotaryEmbedding

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# The relative tolerance of RMSNorm: one bf16 unit in the last place, two float16 units.
NORM_RTOL = {torch.bfloat16: 2**-7, torch.float16: 2**-9}
FLOAT32_TOL = dict(atol=1e-6, rtol=1e-6)


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo", encoding="ascii") as f:
        return set(next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), []))


def cpu_has_fused_isa() -> bool:
    """AVX-512 F, BW and VL, or AVX2 with FMA and F16C: the two paths the fused ops are written for (csrc/vec.h)."""
    flags = _cpu_flags()
    return {"avx512f", "avx512bw", "avx512vl"} <= flags or {"avx2", "fma", "f16c"} <= flags


def test_fused_ops_exist_exactly_where_the_cpu_has_avx512_or_avx2():
    """The module always builds here (a compiler and ninja are there); the fused ops come with AVX-512 or
    AVX2, and without both every layer keeps its plain-torch path."""
    assert load_cpu_kernels() is not None, "the native CPU kernels must build on the CI machines"
    assert (fused_cpu_ops(torch.zeros(1)) is not None) == cpu_has_fused_isa()


@pytest.fixture(scope="module")
def ops():
    if not cpu_has_fused_isa():
        pytest.skip("this CPU has neither AVX-512 nor AVX2: the fused ops are not built (the test above checks that)")
    return load_cpu_kernels()


def _randn(*shape, dtype, seed=0, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def _assert_matches(got, want, dtype, exact=True):
    if dtype in NORM_RTOL and exact:
        assert torch.equal(got, want)
    elif dtype in NORM_RTOL:
        torch.testing.assert_close(got.float(), want.float(), atol=0, rtol=NORM_RTOL[dtype])
    else:
        torch.testing.assert_close(got, want, **FLOAT32_TOL)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,width", [(1, 8), (37, 688), (300, 100)])  # tails, decode and prefill sizes
def test_silu_and_mul(ops, dtype, rows, width):
    gate_up = _randn(rows, 2 * width, dtype=dtype, scale=4.0)
    want = F.silu(gate_up[:, :width]) * gate_up[:, width:]
    _assert_matches(ops.silu_and_mul(gate_up), want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,width", [(1, 24), (3, 13), (64, 256), (300, 896)])
def test_rms_norm_and_fused_add(ops, dtype, rows, width):
    norm = RMSNorm(width, eps=1e-5).to(dtype)
    norm.weight.copy_(_randn(width, dtype=dtype, seed=1) + 1)
    x, residual = _randn(rows, width, dtype=dtype, seed=2), _randn(rows, width, dtype=dtype, seed=3)
    _assert_matches(ops.rms_norm(x, norm.weight, norm.eps), norm._norm(x), dtype, exact=False)
    x_inout, residual_inout = x.clone(), residual.clone()
    ops.fused_add_rms_norm(x_inout, residual_inout, norm.weight, norm.eps)
    assert torch.equal(residual_inout, x + residual)
    _assert_matches(x_inout, norm._norm(x + residual), dtype, exact=False)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_module_same_with_and_without_native_ops(dtype):
    norm = RMSNorm(64).to(dtype)
    x, residual = _randn(5, 3, 64, dtype=dtype, seed=4), _randn(5, 3, 64, dtype=dtype, seed=5)
    with use_cpu_kernels(False):
        want_plain, (want_normed, want_sum) = norm(x), norm(x.clone(), residual.clone())
    got_plain, (got_normed, got_sum) = norm(x), norm(x.clone(), residual.clone())
    assert torch.equal(got_sum, want_sum)
    for got, want in ((got_plain, want_plain), (got_normed, want_normed)):
        _assert_matches(got, want, dtype, exact=False)


def _qkv_views(num_tokens, num_heads, num_kv_heads, head_dim, dtype, seed):
    """q, k, v as the attention layer gets them: views into one packed qkv output."""
    qkv = _randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, seed=seed)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    return (
        q.view(num_tokens, num_heads, head_dim),
        k.view(num_tokens, num_kv_heads, head_dim),
        v.view(num_tokens, num_kv_heads, head_dim),
    )


# The model's dtype and the KV cache's: its own, or a 16-bit cache under float32 (kv_cache_dtype).
DTYPE_PAIRS = [(dtype, dtype) for dtype in DTYPES] + [(torch.float32, torch.bfloat16), (torch.float32, torch.float16)]


@pytest.mark.parametrize("dtype,cache_dtype", DTYPE_PAIRS)
@pytest.mark.parametrize(
    "head_dim,rope",
    [
        (64, {"rope_theta": 10000.0}),
        (16, {"rope_theta": 500.0}),
        (20, {"rope_theta": 10000.0}),  # half = 10: a tail on both vector widths
        (
            128,
            {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
    ],
)
def test_rotary_embedding_and_cache(ops, dtype, cache_dtype, head_dim, rope):
    """q and k rotated in place as torch rotates them; k and v stored as torch's .to() rounds them to the cache."""
    num_tokens, num_heads, num_kv_heads, block_size, num_blocks = 11, 4, 2, 4, 8
    rotary = RotaryEmbedding(head_dim, rope, 256)
    q, k, v = _qkv_views(num_tokens, num_heads, num_kv_heads, head_dim, dtype, seed=6)
    positions = torch.randint(0, 256, (num_tokens,), generator=torch.Generator().manual_seed(7))
    slots = torch.randperm(num_blocks * block_size, generator=torch.Generator().manual_seed(8))[:num_tokens]
    want_q, want_k = rotary(positions, q, k)
    want_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim).to(cache_dtype)
    got_cache = want_cache.clone()
    TorchPagedAttention.write_kv(want_cache, want_k, v, slots)
    ops.rotary_embedding_and_cache(positions, q, k, v, rotary.table(255, q.device), got_cache, slots)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)  # rotated in place
    assert torch.equal(got_cache, want_cache)  # k and v at their slots, nothing else touched


def test_rotary_embedding_and_cache_refuses_a_cache_of_another_dtype_under_16_bit_activations(ops):
    rotary = RotaryEmbedding(16, {"rope_theta": 10000.0}, 64)
    q, k, v = _qkv_views(3, 2, 1, 16, torch.bfloat16, seed=9)
    with pytest.raises(RuntimeError, match="a Half KV cache under BFloat16 activations"):
        ops.rotary_embedding_and_cache(
            torch.tensor([0, 1, 2]),
            q,
            k,
            v,
            rotary.table(63, q.device),
            torch.zeros(2, 2, 4, 1, 16).half(),
            torch.tensor([0, 1, 2]),
        )


def test_rotary_embedding_and_cache_rejects_bad_slots_before_writing(ops):
    rotary = RotaryEmbedding(16, {"rope_theta": 10000.0}, 64)
    q, k, v = _qkv_views(3, 2, 1, 16, torch.float32, seed=9)
    cache = torch.zeros(2, 2, 4, 1, 16)
    before = (q.clone(), k.clone())
    with pytest.raises(RuntimeError, match="outside the KV cache"):
        ops.rotary_embedding_and_cache(
            torch.tensor([0, 1, 2]), q, k, v, rotary.table(63, q.device), cache, torch.tensor([0, 1, 8])
        )
    with pytest.raises(RuntimeError, match="outside the rope table"):
        ops.rotary_embedding_and_cache(
            torch.tensor([0, 1, 64]), q, k, v, rotary.table(63, q.device), cache, torch.tensor([0, 1, 2])
        )
    assert torch.equal(q, before[0]) and torch.equal(k, before[1]) and not cache.any()


def _paged_cache(lens, block_size, num_kv_heads, head_dim, dtype, seed):
    """A KV cache with random contents and each request's blocks drawn at random from a pool 2x too big."""
    gen = torch.Generator().manual_seed(seed)
    max_blocks = -(-max(lens) // block_size)
    num_blocks = 2 * len(lens) * max_blocks + 1
    tables = (torch.randperm(num_blocks - 1, generator=gen)[: len(lens) * max_blocks] + 1).view(len(lens), -1)
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    return cache, tables.to(torch.int32), torch.tensor(lens, dtype=torch.int32)


def _decode_reference(q, cache, tables, lens, scale):
    """Each request's one query token [H, D] over its first seq_len cached keys, dense, in float64."""
    out = []
    for i, seq_len in enumerate(lens.tolist()):
        blocks = tables[i, : -(-seq_len // cache.shape[2])].long()
        k, v = (cache[j, blocks].flatten(0, 1)[:seq_len].double() for j in (0, 1))  # [S, Hk, D]
        group = q.shape[1] // k.shape[1]
        scores = torch.einsum("hd,shd->hs", q[i].double(), k.repeat_interleave(group, dim=1)) * scale
        out.append(torch.einsum("hs,shd->hd", scores.softmax(-1), v.repeat_interleave(group, dim=1)))
    return torch.stack(out)


# Lengths around the vector widths (8, 16) and block boundaries (8, 16, 32), and a long one.
DECODE_LENS = [1, 7, 8, 9, 15, 16, 17, 31, 33, 64, 100, 300]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [32, 64, 128, 24])  # the fast path's sizes and one for the generic path
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (4, 2), (14, 2)])  # GQA groups of 1, 2, 7
@pytest.mark.parametrize("block_size", [16, 8, 12])  # fast on both widths, on AVX2 only, on neither
def test_paged_decode_attention_matches_dense_reference(dtype, head_dim, num_heads, num_kv_heads, block_size):
    cache, tables, lens = _paged_cache(DECODE_LENS, block_size, num_kv_heads, head_dim, dtype, seed=10)
    q = _randn(len(DECODE_LENS), num_heads, head_dim, dtype=dtype, seed=11)
    out = load_cpu_kernels().paged_decode_attention(q, cache, tables, lens, head_dim**-0.5, None)
    assert out.dtype == dtype and out.shape == q.shape
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(
        out.double(), _decode_reference(q, cache, tables, lens, head_dim**-0.5), atol=tolerance, rtol=tolerance
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 24])
def test_paged_decode_attention_reads_strided_q_and_writes_into_out(dtype, head_dim):
    """q a view into a packed qkv output and `out` a slice of a bigger buffer, as the attention layer calls it."""
    lens, num_heads, num_kv_heads = [5, 16, 40], 14, 2
    cache, tables, lens = _paged_cache(lens, 16, num_kv_heads, head_dim, dtype, seed=12)
    packed = _randn(3, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, seed=13)
    q_view = packed[:, : num_heads * head_dim].view(3, num_heads, head_dim)
    assert not q_view.is_contiguous()
    out = torch.full((5, num_heads, head_dim), 7.0, dtype=dtype)
    kernels = load_cpu_kernels()
    assert kernels.paged_decode_attention(q_view, cache, tables, lens, 0.3, out[1:4]).data_ptr() == out[1].data_ptr()
    assert torch.equal(out[1:4], kernels.paged_decode_attention(q_view.contiguous(), cache, tables, lens, 0.3, None))
    assert (out[0] == 7).all() and (out[4] == 7).all()
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(
        out[1:4].double(), _decode_reference(q_view, cache, tables, lens, 0.3), atol=tolerance, rtol=tolerance
    )


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 24])  # the fast path and the generic one
def test_paged_decode_attention_float32_queries_over_a_16_bit_cache(cache_dtype, head_dim):
    """kv_cache_dtype under a float32 model: the cache's rows widen exactly, so the result is the float32 kernel's
    on the same values, bit for bit."""
    cache, tables, lens = _paged_cache(DECODE_LENS, 16, 2, head_dim, cache_dtype, seed=14)
    q = _randn(len(DECODE_LENS), 6, head_dim, dtype=torch.float32, seed=15)
    kernels = load_cpu_kernels()
    out = kernels.paged_decode_attention(q, cache, tables, lens, head_dim**-0.5, None)
    assert out.dtype == torch.float32
    assert torch.equal(out, kernels.paged_decode_attention(q, cache.float(), tables, lens, head_dim**-0.5, None))
    torch.testing.assert_close(
        out.double(), _decode_reference(q, cache, tables, lens, head_dim**-0.5), atol=1e-5, rtol=1e-5
    )
    with pytest.raises(RuntimeError, match="KV cache under"):
        kernels.paged_decode_attention(q.to(torch.bfloat16), cache.half(), tables, lens, 0.1, None)


def test_use_cpu_kernels_switches_everything_off():
    x = torch.zeros(2, 4)
    with use_cpu_kernels(False):
        assert load_cpu_kernels() is None and fused_cpu_ops(x) is None
    assert load_cpu_kernels() is not None and (fused_cpu_ops(x) is not None) == cpu_has_fused_isa()
    assert fused_cpu_ops(x.double()) is None  # float64 stays in torch


@pytest.mark.parametrize("rows", range(1, 9))
@pytest.mark.parametrize(("in_features", "out_features"), [(256, 512), (688, 256), (13, 7), (256, 8192), (33, 100)])
def test_skinny_linear_matches_f_linear(ops, rows, in_features, out_features):
    x = _randn(rows, in_features, dtype=torch.float32, seed=rows)
    weight = _randn(out_features, in_features, dtype=torch.float32, seed=1)
    bias = _randn(out_features, dtype=torch.float32, seed=2)
    torch.testing.assert_close(ops.skinny_linear(x, weight, bias), F.linear(x, weight, bias), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(ops.skinny_linear(x, weight), F.linear(x, weight), atol=1e-4, rtol=1e-5)
    strided = _randn(rows, 2 * in_features, dtype=torch.float32, seed=3)[:, ::2]  # a view: made contiguous inside
    torch.testing.assert_close(ops.skinny_linear(strided, weight), F.linear(strided, weight), atol=1e-4, rtol=1e-5)


def test_a_float32_product_takes_skinny_linear_for_the_rows_its_step_names_only(ops):
    from engine.model.layers.cpu_prepack import NO_NATIVE_ROWS, SPECULATIVE_ROWS, CPUFloat32Product, float_product

    weight = _randn(64, 32, dtype=torch.float32, seed=4)
    chosen = float_product(weight)  # what a float32 CPU layer gets at load: the packed copy, the native kernel
    assert isinstance(chosen, CPUFloat32Product) and chosen.packed is not None and chosen.skinny_linear is not None
    product = CPUFloat32Product(weight, None, ops.skinny_linear)  # unpacked: the rows past 2 show the choice too
    for rows in (1, 2, 8, 9):
        x = _randn(rows, 32, dtype=torch.float32, seed=rows)
        want = ops.skinny_linear(x, weight) if 2 <= rows <= 8 else F.linear(x, weight)
        assert torch.equal(product(x, None, SPECULATIVE_ROWS), want), rows
        assert torch.equal(product(x, None, NO_NATIVE_ROWS), F.linear(x, weight)), rows  # MKL outside
    with pytest.raises(RuntimeError, match="1 to 8 rows"):
        ops.skinny_linear(_randn(9, 32, dtype=torch.float32), weight)
