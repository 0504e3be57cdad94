// quant_linear's activations: x's rows quantized per block of 32 to 14 bits, a = round(128 t) with t = x / e,
// e = max |x| / 127 (llama.cpp's int8 is round(t)), |a| <= 16320, stored in the form this build multiplies fastest:
//   digits (SERVAL_QUANT_DIGITS: AVX-512 VNNI): two int8 digits a = 128 h + l, h = round(t),
//     l = round(128 (t - h)), |l| <= 64; a block's 32 h, then its 32 l. vpdpbusd multiplies 4 u8 weights by 4
//     int8 in one instruction, once a digit.
//   pairs (AVX2, AVX-512 without VNNI): a as int16, each four a0 a1 a2 a3 of a block stored a0 a2 a1 a3, so that a
//     4-byte broadcast meets the even (or odd) weights of every row's 4 widened to int16 pairs: one vpmaddwd for 2
//     pairs, where int8 digits would take vpmaddubsw + vpmaddwd each.
// Both hold the same integers, so the kernels' exact int32 sums, and quant_linear's results, are the same bits on
// every build. 64 bytes a block either way; d = e / 128 (a's scale) and s = sum(a) per block beside them.
#pragma once

#include "torch_ops.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

#include "quant_blocks.h"

#if SERVAL_SIMD

#if SERVAL_AVX512 && defined(__AVX512VNNI__)
#define SERVAL_QUANT_DIGITS 1
#else
#define SERVAL_QUANT_DIGITS 0
#endif

// The scalar reference, compiled without reassociation (the module is built with -fassociative-math): the order
// written is the order computed.
#define SERVAL_EXACT_ORDER __attribute__((optimize("no-associative-math")))

namespace serval::quant {

constexpr float kFraction = 128.f;  // a = round(kFraction * t)
constexpr int kDigitShift = 7;      // a = h << 7 + l

// x quantized: 64 bytes a row's block (a [M, K / 32, 64] bytes), d and s [M, K / 32].
struct Activations {
  std::unique_ptr<int8_t[]> bytes;  // not zeroed first: every byte is written (a prefill's is megabytes a product)
  std::vector<float> d;
  std::vector<int32_t> s;
  int64_t K, blocks;
  const int8_t* block(int64_t m, int64_t b) const { return bytes.get() + 2 * (m * K + b * kBlock); }
};

// The position of a block's value j among its int16 (pairs).
constexpr int stored_index(int j) { return j / 4 * 4 + (j % 2) * 2 + (j % 4) / 2; }

// A block's scales from its largest magnitude: 1 / e (t = x / e, e = amax / 127) and d = e / 128; the kernel and
// the reference divide and invert so.
inline float block_scale(float amax, float* inverse) {
  const float e = amax / 127.f;
  *inverse = e != 0.f ? 1.f / e : 0.f;
  return e / kFraction;
}

// Value j of a stored block.
inline int32_t value_at(const int8_t* block, int j) {
#if SERVAL_QUANT_DIGITS
  return block[j] * (1 << kDigitShift) + block[kBlock + j];
#else
  int16_t a;
  std::memcpy(&a, block + 2 * stored_index(j), sizeof(a));
  return a;
#endif
}

SERVAL_EXACT_ORDER inline void quantize_block_reference(const float* x, int8_t* block, float* d, int32_t* s) {
  float amax = 0.f, inverse;
  for (int j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(x[j]));
  *d = block_scale(amax, &inverse);
  *s = 0;
  for (int j = 0; j < kBlock; ++j) {
    const float t = x[j] * inverse;
#if SERVAL_QUANT_DIGITS
    const float h = std::nearbyint(t);
    block[j] = static_cast<int8_t>(h);
    block[kBlock + j] = static_cast<int8_t>(std::nearbyint((t - h) * kFraction));
#else
    const int16_t a = static_cast<int16_t>(std::nearbyint(t * kFraction));
    std::memcpy(block + 2 * stored_index(j), &a, sizeof(a));
#endif
    *s += value_at(block, j);
  }
}

inline void quantize_block(const float* x, int8_t* block, float* d, int32_t* s) {
  constexpr int kVectors = kBlock / simd::kLanes;
  simd::vfloat t[kVectors], amax = simd::set1(0.f);
  for (int c = 0; c < kVectors; ++c) {
    t[c] = simd::load(x + c * simd::kLanes);
    if constexpr (!SERVAL_QUANT_DIGITS) t[c] = stored_order(t[c]);
    amax = simd::max(amax, abs(t[c]));
  }
  float inverse;
  *d = block_scale(simd::reduce_max(amax), &inverse);
  for (int c = 0; c < kVectors; ++c) t[c] = simd::mul(t[c], simd::set1(inverse));
#if SERVAL_QUANT_DIGITS
  vint high[kVectors], low[kVectors];
  for (int c = 0; c < kVectors; ++c) {
    high[c] = round_to_int(t[c]);
    low[c] = round_to_int(simd::mul(simd::sub(t[c], to_float(high[c])), simd::set1(kFraction)));
  }
  *s = store_int8(block, high) * (1 << kDigitShift) + store_int8(block + kBlock, low);
#else
  vint a[kVectors];
  for (int c = 0; c < kVectors; ++c) a[c] = round_to_int(simd::mul(t[c], simd::set1(kFraction)));
  *s = store_int16(block, a);
#endif
}

// x [M, K] quantized, by the vector code or by the reference (the same bytes).
inline Activations quantize_rows(const float* x, int64_t M, int64_t K, bool reference) {
  const int64_t blocks = K / kBlock;
  Activations act{std::unique_ptr<int8_t[]>(new int8_t[2 * M * K]), std::vector<float>(M * blocks),
                  std::vector<int32_t>(M * blocks), K, blocks};
  at::parallel_for(0, M * blocks, reference ? M * blocks : 4096 / kBlock, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      auto* quantize = reference ? quantize_block_reference : quantize_block;
      quantize(x + i * kBlock, act.bytes.get() + 2 * i * kBlock, act.d.data() + i, act.s.data() + i);
    }
  });
  return act;
}

}  // namespace serval::quant

#endif  // SERVAL_SIMD
