"""The Triton GEMM on GGUF-quantized weights against ``x.float() @ dequantize(w).T``, for every format: the
32-weight blocks quantized by gguf, the K-quants' super-blocks of random bytes (``kquants.random_rows``).

On a machine without CUDA it runs through Triton's interpreter (set before the kernel is imported); on a
GPU the same tests run natively.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from engine.kernels.triton_quant import quant_linear  # noqa: E402 - after TRITON_INTERPRET
from engine.model.quantization import kquants  # noqa: E402
from engine.model.quantization.blocks import QuantType, dequantize, quantize  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Relative (Frobenius) error: float32 is exact up to summation order; 16-bit x rounds each weight to
# x's dtype for tl.dot and rounds y.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}

BLOCK_CASES = [  # M, N, K, x dtype, bias: odd N and M; decode (M <= 16) and prefill tiles; K over several tiles
    (1, 33, 32, torch.float32, False),
    (3, 70, 96, torch.float16, True),
    (17, 129, 576, torch.bfloat16, False),
    (64, 45, 96, torch.float32, True),
    (1, 257, 576, torch.float16, False),
    (64, 161, 576, torch.bfloat16, True),
    (17, 31, 32, torch.float16, True),
    (3, 50, 576, torch.float32, False),
]
# The K-quants: K over one super-block and several (decode tiles hold half of one, prefill tiles a quarter).
KQUANT_CASES = [
    (1, 33, 256, torch.float32, True),
    (3, 45, 768, torch.float16, False),
    (17, 31, 512, torch.bfloat16, True),
    (40, 20, 256, torch.float16, True),
]


def relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    return float((out.float() - expected).norm() / expected.norm())


BLOCK_FORMATS = [q for q in QuantType if not q.super_block]
KQUANTS = [q for q in QuantType if q.super_block]
FORMAT_CASES = [(q, *c) for q in BLOCK_FORMATS for c in BLOCK_CASES] + [(q, *c) for q in KQUANTS for c in KQUANT_CASES]


def quantized_weight(n: int, k: int, qtype: QuantType, generator: torch.Generator) -> torch.Tensor:
    """gguf's blocks of a random weight; a K-quant's random super-blocks (gguf quantizes none)."""
    if qtype.super_block:
        return kquants.random_rows(n, k, qtype.value, generator).to(DEVICE)
    return quantize(torch.randn(n, k, generator=generator), qtype).to(DEVICE)


def reference(x, w, qtype, bias):
    expected = x.float() @ dequantize(w, qtype).T
    return expected if bias is None else expected + bias.float()


def case_id(case) -> str:
    return "-".join(c.value if isinstance(c, QuantType) else str(c).removeprefix("torch.") for c in case)


@pytest.mark.parametrize("qtype, m, n, k, dtype, with_bias", FORMAT_CASES, ids=map(case_id, FORMAT_CASES))
def test_quant_linear_equals_the_reference(qtype, m, n, k, dtype, with_bias):
    generator = torch.Generator().manual_seed(m * 1000 + n + k)
    w = quantized_weight(n, k, qtype, generator)
    x = torch.randn(m, k, generator=generator).to(DEVICE, dtype)
    bias = torch.randn(n, generator=generator).to(DEVICE, dtype) if with_bias else None
    y = quant_linear(x, w, qtype, bias)
    assert y.shape == (m, n) and y.dtype == dtype and y.device == x.device
    assert relative_error(y, reference(x, w, qtype, bias)) <= TOLERANCE[dtype]


@pytest.mark.parametrize("qtype", list(QuantType), ids=lambda q: q.value)
def test_quant_linear_reads_a_shard_of_rows_and_blocks(qtype):
    """A tensor-parallel shard is a narrow of the bytes: rows (output features) or whole blocks (inputs; a
    K-quant's whole super-blocks)."""
    generator = torch.Generator().manual_seed(7)
    b = qtype.block_weights
    full = quantized_weight(40, 6 * b, qtype, generator)
    shard = full[5:30, 2 * qtype.block_bytes : 5 * qtype.block_bytes]  # 25 rows, blocks 2..4 (K = 3 blocks)
    x = torch.randn(5, 3 * b, generator=generator).to(DEVICE)
    y = quant_linear(x, shard, qtype)
    expected = x @ dequantize(full, qtype)[5:30, 2 * b : 5 * b].T
    assert relative_error(y, expected) <= TOLERANCE[torch.float32]


@pytest.mark.parametrize("m", [16, 512], ids=["decode", "prefill"])
@pytest.mark.parametrize("qtype", KQUANTS, ids=lambda q: q.value)
def test_kquant_tiles_dequantize_as_the_reference_bit_for_bit(qtype, m):
    """Rows of the identity in float32 (no TF32) pick weights out of the tiles unrounded: ``y`` is
    ``dequantize(w).T``'s rows exactly, for every weight of every super-block at M = K (prefill tiles)."""
    generator = torch.Generator().manual_seed(m)
    w = quantized_weight(19, 512, qtype, generator)
    x = torch.eye(512)[torch.randperm(512, generator=generator)[:m]].to(DEVICE)
    assert torch.equal(quant_linear(x, w, qtype), x @ dequantize(w, qtype).T)


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
    q4_k = torch.zeros(8, 2 * 144, dtype=torch.uint8, device=DEVICE)  # two Q4_K super-blocks a row (K = 512)
    with pytest.raises(ValueError, match="multiple of 256 for Q4_K, got 288"):
        quant_linear(torch.randn(2, 288).to(DEVICE), q4_k, QuantType.Q4_K)  # 9 blocks of 32: no whole super-block
    with pytest.raises(ValueError, match=r"uint8 \[N, 420\]"):
        quant_linear(torch.randn(2, 512).to(DEVICE), q4_k, QuantType.Q6_K)  # Q4_K's bytes read as Q6_K
    with pytest.raises(ValueError, match="no kernel for Q3_K"):
        quant_linear(torch.randn(2, 256).to(DEVICE), q4_k, UnreadFormat())


@dataclass(frozen=True)
class UnreadFormat:
    """A super-block format the kernel has no tile for (a ``BlockFormat`` with an unknown kernel id)."""

    value: str = "Q3_K"
    kernel_id: int = 9
    super_block: bool = True
    block_weights: int = 256
    block_bytes: int = 110
    header_bytes: int = 0

    def row_bytes(self, k: int) -> int:
        return k // 256 * 110


@pytest.mark.parametrize("qtype", [QuantType.Q4_1, QuantType.Q6_K], ids=lambda q: q.value)
def test_quant_linear_with_no_rows_returns_an_empty_result(qtype):
    k = qtype.block_weights
    w = quantized_weight(8, k, qtype, torch.Generator().manual_seed(2))
    assert quant_linear(torch.empty(0, k, device=DEVICE), w, qtype).shape == (0, 8)
