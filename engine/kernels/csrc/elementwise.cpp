// Fused elementwise ops of the decoder layer (vLLM's fused_add_rms_norm, silu_and_mul, and rope with
// the KV-cache write), one pass over the data instead of several torch ops each.
//
// Numerics follow the plain-torch layers op by op: every intermediate that torch materialises in the
// model dtype is rounded to it here too (serval::round_to), and float32 arithmetic is done with
// separate multiplies and adds (this file is compiled with -ffp-contract=off). SiLU and RoPE are
// therefore bit-identical to torch; RMSNorm's mean of squares is summed in a different order (the
// result can differ in the last bit of the model dtype).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>

#include "vec.h"

#if SERVAL_AVX512

namespace {

// Rows per parallel task: small batches (decode) run on one thread, where a fork costs more than it saves.
inline int64_t row_grain(int64_t row_elems) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(row_elems, 1)); }

template <typename scalar_t>
float sum_of_squares(const scalar_t* row, int64_t n) {
  __m512 total = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __m512 x = serval::load16(row + j, serval::tail_mask(n - j));
    total = _mm512_add_ps(total, _mm512_mul_ps(x, x));
  }
  return _mm512_reduce_add_ps(total);
}

// out = round(weight * round(x * inv_rms)), as RMSNorm.forward: normalise in float, scale in the dtype.
template <typename scalar_t>
void scale_row(const scalar_t* x, const scalar_t* weight, float inv_rms, scalar_t* out, int64_t n) {
  const __m512 inv = _mm512_set1_ps(inv_rms);
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = serval::tail_mask(n - j);
    const __m512 normed = serval::round_to<scalar_t>(_mm512_mul_ps(serval::load16(x + j, m), inv));
    serval::store16(out + j, _mm512_mul_ps(serval::load16(weight + j, m), normed), m);
  }
}

void check_norm_args(const torch::Tensor& x, const torch::Tensor& weight) {
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "x and weight must be contiguous");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "x and weight must share a dtype");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == weight.numel(), "weight must have x.size(-1) elements");
}

}  // namespace

void fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  check_norm_args(x, weight);
  TORCH_CHECK(residual.is_contiguous() && residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(),
              "residual must be contiguous and shaped like x");
  const int64_t n = x.size(-1), rows = x.numel() / std::max<int64_t>(n, 1);
  SERVAL_DISPATCH_MODEL_TYPES(x.scalar_type(), "fused_add_rms_norm", [&] {
    scalar_t* x_ptr = x.data_ptr<scalar_t>();
    scalar_t* r_ptr = residual.data_ptr<scalar_t>();
    const scalar_t* w_ptr = weight.data_ptr<scalar_t>();
    at::parallel_for(0, rows, row_grain(n), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        scalar_t* xr = x_ptr + i * n;
        scalar_t* rr = r_ptr + i * n;
        for (int64_t j = 0; j < n; j += 16) {  // residual = x + residual, in the dtype
          const __mmask16 m = serval::tail_mask(n - j);
          serval::store16(rr + j, _mm512_add_ps(serval::load16(xr + j, m), serval::load16(rr + j, m)), m);
        }
        const float inv_rms = 1.f / std::sqrt(sum_of_squares(rr, n) / n + static_cast<float>(eps));
        scale_row(rr, w_ptr, inv_rms, xr, n);
      }
    });
  });
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  x = x.contiguous();
  check_norm_args(x, weight);
  auto out = torch::empty_like(x);
  const int64_t n = x.size(-1), rows = x.numel() / std::max<int64_t>(n, 1);
  SERVAL_DISPATCH_MODEL_TYPES(x.scalar_type(), "rms_norm", [&] {
    const scalar_t* x_ptr = x.data_ptr<scalar_t>();
    const scalar_t* w_ptr = weight.data_ptr<scalar_t>();
    scalar_t* out_ptr = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, row_grain(n), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const float inv_rms = 1.f / std::sqrt(sum_of_squares(x_ptr + i * n, n) / n + static_cast<float>(eps));
        scale_row(x_ptr + i * n, w_ptr, inv_rms, out_ptr + i * n, n);
      }
    });
  });
  return out;
}

// out = round(round(silu(gate)) * up) with silu(g) = g / (1 + exp(-g)): torch's F.silu(gate) * up.
torch::Tensor silu_and_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "gate_up must be [T, 2 * I]");
  TORCH_CHECK(gate_up.stride(1) == 1, "gate_up rows must be contiguous");
  const int64_t rows = gate_up.size(0), width = gate_up.size(1) / 2;
  auto out = torch::empty({rows, width}, gate_up.options());
  SERVAL_DISPATCH_MODEL_TYPES(gate_up.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* in = gate_up.data_ptr<scalar_t>();
    scalar_t* out_ptr = out.data_ptr<scalar_t>();
    const int64_t in_stride = gate_up.stride(0);
    const __m512 one = _mm512_set1_ps(1.f);
    const __m512 sign = _mm512_set1_ps(-0.f);
    at::parallel_for(0, rows, row_grain(width), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const scalar_t* gate = in + i * in_stride;
        const scalar_t* up = gate + width;
        for (int64_t j = 0; j < width; j += 16) {
          const __mmask16 m = serval::tail_mask(width - j);
          const __m512 g = serval::load16(gate + j, m);
          const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(one, Sleef_expf16_u10(_mm512_xor_ps(g, sign))));
          serval::store16(out_ptr + i * width + j,
                          _mm512_mul_ps(serval::round_to<scalar_t>(silu), serval::load16(up + j, m)), m);
        }
      }
    });
  });
  return out;
}

