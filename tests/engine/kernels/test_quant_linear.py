"""The native quantized linear (engine/kernels/csrc/quant_linear.cpp): GGUF Q8_0 / Q4_0 / Q4_1 weights, float32
activations.

* bit for bit equal to its scalar reference (``quant_linear_reference``: the same dequantized weights, the same
  per-lane fused multiply-adds in the same order, the same sum of the lanes), for every format, odd N and row
  counts on both sides of the register / tiled switch;
* within float32 rounding of the float64 product of the torch dequantization (blocks.py);
* batch-invariant: a row's result is the same bits alone, in any batch of 2 to 600 rows, on 1 or 2 threads;
* the same on the AVX2 build (``SERVAL_CPU_MARCH=x86-64-v3``, 8 lanes), run in a subprocess, whose bits differ
  from the AVX-512 build's where this host has AVX-512 (another lane count, another order) but equal its own
  reference.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.kernels.cpu import load_cpu_kernels
from engine.model.quantization.blocks import QuantType, dequantize, quantize
from tests.engine.kernels.test_cpu_kernels import _cpu_flags, cpu_has_fused_isa

ROWS = [*range(1, 10), 17, 64, 300]
DEPTHS = [32, 64, 576, 1536]
ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def ops():
    if not cpu_has_fused_isa():
        pytest.skip("this CPU has neither AVX-512 nor AVX2: quant_linear is not built (test_cpu_kernels checks that)")
    return load_cpu_kernels()


def _quantized(n: int, k: int, qtype: QuantType, seed: int = 0) -> torch.Tensor:
    return quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.1, qtype)


def _randn(*shape: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def check_equals_reference(ops, qtype: QuantType, k: int) -> None:
    w, n = _quantized(37, k, qtype), 37
    bias = _randn(n, seed=2)
    x = _randn(max(ROWS), k)
    for m in ROWS:
        for b in (None, bias):
            got = ops.quant_linear(x[:m], w, qtype.kernel_id, b)
            assert torch.equal(got, ops.quant_linear_reference(x[:m], w, qtype.kernel_id, b)), (qtype, k, m, b is None)


def check_batch_invariance(ops, qtype: QuantType) -> None:
    w, x = _quantized(45, 576, qtype), _randn(600, 576)
    whole = ops.quant_linear(x, w, qtype.kernel_id)
    for m in range(20):  # each row alone
        assert torch.equal(ops.quant_linear(x[m : m + 1], w, qtype.kernel_id), whole[m : m + 1])
    for size in [2, 3, 4, 5, 8, 9, 17, 31, 64, 65, 129, 300, 599]:  # windows at odd offsets
        start = (7 * size) % (600 - size)
        assert torch.equal(ops.quant_linear(x[start : start + size], w, qtype.kernel_id), whole[start : start + size])
    picked = torch.tensor([599, 3, 250, 17, 18])  # rows from all over, in another order
    assert torch.equal(ops.quant_linear(x[picked], w, qtype.kernel_id), whole[picked])


@pytest.mark.parametrize("k", DEPTHS)
@pytest.mark.parametrize("qtype", list(QuantType), ids=lambda q: q.value)
def test_quant_linear_is_bit_identical_to_its_scalar_reference(ops, qtype, k):
    check_equals_reference(ops, qtype, k)


@pytest.mark.parametrize("k", DEPTHS)
@pytest.mark.parametrize("qtype", list(QuantType), ids=lambda q: q.value)
def test_quant_linear_matches_the_float64_product_of_the_dequantized_weight(ops, qtype, k):
    w, x, bias = _quantized(53, k, qtype), _randn(70, k), _randn(53, seed=3)
    dense = dequantize(w, qtype).double()
    want = x.double() @ dense.T + bias.double()
    # Each output sums K / lanes products per lane and then the lanes: a float32 error bound of that many
    # roundings of the sum of |products| (8 lanes, the AVX2 build's, is the larger bound).
    bound = (k / 8 + 4) * 2.0**-24 * (x.double().abs() @ dense.abs().T + bias.double().abs())
    got = ops.quant_linear(x, w, qtype.kernel_id, bias).double()
    assert ((got - want).abs() <= bound).all()


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


AVX2_CHECKS = """
import torch
from engine.kernels.cpu import load_cpu_kernels
from engine.model.quantization.blocks import QuantType
from tests.engine.kernels import test_quant_linear as t
ops = load_cpu_kernels()
for q in QuantType:
    for k in (32, 576, 1536):
        t.check_equals_reference(ops, q, k)
    t.check_batch_invariance(ops, q)
w, x = t._quantized(37, 576, QuantType.Q8_0), t._randn(5, 576)
torch.save(ops.quant_linear(x, w, 0), {out!r})
"""


def test_the_avx2_build_equals_its_own_reference_and_is_batch_invariant(ops, tmp_path):
    """The AVX2 path built on this host (its own module); the first run compiles it (a minute or two)."""
    if not {"avx2", "fma", "f16c"} <= _cpu_flags():
        pytest.skip("this CPU cannot run the AVX2 build")
    out = tmp_path / "avx2.pt"
    env = os.environ | {"SERVAL_CPU_MARCH": "x86-64-v3", "PYTHONPATH": str(ROOT)}
    code = AVX2_CHECKS.format(out=str(out))
    subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, check=True, timeout=900)
    w, x = _quantized(37, 576, QuantType.Q8_0), _randn(5, 576)
    avx2, native = torch.load(out), ops.quant_linear(x, w, 0)
    torch.testing.assert_close(avx2, native, atol=1e-4, rtol=1e-5)
    if {"avx512f", "avx512bw", "avx512vl"} <= _cpu_flags():  # 8 lanes there, 16 here: another order of sums
        assert not torch.equal(avx2, native)
