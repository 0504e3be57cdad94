"""Triton GEMM on GGUF-quantized weights: ``y = x @ dequantize(w).T (+ bias)``, W8A16 (Q8_0), W4A16 (Q4_0, Q4_1,
Q4_K), W5A16 (Q5_0, Q5_1, Q5_K), W6A16 (Q6_K).

``quant_linear(x, w, qtype, bias=None) -> y``

* ``x``: [M, K] float16, bfloat16 or float32 (a CUDA tensor; a CPU one under ``TRITON_INTERPRET=1``),
  its last dimension contiguous (else it is copied).
* ``qtype``: the weight's ``BlockFormat`` (``engine.model.quantization.blocks.QuantType`` is one; the kernel
  imports nothing of the model's).
* ``w``: uint8 [N, qtype.row_bytes(K)], a row of K / block_weights blocks per output feature (32-weight blocks,
  or the K-quants' 256-weight super-blocks), in GGUF's layout; a row or whole-block (whole-super-block)
  ``narrow`` of a larger weight is fine.
* ``bias``: None or [N], any float dtype.
* returns ``y`` [M, N] in ``x``'s dtype, accumulated in float32.
* raises ``ValueError`` when K is not a multiple of the format's block (32; 256 for Q4_K, Q5_K, Q6_K), when
  ``qtype`` is a format the kernel does not read, when ``w`` is not a 2-D uint8 tensor of ``row_bytes(K)``
  bytes per row, when ``bias`` is not [N], when ``x`` has another dtype, or when the tensors are on different
  devices.

One kernel for the eight formats (``qtype.kernel_id`` and ``qtype.super_block`` are compile-time constants):
each program owns a [BLOCK_M, BLOCK_N] tile of ``y`` and walks K, BLOCK_K weights at a time. It dequantizes
the [BLOCK_K, BLOCK_N] weight tile in float32 registers exactly as ``dequantize`` does, casts it to ``x``'s
dtype and feeds ``tl.dot`` with the activation tile. A 32-weight format's tile is BLOCK_K / 32 blocks: it loads
the block bytes, rebuilds each block's fp16 scale (and Q4_1's / Q5_1's min) from two bytes (a uint16 bitcast to
fp16) and unpacks the int8, 4-bit or 5-bit quants (the fifth bit from qh, the header's last 4 bytes). A
K-quant's tile (``triton_kquant``: a part of a super-block or several) unpacks each 16 weights' scales once
(Q4_K's / Q5_K's 6-bit scales and mins, Q6_K's int8 ones) and their 4-, 5- or 6-bit quants. The tile sizes
are chosen by M: a decode configuration (M <= 16: narrow tiles, many programs) and a prefill one, the same
for every format (BLOCK_K 128 and 64: whole blocks, a half and a quarter super-block).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import triton
import triton.language as tl

from engine.kernels.triton_common import MIN_DOT_ROWS, dot_options, load_fp16
from engine.kernels.triton_kquant import KERNEL_IDS as KQUANT_IDS
from engine.kernels.triton_kquant import dequantize_kquant_tile

ACTIVATION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BLOCK = 32  # weights per block, in every format but the K-quants
SUPER_BLOCK = 256  # weights per K-quant super-block
BLOCK_IDS = (0, 1, 2, 3, 4)  # Q8_0, Q4_0, Q4_1, Q5_0, Q5_1


class BlockFormat(Protocol):
    """What the kernel reads of a block format: its name, kernel id (0 Q8_0, 1 Q4_0, 2 Q4_1, 3 Q5_0, 4 Q5_1;
    10 Q4_K, 11 Q5_K, 12 Q6_K), whether it is a K-quant, a block's weights and bytes, a 32-weight block's
    header's bytes (fp16 scale, and min, then for Q5 the 4 bytes of qh), a row's bytes."""

    value: str
    kernel_id: int
    super_block: bool  # a K-quant: 256-weight super-blocks (triton_kquant)
    block_weights: int  # 32, or 256 for a K-quant
    block_bytes: int
    header_bytes: int  # read for the 32-weight formats only

    def row_bytes(self, k: int) -> int: ...


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    block_k: int  # a power of two of whole blocks (32 on): a part of a super-block, or whole ones
    num_warps: int
    num_stages: int

    def __post_init__(self) -> None:
        if self.block_k < BLOCK or self.block_k & (self.block_k - 1) or min(self.block_m, self.block_n) < MIN_DOT_ROWS:
            raise ValueError(f"tiles {self}: BLOCK_K must be a power of two from 32, tl.dot needs 16 rows and columns")


DECODE_TILES = TileConfig(block_m=MIN_DOT_ROWS, block_n=32, block_k=128, num_warps=4, num_stages=3)
PREFILL_TILES = TileConfig(block_m=64, block_n=128, block_k=64, num_warps=8, num_stages=3)
DECODE_MAX_ROWS = DECODE_TILES.block_m


def tile_config(m: int) -> TileConfig:
    """The tiles for ``m`` rows of activations: decode (a few rows, weight-bandwidth bound) or prefill."""
    return DECODE_TILES if m <= DECODE_MAX_ROWS else PREFILL_TILES


@triton.jit
def _load_quants(block_ptrs, within, mask, QTYPE: tl.constexpr, HEADER: tl.constexpr):
    """Quants [BLOCK_K, BLOCK_N] as float32: element ``within`` (0..31, [BLOCK_K, 1]) of each block."""
    if QTYPE == 0:  # Q8_0: 32 int8 after the scale
        raw = tl.load(block_ptrs + HEADER + within, mask=mask, other=0)
        return raw.to(tl.int8, bitcast=True).to(tl.float32)
    # Q4_0, Q4_1, Q5_0, Q5_1: byte j holds element j (low nibble) and element j + 16 (high nibble).
    raw = tl.load(block_ptrs + HEADER + within % 16, mask=mask, other=0)
    q = (raw >> ((within // 16) * 4).to(tl.uint8)) & 0x0F
    if QTYPE >= 3:  # Q5_0, Q5_1: element j's fifth bit is bit j of qh (little-endian, the header's last 4 bytes)
        high = tl.load(block_ptrs + (HEADER - 4) + within // 8, mask=mask, other=0)
        q = q | (((high >> (within % 8).to(tl.uint8)) & 1) << 4)
    return q.to(tl.float32)


@triton.jit
def _dequantize_tile(
    w_ptr,
    cols_n,
    k_start,
    N,
    K,
    stride_wn,
    QTYPE: tl.constexpr,
    SUPER: tl.constexpr,
    BLOCK_BYTES: tl.constexpr,
    HEADER: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Weights [BLOCK_K, BLOCK_N] (k ``k_start``.., output features ``cols_n``) in float32; 0 out of range."""
    if SUPER:  # a K-quant (triton_kquant)
        return dequantize_kquant_tile(w_ptr, cols_n, k_start, N, K, stride_wn, QTYPE, BLOCK_BYTES, BLOCK_K, BLOCK_N)
    ks = k_start + tl.arange(0, BLOCK_K)
    within = (ks % 32)[:, None]
    mask = (ks < K)[:, None] & (cols_n < N)[None, :]
    # int64: a large weight (an lm_head) has more than 2**31 bytes.
    block_ptrs = w_ptr + cols_n.to(tl.int64)[None, :] * stride_wn + ((ks // 32) * BLOCK_BYTES)[:, None]
    scale = load_fp16(block_ptrs, mask)
    quants = _load_quants(block_ptrs, within, mask, QTYPE, HEADER)
    if QTYPE == 0:
        return scale * quants
    if QTYPE == 1:
        return scale * (quants - 8.0)
    if QTYPE == 3:
        return scale * (quants - 16.0)
    return scale * quants + load_fp16(block_ptrs + 2, mask)


@triton.jit
def _quant_linear_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    QTYPE: tl.constexpr,
    SUPER: tl.constexpr,
    BLOCK_BYTES: tl.constexpr,
    HEADER: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] tile of ``y = x @ dequantize(w).T + bias``."""
    rows_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    x_rows = x_ptr + rows_m.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k_start in range(0, K, BLOCK_K):
        ks = k_start + tl.arange(0, BLOCK_K)
        x = tl.load(x_rows + ks[None, :], mask=(rows_m < M)[:, None] & (ks < K)[None, :], other=0.0)
        w = _dequantize_tile(
            w_ptr, cols_n, k_start, N, K, stride_wn, QTYPE, SUPER, BLOCK_BYTES, HEADER, BLOCK_K, BLOCK_N
        )
        w = w.to(x_ptr.dtype.element_ty)  # rounded to x's dtype, also when the interpreter upcasts
        if UPCAST:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(x, w, acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols_n, mask=cols_n < N, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + rows_m.to(tl.int64)[:, None] * stride_ym + cols_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(rows_m < M)[:, None] & (cols_n < N)[None, :])


def _check(x: torch.Tensor, w: torch.Tensor, qtype: BlockFormat, bias: torch.Tensor | None) -> None:
    """Raises ValueError unless the operands fit the module docstring's contract."""
    ids, weights = (KQUANT_IDS, SUPER_BLOCK) if qtype.super_block else (BLOCK_IDS, BLOCK)
    if qtype.kernel_id not in ids or qtype.block_weights != weights:
        raise ValueError(f"quant_linear has no kernel for {qtype.value} (kernel id {qtype.kernel_id})")
    if x.dim() != 2 or x.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"quant_linear needs x [M, K] of float16, bfloat16 or float32, got {x.dtype} {list(x.shape)}")
    if x.shape[1] % weights:
        raise ValueError(f"quant_linear needs K a multiple of {weights} for {qtype.value}, got {x.shape[1]}")
    row_bytes = qtype.row_bytes(x.shape[1])
    if w.dim() != 2 or w.dtype != torch.uint8 or w.shape[1] != row_bytes:
        raise ValueError(
            f"quant_linear needs w uint8 [N, {row_bytes}] ({qtype.value}, K={x.shape[1]}), "
            f"got {w.dtype} {list(w.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (w.shape[0],):
        raise ValueError(f"quant_linear needs bias [{w.shape[0]}], got {list(bias.shape)}")
    devices = {t.device for t in (x, w, bias) if t is not None}
    if len(devices) > 1:
        raise ValueError(f"quant_linear's tensors are on different devices: {sorted(map(str, devices))}")


def quant_linear(
    x: torch.Tensor, w: torch.Tensor, qtype: BlockFormat, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ dequantize(w, qtype).T + bias`` in ``x``'s dtype (module docstring: the contract)."""
    _check(x, w, qtype, bias)
    x = x if x.stride(1) == 1 else x.contiguous()
    w = w if w.stride(1) == 1 else w.contiguous()
    (m, k), n = x.shape, w.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    tiles = tile_config(m)
    grid = (triton.cdiv(m, tiles.block_m), triton.cdiv(n, tiles.block_n))
    options = dot_options(x.dtype)
    _quant_linear_kernel[grid](
        x,
        w,
        bias if bias is not None else y,  # a placeholder pointer when there is no bias: never read
        y,
        m,
        n,
        k,
        x.stride(0),
        w.stride(0),
        y.stride(0),
        QTYPE=qtype.kernel_id,
        SUPER=qtype.super_block,
        BLOCK_BYTES=qtype.block_bytes,
        HEADER=qtype.header_bytes,
        HAS_BIAS=bias is not None,
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
        **options,
    )
    return y
