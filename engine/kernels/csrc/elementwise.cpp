// Fused elementwise ops of the decoder layer (vLLM's fused_add_rms_norm, silu_and_mul, and rope with
// the KV-cache write), one pass over the data instead of several torch ops each.
//
// Numerics follow the plain-torch layers op by op: every intermediate that torch materialises in the
// model dtype is rounded to it here too (serval::round_to), and float32 arithmetic is done with
// separate multiplies and adds (this file is compiled with -ffp-contract=off). SiLU and RoPE are
// therefore bit-identical to torch; RMSNorm's mean of squares is summed in a different order (the
// result can differ in the last bit of the model dtype).
//
// Written once over serval::simd (vec.h): 16 lanes where the build targets AVX-512, 8 where it
// targets AVX2; built only where one of the two is (SERVAL_FUSED_OPS), else the layers keep torch.
#include "torch_ops.h"

#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "vec.h"

#if SERVAL_FUSED_OPS

namespace {

namespace simd = serval::simd;

// Rows per parallel task: small batches (decode) run on one thread, where a fork costs more than it saves.
inline int64_t row_grain(int64_t row_elems) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(row_elems, 1)); }

template <typename scalar_t>
float sum_of_squares(const scalar_t* row, int64_t n) {
  simd::vfloat total = simd::set1(0.f);
  for (int64_t j = 0; j < n; j += simd::kLanes) {
    const simd::vfloat x = simd::load(row + j, n - j);
    total = simd::add(total, simd::mul(x, x));
  }
  return simd::reduce_add(total);
}

// out = round(weight * round(x * inv_rms)), as RMSNorm.forward: normalise in float, scale in the dtype.
template <typename scalar_t>
void scale_row(const scalar_t* x, const scalar_t* weight, float inv_rms, scalar_t* out, int64_t n) {
  const simd::vfloat inv = simd::set1(inv_rms);
  for (int64_t j = 0; j < n; j += simd::kLanes) {
    const simd::vfloat normed = simd::round<scalar_t>(simd::mul(simd::load(x + j, n - j), inv));
    simd::store(out + j, simd::mul(simd::load(weight + j, n - j), normed), n - j);
  }
}

// residual = x + residual, rounded to the dtype (torch's x + residual).
template <typename scalar_t>
void add_into(const scalar_t* x, scalar_t* residual, int64_t n) {
  for (int64_t j = 0; j < n; j += simd::kLanes)
    simd::store(residual + j, simd::add(simd::load(x + j, n - j), simd::load(residual + j, n - j)), n - j);
}

// out = round(round(silu(gate)) * up) with silu(g) = g / (1 + exp(-g)): torch's F.silu(gate) * up.
template <typename scalar_t>
void silu_mul_row(const scalar_t* gate, const scalar_t* up, scalar_t* out, int64_t n) {
  const simd::vfloat one = simd::set1(1.f);
  for (int64_t j = 0; j < n; j += simd::kLanes) {
    const simd::vfloat g = simd::load(gate + j, n - j);
    const simd::vfloat silu = simd::div(g, simd::add(one, simd::exp(simd::neg(g))));
    simd::store(out + j, simd::mul(simd::round<scalar_t>(silu), simd::load(up + j, n - j)), n - j);
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
        add_into(xr, rr, n);
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

// gate_up [T, 2I] (rows contiguous) -> silu(gate) * up [T, I], row by row (silu_mul_row).
torch::Tensor silu_and_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "gate_up must be [T, 2 * I]");
  TORCH_CHECK(gate_up.stride(1) == 1, "gate_up rows must be contiguous");
  const int64_t rows = gate_up.size(0), width = gate_up.size(1) / 2;
  auto out = torch::empty({rows, width}, gate_up.options());
  SERVAL_DISPATCH_MODEL_TYPES(gate_up.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* in = gate_up.data_ptr<scalar_t>();
    scalar_t* out_ptr = out.data_ptr<scalar_t>();
    const int64_t in_stride = gate_up.stride(0);
    at::parallel_for(0, rows, row_grain(width), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const scalar_t* gate = in + i * in_stride;
        silu_mul_row(gate, gate + width, out_ptr + i * width, width);
      }
    });
  });
  return out;
}

namespace {

// A token's cos/sin row ([2, D] float32) as the dtype holds it (torch casts the table to q's dtype):
// rounded once per token into `scratch`, not once per head. float needs no copy.
template <typename scalar_t>
const float* table_row_in_dtype(const float* row, int64_t n, float* scratch) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return row;
  } else {
    for (int64_t j = 0; j < n; j += simd::kLanes)
      simd::store(scratch + j, simd::round<scalar_t>(simd::load(row + j, n - j)), n - j);
    return scratch;
  }
}

