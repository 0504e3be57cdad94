"""The native quantized linear (engine/kernels/csrc/quant_linear.cpp): GGUF Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 weights
and the K-quants Q4_K / Q5_K / Q6_K (kquant_linear.cpp: random valid super-blocks, which gguf cannot write) in the
packed layout (packed.py), activations quantized per block to 14 bits, integer dot products.

* ``dequantize`` (the reference of every kernel) is the gguf package's dequantization, bit for bit, on random
  blocks (every quant bit pattern) and on weights its quantizer wrote; ``pack`` / ``unpack_rows`` round-trip;
* bit for bit equal to its scalar reference (``quant_linear_reference``: the same activation quantization, the
  same integer sums, the same per-block fused multiply-adds in the same order), for every format, N with rows
  past the last group of 16, and row counts on both sides of the few-rows / many-rows switch;
* within float32 rounding of the float64 product of the dequantized weight and the quantized activations
  (their quantization redone in torch), and within 14-bit rounding of the float activations' product;
* batch-invariant: a row's result is the same bits alone, in any batch of 2 to 600 rows, on 1 or 2 threads;
* the same bits on the AVX2 build (``SERVAL_CPU_MARCH=x86-64-v3``: int16 pairs, vpmaddwd, 8 lanes) and on
  AVX-512 without VNNI (``skylake-avx512``: int16 pairs, 16 lanes) as on this one (on a VNNI CPU: two int8
  digits, vpdpbusd), each built and run in a subprocess: the integer sums are exact, so neither the ISA nor the
  activations' stored form changes a bit.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.kernels.cpu import load_cpu_kernels
from engine.model.quantization import kquants
from engine.model.quantization.blocks import QuantType, dequantize, quantize
from engine.model.quantization.packed import pack
from tests.engine.kernels.test_cpu_kernels import _cpu_flags, cpu_has_fused_isa

ROWS = [*range(1, 10), 17, 64, 300]
DEPTHS = {32: [32, 64, 576, 1536], 256: [256, 512, 1536, 2048]}  # by the format's block_weights
CASES = [(qtype, k) for qtype in QuantType for k in DEPTHS[qtype.block_weights]]
ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def ops():
    if not cpu_has_fused_isa():
        pytest.skip("this CPU has neither AVX-512 nor AVX2: quant_linear is not built (test_cpu_kernels checks that)")
    return load_cpu_kernels()


def _depth(k: int, qtype: QuantType) -> int:
    """``k`` for a 32-weight format, the multiple of 256 below it (at least 256) for a K-quant."""
    return max(qtype.block_weights, k // qtype.block_weights * qtype.block_weights)


def _raw(n: int, k: int, qtype: QuantType, seed: int = 0) -> torch.Tensor:
    if qtype.super_block:  # gguf cannot quantize the K-quants: random valid super-blocks
        return kquants.random_rows(n, k, qtype.value, torch.Generator().manual_seed(seed))
    return quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.1, qtype)


def _quantized(n: int, k: int, qtype: QuantType, seed: int = 0) -> torch.Tensor:
    return pack(_raw(n, k, qtype, seed), qtype)


def _quantized_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel quantizes it, per row and block of 32, to 14 bits: e a / 128 with e = max |x| / 127,
    t = x / e, a = round(128 t)."""
    blocks = x.reshape(x.shape[0], -1, 32)
    e = blocks.abs().amax(dim=-1, keepdim=True) / 127
    t = blocks * torch.where(e != 0, 1 / e, torch.zeros_like(e))
    a = torch.round(t * 128).double()
    return (a * (e / 128).double()).reshape(x.shape)


