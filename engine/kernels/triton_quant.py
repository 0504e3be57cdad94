"""Triton GEMM on GGUF-quantized weights: ``y = x @ dequantize(w).T (+ bias)``, W8A16 (Q8_0), W4A16 (Q4_0, Q4_1),
W5A16 (Q5_0, Q5_1).

``quant_linear(x, w, qtype, bias=None) -> y``

* ``x``: [M, K] float16, bfloat16 or float32 (a CUDA tensor; a CPU one under ``TRITON_INTERPRET=1``),
  its last dimension contiguous (else it is copied).
* ``qtype``: the weight's ``BlockFormat`` (``engine.model.quantization.blocks.QuantType`` is one; the kernel
  imports nothing of the model's).
* ``w``: uint8 [N, qtype.row_bytes(K)], a row of K / 32 blocks per output feature, in GGUF's layout; a row or
  whole-block ``narrow`` of a larger weight is fine.
* ``bias``: None or [N], any float dtype.
* returns ``y`` [M, N] in ``x``'s dtype, accumulated in float32.
* raises ``ValueError`` when K is not a multiple of 32, when ``w`` is not a 2-D uint8 tensor of
  ``row_bytes(K)`` bytes per row, when ``bias`` is not [N], when ``x`` has another dtype, or when the
  tensors are on different devices.

One kernel for the five formats (``qtype.kernel_id`` is a compile-time constant): each program owns a
[BLOCK_M, BLOCK_N] tile of ``y`` and walks K, BLOCK_K weights (BLOCK_K / 32 blocks) at a time. It loads the
block bytes, rebuilds each block's fp16 scale (and Q4_1's / Q5_1's min) from two bytes (a uint16 bitcast to
fp16), unpacks the int8, 4-bit or 5-bit quants (the fifth bit from qh, the header's last 4 bytes),
dequantizes the [BLOCK_K, BLOCK_N] tile in float32 registers exactly as ``dequantize`` does, casts it to
``x``'s dtype and feeds ``tl.dot`` with the activation tile. The tile sizes are chosen by M: a decode
configuration (M <= 16: narrow tiles, many programs) and a prefill one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import triton
import triton.language as tl

from engine.kernels.triton_common import MIN_DOT_ROWS, dot_options

ACTIVATION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BLOCK = 32  # weights per block, in every format the kernel reads


class BlockFormat(Protocol):
    """What the kernel reads of a block format: its name, kernel id (0 Q8_0, 1 Q4_0, 2 Q4_1, 3 Q5_0, 4 Q5_1), a
    block's bytes and its header's (fp16 scale, and min, then for Q5 the 4 bytes of qh), a row's bytes."""

    value: str
    kernel_id: int
    block_weights: int  # 32: the kernel reads no K-quant super-block (256)
    block_bytes: int
    header_bytes: int

    def row_bytes(self, k: int) -> int: ...


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    block_k: int  # a multiple of 32: whole blocks
    num_warps: int
    num_stages: int

    def __post_init__(self) -> None:
        if self.block_k % BLOCK or min(self.block_m, self.block_n, self.block_k) < MIN_DOT_ROWS:
            raise ValueError(f"tiles {self}: BLOCK_K must hold whole blocks, tl.dot needs 16 rows and columns")


DECODE_TILES = TileConfig(block_m=MIN_DOT_ROWS, block_n=32, block_k=128, num_warps=4, num_stages=3)
PREFILL_TILES = TileConfig(block_m=64, block_n=128, block_k=64, num_warps=8, num_stages=3)
DECODE_MAX_ROWS = DECODE_TILES.block_m


def tile_config(m: int) -> TileConfig:
    """The tiles for ``m`` rows of activations: decode (a few rows, weight-bandwidth bound) or prefill."""
    return DECODE_TILES if m <= DECODE_MAX_ROWS else PREFILL_TILES


@triton.jit
def _load_fp16(ptr, mask):
    """The little-endian fp16 at ``ptr`` (two bytes, any alignment) as float32."""
    low = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    high = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return (low | (high << 8)).to(tl.float16, bitcast=True).to(tl.float32)


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
    BLOCK_BYTES: tl.constexpr,
    HEADER: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Weights [BLOCK_K, BLOCK_N] (k ``k_start``.., output features ``cols_n``) in float32; 0 out of range."""
    ks = k_start + tl.arange(0, BLOCK_K)
    within = (ks % 32)[:, None]
    mask = (ks < K)[:, None] & (cols_n < N)[None, :]
    # int64: a large weight (an lm_head) has more than 2**31 bytes.
    block_ptrs = w_ptr + cols_n.to(tl.int64)[None, :] * stride_wn + ((ks // 32) * BLOCK_BYTES)[:, None]
    scale = _load_fp16(block_ptrs, mask)
    quants = _load_quants(block_ptrs, within, mask, QTYPE, HEADER)
    if QTYPE == 0:
        return scale * quants
    if QTYPE == 1:
        return scale * (quants - 8.0)
    if QTYPE == 3:
        return scale * (quants - 16.0)
    return scale * quants + _load_fp16(block_ptrs + 2, mask)


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
        w = _dequantize_tile(w_ptr, cols_n, k_start, N, K, stride_wn, QTYPE, BLOCK_BYTES, HEADER, BLOCK_K)
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
    if qtype.block_weights != 32:
        raise ValueError(f"quant_linear reads 32-weight blocks; {qtype.value}'s are {qtype.block_weights}")
    if x.dim() != 2 or x.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"quant_linear needs x [M, K] of float16, bfloat16 or float32, got {x.dtype} {list(x.shape)}")
    row_bytes = qtype.row_bytes(x.shape[1])  # raises unless K is a multiple of 32
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
