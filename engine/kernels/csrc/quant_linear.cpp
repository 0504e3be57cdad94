// y = x @ dequantize(w)^T (+ bias) with w kept in GGUF's Q8_0 / Q4_0 / Q4_1 blocks (quant_blocks.h): float32
// x [M, K], uint8 w [N, K / 32 * block_bytes], bias float32 [N] or none -> float32 y [M, N].
//
// Activations stay float32; the weights are widened to float in registers (few rows of x: each block is read
// once for all of them, so a decode step costs what reading the quantized bytes costs) or, for many rows, into
// a tile of float rows small enough to stay in L1 and reused by every row of x (a register-blocked float
// product then, the widening paid once per tile).
//
// Batch-invariant, bit for bit: every y[m, n] is accumulated the same way whatever M is and whichever path
// or thread computes it. Lane l of one vector accumulator takes x[m, k] * w[n, k] for k = l, l + kLanes, ...
// in ascending k (one fused multiply-add each), its lanes are summed by simd::transpose_sum's fixed tree,
// then the bias is added. quant_linear_reference does exactly that in scalar code.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "quant_blocks.h"

#if SERVAL_SIMD

namespace {

namespace simd = serval::simd;
using serval::quant::Format;
using serval::quant::kBlock;
using serval::quant::kChunks;

struct Problem {
  const float* x;
  const uint8_t* w;
  const float* bias;  // nullptr: none
  float* y;
  int64_t M, K, N, row_bytes;
};

// Rows of x up to which the weights are widened in registers; past it, into a tile.
constexpr int64_t kRegisterRows = 4;
constexpr int64_t kPrefetchGroups = 4;  // measured best of 0, 2, 4 (bench_quant_linear.py, M = 1)

// Vectors of accumulators for M x R outputs: whole vectors of sums.
template <int M, int R>
constexpr int64_t accumulators() {
  return (M * R + simd::kLanes - 1) / simd::kLanes * simd::kLanes;
}

// Sums the lanes of acc[0 .. M * R) (a vector of sums at a time; the rest of the last is overwritten) and stores
// y[m0 + m, n + r] (+ bias).
template <int M, int R>
inline void store_sums(const Problem& p, simd::vfloat* acc, int64_t m0, int64_t n) {
  constexpr int kOutputs = M * R, kVectors = accumulators<M, R>() / simd::kLanes;
  for (int i = kOutputs; i < kVectors * simd::kLanes; ++i) acc[i] = simd::set1(0.f);
  alignas(64) float sums[kVectors * simd::kLanes];
  for (int v = 0; v < kVectors; ++v) simd::store(sums + v * simd::kLanes, simd::transpose_sum(acc + v * simd::kLanes));
  // Two loops rather than a test per output: each row's R sums then go out as one short vector.
  if (p.bias == nullptr) {
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < R; ++r) p.y[(m0 + m) * p.N + n + r] = sums[m * R + r];
  } else {
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < R; ++r) p.y[(m0 + m) * p.N + n + r] = sums[m * R + r] + p.bias[n + r];
  }
}

// Few rows: y[m0 .. m0 + M, n .. n + R), each block widened in registers and used by the M rows.
template <Format F, int M, int R>
inline void register_block(const Problem& p, int64_t m0, int64_t n) {
  simd::vfloat acc[accumulators<M, R>()];
  for (int i = 0; i < M * R; ++i) acc[i] = simd::set1(0.f);
  const int64_t bb = serval::quant::block_bytes(F), blocks = p.K / kBlock;
  // The weight rows kPrefetchGroups blocks of rows ahead, a few cache lines per step: R rows read side by side
  // are more streams than the hardware prefetcher follows well (a prefetch past the end is harmless).
  const char* ahead = reinterpret_cast<const char*>(p.w + (n + kPrefetchGroups * R) * p.row_bytes);
  const int64_t lines = (R * p.row_bytes + 63) / 64, per_step = (lines + blocks - 1) / blocks;
  for (int64_t b = 0; b < blocks; ++b) {
    for (int64_t i = b * per_step; i < (b + 1) * per_step; ++i) _mm_prefetch(ahead + 64 * i, _MM_HINT_T0);
    simd::vfloat xv[M][kChunks];
    for (int m = 0; m < M; ++m)
      for (int c = 0; c < kChunks; ++c) xv[m][c] = simd::load(p.x + (m0 + m) * p.K + b * kBlock + c * simd::kLanes);
    for (int r = 0; r < R; ++r) {
      simd::vfloat wv[kChunks];
      serval::quant::widen<F>(p.w + (n + r) * p.row_bytes + b * bb, wv);
      for (int c = 0; c < kChunks; ++c)
        for (int m = 0; m < M; ++m) acc[m * R + r] = simd::fmadd(xv[m][c], wv[c], acc[m * R + r]);
    }
  }
  store_sums<M, R>(p, acc, m0, n);
}

