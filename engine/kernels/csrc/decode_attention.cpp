// Serval's native CPU ops, built on first use by engine/kernels/cpu.py.
//
// Paged attention for decode tokens on CPU: one query token per request reads its keys and values
// straight from the paged KV cache through the block table (no gather into padded tensors), with
// float32 accumulation whatever the cache dtype. Parallel over requests; each task reads every cached
// token row of its request once and serves all query heads (GQA groups share the row) from it.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>


namespace {

// Converts one key/value row to float. bf16 is the top half of a float32: widen and shift.
template <typename scalar_t>
inline void to_float(const scalar_t* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}
inline void to_float(const at::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(bits[i]) << 16;
}

// Plain loops: with the reassociation flags the compiler vectorizes both.
inline float dot(const float* a, const float* b, int64_t n) {
  float total = 0.f;
  for (int64_t i = 0; i < n; ++i) total += a[i] * b[i];
  return total;
}
inline void axpy(float w, const float* x, float* y, int64_t n) {  // y += w * x
  for (int64_t i = 0; i < n; ++i) y[i] += w * x[i];
}

struct Scratch {
  std::vector<float> q, scores, row, acc;
};

// One request: all its query heads over its whole sequence. Each cached token row (all KV heads)
// is read once, so the memory traffic is one pass over the request's keys and values.
// kHeadDim > 0 fixes the head size at compile time (fully vectorized inner loops); 0 = runtime head_dim.
template <typename scalar_t, int64_t kHeadDim>
void decode_one_request(const scalar_t* q, const scalar_t* k_cache, const scalar_t* v_cache,
                        const int32_t* block_row, int64_t seq_len, int64_t block_size, int64_t num_heads,
                        int64_t num_kv_heads, int64_t runtime_head_dim, float scale, scalar_t* out, Scratch& s) {
  const int64_t head_dim = kHeadDim > 0 ? kHeadDim : runtime_head_dim;
  // q, out: [num_heads, head_dim]. Position p lives in block block_row[p / bs] at offset p % bs.
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * head_dim;
  const int64_t block_stride = block_size * token_stride;
  s.q.resize(num_heads * head_dim);
  to_float(q, s.q.data(), num_heads * head_dim);
  for (auto& x : s.q) x *= scale;
  s.scores.resize(num_heads * seq_len);
  s.row.resize(token_stride);
  // Walk block by block: no division per position, and each block's rows are contiguous.
  for (int64_t block_start = 0; block_start < seq_len; block_start += block_size) {
    const scalar_t* k_block = k_cache + block_row[block_start / block_size] * block_stride;
    const int64_t block_end = std::min(block_start + block_size, seq_len);
    for (int64_t p = block_start; p < block_end; ++p) {
      to_float(k_block + (p - block_start) * token_stride, s.row.data(), token_stride);
      for (int64_t kv_head = 0, h = 0; kv_head < num_kv_heads; ++kv_head)
        for (int64_t g = 0; g < group; ++g, ++h)
          s.scores[h * seq_len + p] = dot(s.q.data() + h * head_dim, s.row.data() + kv_head * head_dim, head_dim);
    }
  }
  for (int64_t h = 0; h < num_heads; ++h) {  // softmax per query head
    float* sc = s.scores.data() + h * seq_len;
    float max_score = -std::numeric_limits<float>::infinity();
    for (int64_t p = 0; p < seq_len; ++p) max_score = std::max(max_score, sc[p]);
    float total = 0.f;
    for (int64_t p = 0; p < seq_len; ++p) {
      sc[p] = std::exp(sc[p] - max_score);
      total += sc[p];
    }
    const float inv_total = 1.f / total;
    for (int64_t p = 0; p < seq_len; ++p) sc[p] *= inv_total;
  }
  s.acc.assign(num_heads * head_dim, 0.f);
  for (int64_t block_start = 0; block_start < seq_len; block_start += block_size) {
    const scalar_t* v_block = v_cache + block_row[block_start / block_size] * block_stride;
    const int64_t block_end = std::min(block_start + block_size, seq_len);
    for (int64_t p = block_start; p < block_end; ++p) {
      to_float(v_block + (p - block_start) * token_stride, s.row.data(), token_stride);
      for (int64_t kv_head = 0, h = 0; kv_head < num_kv_heads; ++kv_head)
        for (int64_t g = 0; g < group; ++g, ++h)
          axpy(s.scores[h * seq_len + p], s.row.data() + kv_head * head_dim, s.acc.data() + h * head_dim, head_dim);
    }
  }
  for (int64_t i = 0; i < num_heads * head_dim; ++i) out[i] = static_cast<scalar_t>(s.acc[i]);
}

}  // namespace

