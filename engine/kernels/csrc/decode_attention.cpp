// Paged attention for decode tokens on CPU: one query token per request reads its keys and values
// straight from the paged KV cache through the block table (no gather into padded tensors), with
// float32 accumulation whatever the cache dtype: the query's own, or a 16-bit cache under float32 queries.
//
// Fast path (AVX-512 or AVX2, written once over serval::simd; head_dim 32/64/128, block_size a
// multiple of the vector width): one task per (request, KV head) serves all query heads of that KV
// head's GQA group, so each key/value row is read once. Per slice of kLanes tokens (16 on AVX-512, 8
// on AVX2): the slice's rows are widened to float once, the scores of its tokens are computed with
// the query in registers and summed across lanes by a register transpose (one vector of scores),
// the softmax uses a vectorized exp, and the values are accumulated with the probabilities broadcast.
// Generic path (any other shape, or neither vector ISA): one task per request, scalar-friendly loops.
#include "torch_ops.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "vec.h"


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

// One request: all its query heads over its keys [first, seq_len) (first > 0: a sliding window). Each cached
// token row (all KV heads) is read once, so the memory traffic is one pass over the request's keys and values.
// kHeadDim > 0 fixes the head size at compile time (fully vectorized inner loops); 0 = runtime head_dim.
template <typename scalar_t, typename kv_t, int64_t kHeadDim>
void decode_one_request(const scalar_t* q, const kv_t* k_cache, const kv_t* v_cache,
                        const int32_t* block_row, int64_t first, int64_t seq_len, int64_t block_size,
                        int64_t num_heads, int64_t num_kv_heads, int64_t runtime_head_dim, float scale, scalar_t* out,
                        Scratch& s) {
  const int64_t head_dim = kHeadDim > 0 ? kHeadDim : runtime_head_dim;
  // q, out: [num_heads, head_dim]. Position p lives in block block_row[p / bs] at offset p % bs.
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * head_dim;
  const int64_t block_stride = block_size * token_stride;
  const int64_t len = seq_len - first;  // the keys read; scores[h * len + (p - first)]
  s.q.resize(num_heads * head_dim);
  to_float(q, s.q.data(), num_heads * head_dim);
  for (auto& x : s.q) x *= scale;
  s.scores.resize(num_heads * len);
  s.row.resize(token_stride);
  // Walk block by block: no division per position, and each block's rows are contiguous.
  for (int64_t block_start = first / block_size * block_size; block_start < seq_len; block_start += block_size) {
    const kv_t* k_block = k_cache + block_row[block_start / block_size] * block_stride;
    const int64_t block_end = std::min(block_start + block_size, seq_len);
    for (int64_t p = std::max(block_start, first); p < block_end; ++p) {
      to_float(k_block + (p - block_start) * token_stride, s.row.data(), token_stride);
      for (int64_t kv_head = 0, h = 0; kv_head < num_kv_heads; ++kv_head)
        for (int64_t g = 0; g < group; ++g, ++h)
          s.scores[h * len + p - first] = dot(s.q.data() + h * head_dim, s.row.data() + kv_head * head_dim, head_dim);
    }
  }
  for (int64_t h = 0; h < num_heads; ++h) {  // softmax per query head
    float* sc = s.scores.data() + h * len;
    float max_score = -std::numeric_limits<float>::infinity();
    for (int64_t p = 0; p < len; ++p) max_score = std::max(max_score, sc[p]);
    float total = 0.f;
    for (int64_t p = 0; p < len; ++p) {
      sc[p] = std::exp(sc[p] - max_score);
      total += sc[p];
    }
    const float inv_total = 1.f / total;
    for (int64_t p = 0; p < len; ++p) sc[p] *= inv_total;
  }
  s.acc.assign(num_heads * head_dim, 0.f);
  for (int64_t block_start = first / block_size * block_size; block_start < seq_len; block_start += block_size) {
    const kv_t* v_block = v_cache + block_row[block_start / block_size] * block_stride;
    const int64_t block_end = std::min(block_start + block_size, seq_len);
    for (int64_t p = std::max(block_start, first); p < block_end; ++p) {
      to_float(v_block + (p - block_start) * token_stride, s.row.data(), token_stride);
      for (int64_t kv_head = 0, h = 0; kv_head < num_kv_heads; ++kv_head)
        for (int64_t g = 0; g < group; ++g, ++h)
          axpy(s.scores[h * len + p - first], s.row.data() + kv_head * head_dim, s.acc.data() + h * head_dim,
               head_dim);
    }
  }
  for (int64_t i = 0; i < num_heads * head_dim; ++i) out[i] = static_cast<scalar_t>(s.acc[i]);
}