def _randn(*shape: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def check_equals_reference(ops, qtype: QuantType, k: int) -> None:
    w, n = _quantized(53, k, qtype), 53  # 3 groups of 16 rows and 5: an odd number of lane sets on AVX-512
    bias = _randn(n, seed=2)
    x = _randn(max(ROWS), k)
    for m in ROWS:
        for b in (None, bias):
            got = ops.quant_linear(x[:m], w, qtype.kernel_id, b)
            assert torch.equal(got, ops.quant_linear_reference(x[:m], w, qtype.kernel_id, b)), (qtype, k, m, b is None)


def check_batch_invariance(ops, qtype: QuantType) -> None:
    k = _depth(576, qtype)
    w, x = _quantized(45, k, qtype), _randn(600, k)
    whole = ops.quant_linear(x, w, qtype.kernel_id)
    for m in range(20):  # each row alone
        assert torch.equal(ops.quant_linear(x[m : m + 1], w, qtype.kernel_id), whole[m : m + 1])
    for size in [2, 3, 4, 5, 8, 9, 17, 31, 64, 65, 129, 300, 599]:  # windows at odd offsets
        start = (7 * size) % (600 - size)
        assert torch.equal(ops.quant_linear(x[start : start + size], w, qtype.kernel_id), whole[start : start + size])
    picked = torch.tensor([599, 3, 250, 17, 18])  # rows from all over, in another order
    assert torch.equal(ops.quant_linear(x[picked], w, qtype.kernel_id), whole[picked])


@pytest.mark.parametrize("qtype, k", CASES, ids=lambda c: getattr(c, "value", c))
def test_quant_linear_is_bit_identical_to_its_scalar_reference(ops, qtype, k):
    check_equals_reference(ops, qtype, k)


def _magnitudes(raw: torch.Tensor, qtype: QuantType) -> torch.Tensor:
    """|each term| of the dequantized weights: d sc q + dmin m for Q4_K / Q5_K (their dmin's sign flipped: a
    weight near 0 may be two large terms cancelling), |w| for the other formats."""
    if qtype not in (QuantType.Q4_K, QuantType.Q5_K):
        return dequantize(raw, qtype).double().abs()
    flipped = raw.clone().reshape(raw.shape[0], -1, qtype.block_bytes)
    flipped[..., 3] ^= 0x80  # dmin's fp16 sign bit
    return dequantize(flipped.reshape(raw.shape), qtype).double().abs()


@pytest.mark.parametrize("qtype, k", CASES, ids=lambda c: getattr(c, "value", c))
def test_quant_linear_is_the_product_of_the_quantized_activations_and_the_dequantized_weight(ops, qtype, k):
    raw, x, bias = _raw(53, k, qtype), _randn(70, k), _randn(53, seed=3)
    dense = dequantize(raw, qtype).double()
    got = ops.quant_linear(x, pack(raw, qtype), qtype.kernel_id, bias).double()
    want = _quantized_activations(x) @ dense.T + bias.double()
    # Exact integer sums; per block their rounding to float, a rounded scale, a rounded fused multiply-add
    # (two for Q4_1, Q4_K and Q5_K, whose dequantized weights round once more).
    bound = (
        (5 * k / 32 + 4)
        * 2.0**-24
        * (_quantized_activations(x).abs() @ _magnitudes(raw, qtype).T + bias.double().abs())
    )
    assert ((got - want).abs() <= bound).all()
    exact = x.double() @ dense.T + bias.double()
    assert (got - exact).norm() < 1e-4 * (exact - bias.double()).norm()  # 14-bit activations: about 4e-5


@pytest.mark.parametrize("qtype", list(QuantType), ids=lambda q: q.value)
def test_a_rows_result_is_the_same_bits_in_any_batch(ops, qtype):
    check_batch_invariance(ops, qtype)


def test_a_rows_result_is_the_same_bits_on_one_thread_or_two(ops):
    w, x = _quantized(3000, 576, QuantType.Q4_1), _randn(70, 576)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = [ops.quant_linear(x[:m], w, QuantType.Q4_1.kernel_id) for m in (1, 4, 70)]
        torch.set_num_threads(1)
        one = [ops.quant_linear(x[:m], w, QuantType.Q4_1.kernel_id) for m in (1, 4, 70)]
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(one, two))


def test_bad_operands_raise_clear_errors(ops):
    w = _quantized(8, 64, QuantType.Q8_0)
    with pytest.raises(RuntimeError, match="kernel_id"):
        ops.quant_linear(torch.zeros(1, 64), w, 7)
    with pytest.raises(RuntimeError, match="blocks of 32"):
        ops.quant_linear(torch.zeros(1, 64), w, QuantType.Q4_0.kernel_id)  # Q8_0's bytes read as Q4_0
    with pytest.raises(RuntimeError, match="bias"):
        ops.quant_linear(torch.zeros(1, 64), w, 0, torch.zeros(3))
    k_quant = _quantized(8, 512, QuantType.Q4_K)
    with pytest.raises(RuntimeError, match="super-blocks of 256"):
        ops.quant_linear(torch.zeros(1, 256), k_quant, QuantType.Q4_K.kernel_id)  # two super-blocks a row


