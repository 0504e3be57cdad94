// GGUF's Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 blocks (engine/model/quantization/blocks.py) in the interleaved layout
// the CPU kernels read (packed.py's `pack`), and the integer dot products over it.
//
// The packed layout of a weight [N, K] (the same bytes as the file's [N, K / 32 * block_bytes]): rows
// 0 .. N / 16 * 16 in groups of 16, each group 16 rows of bytes; inside a group, block b (weights
// 32 b .. 32 b + 31 of all 16 rows) is 16 * block_bytes bytes: the 16 fp16 scales d, for Q4_1 / Q5_1 then the 16
// fp16 mins m, for Q5_0 / Q5_1 then the 16 rows' qh words (4 bytes a row, at 4 r), then the quants in chunks of
// 64 bytes, row r's 4 bytes at 4 r of each chunk:
//   Q8_0: 8 chunks; chunk c holds weights 4 c .. 4 c + 3 as u = q + 128 (q clamped to -127 .. 127);
//   Q4_0, Q4_1, Q5_0, Q5_1: 4 chunks; byte i of row r's 4 in chunk c holds weight 4 c + i's low 4 bits in its
//   low nibble and 16 + 4 c + i's in its high one (the file's bytes 4 c .. 4 c + 3 of the block, moved, not
//   changed). The fifth bit of weight 16 h + 4 c + i (the file's qh bit 16 h + 4 c + i) is the packed word's bit
//   8 i + 4 h + c (high_bit_position): shifting the word by 4 - c (h = 0) or -c (h = 1) puts chunk c's
//   four fifth bits at bit 4 of the bytes holding their nibbles, one shift and a mask (llama.cpp instead spreads
//   each row's 32 bits over a vector of 32 bytes with a shuffle, a compare and a mask, for its one row a vector).
// Rows past the last whole group stay as the file has them (Q8_0's q clamped the same way).
// So one vector of int32 lanes is one weight row per lane: dot products against activations broadcast need no
// horizontal sums.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#include "vec.h"

namespace serval::quant {

// The formats by the number the kernels know them by (QuantType.kernel_id).
enum class Format : int { kQ8_0 = 0, kQ4_0 = 1, kQ4_1 = 2, kQ5_0 = 3, kQ5_1 = 4 };

constexpr int64_t kBlock = 32;  // weights per block
constexpr int64_t kGroup = 16;  // weight rows interleaved in a group

// Whether a block stores a min m (w = d q + m) after its scale, and a qh word of fifth bits after those.
constexpr bool has_min(Format f) { return f == Format::kQ4_1 || f == Format::kQ5_1; }
constexpr bool has_high_bits(Format f) { return f == Format::kQ5_0 || f == Format::kQ5_1; }
constexpr int64_t scale_bytes(Format f) { return has_min(f) ? 4 : 2; }
constexpr int64_t header_bytes(Format f) { return scale_bytes(f) + (has_high_bits(f) ? 4 : 0); }  // before quants
constexpr int64_t block_bytes(Format f) { return header_bytes(f) + (f == Format::kQ8_0 ? 32 : 16); }
constexpr int chunks(Format f) { return f == Format::kQ8_0 ? 8 : 4; }
// What the integer dot product over a block's u values carries beyond sum(q * a): offset * sum(a).
// Q8_0's u = q + 128, Q4_0's nibble = q + 8 and Q5_0's 5 bits = q + 16; Q4_1's and Q5_1's are their q (the min
// is a separate term).
constexpr int offset(Format f) {
  return f == Format::kQ8_0 ? 128 : (f == Format::kQ4_0 ? 8 : (f == Format::kQ5_0 ? 16 : 0));
}
// The bit of a packed qh word holding weight j's fifth bit (the layout above; packed.py's HIGH_BIT_POSITION).
constexpr int high_bit_position(int j) { return 8 * (j % 4) + 4 * (j / 16) + j % 16 / 4; }

// fn(std::integral_constant<int, 0>{}), .., fn(<N - 1>): a loop over chunks whose index is a compile-time
// constant (the 5-bit formats shift their qh words by it, as an immediate).
template <typename Fn, int... C>
inline void for_each_chunk(Fn&& fn, std::integer_sequence<int, C...>) {
  (fn(std::integral_constant<int, C>{}), ...);
}
template <Format F, typename Fn>
inline void for_chunks(Fn&& fn) {
  for_each_chunk(fn, std::make_integer_sequence<int, chunks(F)>{});
}

// The fp16 at `p` as float (exact).
inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// One block of one weight row wherever it lies: its scale, min, qh word and unsigned quant u of weight j.
struct RowBlock {
  const uint8_t* d;
  const uint8_t* m;     // Q4_1, Q5_1 only
  const uint8_t* high;  // Q5_0, Q5_1 only
  const uint8_t* quants;
  bool packed;  // in a packed group (else a row as the file has it)
};

template <Format F>
inline RowBlock row_block(const uint8_t* w, int64_t n, int64_t b, int64_t N, int64_t row_bytes) {
  constexpr int64_t bb = block_bytes(F);
  if (n < N / kGroup * kGroup) {
    const uint8_t* at = w + n / kGroup * kGroup * row_bytes + b * kGroup * bb;
    const int64_t r = n % kGroup;
    return {at + 2 * r, at + 2 * kGroup + 2 * r, at + kGroup * scale_bytes(F) + 4 * r,
            at + kGroup * header_bytes(F) + 4 * r, true};
  }
  const uint8_t* at = w + n * row_bytes + b * bb;
  return {at, at + 2, at + scale_bytes(F), at + header_bytes(F), false};
}

template <Format F>
inline int32_t u_at(const RowBlock& rb, int j) {
  if constexpr (F == Format::kQ8_0) {
    if (rb.packed) return rb.quants[j / 4 * 64 + j % 4];
    const int q = static_cast<int8_t>(rb.quants[j]);
    return (q < -127 ? -127 : q) + 128;
  } else {
    const int i = j % 16, byte = rb.packed ? rb.quants[i / 4 * 64 + i % 4] : rb.quants[i];
    const int nibble = j < 16 ? (byte & 0x0F) : (byte >> 4);
    if constexpr (!has_high_bits(F)) return nibble;
    uint32_t word;  // little-endian, as x86 loads it
    std::memcpy(&word, rb.high, sizeof(word));
    return nibble | static_cast<int32_t>((word >> (rb.packed ? high_bit_position(j) : j)) & 1) << 4;
  }
}

}  // namespace serval::quant

