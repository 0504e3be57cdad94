// SIMD helpers shared by Serval's native CPU ops: AVX-512 (16 float lanes) and AVX2 (8 lanes).
//
// Loads widen any storage type to float lanes; stores round back the way torch does (round to
// nearest even, NaN kept quiet), so an op computed here in float and stored as bf16 is bit-identical
// to the same arithmetic done by torch's elementwise kernels. Row tails of any length are covered
// (AVX-512: masks; AVX2: a zero-padded copy on the stack). `serval::simd` names whichever of the two
// this build targets, so the fused elementwise ops and the decode attention kernel are written once
// for both.
#pragma once

#include <ATen/Dispatch.h>
#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

// float, bfloat16 and half (the dtypes a model runs in); other dtypes raise.
#define SERVAL_DISPATCH_MODEL_TYPES(TYPE, NAME, ...)                                      \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)                \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__) AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

namespace serval {
// f(kv_t{}) with kv_t the KV cache's element type under activations of scalar_t: their own, or a 16-bit cache
// under float32 ones (the engine's kv_cache_dtype). Other pairs raise.
template <typename scalar_t, typename F>
void dispatch_kv_type(at::ScalarType kv, const char* op, const F& f) {
  constexpr at::ScalarType activations = c10::CppTypeToScalarType<scalar_t>::value;
  if (kv == activations) return f(scalar_t{});
  if constexpr (std::is_same_v<scalar_t, float>) {
    if (kv == at::kBFloat16) return f(c10::BFloat16{});
    if (kv == at::kHalf) return f(c10::Half{});
  }
  TORCH_CHECK(false, op, ": a ", c10::toString(kv), " KV cache under ", c10::toString(activations),
              " activations (a cache of another dtype needs float32 activations and a 16-bit cache)");
}
}  // namespace serval

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define SERVAL_AVX512 1
#else
#define SERVAL_AVX512 0
#endif

// AVX2 with FMA and F16C (every x86 CPU with AVX2 has the other two): the fallback vector path.
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define SERVAL_AVX2 1
#else
#define SERVAL_AVX2 0
#endif

// serval::simd exists where either vector path is; the fused elementwise ops (elementwise.cpp) are built there.
#define SERVAL_SIMD (SERVAL_AVX512 || SERVAL_AVX2)
#define SERVAL_FUSED_OPS SERVAL_SIMD

#if SERVAL_AVX512

// torch's vectorized exp (libtorch_cpu exports SLEEF): using it keeps SiLU bit-identical to torch's.
extern "C" __m512 Sleef_expf16_u10(__m512);

namespace serval {

inline __mmask16 tail_mask(int64_t count) {
  return count >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << count) - 1u);
}

inline __m512 load16(const float* p, __mmask16 m = 0xFFFF) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const c10::BFloat16* p, __mmask16 m = 0xFFFF) {
  // bf16 is the top half of a float32: widen and shift.
  const __m256i bits = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline __m512 load16(const c10::Half* p, __mmask16 m = 0xFFFF) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
}

// float -> bf16 bits, round to nearest even, NaN -> quiet NaN (torch's cvtfp32_bf16).
inline __m256i to_bf16_bits(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), lsb);
  const __mmask16 is_nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  const __m512i result = _mm512_mask_blend_epi32(is_nan, _mm512_srli_epi32(rounded, 16), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(result);
}

inline void store16(float* p, __m512 v, __mmask16 m = 0xFFFF) { _mm512_mask_storeu_ps(p, m, v); }
inline void store16(c10::BFloat16* p, __m512 v, __mmask16 m = 0xFFFF) {
  _mm256_mask_storeu_epi16(p, m, to_bf16_bits(v));
}
inline void store16(c10::Half* p, __m512 v, __mmask16 m = 0xFFFF) {
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// The value a torch op producing `scalar_t` would hold: rounded to the type and widened again.
template <typename scalar_t>
inline __m512 round_to(__m512 v) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return v;
  } else if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16_bits(v)), 16));
  } else {
    return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
}

}  // namespace serval

#endif  // SERVAL_AVX512

#if SERVAL_AVX2

// torch's vectorized exp for 8 lanes (the symbol its AVX2 kernels call): SiLU stays bit-identical.
extern "C" __m256 Sleef_expf8_u10(__m256);

namespace serval {

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  // bf16 is the top half of a float32: widen and shift.
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// float -> bf16 bits, round to nearest even, NaN -> quiet NaN (as to_bf16_bits above, 8 lanes).
inline __m128i to_bf16_bits(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), lsb);
  const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  const __m256i result = _mm256_blendv_epi8(_mm256_srli_epi32(rounded, 16), _mm256_set1_epi32(0x7FC0), is_nan);
  // Every 32-bit lane now holds a value below 0x10000, so the unsigned-saturating pack is exact.
  return _mm_packus_epi32(_mm256_castsi256_si128(result), _mm256_extracti128_si256(result, 1));
}

inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(c10::BFloat16* p, __m256 v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), to_bf16_bits(v)); }
inline void store8(c10::Half* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// The value a torch op producing `scalar_t` would hold: rounded to the type and widened again.
template <typename scalar_t>
inline __m256 round_to8(__m256 v) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return v;
  } else if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    // to_bf16_bits widened again, without leaving the 32-bit lanes: round, then clear the low half.
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), lsb);
    const __m256 truncated = _mm256_castsi256_ps(_mm256_and_si256(rounded, _mm256_set1_epi32(0xFFFF0000u)));
    const __m256 quiet_nan = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000));
    return _mm256_blendv_ps(truncated, quiet_nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  } else {
    return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
}

}  // namespace serval

#endif  // SERVAL_AVX2

namespace serval {

// Software prefetch of `count` rows (`row_bytes` each, `row_stride` elements apart) into L1/L2:
// decode reads blocks scattered over the cache from DRAM, and the hardware prefetcher cannot guess
// the next block.
template <typename scalar_t>
inline void prefetch_rows(const scalar_t* rows, int64_t count, int64_t row_stride, int64_t row_bytes) {
#ifdef SERVAL_NO_PREFETCH
  return;
#endif
  for (int64_t t = 0; t < count; ++t) {
    const char* row = reinterpret_cast<const char*>(rows + t * row_stride);
    for (int64_t b = 0; b < row_bytes; b += 64) _mm_prefetch(row + b, _MM_HINT_T0);
  }
}

}  // namespace serval

// serval::simd: the vector type of this build and the few operations the native ops need. A load or
// store of `remaining` elements touches min(remaining, kLanes) of them; lanes past the end read 0.
// Without `remaining`, a load or store covers a full vector.
namespace serval::simd {

#if SERVAL_AVX512

using vfloat = __m512;
constexpr int64_t kLanes = 16;
constexpr int kRegisters = 32;  // vector registers: how many values a kernel may keep in them
template <typename T>
inline vfloat load(const T* p, int64_t remaining) { return load16(p, tail_mask(remaining)); }
template <typename T>
inline void store(T* p, vfloat v, int64_t remaining) { store16(p, v, tail_mask(remaining)); }
inline vfloat load(const float* p) { return _mm512_loadu_ps(p); }
template <typename T>
inline vfloat load(const T* p) { return load16(p); }
inline void store(float* p, vfloat v) { _mm512_storeu_ps(p, v); }
template <typename T>
inline void store(T* p, vfloat v) { store16(p, v); }
template <typename scalar_t>
inline vfloat round(vfloat v) { return round_to<scalar_t>(v); }
inline vfloat set1(float x) { return _mm512_set1_ps(x); }
inline vfloat add(vfloat a, vfloat b) { return _mm512_add_ps(a, b); }
inline vfloat mul(vfloat a, vfloat b) { return _mm512_mul_ps(a, b); }
inline vfloat div(vfloat a, vfloat b) { return _mm512_div_ps(a, b); }
inline vfloat sub(vfloat a, vfloat b) { return _mm512_sub_ps(a, b); }
inline vfloat fmadd(vfloat a, vfloat b, vfloat c) { return _mm512_fmadd_ps(a, b, c); }  // a * b + c
inline vfloat max(vfloat a, vfloat b) { return _mm512_max_ps(a, b); }
inline vfloat neg(vfloat a) { return _mm512_xor_ps(a, _mm512_set1_ps(-0.f)); }
inline vfloat exp(vfloat a) { return Sleef_expf16_u10(a); }
inline float reduce_add(vfloat a) { return _mm512_reduce_add_ps(a); }
inline float reduce_max(vfloat a) { return _mm512_reduce_max_ps(a); }

// Lane t of the result = sum of the lanes of v[t] (16 dot-product partials -> 16 dot products).
inline vfloat transpose_sum(const vfloat* v) {
  __m512 w[8], x[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int j = 0; j < 4; ++j) {  // per 128-bit lane: the partial sums of tokens 4j .. 4j+3
    const __m512d a = _mm512_castps_pd(w[2 * j]), b = _mm512_castps_pd(w[2 * j + 1]);
    x[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // Sum the four 128-bit lanes of each x[j] and place x[j]'s total in lane group j.
  const __m512 y01 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], 0x88), _mm512_shuffle_f32x4(x[0], x[1], 0xDD));
  const __m512 y23 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], 0x88), _mm512_shuffle_f32x4(x[2], x[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(y01, y23, 0x88), _mm512_shuffle_f32x4(y01, y23, 0xDD));
}