// q: [n, H, D]; kv_cache: [2, num_blocks, block_size, Hk, D]; block_tables: [n, max_blocks] int32;
// seq_lens: [n] int32 (keys per request, the new token included). Returns [n, H, D] in q's dtype.
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor block_tables,
                                     torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && kv_cache.dim() == 5, "q must be [n, H, D] and kv_cache [2, blocks, bs, Hk, D]");
  TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type(), "q and kv_cache must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32,
              "block_tables and seq_lens must be int32");
  q = q.contiguous();
  kv_cache = kv_cache.contiguous();
  block_tables = block_tables.contiguous();
  seq_lens = seq_lens.contiguous();
  const int64_t n = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_blocks = kv_cache.size(1), block_size = kv_cache.size(2), num_kv_heads = kv_cache.size(3);
  TORCH_CHECK(num_heads % num_kv_heads == 0 && kv_cache.size(4) == head_dim, "head shapes do not match");
  auto out = torch::empty_like(q);
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t max_blocks = block_tables.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    const scalar_t* q_ptr = q.data_ptr<scalar_t>();
    const scalar_t* k_cache = kv_cache.data_ptr<scalar_t>();
    const scalar_t* v_cache = k_cache + num_blocks * block_size * num_kv_heads * head_dim;
    scalar_t* out_ptr = out.data_ptr<scalar_t>();
    auto run = [&](auto head_dim_constant) {
      constexpr int64_t kHeadDim = decltype(head_dim_constant)::value;
      at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
        Scratch scratch;
        for (int64_t i = begin; i < end; ++i) {
          const int64_t offset = i * num_heads * head_dim;
          decode_one_request<scalar_t, kHeadDim>(q_ptr + offset, k_cache, v_cache, tables + i * max_blocks, lens[i],
                                                 block_size, num_heads, num_kv_heads, head_dim,
                                                 static_cast<float>(scale), out_ptr + offset, scratch);
        }
      });
    };
    if (head_dim == 64) {
      run(std::integral_constant<int64_t, 64>{});
    } else if (head_dim == 128) {
      run(std::integral_constant<int64_t, 128>{});
    } else {
      run(std::integral_constant<int64_t, 0>{});
    }
  });
  return out;
}

// Row-wise argmax of float32 logits [n, V] -> int64 [n]; the first maximal index wins, as torch's.
// torch's CPU argmax runs at about 1 GB/s; here a vectorized max pass and an early-exit search.
torch::Tensor argmax_rows(torch::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat32, "logits must be float32 [n, V]");
  logits = logits.contiguous();
  const int64_t n = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(vocab > 0, "logits must have at least one column");
  auto out = torch::empty({n}, logits.options().dtype(torch::kInt64));
  const float* data = logits.data_ptr<float>();
  int64_t* result = out.data_ptr<int64_t>();
  at::parallel_for(0, n, 8, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* row = data + i * vocab;
      float best = row[0];
      int has_nan = 0;
#pragma omp simd reduction(max : best) reduction(| : has_nan)
      for (int64_t j = 0; j < vocab; ++j) {
        best = row[j] > best ? row[j] : best;
        has_nan |= row[j] != row[j];
      }
      int64_t index = 0;
      if (has_nan) {  // torch treats NaN as the maximum: the first NaN wins
        while (!(row[index] != row[index])) ++index;
      } else {
        while (!(row[index] == best)) ++index;
      }
      result[i] = index;
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("argmax_rows", &argmax_rows, "Row-wise argmax of float32 logits [n, V] -> int64 [n]");
  m.def("paged_decode_attention", &paged_decode_attention,
        "Decode attention over a paged KV cache (q [n, H, D] -> [n, H, D])");
}
