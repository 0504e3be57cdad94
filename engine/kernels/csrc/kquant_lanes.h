// kquant_linear's micro-kernel over packed K-quant super-blocks (kquant_blocks.h): MR rows of x against NV lane
// sets of kRows weight rows, one 32-weight block's exact int32 sums in the registers, then its scales in float.
// The integer steps, per build (quant_activations.h's forms):
//   digits (VNNI): vpdpbusd of the unsigned quants u with each digit h, l of the activations; sum = 128 h-sum +
//     l-sum; Q6_K's u - 32 by its offset: sum - 32 * (the half-block's activation sum);
//   pairs (AVX2, AVX-512 without VNNI): u widened to int16 pairs, vpmaddwd; Q6_K's u - 32 by the offset as above.
// Both are the same integers, so the same bits on every build as kquant_linear.cpp's scalar reference.
#pragma once

#include "kquant_blocks.h"
#include "quant_lanes.h"

#if SERVAL_SIMD

namespace serval::kquant {

using quant::Activations;
using quant::kRows;
using quant::Problem;
using quant::vint;
using simd::vfloat;

#if SERVAL_AVX512
inline vint add32(vint a, vint b) { return _mm512_add_epi32(a, b); }
inline vint mul32(vint a, vint b) { return _mm512_mullo_epi32(a, b); }
inline vint or_(vint a, vint b) { return _mm512_or_si512(a, b); }
inline vint and32(vint a, int32_t m) { return _mm512_and_si512(a, _mm512_set1_epi32(m)); }
inline vint srl32(vint a, int n) { return _mm512_srl_epi32(a, _mm_cvtsi32_si128(n)); }
inline vint srl16(vint a, int n) { return _mm512_srl_epi16(a, _mm_cvtsi32_si128(n)); }
inline vint sll(vint a, int n) { return _mm512_sll_epi32(a, _mm_cvtsi32_si128(n)); }
inline vint sra32(vint a, int n) { return _mm512_sra_epi32(a, _mm_cvtsi32_si128(n)); }
inline vfloat fnmadd(vfloat a, vfloat b, vfloat c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a * b, one rounding
template <int B>
inline vint sll16(vint a) { return _mm512_slli_epi16(a, B); }
// Each byte's bits 0-3 from `low`, 4-5 from `high`, 6-7 zero: one ternary-logic select (c ? a : b) and a mask.
inline vint nibble_and_two(vint low, vint high) {
  return quant::and16(_mm512_ternarylogic_epi32(low, high, _mm512_set1_epi8(0x0F), 0xE4), 0x3F3F);
}
#else
inline vint add32(vint a, vint b) { return _mm256_add_epi32(a, b); }
inline vint mul32(vint a, vint b) { return _mm256_mullo_epi32(a, b); }
inline vint or_(vint a, vint b) { return _mm256_or_si256(a, b); }
inline vint and32(vint a, int32_t m) { return _mm256_and_si256(a, _mm256_set1_epi32(m)); }
inline vint srl32(vint a, int n) { return _mm256_srl_epi32(a, _mm_cvtsi32_si128(n)); }
inline vint srl16(vint a, int n) { return _mm256_srl_epi16(a, _mm_cvtsi32_si128(n)); }
inline vint sll(vint a, int n) { return _mm256_sll_epi32(a, _mm_cvtsi32_si128(n)); }
inline vint sra32(vint a, int n) { return _mm256_sra_epi32(a, _mm_cvtsi32_si128(n)); }
inline vfloat fnmadd(vfloat a, vfloat b, vfloat c) { return _mm256_fnmadd_ps(a, b, c); }
template <int B>
inline vint sll16(vint a) { return _mm256_slli_epi16(a, B); }
inline vint nibble_and_two(vint low, vint high) { return or_(quant::and16(low, 0x0F0F), quant::and16(high, 0x3030)); }
#endif

// Q6_K's quants u of block 4 n + T from its ql and qh chunks: ql's low (T < 2) or high nibble, bits 2T, 2T + 1 of
// qh as bits 4, 5. Shifts in 16-bit lanes move no wanted bit across a byte.
template <int T>
inline vint q6_bytes(vint ql, vint qh) {
  const vint low = T < 2 ? ql : quant::shift_right16<4>(ql);
  if constexpr (T == 0) return nibble_and_two(low, sll16<4>(qh));
  if constexpr (T == 1) return nibble_and_two(low, sll16<2>(qh));
  if constexpr (T == 2) return nibble_and_two(low, qh);
  return nibble_and_two(low, quant::shift_right16<2>(qh));
}

// A block's integer sums for one row of x and one lane set, and a chunk's weights (4 a row) made ready for them.
#if SERVAL_QUANT_DIGITS
struct Acc {
  vint h, l;
};
struct Quads {
  vint u;
};
inline Quads prepare(vint u) { return {u}; }
inline void clear(Acc& acc) { acc.h = acc.l = quant::zero(); }
// acc += weights 4c .. 4c + 3 of the block times values 4c .. 4c + 3 of its stored activations a.
inline void dot_chunk(Acc& acc, const Quads& w, const int8_t* a, int c) {
  acc.h = quant::dot4(acc.h, w.u, quant::bcast4(a + 4 * c));
  acc.l = quant::dot4(acc.l, w.u, quant::bcast4(a + quant::kBlock + 4 * c));
}
// sum (u - Offset) a, given `a_sum` = sum a over the chunks accumulated.
template <int Offset>
inline vint finish(const Acc& acc, int32_t a_sum) {
  const vint sum = add32(quant::shift_left<quant::kDigitShift>(acc.h), acc.l);
  return Offset == 0 ? sum : quant::sub32(sum, quant::set32(Offset * a_sum));
}
#else
struct Acc {
  vint s;
};
struct Quads {
  vint even, odd;
};
inline Quads prepare(vint u) { return {quant::and16(u, 0x00FF), quant::shift_right16<8>(u)}; }
inline void clear(Acc& acc) { acc.s = quant::zero(); }
inline void dot_chunk(Acc& acc, const Quads& w, const int8_t* a, int c) {
  acc.s = quant::dot2(quant::dot2(acc.s, w.even, quant::bcast4(a + 8 * c)), w.odd, quant::bcast4(a + 8 * c + 4));
}
template <int Offset>
inline vint finish(const Acc& acc, int32_t a_sum) {
  return Offset == 0 ? acc.s : quant::sub32(acc.s, quant::set32(Offset * a_sum));
}
#endif

// NV lane sets of kRows rows each from row n0 (inside whole groups), as quant_lanes.h's LaneSets.
template <KFormat F, int NV>
struct KLanes {
  const uint8_t* group[NV];
  int64_t lane[NV];
  KLanes(const Problem& p, int64_t n0) {
    for (int v = 0; v < NV; ++v) {
      const int64_t n = n0 + v * kRows;
      group[v] = p.w + n / kGroup * kGroup * p.row_bytes;
      lane[v] = n % kGroup;
    }
  }
  const uint8_t* super(int v, int64_t s) const { return group[v] + s * kGroup * block_bytes(F); }
  vint chunk(int v, int64_t s, Field f, int c) const {
    return quant::load_bytes(super(v, s) + f.packed + 64 * c + 4 * lane[v]);
  }
  vfloat half(int v, int64_t s, Field f) const { return quant::halves(super(v, s) + f.packed + 2 * lane[v]); }
};

// Block B's quants u (as kquant_blocks.h's u_at) of its chunk c, weights 4c .. 4c + 3 of each row of lane set v.
template <KFormat F, int B, int NV>
inline vint quants(const KLanes<F, NV>& L, int v, int64_t s, int c) {
  using Fl = Fields<F>;
  if constexpr (F == KFormat::kQ6_K) {
    constexpr int n = B / 4, t = B % 4;
    return q6_bytes<t>(L.chunk(v, s, Fl::qs, 16 * n + 8 * (t % 2) + c), L.chunk(v, s, Fl::qh, 8 * n + c));
  } else {
    vint u = quant::and16(quant::shift_right16<4 * (B % 2)>(L.chunk(v, s, Fl::qs, 8 * (B / 2) + c)), 0x0F0F);
    if constexpr (F == KFormat::kQ5_K)
      u = or_(u, sll16<4>(quant::and16(quant::shift_right16<B>(L.chunk(v, s, Fl::qh, c)), 0x0101)));
    return u;
  }
}

// fn(std::integral_constant<int, B>{}) for each block B of a super-block.
template <typename Fn>
inline void for_blocks(Fn&& fn) {
  quant::for_each_chunk(fn, std::make_integer_sequence<int, kBlocks>{});
}

// Q6_K's int8 scale i (0 .. 15) of each row of lane set v, sign-extended: byte i % 4 of the scales' dword i / 4.
template <int NV>
inline vint q6_scale(const KLanes<KFormat::kQ6_K, NV>& L, int v, int64_t s, int i) {
  return sra32(sll(L.chunk(v, s, Fields<KFormat::kQ6_K>::scales, i / 4), 24 - 8 * (i % 4)), 24);
}

// What the MR rows' blocks need: their stored activations, scales d_a and sums (Q6_K: of the first 16 too).
template <int MR>
struct RowBlocks {
  const int8_t* a[MR];
  vfloat da[MR];
  int32_t s[MR], first_half[MR];
  RowBlocks(const Activations& act, const int32_t* halves, int64_t m0, int64_t block) {
    for (int m = 0; m < MR; ++m) {
      const int64_t i = (m0 + m) * act.blocks + block;
      a[m] = act.block(m0 + m, block);
      da[m] = simd::set1(act.d[i]);
      s[m] = act.s[i];
      first_half[m] = halves == nullptr ? 0 : halves[i];
    }
  }
};

// Q4_K / Q5_K sub-block b's 6-bit scale and min in every lane, from its 12 scale bytes as 3 dwords a row.
inline void scale_min(const vint (&dw)[3], int b, vint* sc, vint* m) {
  if (b < 4) {
    *sc = and32(srl32(dw[0], 8 * b), 63);
    *m = and32(srl32(dw[1], 8 * b), 63);
  } else {
    const int e = 8 * (b - 4);
    *sc = or_(and32(srl32(dw[2], e), 0x0F), sll(and32(srl32(dw[0], e + 6), 3), 4));
    *m = or_(and32(srl32(dw[2], e + 4), 0x0F), sll(and32(srl32(dw[1], e + 6), 3), 4));
  }
}

}  // namespace serval::kquant

#endif  // SERVAL_SIMD