#elif SERVAL_AVX2

using vfloat = __m256;
constexpr int64_t kLanes = 8;
constexpr int kRegisters = 16;
// Full vectors load and store directly; a row's tail goes through a zero-padded stack copy (AVX2
// has no masked 16-bit loads, and tails are rare: model widths are multiples of 8).
template <typename T>
inline vfloat load(const T* p, int64_t remaining) {
  if (remaining >= kLanes) return load8(p);
  T buffer[kLanes] = {};
  std::memcpy(buffer, p, remaining * sizeof(T));
  return load8(buffer);
}
template <typename T>
inline void store(T* p, vfloat v, int64_t remaining) {
  if (remaining >= kLanes) return store8(p, v);
  T buffer[kLanes];
  store8(buffer, v);
  std::memcpy(p, buffer, remaining * sizeof(T));
}
template <typename T>
inline vfloat load(const T* p) { return load8(p); }
template <typename T>
inline void store(T* p, vfloat v) { store8(p, v); }
template <typename scalar_t>
inline vfloat round(vfloat v) { return round_to8<scalar_t>(v); }
inline vfloat set1(float x) { return _mm256_set1_ps(x); }
inline vfloat add(vfloat a, vfloat b) { return _mm256_add_ps(a, b); }
inline vfloat mul(vfloat a, vfloat b) { return _mm256_mul_ps(a, b); }
inline vfloat div(vfloat a, vfloat b) { return _mm256_div_ps(a, b); }
inline vfloat sub(vfloat a, vfloat b) { return _mm256_sub_ps(a, b); }
inline vfloat fmadd(vfloat a, vfloat b, vfloat c) { return _mm256_fmadd_ps(a, b, c); }  // a * b + c
inline vfloat max(vfloat a, vfloat b) { return _mm256_max_ps(a, b); }
inline vfloat neg(vfloat a) { return _mm256_xor_ps(a, _mm256_set1_ps(-0.f)); }
inline vfloat exp(vfloat a) { return Sleef_expf8_u10(a); }
inline float reduce_add(vfloat a) {
  const __m128 halves = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 pairs = _mm_add_ps(halves, _mm_movehl_ps(halves, halves));
  return _mm_cvtss_f32(_mm_add_ss(pairs, _mm_movehdup_ps(pairs)));
}
inline float reduce_max(vfloat a) {
  const __m128 halves = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 pairs = _mm_max_ps(halves, _mm_movehl_ps(halves, halves));
  return _mm_cvtss_f32(_mm_max_ss(pairs, _mm_movehdup_ps(pairs)));
}

// Lane t of the result = sum of the lanes of v[t] (8 dot-product partials -> 8 dot products).
inline vfloat transpose_sum(const vfloat* v) {
  __m256 w[4], x[2];
  for (int i = 0; i < 4; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    w[i] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int j = 0; j < 2; ++j) {  // per 128-bit lane: the partial sums of tokens 4j .. 4j+3
    const __m256d a = _mm256_castps_pd(w[2 * j]), b = _mm256_castps_pd(w[2 * j + 1]);
    x[j] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(a, b)), _mm256_castpd_ps(_mm256_unpackhi_pd(a, b)));
  }
  // Sum the two 128-bit lanes of each x[j] and place x[j]'s total in lane group j.
  return _mm256_add_ps(_mm256_permute2f128_ps(x[0], x[1], 0x20), _mm256_permute2f128_ps(x[0], x[1], 0x31));
}

#endif

#if SERVAL_SIMD
// Softmax numerators of one score row in place; returns their sum (the caller divides at the end).
// `scores` has room for n rounded up to whole vectors: that padding is set to -inf, whose exp is 0.
inline float exp_minus_max(float* scores, int64_t n) {
  const int64_t padded = (n + kLanes - 1) / kLanes * kLanes;
  for (int64_t p = n; p < padded; ++p) scores[p] = -std::numeric_limits<float>::infinity();
  vfloat max_v = set1(-std::numeric_limits<float>::infinity());
  for (int64_t p = 0; p < padded; p += kLanes) max_v = max(max_v, load(scores + p));
  const vfloat max_b = set1(reduce_max(max_v));
  vfloat sum_v = set1(0.f);
  for (int64_t p = 0; p < padded; p += kLanes) {
    const vfloat e = exp(sub(load(scores + p), max_b));
    sum_v = add(sum_v, e);
    store(scores + p, e);
  }
  return reduce_add(sum_v);
}
#endif

}  // namespace serval::simd
