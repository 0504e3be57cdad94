// y = x @ w^T (+ bias) for a few rows of x: a speculative step's 1 + k tokens, a short prompt, a small
// decode batch. float32 x [M, K] with 2 <= M <= kMaxRows, w [N, K] (rows contiguous), bias [N] or none
// -> y [M, N].
//
// Why: on AVX2, MKL's sgemm at 2-8 rows takes several times the time of its one-row GEMV, so verifying
// 4 drafts cost several decode steps. Here each weight row
// is read once for all M rows, so the cost stays that of a GEMV (memory-bound on w). Output columns are
// split across threads. Accumulation order differs from MKL's: results agree to float32 rounding.
#include "torch_ops.h"

#include "vec.h"

#if SERVAL_SIMD

namespace {

namespace simd = serval::simd;

constexpr int64_t kMaxRows = 8;

// Output columns [n, n + R) for all M rows: R * M independent accumulators (the FMA chains overlap), each x
// vector loaded once for the R weight rows. Every y[m, n] sums its products in the same order whatever M and R
// are, so a row's result does not depend on how many rows (or which block) it is computed with.
template <int M, int R>
inline void column_block(const float* x, const float* w, const float* bias, float* y, int64_t K, int64_t N,
                         int64_t n) {
  simd::vfloat acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = simd::set1(0.f);
  int64_t k = 0;
  for (; k + simd::kLanes <= K; k += simd::kLanes) {
    simd::vfloat wv[R];
    for (int r = 0; r < R; ++r) wv[r] = simd::load(w + (n + r) * K + k);
    for (int m = 0; m < M; ++m) {
      const simd::vfloat xv = simd::load(x + m * K + k);
      for (int r = 0; r < R; ++r) acc[m][r] = simd::fmadd(xv, wv[r], acc[m][r]);
    }
  }
  if (k < K) {  // the tail: lanes past K read 0
    simd::vfloat wv[R];
    for (int r = 0; r < R; ++r) wv[r] = simd::load(w + (n + r) * K + k, K - k);
    for (int m = 0; m < M; ++m) {
      const simd::vfloat xv = simd::load(x + m * K + k, K - k);
      for (int r = 0; r < R; ++r) acc[m][r] = simd::fmadd(xv, wv[r], acc[m][r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const float b = bias == nullptr ? 0.f : bias[n + r];
    for (int m = 0; m < M; ++m) y[m * N + n + r] = simd::reduce_add(acc[m][r]) + b;
  }
}

template <int M>
void columns(const float* x, const float* w, const float* bias, float* y, int64_t K, int64_t N, int64_t begin,
             int64_t end) {
  // Up to 8 accumulators in flight: 4 weight rows at a time for 1-2 rows of x, 2 for 3-4, one beyond.
  constexpr int R = M <= 2 ? 4 : (M <= 4 ? 2 : 1);
  int64_t n = begin;
  for (; n + R <= end; n += R) column_block<M, R>(x, w, bias, y, K, N, n);
  for (; n < end; ++n) column_block<M, 1>(x, w, bias, y, K, N, n);
}

template <int M>
void run(const float* x, const float* w, const float* bias, float* y, int64_t K, int64_t N) {
  // About 64 KiB of weights per task: small matrices stay on one thread, where a fork costs more.
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(K, 1));
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) { columns<M>(x, w, bias, y, K, N, begin, end); });
}

}  // namespace

torch::Tensor skinny_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x [M, K] and w [N, K] expected");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && w.scalar_type() == torch::kFloat32, "float32 x and w expected");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(1 <= M && M <= kMaxRows, "skinny_linear takes 1 to ", kMaxRows, " rows, got ", M);
  x = x.contiguous();
  w = w.contiguous();
  const float* b = nullptr;
  torch::Tensor bias_c;
  if (bias.has_value() && bias->defined()) {
    bias_c = bias->to(torch::kFloat32).contiguous();
    TORCH_CHECK(bias_c.numel() == N, "bias [N] expected");
    b = bias_c.data_ptr<float>();
  }
  auto y = torch::empty({M, N}, x.options());
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  switch (M) {
    case 1: run<1>(xp, wp, b, yp, K, N); break;
    case 2: run<2>(xp, wp, b, yp, K, N); break;
    case 3: run<3>(xp, wp, b, yp, K, N); break;
    case 4: run<4>(xp, wp, b, yp, K, N); break;
    case 5: run<5>(xp, wp, b, yp, K, N); break;
    case 6: run<6>(xp, wp, b, yp, K, N); break;
    case 7: run<7>(xp, wp, b, yp, K, N); break;
    default: run<8>(xp, wp, b, yp, K, N); break;
  }
  return y;
}

#endif  // SERVAL_SIMD