// The first key a query at position seq_len - 1 attends: the window's (window > 0 keys, its own included), or 0.
inline int64_t first_key(int64_t seq_len, int64_t window) {
  return window > 0 && seq_len > window ? seq_len - window : 0;
}


#if SERVAL_SIMD

namespace simd = serval::simd;
using simd::kLanes;  // one slice of the fast path: kLanes tokens, scored by one transpose-sum
using simd::vfloat;

alignas(64) constexpr float kZeros[128] = {};  // a zero key row (head_dim <= 128, any dtype)

struct FastScratch {
  std::vector<float> q, scores, rows, acc;
  void size_for(int64_t group, int64_t head_dim, int64_t padded_len) {  // acc zeroed
    q.resize(group * head_dim);
    scores.resize(group * padded_len);
    rows.resize(kLanes * head_dim);
    acc.assign(group * head_dim, 0.f);
  }
};

#if SERVAL_AVX512 && defined(__AVX512BF16__)
// Scores of up to 16 tokens for every query head of the group, bf16 cache and query: the dot
// products run on bf16 pairs (exact products, float32 sums), no widening of the keys; the scale is
// applied to the sums.
template <int kChunks>
inline void score_slice_bf16(const c10::BFloat16* q, const c10::BFloat16* k_rows, int64_t count, int64_t row_stride,
                             int64_t group, __m512 scale, float* scores, int64_t scores_stride) {
  constexpr int kPairs = kChunks / 2;  // 32 bf16 per instruction
  for (int64_t g = 0; g < group; ++g) {
    __m512bh qv[kPairs];
    for (int c = 0; c < kPairs; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(q + g * kChunks * 16 + c * 32);
    __m512 partial[16];
    for (int64_t t = 0; t < 16; ++t) {  // rows past `count` read zeros: no branches in the unrolled loop
      const c10::BFloat16* row = t < count ? k_rows + t * row_stride : reinterpret_cast<const c10::BFloat16*>(kZeros);
      partial[t] = _mm512_setzero_ps();
      for (int c = 0; c < kPairs; ++c)
        partial[t] = _mm512_dpbf16_ps(partial[t], qv[c], (__m512bh)_mm512_loadu_si512(row + c * 32));
    }
    _mm512_mask_storeu_ps(scores + g * scores_stride, serval::tail_mask(count),
                          _mm512_mul_ps(simd::transpose_sum(partial), scale));
  }
}
#endif

// The `count` rows of one slice (`row_stride` elements apart in the cache) widened to float, D apart.
template <typename scalar_t, int kChunks>
inline void widen_rows(const scalar_t* src, int64_t count, int64_t row_stride, float* __restrict rows) {
  constexpr int64_t D = kChunks * kLanes;
  for (int64_t t = 0; t < count; ++t)
    for (int c = 0; c < kChunks; ++c)
      simd::store(rows + t * D + c * kLanes, simd::load(src + t * row_stride + c * kLanes));
}

// Scores of one slice (its widened rows, `count` of them real) for every query head of the group.
// The query chunks in registers at a time leave room for the kLanes partial sums (all of them on
// AVX-512; half of a 64-wide head on AVX2, whose 16 registers would otherwise spill).
template <int kChunks>
inline void score_slice(const float* __restrict q_scaled, const float* __restrict rows, int64_t count, int64_t group,
                        float* __restrict scores, int64_t scores_stride) {
  constexpr int64_t D = kChunks * kLanes;
  constexpr int kQChunks = std::min<int>(kChunks, (simd::kRegisters - kLanes) / 2);
  static_assert(kChunks % kQChunks == 0, "query chunks come in equal register loads");
  for (int64_t g = 0; g < group; ++g) {
    vfloat partial[kLanes];
    for (int c0 = 0; c0 < kChunks; c0 += kQChunks) {
      vfloat qv[kQChunks];
      for (int c = 0; c < kQChunks; ++c) qv[c] = simd::load(q_scaled + g * D + (c0 + c) * kLanes);
      for (int64_t t = 0; t < kLanes; ++t) {  // rows past `count` read zeros: no branches in the unrolled loop
        const float* row = (t < count ? rows + t * D : kZeros) + c0 * kLanes;
        if (c0 == 0) partial[t] = simd::set1(0.f);
        for (int c = 0; c < kQChunks; ++c) partial[t] = simd::fmadd(qv[c], simd::load(row + c * kLanes), partial[t]);
      }
    }
    simd::store(scores + g * scores_stride, simd::transpose_sum(partial), count);
  }
}

// acc[g] += p[g, t] * v[t] over one slice's widened value rows, for every query head of the group.
// Accumulators of at most half the registers at a time (a 128-wide head on AVX2 takes two rounds).
template <int kChunks>
inline void accumulate_slice(const float* __restrict probs, const float* __restrict rows, int64_t count,
                             int64_t group, int64_t probs_stride, float* __restrict acc_base) {
  constexpr int64_t D = kChunks * kLanes;
  constexpr int kAccChunks = std::min<int>(kChunks, simd::kRegisters / 2);
  static_assert(kChunks % kAccChunks == 0, "accumulators come in equal register loads");
  for (int64_t g = 0; g < group; ++g) {
    const float* p = probs + g * probs_stride;
    for (int c0 = 0; c0 < kChunks; c0 += kAccChunks) {
      float* acc_g = acc_base + g * D + c0 * kLanes;
      vfloat acc[kAccChunks];
      for (int c = 0; c < kAccChunks; ++c) acc[c] = simd::load(acc_g + c * kLanes);
      for (int64_t t = 0; t < count; ++t) {
        const vfloat weight = simd::set1(p[t]);
        const float* row = rows + t * D + c0 * kLanes;
        for (int c = 0; c < kAccChunks; ++c) acc[c] = simd::fmadd(weight, simd::load(row + c * kLanes), acc[c]);
      }
      for (int c = 0; c < kAccChunks; ++c) simd::store(acc_g + c * kLanes, acc[c]);
    }
  }
}

// One (request, KV head): the `group` query heads q[group, D] -> out[group, D] over the keys [first, seq_len).
// kChunks = head_dim / kLanes. Rows of one block for this KV head are `row_stride` elements apart. The slices
// start at `first` rounded down to kLanes (a slice never straddles blocks, so the rows before `first` that its
// first slice reads lie in the block `first` is in); their scores are -inf, so they weigh nothing.
template <typename scalar_t, typename kv_t, int kChunks>
void decode_one_kv_head(const scalar_t* q, const kv_t* k_base, const kv_t* v_base, const int32_t* block_row,
                        int64_t first, int64_t seq_len, int64_t block_size, int64_t block_stride, int64_t row_stride,
                        int64_t group, float scale, scalar_t* out, FastScratch& s) {
  constexpr int64_t D = kChunks * kLanes;
  const int64_t begin = first / kLanes * kLanes, len = seq_len - begin;  // scores[g * padded_len + p - begin]
  const int64_t padded_len = (len + kLanes - 1) / kLanes * kLanes;
  s.size_for(group, D, padded_len);
  // Raw pointers: stores through float* could alias the vectors' own pointers and force reloads.
  float* __restrict q_scaled = s.q.data();
  float* __restrict scores = s.scores.data();
  float* __restrict rows = s.rows.data();
  float* __restrict acc_base = s.acc.data();
  const vfloat scale_v = simd::set1(scale);
  for (int64_t i = 0; i < group * D; i += kLanes) simd::store(q_scaled + i, simd::mul(simd::load(q + i), scale_v));
  auto slice_rows = [&](const kv_t* base, int64_t start) {  // a slice never straddles blocks
    return base + block_row[start / block_size] * block_stride + (start % block_size) * row_stride;
  };
  // Pass 1: scores, kLanes tokens at a time (a block, or a kLanes-token slice of a bigger block).
  for (int64_t start = begin; start < seq_len; start += kLanes) {
    const int64_t count = std::min<int64_t>(kLanes, seq_len - start);
    if (start + kLanes < seq_len)  // the next slice's keys and this slice's values, ahead of their use
      serval::prefetch_rows(slice_rows(k_base, start + kLanes), std::min<int64_t>(kLanes, seq_len - start - kLanes),
                            row_stride, D * sizeof(kv_t));
    serval::prefetch_rows(slice_rows(v_base, start), count, row_stride, D * sizeof(kv_t));
#if SERVAL_AVX512 && defined(__AVX512BF16__) && !defined(SERVAL_NO_DPBF16)
    if constexpr (std::is_same_v<scalar_t, c10::BFloat16> && std::is_same_v<kv_t, c10::BFloat16>) {  // bf16 pairs
      score_slice_bf16<kChunks>(q, slice_rows(k_base, start), count, row_stride, group, scale_v,
                                scores + start - begin, padded_len);
      continue;
    }
#endif
    widen_rows<kv_t, kChunks>(slice_rows(k_base, start), count, row_stride, rows);
    score_slice<kChunks>(q_scaled, rows, count, group, scores + start - begin, padded_len);
  }
  for (int64_t g = 0; g < group; ++g)  // keys before the window
    for (int64_t p = begin; p < first; ++p) scores[g * padded_len + p - begin] = -std::numeric_limits<float>::infinity();
  float inv_sums[64];  // group <= 64 (checked by the caller)
  for (int64_t g = 0; g < group; ++g) inv_sums[g] = 1.f / simd::exp_minus_max(scores + g * padded_len, len);
  // Pass 2: acc[g] += p[g, t] * v[t], the slice's value rows widened to float once for all heads.
  for (int64_t start = begin; start < seq_len; start += kLanes) {
    const int64_t count = std::min<int64_t>(kLanes, seq_len - start);
    widen_rows<kv_t, kChunks>(slice_rows(v_base, start), count, row_stride, rows);
    accumulate_slice<kChunks>(scores + start - begin, rows, count, group, padded_len, acc_base);
  }
  for (int64_t g = 0; g < group; ++g) {
    const vfloat inv = simd::set1(inv_sums[g]);
    for (int c = 0; c < kChunks; ++c)
      simd::store(out + g * D + c * kLanes, simd::mul(simd::load(acc_base + g * D + c * kLanes), inv));
  }
}

// The fast path for all requests; returns false (nothing done) where it does not apply.
template <typename scalar_t, typename kv_t>
bool decode_fast(const scalar_t* q, const kv_t* k_cache, const kv_t* v_cache, const int32_t* tables,
                 const int32_t* lens, int64_t window, int64_t n, int64_t max_blocks, int64_t block_size,
                 int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, float scale, scalar_t* out,
                 int64_t out_stride, int64_t q_stride) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t row_stride = num_kv_heads * head_dim, block_stride = block_size * row_stride;
  // kLanes-token slices must not straddle blocks.
  if (block_size % kLanes != 0 || group > 64) return false;
  auto run = [&](auto chunks_constant) {
    constexpr int kChunks = decltype(chunks_constant)::value;
    at::parallel_for(0, n * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
      FastScratch scratch;
      for (int64_t task = begin; task < end; ++task) {
        const int64_t i = task / num_kv_heads, kv_head = task % num_kv_heads;
        const int64_t head_offset = kv_head * group * head_dim;
        decode_one_kv_head<scalar_t, kv_t, kChunks>(
            q + i * q_stride + head_offset, k_cache + kv_head * head_dim, v_cache + kv_head * head_dim,
            tables + i * max_blocks, first_key(lens[i], window), lens[i], block_size, block_stride, row_stride,
            group, scale,
            out + i * out_stride + head_offset, scratch);
      }
    });
  };
  if (head_dim == 32) run(std::integral_constant<int, 32 / kLanes>{});
  else if (head_dim == 64) run(std::integral_constant<int, 64 / kLanes>{});
  else if (head_dim == 128) run(std::integral_constant<int, 128 / kLanes>{});
  else return false;
  return true;
}