namespace {

// Neox-style rope of one head in place: x1' = x1*c1 - x2*s1, x2' = x2*c2 + x1*s2 (c, s: the table
// row rounded to the dtype; every product and sum rounded, as torch's q * cos + rotate_half(q) * sin).
template <typename scalar_t>
void rotate_head(scalar_t* x, const float* cos, const float* sin, int64_t half) {
  const __m512 sign = _mm512_set1_ps(-0.f);
  for (int64_t j = 0; j < half; j += 16) {
    const __mmask16 m = serval::tail_mask(half - j);
    const __m512 x1 = serval::load16(x + j, m), x2 = serval::load16(x + half + j, m);
    auto r = [&](const float* p) { return serval::round_to<scalar_t>(_mm512_maskz_loadu_ps(m, p)); };
    auto mul = [](__m512 a, __m512 b) { return serval::round_to<scalar_t>(_mm512_mul_ps(a, b)); };
    const __m512 y1 = _mm512_add_ps(mul(x1, r(cos + j)), mul(_mm512_xor_ps(x2, sign), r(sin + j)));
    const __m512 y2 = _mm512_add_ps(mul(x2, r(cos + half + j)), mul(x1, r(sin + half + j)));
    serval::store16(x + j, y1, m);
    serval::store16(x + half + j, y2, m);
  }
}

void check_heads(const torch::Tensor& t, const char* name, int64_t num_tokens, int64_t head_dim) {
  TORCH_CHECK(t.dim() == 3 && t.size(0) == num_tokens && t.size(2) == head_dim && t.stride(2) == 1 &&
              t.stride(1) == head_dim, name, " must be [T, heads, D] with contiguous heads");
}

}  // namespace

// positions [T] int64; q [T, H, D], k and v [T, Hk, D] (views with contiguous heads, e.g. of the qkv
// output); cos_sin [P, 2, D] float32 (cos, sin by absolute position); kv_cache [2, blocks, bs, Hk, D];
// slot_mapping [T] int64. Rotates q and k in place, then stores k and v at their slots.
void rotary_embedding_and_cache(torch::Tensor positions, torch::Tensor q, torch::Tensor k, torch::Tensor v,
                                torch::Tensor cos_sin, torch::Tensor kv_cache, torch::Tensor slot_mapping) {
  const int64_t num_tokens = q.size(0), head_dim = q.size(2);
  check_heads(q, "q", num_tokens, head_dim);
  check_heads(k, "k", num_tokens, head_dim);
  check_heads(v, "v", num_tokens, head_dim);
  TORCH_CHECK(head_dim % 2 == 0, "head_dim must be even");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type() &&
              v.scalar_type() == kv_cache.scalar_type(), "q, k, v and kv_cache must share a dtype");
  TORCH_CHECK(cos_sin.scalar_type() == torch::kFloat32 && cos_sin.is_contiguous() && cos_sin.dim() == 3 &&
              cos_sin.size(1) == 2 && cos_sin.size(2) == head_dim, "cos_sin must be contiguous float32 [P, 2, D]");
  TORCH_CHECK(kv_cache.is_contiguous() && kv_cache.dim() == 5 && kv_cache.size(3) == k.size(1) &&
              kv_cache.size(4) == head_dim, "kv_cache must be contiguous [2, blocks, bs, Hk, D]");
  positions = positions.contiguous();
  slot_mapping = slot_mapping.contiguous();
  TORCH_CHECK(positions.scalar_type() == torch::kInt64 && slot_mapping.scalar_type() == torch::kInt64 &&
              positions.numel() == num_tokens && slot_mapping.numel() == num_tokens,
              "positions and slot_mapping must be int64 [T]");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t num_slots = kv_cache.size(1) * kv_cache.size(2), num_positions = cos_sin.size(0);
  for (int64_t t = 0; t < num_tokens; ++t) {  // validate before touching anything
    TORCH_CHECK(pos[t] >= 0 && pos[t] < num_positions, "position ", pos[t], " outside the rope table");
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot ", slots[t], " outside the KV cache");
  }
  const int64_t num_heads = q.size(1), num_kv_heads = k.size(1), half = head_dim / 2;
  const int64_t row_elems = num_kv_heads * head_dim;
  SERVAL_DISPATCH_MODEL_TYPES(q.scalar_type(), "rotary_embedding_and_cache", [&] {
    scalar_t* q_ptr = q.data_ptr<scalar_t>();
    scalar_t* k_ptr = k.data_ptr<scalar_t>();
    const scalar_t* v_ptr = v.data_ptr<scalar_t>();
    scalar_t* k_cache = kv_cache.data_ptr<scalar_t>();
    scalar_t* v_cache = k_cache + num_slots * row_elems;
    const float* table = cos_sin.data_ptr<float>();
    at::parallel_for(0, num_tokens, row_grain((num_heads + 2 * num_kv_heads) * head_dim), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const float* cos = table + pos[t] * 2 * head_dim;
        const float* sin = cos + head_dim;
        for (int64_t h = 0; h < num_heads; ++h) rotate_head(q_ptr + t * q.stride(0) + h * head_dim, cos, sin, half);
        scalar_t* k_row = k_ptr + t * k.stride(0);
        for (int64_t h = 0; h < num_kv_heads; ++h) rotate_head(k_row + h * head_dim, cos, sin, half);
        std::memcpy(k_cache + slots[t] * row_elems, k_row, row_elems * sizeof(scalar_t));
        std::memcpy(v_cache + slots[t] * row_elems, v_ptr + t * v.stride(0), row_elems * sizeof(scalar_t));
      }
    });
  });
}

#endif  // SERVAL_AVX512
