// AVX-512 helpers shared by Serval's native CPU ops.
//
// Loads widen any storage type to 16 float lanes; stores round back the way torch does (round to
// nearest even, NaN kept quiet), so an op computed here in float and stored as bf16 is bit-identical
// to the same arithmetic done by torch's elementwise kernels. Masks cover row tails of any length.
#pragma once

#include <ATen/Dispatch.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <cstdint>

// float, bfloat16 and half (the dtypes a model runs in); other dtypes raise.
#define SERVAL_DISPATCH_MODEL_TYPES(TYPE, NAME, ...)                                      \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)                \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__) AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define SERVAL_AVX512 1
#else
#define SERVAL_AVX512 0
#endif

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
