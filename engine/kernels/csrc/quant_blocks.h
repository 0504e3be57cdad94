// GGUF's Q8_0 / Q4_0 / Q4_1 blocks (engine/model/quantization/blocks.py) in the interleaved layout the CPU
// kernels read (blocks.py's `pack`), and the integer dot products over it.
//
// The packed layout of a weight [N, K] (the same bytes as the file's [N, K / 32 * block_bytes]): rows
// 0 .. N / 16 * 16 in groups of 16, each group 16 rows of bytes; inside a group, block b (weights
// 32 b .. 32 b + 31 of all 16 rows) is 16 * block_bytes bytes: the 16 fp16 scales d, for Q4_1 then the 16 fp16
// mins m, then the quants in chunks of 64 bytes, row r's 4 bytes at 4 r of each chunk:
//   Q8_0: 8 chunks; chunk c holds weights 4 c .. 4 c + 3 as u = q + 128 (q clamped to -127 .. 127);
//   Q4_0, Q4_1: 4 chunks; byte i of row r's 4 in chunk c holds weight 4 c + i in its low nibble and
//   16 + 4 c + i in its high one (the file's bytes 4 c .. 4 c + 3 of the block, moved, not changed).
// Rows past the last whole group stay as the file has them (Q8_0's q clamped the same way).
// So one vector of int32 lanes is one weight row per lane: 4-byte dot products against 4 activations
// broadcast (VNNI's vpdpbusd, or vpmaddubsw + vpmaddwd) need no horizontal sums.
#pragma once

#include <cstdint>
#include <cstring>

#include "vec.h"