#if SERVAL_SIMD

namespace serval::quant {

#if SERVAL_AVX512
using vint = __m512i;
#else
using vint = __m256i;
#endif
constexpr int64_t kRows = simd::kLanes;  // weight rows (int32 lanes) in a vector: 16 or 8

#if SERVAL_AVX512
inline vint zero() { return _mm512_setzero_si512(); }
inline vint load_bytes(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline vint bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}
inline vint and16(vint v, int16_t mask) { return _mm512_and_si512(v, _mm512_set1_epi16(mask)); }
template <int B>
inline vint shift_right16(vint v) { return _mm512_srli_epi16(v, B); }
template <int B>
inline vint shift_left(vint v) { return _mm512_slli_epi32(v, B); }
template <int B>
inline vint shift_right(vint v) { return _mm512_srli_epi32(v, B); }
inline vint or_bits(vint a, vint b) { return _mm512_or_si512(a, b); }
inline vint sub32(vint a, vint b) { return _mm512_sub_epi32(a, b); }
inline vint add32(vint a, vint b) { return _mm512_add_epi32(a, b); }
inline vint sub16(vint a, int16_t x) { return _mm512_sub_epi16(a, _mm512_set1_epi16(x)); }
inline vint set32(int32_t x) { return _mm512_set1_epi32(x); }
inline simd::vfloat to_float(vint v) { return _mm512_cvtepi32_ps(v); }
inline simd::vfloat halves(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline simd::vfloat abs(simd::vfloat v) { return _mm512_abs_ps(v); }
inline simd::vfloat stored_order(simd::vfloat v) { return _mm512_permute_ps(v, _MM_SHUFFLE(3, 1, 2, 0)); }
inline vint round_to_int(simd::vfloat v) { return _mm512_cvtps_epi32(v); }  // to nearest even (MXCSR's default)
inline int32_t reduce_add(const vint* r, int n) {
  vint sum = r[0];
  for (int i = 1; i < n; ++i) sum = _mm512_add_epi32(sum, r[i]);
  return _mm512_reduce_add_epi32(sum);
}
// Stores a block's 32 values (two vectors of int32 lanes) as int8 / int16 at `a`; returns their sum.
inline int32_t store_int8(int8_t* a, const vint* r) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(a), _mm512_cvtsepi32_epi8(r[0]));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(a + 16), _mm512_cvtsepi32_epi8(r[1]));
  return reduce_add(r, 2);
}
inline int32_t store_int16(int8_t* a, const vint* r) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(a), _mm512_cvtsepi32_epi16(r[0]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(a + 32), _mm512_cvtsepi32_epi16(r[1]));
  return reduce_add(r, 2);
}
inline vint dot2(vint acc, vint w, vint a) { return _mm512_add_epi32(acc, _mm512_madd_epi16(w, a)); }
#if defined(__AVX512VNNI__)
inline vint dot4(vint acc, vint u, vint a) { return _mm512_dpbusd_epi32(acc, u, a); }
#endif
#else  // AVX2
inline vint zero() { return _mm256_setzero_si256(); }
inline vint load_bytes(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline vint bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}
inline vint and16(vint v, int16_t mask) { return _mm256_and_si256(v, _mm256_set1_epi16(mask)); }
template <int B>
inline vint shift_right16(vint v) { return _mm256_srli_epi16(v, B); }
template <int B>
inline vint shift_left(vint v) { return _mm256_slli_epi32(v, B); }
template <int B>
inline vint shift_right(vint v) { return _mm256_srli_epi32(v, B); }
inline vint or_bits(vint a, vint b) { return _mm256_or_si256(a, b); }
inline vint sub32(vint a, vint b) { return _mm256_sub_epi32(a, b); }
inline vint add32(vint a, vint b) { return _mm256_add_epi32(a, b); }
inline vint sub16(vint a, int16_t x) { return _mm256_sub_epi16(a, _mm256_set1_epi16(x)); }
inline vint set32(int32_t x) { return _mm256_set1_epi32(x); }
inline simd::vfloat to_float(vint v) { return _mm256_cvtepi32_ps(v); }
inline simd::vfloat halves(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline simd::vfloat abs(simd::vfloat v) { return _mm256_andnot_ps(_mm256_set1_ps(-0.f), v); }
inline simd::vfloat stored_order(simd::vfloat v) { return _mm256_permute_ps(v, _MM_SHUFFLE(3, 1, 2, 0)); }
inline vint round_to_int(simd::vfloat v) { return _mm256_cvtps_epi32(v); }  // to nearest even (MXCSR's default)
// Stores a block's 32 values (four vectors of int32 lanes) as int16 at `a`; returns their sum. The pack works per
// 128-bit lane (the quads of 4 values come out 0 2 1 3): the 64-bit permute puts them back in order.
inline int32_t store_int16(int8_t* a, const vint* r) {
  for (int i = 0; i < 2; ++i) {
    const __m256i words = _mm256_packs_epi32(r[2 * i], r[2 * i + 1]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(a + 32 * i), _mm256_permute4x64_epi64(words, 0xD8));
  }
  const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(r[0], r[1]), _mm256_add_epi32(r[2], r[3]));
  const __m128i half = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
  const __m128i quarter = _mm_add_epi32(half, _mm_shuffle_epi32(half, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(quarter, _mm_shuffle_epi32(quarter, 0xB1)));
}
inline vint dot2(vint acc, vint w, vint a) { return _mm256_add_epi32(acc, _mm256_madd_epi16(w, a)); }
#endif

// A loaded chunk C's (4 bytes a row) unsigned weights `quad` (0 .. quads(F) - 1): Q8_0's bytes u (quad 0), or the
// low nibbles (quad 0: weights 4C .. 4C + 3) or high ones (quad 1: 16 + 4C ..), for Q5_0 / Q5_1 with their fifth
// bits from the rows' packed qh words `high` (ignored in the other formats); as bytes, or widened to int16 pairs,
// the even bytes of each row's four and the odd ones.
constexpr int quads(Format f) { return f == Format::kQ8_0 ? 1 : 2; }
template <Format F, int Quad, int C>
inline vint quad_bytes(vint u, vint high) {
  if constexpr (F == Format::kQ8_0) return u;
  const vint nibbles = Quad == 0 ? and16(u, 0x0F0F) : and16(shift_right16<4>(u), 0x0F0F);
  if constexpr (!has_high_bits(F)) return nibbles;
  const vint fifth = Quad == 0 ? shift_left<4 - C>(high) : shift_right<C>(high);  // bit 4 h + C -> bit 4
  return or_bits(nibbles, and16(fifth, 0x1010));
}
template <Format F, int Quad, int C>
inline void widen(vint u, vint high, vint* even, vint* odd) {
  if constexpr (F == Format::kQ8_0 || has_high_bits(F)) {
    const vint bytes = quad_bytes<F, Quad, C>(u, high);
    *even = and16(bytes, 0x00FF);
    *odd = shift_right16<8>(bytes);
  } else if constexpr (Quad == 0) {
    *even = and16(u, 0x000F);
    *odd = and16(shift_right16<8>(u), 0x000F);
  } else {
    *even = and16(shift_right16<4>(u), 0x000F);
    *odd = shift_right16<12>(u);
  }
}

}  // namespace serval::quant

#endif  // SERVAL_SIMD