// Weight rows per register block: M * R accumulators, at most one vector of sums.
template <int M>
constexpr int register_block_rows() {
  return M == 1 ? 8 : static_cast<int>(simd::kLanes / M);
}

template <Format F, int M>
void register_rows(const Problem& p) {
  constexpr int R = register_block_rows<M>();
  // About 16 K weights per task: small matrices stay on one thread, where a fork costs more.
  const int64_t grain = std::max<int64_t>(R, 16384 / p.K);
  at::parallel_for(0, p.N, grain, [&](int64_t begin, int64_t end) {
    int64_t n = begin;
    for (; n + R <= end; n += R) register_block<F, M, R>(p, 0, n);
    for (; n < end; ++n) register_block<F, M, 1>(p, 0, n);
  });
}

// Many rows: a tile of weight rows is widened into `tile` [rows, K] once, then multiplied by rows of x in
// blocks of kTileM x kTileR outputs: 6 x 4 with AVX-512's 32 registers (24 accumulators, 6 rows of x, a weight
// vector), 4 x 2 with AVX2's 16 (bench_quant_linear.py chose them among 2 x 8, 4 x 4, 4 x 6, 6 x 4, 8 x 3).
constexpr int kTileM = simd::kRegisters == 32 ? 6 : 4;
constexpr int kTileR = simd::kRegisters == 32 ? 4 : 2;

template <Format F>
void widen_rows(const Problem& p, int64_t n0, int64_t rows, float* tile) {
  const int64_t bb = serval::quant::block_bytes(F);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < p.K / kBlock; ++b) {
      simd::vfloat wv[kChunks];
      serval::quant::widen<F>(p.w + (n0 + r) * p.row_bytes + b * bb, wv);
      for (int c = 0; c < kChunks; ++c) simd::store(tile + r * p.K + b * kBlock + c * simd::kLanes, wv[c]);
    }
}

// y[m0 .. m0 + M, n0 + r0 .. n0 + r0 + R) from the widened tile of rows n0 ...
template <int M, int R>
inline void tile_block(const Problem& p, const float* tile, int64_t m0, int64_t n0, int64_t r0) {
  simd::vfloat acc[accumulators<M, R>()];
  for (int i = 0; i < M * R; ++i) acc[i] = simd::set1(0.f);
  for (int64_t k = 0; k < p.K; k += simd::kLanes) {
    simd::vfloat xv[M];
    for (int m = 0; m < M; ++m) xv[m] = simd::load(p.x + (m0 + m) * p.K + k);
    for (int r = 0; r < R; ++r) {
      const simd::vfloat wv = simd::load(tile + (r0 + r) * p.K + k);
      for (int m = 0; m < M; ++m) acc[m * R + r] = simd::fmadd(xv[m], wv, acc[m * R + r]);
    }
  }
  store_sums<M, R>(p, acc, m0, n0 + r0);
}

// Rows m0 .. m0 + M of x against the whole tile (weight rows n0 .. n0 + rows).
template <int M>
inline void tile_rows(const Problem& p, const float* tile, int64_t m0, int64_t n0, int64_t rows) {
  int64_t r = 0;
  for (; r + kTileR <= rows; r += kTileR) tile_block<M, kTileR>(p, tile, m0, n0, r);
  for (; r < rows; ++r) tile_block<M, 1>(p, tile, m0, n0, r);
}

template <Format F>
void tiled_rows(const Problem& p) {
  // A tile of about 24 KiB of float weights (a whole number of kTileR rows), and chunks of 256 rows of x: the
  // tasks are (tile, chunk) pairs, so a few weight rows and many x rows still keep both threads busy.
  const int64_t tile_rows_n = std::clamp<int64_t>(6144 / p.K / kTileR * kTileR, kTileR, 64);
  const int64_t chunk = 256, tiles = (p.N + tile_rows_n - 1) / tile_rows_n, chunks = (p.M + chunk - 1) / chunk;
  const int64_t task_work = tile_rows_n * p.K * std::min(p.M, chunk);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / task_work);
  at::parallel_for(0, tiles * chunks, grain, [&](int64_t begin, int64_t end) {
    // Cache-line aligned (rows of K floats keep it: K is a multiple of 32): a vector load that straddles two
    // lines costs two.
    std::vector<float> storage(tile_rows_n * p.K + 16);
    float* tile = storage.data() + (16 - reinterpret_cast<uintptr_t>(storage.data()) / sizeof(float) % 16) % 16;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n0 = task % tiles * tile_rows_n, rows = std::min(tile_rows_n, p.N - n0);
      const int64_t m_begin = task / tiles * chunk, m_end = std::min(p.M, m_begin + chunk);
      widen_rows<F>(p, n0, rows, tile);
      int64_t m = m_begin;
      for (; m + kTileM <= m_end; m += kTileM) tile_rows<kTileM>(p, tile, m, n0, rows);
      for (; m < m_end; ++m) tile_rows<1>(p, tile, m, n0, rows);
    }
  });
}

