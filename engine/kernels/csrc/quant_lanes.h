// quant_linear's micro-kernels over the packed weights as they lie (quant_blocks.h): MR rows of x against NV lane
// sets of kRows weight rows, a block's exact int32 sums in the registers, then its scales in float (the
// arithmetic is quant_linear.cpp's). Few rows of x stream the weights through these once; many rows reuse a tile
// of them from cache (quant_linear.cpp's many_rows), or on the pairs builds, from 24 rows, a widened copy of it
// (quant_tile.h).
#pragma once

#include "quant_activations.h"

#if SERVAL_SIMD

namespace serval::quant {

// The op's operands as quant_linear.cpp checked them.
struct Problem {
  const float* x;
  const uint8_t* w;
  const float* bias;  // nullptr: none
  float* y;
  int64_t M, K, N, row_bytes;
};

// NV lane sets of kRows weight rows each, from row n0 (a multiple of kRows) inside whole groups: set v's rows
// n0 + v * kRows .. lie in one group, at lane offset `lane[v]` of each 64-byte chunk (4 bytes a row) and of
// the scales (2 bytes a row).
template <Format F, int NV>
struct LaneSets {
  const uint8_t* group[NV];
  int64_t lane[NV];
  LaneSets(const Problem& p, int64_t n0) {
    for (int v = 0; v < NV; ++v) {
      const int64_t n = n0 + v * kRows;
      group[v] = p.w + n / kGroup * kGroup * p.row_bytes;
      lane[v] = n % kGroup;
    }
  }
  // Set v's bytes of block b: its scales d (and the mins m after them), the qh words at +kHigh (Q5), then the
  // quant chunks at +kHeader.
  const uint8_t* block(int v, int64_t b) const { return group[v] + b * kGroup * block_bytes(F); }
  static constexpr int64_t kHigh = kGroup * scale_bytes(F);
  static constexpr int64_t kHeader = kGroup * header_bytes(F);
  // Set v's chunk C of block b and (Q5) its rows' qh words; zero for formats without them.
  vint chunk(int v, int64_t b, int c) const { return load_bytes(block(v, b) + kHeader + 64 * c + 4 * lane[v]); }
  vint high(int v, int64_t b) const {
    if constexpr (has_high_bits(F)) return load_bytes(block(v, b) + kHigh + 4 * lane[v]);
    return zero();
  }
};

#if SERVAL_QUANT_DIGITS
// Lane set v's weights of chunk C (4C .. 4C + 3, and for Q4 / Q5 16 + 4C ..) as bytes u[quad][v] (Q5: with their
// fifth bits put in).
template <Format F, int NV, int C>
inline void chunk_bytes(const LaneSets<F, NV>& sets, int64_t b, vint (&u)[quads(F)][NV]) {
  for (int v = 0; v < NV; ++v) {
    const vint chunk = sets.chunk(v, b, C), high = sets.high(v, b);
    u[0][v] = quad_bytes<F, 0, C>(chunk, high);
    if constexpr (quads(F) == 2) u[1][v] = quad_bytes<F, 1, C>(chunk, high);
  }
}

// acc[m][v] += digit D's (0: h, 1: l) dot products of chunk C's bytes u with x's row m0 + m: vpdpbusd.
template <Format F, int MR, int NV, int D, int C>
inline void digit_dots(const vint (&u)[quads(F)][NV], const Activations& act, int64_t m0, int64_t b,
                       vint (&acc)[MR][NV]) {
  for (int m = 0; m < MR; ++m) {
    const int8_t* a = act.block(m0 + m, b) + D * kBlock + 4 * C;
    for (int v = 0; v < NV; ++v) {
      acc[m][v] = dot4(acc[m][v], u[0][v], bcast4(a));
      if constexpr (quads(F) == 2) acc[m][v] = dot4(acc[m][v], u[1][v], bcast4(a + 16));
    }
  }
}

// Whether block_sums makes each chunk's bytes once for both digits (two sets of accumulators) rather than in each
// of two passes: for the 5-bit formats, whose bytes take a shift, a mask and an or more to make than Q4's, where
// the accumulators fit the registers beside them (the sums are the same integers either way).
template <Format F, int MR, int NV>
constexpr bool one_pass() {
  return has_high_bits(F) && MR * NV <= 6;
}
#else#else
// acc[m][v] += quad `Quad`'s dot products over chunk C (weights 16 Quad + 4C .. + 3) for x's row m0 + m and lane set
// v: each lane set's weights widened to int16 pairs once, then two int16-pair multiply-adds a row of x.
template <Format F, int MR, int NV, int Quad, int C>
inline void quad_sums(const LaneSets<F, NV>& sets, const Activations& act, int64_t m0, int64_t b,
                      vint (&acc)[MR][NV]) {
  vint a_even[MR], a_odd[MR];  // the rows' activations first: then one lane set's weights are live at a time
  for (int m = 0; m < MR; ++m) {
    const int8_t* a = act.block(m0 + m, b) + 2 * (16 * Quad + 4 * C);
    a_even[m] = bcast4(a);
    a_odd[m] = bcast4(a + 4);
  }
  for (int v = 0; v < NV; ++v) {
    vint even, odd;
    widen<F, Quad, C>(sets.chunk(v, b, C), sets.high(v, b), &even, &odd);
    for (int m = 0; m < MR; ++m) acc[m][v] = dot2(dot2(acc[m][v], even, a_even[m]), odd, a_odd[m]);
  }
}
#endif

// acc[m][v] = block b's integer dot products of x's row m0 + m with lane set v's rows (quant_activations.h's forms).
template <Format F, int MR, int NV>
inline void block_sums(const LaneSets<F, NV>& sets, const Activations& act, int64_t m0, int64_t b,
                       vint (&acc)[MR][NV]) {
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) acc[m][v] = zero();
#if SERVAL_QUANT_DIGITS
  if constexpr (one_pass<F, MR, NV>()) {
    vint low[MR][NV];
    for (int m = 0; m < MR; ++m)
      for (int v = 0; v < NV; ++v) low[m][v] = zero();
    for_chunks<F>([&](auto c) {
      vint u[quads(F)][NV];
      chunk_bytes<F, NV, decltype(c)::value>(sets, b, u);
      digit_dots<F, MR, NV, 0, decltype(c)::value>(u, act, m0, b, acc);
      digit_dots<F, MR, NV, 1, decltype(c)::value>(u, act, m0, b, low);
    });
    for (int m = 0; m < MR; ++m)
      for (int v = 0; v < NV; ++v) acc[m][v] = add32(shift_left<kDigitShift>(acc[m][v]), low[m][v]);
    return;
  }
  // h, then l: two passes over the block (one with two sets of accumulators spills)
  for_chunks<F>([&](auto c) {
    vint u[quads(F)][NV];
    chunk_bytes<F, NV, decltype(c)::value>(sets, b, u);
    digit_dots<F, MR, NV, 0, decltype(c)::value>(u, act, m0, b, acc);
  });
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) acc[m][v] = shift_left<kDigitShift>(acc[m][v]);
  for_chunks<F>([&](auto c) {
    vint u[quads(F)][NV];
    chunk_bytes<F, NV, decltype(c)::value>(sets, b, u);
    digit_dots<F, MR, NV, 1, decltype(c)::value>(u, act, m0, b, acc);
  });
