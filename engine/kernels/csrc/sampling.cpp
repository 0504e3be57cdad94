// Sampling helpers for Serval's CPU path.
#include "torch_ops.h"

#include <algorithm>
#include <cstdint>
#include <limits>

// Row-wise argmax of float32 logits [n, V] -> int64 [n]; the first maximal index wins, as torch's.
// torch's CPU argmax is slow; here a vectorized max pass and an early-exit search.
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


// Structured outputs: logits[rows[i], t] = -inf wherever bit t of bitmask[i] is 0, in place.
// logits float32 [n, V] (rows contiguous); bitmask int32 [r, W] with 32 * W >= V (bit b of word w is
// token 32 * w + b); rows int64 [r], each < n. Whole words are the common case (a grammar allows few
// tokens): an all-zero word is 32 stores of -inf, an all-one word is skipped.
void apply_token_bitmask(torch::Tensor logits, torch::Tensor bitmask, torch::Tensor rows) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat32 && logits.stride(1) == 1,
              "logits must be float32 [n, V] with contiguous rows");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == torch::kInt32, "bitmask must be int32 [r, W]");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == torch::kInt64 && rows.size(0) == bitmask.size(0),
              "rows must be int64 [r], one per bitmask row");
  bitmask = bitmask.contiguous();
  rows = rows.contiguous();
  const int64_t n = logits.size(0), vocab = logits.size(1), words = bitmask.size(1);
  TORCH_CHECK(words * 32 >= vocab, "the bitmask must cover the vocabulary");
  const int64_t* row_ids = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows.size(0); ++i) TORCH_CHECK(0 <= row_ids[i] && row_ids[i] < n, "row out of range");
  float* data = logits.data_ptr<float>();
  const int64_t stride = logits.stride(0);
  const int32_t* masks = bitmask.data_ptr<int32_t>();
  const float neg_inf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, rows.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* row = data + row_ids[i] * stride;
      const int32_t* mask = masks + i * words;
      for (int64_t w = 0; w * 32 < vocab; ++w) {
        const uint32_t bits = static_cast<uint32_t>(mask[w]);
        if (bits == 0xFFFFFFFFu) continue;
        float* out = row + w * 32;
        const int64_t width = std::min<int64_t>(32, vocab - w * 32);
        if (bits == 0) {
          for (int64_t b = 0; b < width; ++b) out[b] = neg_inf;
        } else {
          for (int64_t b = 0; b < width; ++b) out[b] = (bits >> b) & 1u ? out[b] : neg_inf;
        }
      }
    }
  });
}
