"""The K-quants' weight tiles for ``triton_quant``'s GEMM: Q4_K, Q5_K and Q6_K super-blocks (256 weights)
dequantized in registers exactly as ``engine.model.quantization.kquants.dequantize`` computes each weight.

The super-block layouts (ggml-common.h; the file's bytes, a row K / 256 super-blocks back to back):

* Q4_K (144 bytes): fp16 d, fp16 dmin, 12 bytes of 6-bit scales sc and mins m (ggml's ``get_scale_min_k4``),
  128 bytes qs. Weight l (0..31) of sub-block s (0..7) is the low (even s) or high (odd s) nibble of
  qs[32 (s // 2) + l]:   w = (d sc_s) q - (dmin m_s)
* Q5_K (176 bytes): Q4_K's d, dmin and scales, 32 bytes qh, then qs; q = nibble + 16 * bit s of qh[l].
* Q6_K (210 bytes): ql 128, qh 64, int8 scales 16 (one per 16 weights), fp16 d. Weight i: half h = i // 128,
  t = i % 128 // 32, l = i % 32; the low (t < 2) or high nibble of ql[64 h + 32 (t % 2) + l], bits 2 t and
  2 t + 1 of qh[32 h + l] on top:   w = (d sc_(i // 16)) (q - 32)

A tile [BLOCK_K, BLOCK_N] is read as [BLOCK_K / 16, 16, BLOCK_N]: groups of 16 weights (half a Q4_K / Q5_K
sub-block, one Q6_K scale), so each group's scales are loaded and unpacked once, [BLOCK_K / 16, 1, BLOCK_N],
and broadcast over its 16 weights; the tile is then reshaped to [BLOCK_K, BLOCK_N]. BLOCK_K is a power of two
from 16 on: whole groups, a part of one super-block (BLOCK_K < 256) or several. Every product is exact in
float32 (fp16 d times a 6- or 8-bit scale times a quant of at most 6 bits), so a fused multiply-add rounds as
``dequantize`` does: once, at Q4_K's / Q5_K's subtraction.
"""

from __future__ import annotations

import triton
import triton.language as tl

from engine.kernels.triton_common import load_fp16

KERNEL_IDS = (10, 11, 12)  # Q4_K, Q5_K, Q6_K (QuantType.kernel_id)


@triton.jit
def _byte(ptrs, mask):
    return tl.load(ptrs, mask=mask, other=0).to(tl.int32)


@triton.jit
def _q45_k(sb_ptrs, g, j, mask, FIVE_BITS: tl.constexpr):
    """Q4_K / Q5_K weights [G, 16, BLOCK_N] of groups ``g`` ([G, 1, 1], 0..15 in the super-block)."""
    s = g // 2  # the sub-block of 32: its 6-bit scale and min from the 12 bytes at 4 (get_scale_min_k4)
    a = _byte(sb_ptrs + 8 + s, mask)  # scales[s + 4]
    b = _byte(sb_ptrs + 4 + s % 4, mask)  # scales[s % 4]
    c = _byte(sb_ptrs + 4 + s, mask)  # scales[s]
    sc = tl.where(s < 4, b & 63, (a & 15) | ((b >> 6) << 4))
    m = tl.where(s < 4, a & 63, (a >> 4) | ((c >> 6) << 4))
    d = load_fp16(sb_ptrs, mask) * sc.to(tl.float32)  # [G, 1, BLOCK_N], exact
    dm = load_fp16(sb_ptrs + 2, mask) * m.to(tl.float32)
    at = (g % 2) * 16 + j  # weight within the sub-block (l), [G, 16, 1]
    if FIVE_BITS:
        q = (_byte(sb_ptrs + 48 + 32 * (s // 2) + at, mask) >> (4 * (s % 2))) & 15
        q = q | (((_byte(sb_ptrs + 16 + at, mask) >> s) & 1) << 4)
    else:
        q = (_byte(sb_ptrs + 16 + 32 * (s // 2) + at, mask) >> (4 * (s % 2))) & 15
    return d * q.to(tl.float32) - dm


@triton.jit
def _q6_k(sb_ptrs, g, j, mask):
    """Q6_K weights [G, 16, BLOCK_N] of groups ``g`` ([G, 1, 1], 0..15: the int8 scale of each)."""
    sc = tl.load(sb_ptrs + 192 + g, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
    d = load_fp16(sb_ptrs + 208, mask) * sc  # [G, 1, BLOCK_N], exact
    i = g * 16 + j  # weight within the super-block, [G, 16, 1]
    half, t, at = i // 128, i % 128 // 32, i % 32  # at: l
    low = (_byte(sb_ptrs + 64 * half + 32 * (t % 2) + at, mask) >> (4 * (t // 2))) & 15
    high = (_byte(sb_ptrs + 128 + 32 * half + at, mask) >> (2 * t)) & 3
    return d * ((low | (high << 4)) - 32).to(tl.float32)


@triton.jit
def dequantize_kquant_tile(
    w_ptr,
    cols_n,
    k_start,
    N,
    K,
    stride_wn,
    QTYPE: tl.constexpr,
    BLOCK_BYTES: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Weights [BLOCK_K, BLOCK_N] (k ``k_start``.., output features ``cols_n``) in float32; 0 out of range."""
    groups = k_start // 16 + tl.arange(0, BLOCK_K // 16)  # the tile's groups of 16, counted along the row
    g = (groups % 16)[:, None, None]
    j = tl.arange(0, 16)[None, :, None]
    mask = (groups * 16 < K)[:, None, None] & (cols_n < N)[None, None, :]  # [G, 1, BLOCK_N]
    # int64: a large weight (an lm_head) has more than 2**31 bytes.
    rows = cols_n.to(tl.int64)[None, None, :] * stride_wn
    sb_ptrs = w_ptr + rows + ((groups // 16) * BLOCK_BYTES)[:, None, None]  # each group's super-block
    if QTYPE == 12:
        w = _q6_k(sb_ptrs, g, j, mask)
    else:
        w = _q45_k(sb_ptrs, g, j, mask, QTYPE == 11)
    return tl.reshape(w, (BLOCK_K, BLOCK_N))