#else
  for_chunks<F>([&](auto c) {
    quad_sums<F, MR, NV, 0, decltype(c)::value>(sets, act, m0, b, acc);
    if constexpr (quads(F) == 2) quad_sums<F, MR, NV, 1, decltype(c)::value>(sets, act, m0, b, acc);
  });
#endif
}

// y[m][v] += block b's sums in float: fma(sum - offset * s, d_w * d_a), then (Q4_1, Q5_1) fma(s, m_w * d_a).
template <Format F, int MR, int NV>
inline void scale_block(const LaneSets<F, NV>& sets, const Activations& act, int64_t m0, int64_t b,
                        const vint (&acc)[MR][NV], simd::vfloat (&y)[MR][NV]) {
  simd::vfloat d_w[NV], m_w[NV];  // the weights' scales (and mins), widened once for the MR rows
  for (int v = 0; v < NV; ++v) {
    const uint8_t* scales = sets.block(v, b) + 2 * sets.lane[v];
    d_w[v] = halves(scales);
    if constexpr (has_min(F)) m_w[v] = halves(scales + 2 * kGroup);
  }
  for (int m = 0; m < MR; ++m) {
    const int64_t i = (m0 + m) * act.blocks + b;
    const simd::vfloat da = simd::set1(act.d[i]);
    const vint correction = set32(offset(F) * act.s[i]);
    for (int v = 0; v < NV; ++v) {
      const simd::vfloat sum = to_float(sub32(acc[m][v], correction));
      y[m][v] = simd::fmadd(sum, simd::mul(d_w[v], da), y[m][v]);
      if constexpr (has_min(F))
        y[m][v] = simd::fmadd(simd::set1(static_cast<float>(act.s[i])), simd::mul(m_w[v], da), y[m][v]);
    }
  }
}

// y[m0 .. m0 + MR, n0 .. n0 + NV * kRows) = acc + bias.
template <int MR, int NV>
inline void store_rows(const Problem& p, int64_t m0, int64_t n0, const simd::vfloat (&y)[MR][NV]) {
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) {
      const int64_t n = n0 + v * kRows;
      const simd::vfloat out = p.bias == nullptr ? y[m][v] : simd::add(y[m][v], simd::load(p.bias + n));
      simd::store(p.y + (m0 + m) * p.N + n, out);
    }
}

// y[m0 .. m0 + MR, n0 .. n0 + NV * kRows), + bias.
template <Format F, int MR, int NV>
inline void micro(const Problem& p, const Activations& act, int64_t m0, int64_t n0) {
  const LaneSets<F, NV> sets(p, n0);
  simd::vfloat y[MR][NV];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) y[m][v] = simd::set1(0.f);
  for (int64_t b = 0; b < act.blocks; ++b) {
    vint acc[MR][NV];
    block_sums<F, MR, NV>(sets, act, m0, b, acc);
    scale_block<F, MR, NV>(sets, act, m0, b, acc, y);
  }
  store_rows<MR, NV>(p, m0, n0, y);
}

// Lane sets (kRows weight rows each) per micro-kernel: few rows of x stream the weights (more streams in
// flight); many rows keep MR x NV int32 and float accumulators in the registers.
template <int MR>
constexpr int lane_sets() {
  return MR == 1 && simd::kRegisters == 32 ? 4 : 2;
}
constexpr int kTileRows = simd::kRegisters == 32 ? 4 : 3;  // MR for many rows of x: the fastest measured
constexpr int kTileSets = lane_sets<kTileRows>();  // NV for many rows of x

// Rows m0 .. m0 + MR of x against lane sets [v_begin, v_end).
template <Format F, int MR>
void lane_range(const Problem& p, const Activations& act, int64_t m0, int64_t v_begin, int64_t v_end) {
  constexpr int NV = lane_sets<MR>();
  int64_t v = v_begin;
  for (; v + NV <= v_end; v += NV) micro<F, MR, NV>(p, act, m0, v * kRows);
  for (; v < v_end; ++v) micro<F, MR, 1>(p, act, m0, v * kRows);
}

}  // namespace serval::quant

#endif  // SERVAL_SIMD