ISA_CHECKS = """
import torch
from engine.kernels.cpu import load_cpu_kernels
from engine.model.quantization.blocks import QuantType
from tests.engine.kernels import test_quant_linear as t
ops = load_cpu_kernels()
for q in QuantType:
    for k in sorted({{t._depth(k, q) for k in (32, 576, 1536)}}):
        t.check_equals_reference(ops, q, k)
    t.check_batch_invariance(ops, q)
k = {{q: t._depth(576, q) for q in QuantType}}
y = {{q.value: ops.quant_linear(t._randn(5, k[q]), t._quantized(37, k[q], q), q.kernel_id) for q in QuantType}}
torch.save(y, {out!r})
"""


@pytest.mark.parametrize(
    "march, flags",
    [("x86-64-v3", {"avx2", "fma", "f16c"}), ("skylake-avx512", {"avx512f", "avx512bw", "avx512vl", "avx512cd"})],
)
def test_another_isas_build_equals_its_reference_and_this_builds_bits(ops, tmp_path, march, flags):
    """The AVX2 path and AVX-512 without VNNI, built on this host (their own modules of the block products
    alone: ``SERVAL_CPU_KERNELS_SUBSET=quant``); the first run compiles each (tens of seconds)."""
    if not flags <= _cpu_flags():
        pytest.skip(f"this CPU cannot run the {march} build")
    out = tmp_path / "isa.pt"
    env = os.environ | {"SERVAL_CPU_MARCH": march, "SERVAL_CPU_KERNELS_SUBSET": "quant", "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-c", ISA_CHECKS.format(out=str(out))], env=env, cwd=ROOT, check=True, timeout=900)
    other = torch.load(out)
    for q in QuantType:
        k = _depth(576, q)
        assert torch.equal(other[q.value], ops.quant_linear(_randn(5, k), _quantized(37, k, q), q.kernel_id)), q


# The 32-weight formats; the K-quants' (which gguf cannot quantize) in tests/engine/model/test_kquant_weights.py.
@pytest.mark.parametrize("qtype", [q for q in QuantType if not q.super_block], ids=lambda q: q.value)
def test_dequantize_is_ggufs_on_random_blocks_and_quantized_weights(qtype):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    g = torch.Generator().manual_seed(5)
    random = torch.randint(0, 256, (64, 8 * qtype.block_bytes), dtype=torch.uint8, generator=g)
    blocks = random.view(64, 8, qtype.block_bytes)
    scales = (torch.rand(64, 8, qtype.scale_bytes // 2, generator=g) - 0.5).half()  # finite: NaN != NaN
    blocks[..., : qtype.scale_bytes] = scales.view(torch.uint8)
    for raw in (random, _raw(45, 576, qtype, seed=4)):
        want = gguf_dequantize(raw.numpy(), GGMLQuantizationType[qtype.value])
        assert torch.equal(dequantize(raw, qtype), torch.from_numpy(want)), qtype


@pytest.mark.parametrize("qtype", list(QuantType), ids=lambda q: q.value)
def test_pack_keeps_the_shape_and_unpack_rows_reads_the_files_rows_back(qtype):
    from engine.model.quantization.packed import unpack_rows

    for n in (5, 16, 37):  # no whole group, one, two and a tail
        raw = _raw(n, _depth(96, qtype), qtype)
        packed = pack(raw, qtype)
        assert packed.shape == raw.shape
        ids = torch.tensor([n - 1, 0, n // 2, 0])
        assert torch.equal(unpack_rows(packed, ids, qtype), raw[ids])
    if qtype is QuantType.Q8_0:  # a quant of -128 (llama.cpp never writes one) reads as -127
        raw = _raw(16, 32, qtype)
        raw[3, 2] = 0x80
        assert unpack_rows(pack(raw, qtype), torch.tensor([3]), qtype)[0, 2] == 0x81