#endif  // SERVAL_SIMD

}  // namespace

// q: [n, H, D]; kv_cache: [2, num_blocks, block_size, Hk, D]; block_tables: [n, max_blocks] int32;
// seq_lens: [n] int32 (keys per request, the new token included); the cache in q's dtype, or bf16 / half under
// float32 q (serval::dispatch_kv_type). window > 0: each query attends only its last `window` keys (its own
// included; a sliding window), and the blocks before them are never read (they may be the null block); 0: all.
// Returns [n, H, D] in q's dtype, written into `out` when given (any [n, H, D] tensor whose rows are contiguous,
// e.g. a slice).
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor block_tables,
                                     torch::Tensor seq_lens, double scale, c10::optional<torch::Tensor> out_arg,
                                     int64_t window) {
  TORCH_CHECK(q.dim() == 3 && kv_cache.dim() == 5, "q must be [n, H, D] and kv_cache [2, blocks, bs, Hk, D]");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32,
              "block_tables and seq_lens must be int32");
  if (q.stride(2) != 1 || q.stride(1) != q.size(2)) q = q.contiguous();  // token rows may be strided (qkv views)
  TORCH_CHECK(kv_cache.is_contiguous(), "kv_cache must be contiguous");
  block_tables = block_tables.contiguous();
  seq_lens = seq_lens.contiguous();
  const int64_t n = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_blocks = kv_cache.size(1), block_size = kv_cache.size(2), num_kv_heads = kv_cache.size(3);
  TORCH_CHECK(num_heads % num_kv_heads == 0 && kv_cache.size(4) == head_dim, "head shapes do not match");
  TORCH_CHECK(block_tables.size(0) == n && seq_lens.size(0) == n, "one block table row and seq_len per query");
  torch::Tensor out = out_arg.has_value() ? *out_arg : torch::empty_like(q);
  TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type() && out.stride(2) == 1 &&
              out.stride(1) == head_dim, "out must be [n, H, D] like q, with contiguous rows");
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t max_blocks = block_tables.size(1);
  const at::ScalarType kv_type = kv_cache.scalar_type();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    serval::dispatch_kv_type<scalar_t>(kv_type, "paged_decode_attention", [&](auto kv_tag) {
      using kv_t = decltype(kv_tag);
      const scalar_t* q_ptr = q.data_ptr<scalar_t>();
      const kv_t* k_cache = kv_cache.data_ptr<kv_t>();
      const kv_t* v_cache = k_cache + num_blocks * block_size * num_kv_heads * head_dim;
      scalar_t* out_ptr = out.data_ptr<scalar_t>();
      const int64_t out_stride = out.stride(0), q_stride = q.stride(0);
#if SERVAL_SIMD
      if constexpr (!std::is_same_v<scalar_t, double>) {
        if (decode_fast<scalar_t, kv_t>(q_ptr, k_cache, v_cache, tables, lens, window, n, max_blocks, block_size,
                                        num_heads,
                                        num_kv_heads, head_dim, static_cast<float>(scale), out_ptr, out_stride,
                                        q_stride))
          return;
      }
#endif
      auto run = [&](auto head_dim_constant) {
        constexpr int64_t kHeadDim = decltype(head_dim_constant)::value;
        at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
          Scratch scratch;
          for (int64_t i = begin; i < end; ++i) {
            decode_one_request<scalar_t, kv_t, kHeadDim>(q_ptr + i * q_stride, k_cache, v_cache,
                                                         tables + i * max_blocks, first_key(lens[i], window),
                                                         lens[i], block_size, num_heads,
                                                         num_kv_heads, head_dim, static_cast<float>(scale),
                                                         out_ptr + i * out_stride, scratch);
          }
        });
      };
      if (head_dim == 64) run(std::integral_constant<int64_t, 64>{});
      else if (head_dim == 128) run(std::integral_constant<int64_t, 128>{});
      else run(std::integral_constant<int64_t, 0>{});
    });
  });
  return out;
}
