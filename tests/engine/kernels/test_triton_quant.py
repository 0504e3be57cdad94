"""The Triton GEMM on GGUF-quantized weights against ``x.float() @ dequantize(w).T``, for every format.

On a machine without CUDA it runs through Triton's interpreter (set before the kernel is imported); on a
GPU the same tests run natively.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from engine.kernels.triton_quant import quant_linear  # noqa: E402 - after TRITON_INTERPRET
from engine.model.quantization.blocks import QuantType, dequantize, quantize  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Relative (Frobenius) error: float32 is exact up to summation order; 16-bit x rounds each weight to
# x's dtype for tl.dot and rounds y.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}

CASES = [  # M, N, K, x dtype, bias: odd N and M; decode (M <= 16) and prefill tiles; K over several tiles
    (1, 33, 32, torch.float32, False),
    (3, 70, 96, torch.float16, True),
    (17, 129, 576, torch.bfloat16, False),
    (64, 45, 96, torch.float32, True),
    (1, 257, 576, torch.float16, False),
    (64, 161, 576, torch.bfloat16, True),
    (17, 31, 32, torch.float16, True),
    (3, 50, 576, torch.float32, False),
]


def relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    return float((out.float() - expected).norm() / expected.norm())


# The kernel's formats: the K-quants on CUDA take the torch reference (block_method.py), and are refused here.
BLOCK_FORMATS = [q for q in QuantType if not q.super_block]


def quantized_weight(n: int, k: int, qtype: QuantType, generator: torch.Generator) -> torch.Tensor:
    return quantize(torch.randn(n, k, generator=generator), qtype).to(DEVICE)


def reference(x, w, qtype, bias):
    expected = x.float() @ dequantize(w, qtype).T
    return expected if bias is None else expected + bias.float()


@pytest.mark.parametrize("qtype", BLOCK_FORMATS, ids=lambda q: q.value)
@pytest.mark.parametrize("m, n, k, dtype, with_bias", CASES)
def test_quant_linear_equals_the_reference(qtype, m, n, k, dtype, with_bias):
    generator = torch.Generator().manual_seed(m * 1000 + n + k)
    w = quantized_weight(n, k, qtype, generator)
    x = torch.randn(m, k, generator=generator).to(DEVICE, dtype)
    bias = torch.randn(n, generator=generator).to(DEVICE, dtype) if with_bias else None
    y = quant_linear(x, w, qtype, bias)
    assert y.shape == (m, n) and y.dtype == dtype and y.device == x.device
    assert relative_error(y, reference(x, w, qtype, bias)) <= TOLERANCE[dtype]


@pytest.mark.parametrize("qtype", BLOCK_FORMATS, ids=lambda q: q.value)
def test_quant_linear_reads_a_shard_of_rows_and_blocks(qtype):
    """A tensor-parallel shard is a narrow of the bytes: rows (output features) or whole blocks (inputs)."""
    generator = torch.Generator().manual_seed(7)
    full = quantized_weight(40, 192, qtype, generator)
    shard = full[5:30, 2 * qtype.block_bytes : 5 * qtype.block_bytes]  # 25 rows, blocks 2..4 (K = 96)
    x = torch.randn(5, 96, generator=generator).to(DEVICE)
    y = quant_linear(x, shard, qtype)
    expected = x @ dequantize(full, qtype)[5:30, 64:160].T
    assert relative_error(y, expected) <= TOLERANCE[torch.float32]


def test_quant_linear_rejects_what_breaks_its_contract():
    generator = torch.Generator().manual_seed(1)
    w = quantized_weight(8, 64, QuantType.Q8_0, generator)
    x = torch.randn(2, 64, generator=generator).to(DEVICE)
    with pytest.raises(ValueError, match="multiple of 32"):
        quant_linear(torch.randn(2, 48).to(DEVICE), w, QuantType.Q4_0)
    with pytest.raises(ValueError, match=r"uint8 \[N, 36\]"):
        quant_linear(x, w, QuantType.Q4_0)  # Q8_0's bytes read as Q4_0: the row length is wrong
    with pytest.raises(ValueError, match="bias"):
        quant_linear(x, w, QuantType.Q8_0, torch.zeros(9, device=DEVICE))
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        quant_linear(x.double(), w, QuantType.Q8_0)
    with pytest.raises(ValueError, match="32-weight blocks; Q4_K's are 256"):
        quant_linear(
            torch.randn(2, 256).to(DEVICE), torch.zeros(8, 144, dtype=torch.uint8, device=DEVICE), QuantType.Q4_K
        )


def test_quant_linear_with_no_rows_returns_an_empty_result():
    w = quantized_weight(8, 32, QuantType.Q4_1, torch.Generator().manual_seed(2))
    assert quant_linear(torch.empty(0, 32, device=DEVICE), w, QuantType.Q4_1).shape == (0, 8)
