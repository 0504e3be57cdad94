// kquant_linear's many-rows path: a task's tile of NV lane sets unpacked once into quant_tile.h's layout, every row
// of x then reading it through wide_micro (nothing unpacked per row). What the tile holds per 32-weight block b of
// a super-block:
//   Q4_K, Q5_K: the quants u (the pairs builds: as int16 pairs, WideTile's; VNNI, Q5_K only: as bytes,
//     ByteTile's); the scale d sc_b and the min -(dmin m_b) as float (y += s * min d_a is the micro-kernel's
//     fnmadd of s, dmin m_b d_a: negation is exact);
//   Q6_K, pairs builds only: the pairs (u - 32) sc (|.| <= 32 * 128: a block's sum stays below 2^31, as the
//     kernel's); the scale d.
// On VNNI, as for the 32-weight formats (quant_tile.h), vpdpbusd multiplies Q4_K's bytes nearly as they lie: a
// tile of them measured 0.85-1.11x the micro-kernel's time, Q5_K's 0.80-1.08x (0.8x from 64 rows); and Q6_K's two
// sub-block scales a block would need two sums a row.
// The same integers and float steps as kquant_linear.cpp's micro-kernel, so the same bits.
#pragma once

#include "kquant_lanes.h"
#include "quant_tile.h"

#if SERVAL_SIMD

namespace serval::kquant {

using quant::kSteps;

#if SERVAL_AVX512
inline vint mul16(vint a, vint b) { return _mm512_mullo_epi16(a, b); }
inline vint both_halves(vint x) { return _mm512_mask_blend_epi16(0xAAAAAAAA, x, _mm512_slli_epi32(x, 16)); }
#else
inline vint mul16(vint a, vint b) { return _mm256_mullo_epi16(a, b); }
inline vint both_halves(vint x) { return _mm256_blend_epi16(x, _mm256_slli_epi32(x, 16), 0xAA); }
#endif

// Whether format F's many rows go through a tile on this build.
template <KFormat F>
constexpr bool has_tile() {
  return !SERVAL_QUANT_DIGITS || F == KFormat::kQ5_K;
}

template <KFormat F, int NV>
struct KWideTile {
  static_assert(has_tile<F>());
  static constexpr int kWords = SERVAL_QUANT_DIGITS ? 1 : 2;  // vectors a step and lane set: bytes, or two pairs
  static constexpr int kOffset = 0;
  static constexpr bool kHasMin = F != KFormat::kQ6_K;
  quant::vint* pairs;  // [block][step][lane set][bytes, or the pairs even, odd]
  float* d;            // [block][lane set][kRows]
  float* m;

  KWideTile(quant::TileBuffer& buffer, const Problem& p, int64_t n0) {
    static_assert(NV <= quant::kTileSets);
    buffer.reserve(p.K);
    pairs = buffer.pairs.get(), d = buffer.scales.get(), m = d + p.K / quant::kBlock * NV * kRows;
    const KLanes<F, NV> L(p, n0);
    for (int64_t s = 0; s < p.K / kSuper; ++s)
      for (int v = 0; v < NV; ++v) for_blocks([&](auto b) { widen_block<decltype(b)::value>(L, s, v); });
  }

  template <int B>
  void widen_block(const KLanes<F, NV>& L, int64_t s, int v) {
    using Fl = Fields<F>;
    const int64_t block = s * kBlocks + B, at = (block * NV + v) * kRows;
    const vfloat d_s = L.half(v, s, Fl::d);
    vint scale[2];
    if constexpr (F == KFormat::kQ6_K) {
      simd::store(d + at, d_s);
      for (int h = 0; h < 2; ++h) scale[h] = both_halves(q6_scale(L, v, s, 2 * B + h));
    } else {
      vint dw[3], sc, mn;
      for (int i = 0; i < 3; ++i) dw[i] = L.chunk(v, s, Fl::scales, i);
      scale_min(dw, B, &sc, &mn);
      simd::store(d + at, simd::mul(d_s, quant::to_float(sc)));
      simd::store(m + at, simd::mul(simd::sub(simd::set1(0.f), L.half(v, s, Fl::dmin)), quant::to_float(mn)));
    }
    for (int c = 0; c < kSteps; ++c) {
      const vint u = quants<F, B>(L, v, s, c);
      quant::vint* out = pairs + ((block * kSteps + c) * NV + v) * kWords;
#if SERVAL_QUANT_DIGITS
      out[0] = u;
#else
      Quads w = prepare(u);
      if constexpr (F == KFormat::kQ6_K) {
        w.even = mul16(quant::sub16(w.even, 32), scale[c / 4]);
        w.odd = mul16(quant::sub16(w.odd, 32), scale[c / 4]);
      }
      out[0] = w.even, out[1] = w.odd;
#endif
    }
  }
  const quant::vint* block(int64_t b) const { return pairs + b * kSteps * NV * kWords; }
};

}  // namespace serval::kquant

#endif  // SERVAL_SIMD