// Neox-style rope of one head in place: x1' = x1*c1 - x2*s1, x2' = x2*c2 + x1*s2 (c, s: the table
// row already in the dtype; every product and sum rounded, as torch's q * cos + rotate_half(q) * sin).
template <typename scalar_t>
void rotate_head(scalar_t* x, const float* cos, const float* sin, int64_t half) {
  for (int64_t j = 0; j < half; j += simd::kLanes) {
    const int64_t left = half - j;
    const simd::vfloat x1 = simd::load(x + j, left), x2 = simd::load(x + half + j, left);
    auto r = [&](const float* p) { return simd::load(p, left); };
    auto mul = [](simd::vfloat a, simd::vfloat b) { return simd::round<scalar_t>(simd::mul(a, b)); };
    const simd::vfloat y1 = simd::add(mul(x1, r(cos + j)), mul(simd::neg(x2), r(sin + j)));
    const simd::vfloat y2 = simd::add(mul(x2, r(cos + half + j)), mul(x1, r(sin + half + j)));
    simd::store(x + j, y1, left);
    simd::store(x + half + j, y2, left);
  }
}

// One token's K or V row into its cache slot, rounded to the cache's dtype as torch's .to() rounds.
template <typename scalar_t, typename kv_t>
void store_row(kv_t* dst, const scalar_t* src, int64_t n) {
  if constexpr (std::is_same_v<scalar_t, kv_t>) {
    std::memcpy(dst, src, n * sizeof(kv_t));
  } else {
    for (int64_t j = 0; j < n; j += simd::kLanes) simd::store(dst + j, simd::load(src + j, n - j), n - j);
  }
}

void check_heads(const torch::Tensor& t, const char* name, int64_t num_tokens, int64_t head_dim) {
  TORCH_CHECK(t.dim() == 3 && t.size(0) == num_tokens && t.size(2) == head_dim && t.stride(2) == 1 &&
              t.stride(1) == head_dim, name, " must be [T, heads, D] with contiguous heads");
}

}  // namespace

// positions [T] int64; q [T, H, D], k and v [T, Hk, D] (views with contiguous heads, e.g. of the qkv
// output); cos_sin [P, 2, D] float32 (cos, sin by absolute position); kv_cache [2, blocks, bs, Hk, D];
// slot_mapping [T] int64. Rotates q and k in place, then stores k and v at their slots. The cache has q's
// dtype, or bf16 / half under float32 q (serval::dispatch_kv_type).
void rotary_embedding_and_cache(torch::Tensor positions, torch::Tensor q, torch::Tensor k, torch::Tensor v,
                                torch::Tensor cos_sin, torch::Tensor kv_cache, torch::Tensor slot_mapping) {
  const int64_t num_tokens = q.size(0), head_dim = q.size(2);
  check_heads(q, "q", num_tokens, head_dim);
  check_heads(k, "k", num_tokens, head_dim);
  check_heads(v, "v", num_tokens, head_dim);
  TORCH_CHECK(head_dim % 2 == 0, "head_dim must be even");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type(),
              "q, k and v must share a dtype");
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
    serval::dispatch_kv_type<scalar_t>(kv_cache.scalar_type(), "rotary_embedding_and_cache", [&](auto kv_tag) {
      using kv_t = decltype(kv_tag);
      scalar_t* q_ptr = q.data_ptr<scalar_t>();
      scalar_t* k_ptr = k.data_ptr<scalar_t>();
      const scalar_t* v_ptr = v.data_ptr<scalar_t>();
      kv_t* k_cache = kv_cache.data_ptr<kv_t>();
      kv_t* v_cache = k_cache + num_slots * row_elems;
      const float* table = cos_sin.data_ptr<float>();
      const int64_t grain = row_grain((num_heads + 2 * num_kv_heads) * head_dim);
      at::parallel_for(0, num_tokens, grain, [&](int64_t begin, int64_t end) {
        std::vector<float> scratch(2 * head_dim);
        for (int64_t t = begin; t < end; ++t) {
          const float* cos = table_row_in_dtype<scalar_t>(table + pos[t] * 2 * head_dim, 2 * head_dim, scratch.data());
          const float* sin = cos + head_dim;
          for (int64_t h = 0; h < num_heads; ++h) rotate_head(q_ptr + t * q.stride(0) + h * head_dim, cos, sin, half);
          scalar_t* k_row = k_ptr + t * k.stride(0);
          for (int64_t h = 0; h < num_kv_heads; ++h) rotate_head(k_row + h * head_dim, cos, sin, half);
          store_row(k_cache + slots[t] * row_elems, k_row, row_elems);
          store_row(v_cache + slots[t] * row_elems, v_ptr + t * v.stride(0), row_elems);
        }
      });
    });
  });
}

#endif  // SERVAL_FUSED_OPS