template <Format F>
void quant_linear_rows(const Problem& p) {
  switch (p.M) {
    case 1: return register_rows<F, 1>(p);
    case 2: return register_rows<F, 2>(p);
    case 3: return register_rows<F, 3>(p);
    case 4: return register_rows<F, 4>(p);
    default: return tiled_rows<F>(p);
  }
  static_assert(kRegisterRows == 4, "the cases above are the register rows");
}

// ---- The scalar reference: the same products, accumulations and sums, one float at a time. ----
// Compiled without reassociation (the module is built with -fassociative-math): the order written is the
// order computed.

#define SERVAL_EXACT_ORDER __attribute__((optimize("no-associative-math")))

// simd::transpose_sum's tree over one vector's lanes: within each 4-lane group (l0 + l2) + (l1 + l3), then
// the groups pairwise (16 lanes: (g0 + g1) + (g2 + g3)).
SERVAL_EXACT_ORDER float tree_sum(const float* lanes) {
  float groups[simd::kLanes / 4];
  for (int g = 0; g < simd::kLanes / 4; ++g) {
    const float* l = lanes + 4 * g;
    groups[g] = (l[0] + l[2]) + (l[1] + l[3]);
  }
  if constexpr (simd::kLanes == 16) return (groups[0] + groups[1]) + (groups[2] + groups[3]);
  return groups[0] + groups[1];
}

template <Format F>
SERVAL_EXACT_ORDER void reference_rows(const Problem& p) {
  const int64_t bb = serval::quant::block_bytes(F);
  for (int64_t m = 0; m < p.M; ++m)
    for (int64_t n = 0; n < p.N; ++n) {
      float acc[simd::kLanes] = {};
      for (int64_t k = 0; k < p.K; ++k) {
        const float w = serval::quant::weight_at<F>(p.w + n * p.row_bytes + k / kBlock * bb, k % kBlock);
        acc[k % simd::kLanes] = std::fma(p.x[m * p.K + k], w, acc[k % simd::kLanes]);
      }
      const float s = tree_sum(acc);
      p.y[m * p.N + n] = p.bias == nullptr ? s : s + p.bias[n];
    }
}

// ---- Checks and dispatch shared by the op and its reference. ----

struct Operands {
  torch::Tensor x, w, bias, y;
  Problem problem;
};

Operands operands(torch::Tensor x, torch::Tensor w, int64_t qtype, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(0 <= qtype && qtype <= 2, "qtype is a kernel_id: 0 (Q8_0), 1 (Q4_0) or 2 (Q4_1); got ", qtype);
  const auto format = static_cast<Format>(qtype);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "float32 x [M, K] expected");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8, "uint8 w [N, row_bytes] expected");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(K % kBlock == 0 && w.size(1) == K / kBlock * serval::quant::block_bytes(format),
              "w's rows must hold K = ", K, " weights in blocks of 32 of this format; got ", w.size(1), " bytes");
  Operands o{x.contiguous(), w.contiguous(), torch::Tensor(), torch::empty({M, N}, x.options()), {}};
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->numel() == N, "float32 bias [N] expected");
    o.bias = bias->contiguous();
  }
  o.problem = {o.x.data_ptr<float>(), o.w.data_ptr<uint8_t>(), o.bias.defined() ? o.bias.data_ptr<float>() : nullptr,
               o.y.data_ptr<float>(), M, K, N, w.size(1)};
  return o;
}

template <template <Format> class Runner>
void dispatch(int64_t qtype, const Problem& p) {
  switch (static_cast<Format>(qtype)) {
    case Format::kQ8_0: return Runner<Format::kQ8_0>::run(p);
    case Format::kQ4_0: return Runner<Format::kQ4_0>::run(p);
    case Format::kQ4_1: return Runner<Format::kQ4_1>::run(p);
  }
}

template <Format F>
struct Kernel {
  static void run(const Problem& p) { quant_linear_rows<F>(p); }
};
template <Format F>
struct Reference {
  static void run(const Problem& p) { reference_rows<F>(p); }
};

}  // namespace

torch::Tensor quant_linear(torch::Tensor x, torch::Tensor w, int64_t qtype, c10::optional<torch::Tensor> bias) {
  Operands o = operands(x, w, qtype, bias);
  if (o.problem.M > 0 && o.problem.N > 0) dispatch<Kernel>(qtype, o.problem);
  return o.y;
}

torch::Tensor quant_linear_reference(torch::Tensor x, torch::Tensor w, int64_t qtype,
                                     c10::optional<torch::Tensor> bias) {
  Operands o = operands(x, w, qtype, bias);
  dispatch<Reference>(qtype, o.problem);
  return o.y;
}

#endif  // SERVAL_SIMD