namespace serval::quant {

// The formats by the number the kernels know them by (QuantType.kernel_id).
enum class Format : int { kQ8_0 = 0, kQ4_0 = 1, kQ4_1 = 2 };

constexpr int64_t kBlock = 32;  // weights per block
constexpr int64_t kGroup = 16;  // weight rows interleaved in a group

constexpr int64_t block_bytes(Format f) { return f == Format::kQ8_0 ? 34 : (f == Format::kQ4_0 ? 18 : 20); }
constexpr int64_t header_bytes(Format f) { return f == Format::kQ4_1 ? 4 : 2; }
constexpr int chunks(Format f) { return f == Format::kQ8_0 ? 8 : 4; }
// What the integer dot product over a block's u values carries beyond sum(q * a): offset * sum(a).
// Q8_0's u = q + 128 and Q4_0's nibble = q + 8; Q4_1's nibble is its q (its min is a separate term).
constexpr int offset(Format f) { return f == Format::kQ8_0 ? 128 : (f == Format::kQ4_0 ? 8 : 0); }

// The fp16 at `p` as float (exact).
inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// One block of one weight row wherever it lies: its scale, min (Q4_1) and unsigned quant u of weight j.
struct RowBlock {
  const uint8_t* d;
  const uint8_t* m;  // Q4_1 only
  const uint8_t* quants;
  int64_t stride;  // 16 (a packed group: 2 bytes of scale per row) or 1 (a row as the file has it)
  bool packed;
};

template <Format F>
inline RowBlock row_block(const uint8_t* w, int64_t n, int64_t b, int64_t N, int64_t row_bytes) {
  constexpr int64_t bb = block_bytes(F);
  if (n < N / kGroup * kGroup) {
    const uint8_t* at = w + n / kGroup * kGroup * row_bytes + b * kGroup * bb;
    const int64_t r = n % kGroup;
    return {at + 2 * r, at + 2 * kGroup + 2 * r, at + kGroup * header_bytes(F) + 4 * r, kGroup, true};
  }
  const uint8_t* at = w + n * row_bytes + b * bb;
  return {at, at + 2, at + header_bytes(F), 1, false};
}

template <Format F>
inline int32_t u_at(const RowBlock& rb, int j) {
  if constexpr (F == Format::kQ8_0) {
    if (rb.packed) return rb.quants[j / 4 * 64 + j % 4];
    const int q = static_cast<int8_t>(rb.quants[j]);
    return (q < -127 ? -127 : q) + 128;
  } else {
    const int i = j % 16, byte = rb.packed ? rb.quants[i / 4 * 64 + i % 4] : rb.quants[i];
    return j < 16 ? (byte & 0x0F) : (byte >> 4);
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
inline vint low_nibbles(vint v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0F)); }
inline vint high_nibbles(vint v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F)); }
inline vint sub32(vint a, vint b) { return _mm512_sub_epi32(a, b); }
template <int B>
inline vint shift_left(vint v) { return _mm512_slli_epi32(v, B); }
inline vint set32(int32_t x) { return _mm512_set1_epi32(x); }
inline simd::vfloat to_float(vint v) { return _mm512_cvtepi32_ps(v); }
inline simd::vfloat halves(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline simd::vfloat abs(simd::vfloat v) { return _mm512_abs_ps(v); }
inline vint round_to_int(simd::vfloat v) { return _mm512_cvtps_epi32(v); }  // to nearest even (MXCSR's default)
// Stores a block's 32 int8 (two vectors of int32 lanes in -127 .. 127) at `a`; returns their sum.
inline int32_t store_int8(int8_t* a, const vint* r) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(a), _mm512_cvtsepi32_epi8(r[0]));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(a + 16), _mm512_cvtsepi32_epi8(r[1]));
  return _mm512_reduce_add_epi32(_mm512_add_epi32(r[0], r[1]));
}
#if defined(__AVX512VNNI__)
constexpr bool kVnni = true;
inline vint dot4(vint acc, vint u, vint a) { return _mm512_dpbusd_epi32(acc, u, a); }
vint dot4_signed(vint acc, vint u, vint a);  // not built: dot_u8 needs it only without VNNI
#else
constexpr bool kVnni = false;
inline vint pairs(vint u, vint a) { return _mm512_madd_epi16(_mm512_maddubs_epi16(u, a), _mm512_set1_epi16(1)); }
inline vint dot4(vint acc, vint u, vint a) { return _mm512_add_epi32(acc, pairs(u, a)); }
// sum(q * a) with q = u - 128: |a| times q with a's sign, so that vpmaddubsw's int16 pairs cannot saturate.
inline vint dot4_signed(vint acc, vint u, vint a) {
  const vint q = _mm512_xor_si512(u, _mm512_set1_epi8(static_cast<char>(0x80)));
  const vint signed_q = _mm512_mask_sub_epi8(q, _mm512_movepi8_mask(a), _mm512_setzero_si512(), q);
  return _mm512_add_epi32(acc, pairs(_mm512_abs_epi8(a), signed_q));
}
#endif
#else  // AVX2
constexpr bool kVnni = false;
inline vint zero() { return _mm256_setzero_si256(); }
inline vint load_bytes(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline vint bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}
inline vint low_nibbles(vint v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
inline vint high_nibbles(vint v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F)); }
inline vint sub32(vint a, vint b) { return _mm256_sub_epi32(a, b); }
template <int B>
inline vint shift_left(vint v) { return _mm256_slli_epi32(v, B); }
inline vint set32(int32_t x) { return _mm256_set1_epi32(x); }
inline simd::vfloat to_float(vint v) { return _mm256_cvtepi32_ps(v); }
inline simd::vfloat halves(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline simd::vfloat abs(simd::vfloat v) { return _mm256_andnot_ps(_mm256_set1_ps(-0.f), v); }
inline vint round_to_int(simd::vfloat v) { return _mm256_cvtps_epi32(v); }  // to nearest even (MXCSR's default)
// Stores a block's 32 int8 (four vectors of int32 lanes in -127 .. 127) at `a`; returns their sum. The packs
// work per 128-bit lane, so the 4-byte groups come out in the order 0 4 1 5 2 6 3 7: the permute undoes it.
inline int32_t store_int8(int8_t* a, const vint* r) {
  const __m256i words = _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]), _mm256_packs_epi32(r[2], r[3]));
  const __m256i bytes = _mm256_permutevar8x32_epi32(words, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(a), bytes);
  const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(r[0], r[1]), _mm256_add_epi32(r[2], r[3]));
  const __m128i half = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
  const __m128i quarter = _mm_add_epi32(half, _mm_shuffle_epi32(half, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(quarter, _mm_shuffle_epi32(quarter, 0xB1)));
}
inline vint pairs(vint u, vint a) { return _mm256_madd_epi16(_mm256_maddubs_epi16(u, a), _mm256_set1_epi16(1)); }
inline vint dot4(vint acc, vint u, vint a) { return _mm256_add_epi32(acc, pairs(u, a)); }
inline vint dot4_signed(vint acc, vint u, vint a) {
  const vint q = _mm256_xor_si256(u, _mm256_set1_epi8(static_cast<char>(0x80)));
  return _mm256_add_epi32(acc, pairs(_mm256_abs_epi8(a), _mm256_sign_epi8(q, a)));
}
#endif

// acc += the block's chunk dot products for one lane set: Q8_0's u (0 .. 255) times a (-127 .. 127) would
// saturate vpmaddubsw's pairs, so without VNNI it takes the signed form, which leaves out offset * sum(a).
template <Format F>
inline vint dot_u8(vint acc, vint u, vint a) {
  if constexpr (F == Format::kQ8_0 && !kVnni) return dot4_signed(acc, u, a);
  else return dot4(acc, u, a);
}

// The offset the kernel's integer sums carry (see offset()): none where dot_u8 took the signed form.
template <Format F>
constexpr int kernel_offset() {
  return F == Format::kQ8_0 && !kVnni ? 0 : offset(F);
}

}  // namespace serval::quant

#endif  // SERVAL_SIMD
