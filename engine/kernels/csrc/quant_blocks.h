// GGUF's Q8_0 / Q4_0 / Q4_1 blocks (engine/model/quantization/blocks.py) widened to float vectors.
//
// A block is 32 weights; chunk c of it is the serval::simd vector of weights c * kLanes .. (c + 1) * kLanes - 1
// (2 chunks with AVX-512, 4 with AVX2). Each weight is the value blocks.py's `dequantize` computes, bit for
// bit: d * q and d * (q - 8) are exact in float32 (an 11-bit scale times an integer of at most 8 bits), so
// Q4_1's d * q + m rounds once whether fused or not.
#pragma once

#include <cstdint>
#include <cstring>

#include "vec.h"

namespace serval::quant {

// The formats by the number the kernels know them by (QuantType.kernel_id).
enum class Format : int { kQ8_0 = 0, kQ4_0 = 1, kQ4_1 = 2 };

constexpr int64_t kBlock = 32;

constexpr int64_t block_bytes(Format f) { return f == Format::kQ8_0 ? 34 : (f == Format::kQ4_0 ? 18 : 20); }
constexpr int64_t header_bytes(Format f) { return f == Format::kQ4_1 ? 4 : 2; }

// The fp16 at `p` as float (exact).
inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// Weight j of a block (j < 32), in float32 as the reference computes it.
template <Format F>
inline float weight_at(const uint8_t* block, int64_t j) {
  const float d = half_at(block);
  const uint8_t* body = block + header_bytes(F);
  if constexpr (F == Format::kQ8_0) {
    return d * static_cast<float>(static_cast<int8_t>(body[j]));
  } else {
    const int q = j < 16 ? (body[j] & 0x0F) : (body[j - 16] >> 4);
    if constexpr (F == Format::kQ4_0) return d * static_cast<float>(q - 8);
    return d * static_cast<float>(q) + half_at(block + 2);
  }
}

}  // namespace serval::quant

#if SERVAL_SIMD

namespace serval::quant {

constexpr int kChunks = static_cast<int>(kBlock / simd::kLanes);

// A block's scale (and min) broadcast, loaded once for its chunks (F16C: c10::Half's conversion is scalar code).
struct Scales {
  simd::vfloat d, m;
};

inline simd::vfloat broadcast_half(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return simd::set1(_cvtsh_ss(bits));
}

template <Format F>
inline Scales scales_of(const uint8_t* block) {
  return {broadcast_half(block), F == Format::kQ4_1 ? broadcast_half(block + 2) : simd::set1(0.f)};
}

#if SERVAL_AVX512

// The 16 quants of chunk c (0 or 1) as int32 lanes.
template <Format F>
inline __m512i quants(const uint8_t* body, int c) {
  if constexpr (F == Format::kQ8_0) {
    return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(body + 16 * c)));
  } else {  // element j in the low nibble of byte j, j + 16 in its high nibble
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(body)));
    return c == 0 ? _mm512_and_si512(bytes, _mm512_set1_epi32(0x0F)) : _mm512_srli_epi32(bytes, 4);
  }
}

inline simd::vfloat to_float(__m512i q) { return _mm512_cvtepi32_ps(q); }
inline __m512i minus8(__m512i q) { return _mm512_sub_epi32(q, _mm512_set1_epi32(8)); }

#else  // AVX2

// The 8 quants of chunk c (0 .. 3) as int32 lanes.
template <Format F>
inline __m256i quants(const uint8_t* body, int c) {
  if constexpr (F == Format::kQ8_0) {
    return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(body + 8 * c)));
  } else {  // chunks 0, 1: low nibbles of bytes 0-7, 8-15; chunks 2, 3: their high nibbles
    const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(body + 8 * (c & 1))));
    return c < 2 ? _mm256_and_si256(bytes, _mm256_set1_epi32(0x0F)) : _mm256_srli_epi32(bytes, 4);
  }
}

inline simd::vfloat to_float(__m256i q) { return _mm256_cvtepi32_ps(q); }
inline __m256i minus8(__m256i q) { return _mm256_sub_epi32(q, _mm256_set1_epi32(8)); }

#endif

template <Format F>
inline simd::vfloat scaled(const simd::vfloat q, const Scales& s) {
  if constexpr (F == Format::kQ4_1) return simd::fmadd(s.d, q, s.m);  // d * q is exact: one rounding, as d * q + m
  return simd::mul(q, s.d);
}

// The block at `block` as float weights: its kChunks vectors.
template <Format F>
inline void widen(const uint8_t* block, simd::vfloat* out) {
  const Scales s = scales_of<F>(block);
  for (int c = 0; c < kChunks; ++c) {
    auto q = quants<F>(block + header_bytes(F), c);
    if constexpr (F == Format::kQ4_0) q = minus8(q);
    out[c] = scaled<F>(to_float(q), s);
  }
}

}  // namespace serval::quant

#endif  // SERVAL_SIMD
