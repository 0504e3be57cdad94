// y = x @ W^T (+ bias) with W in GGUF's Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 blocks, packed (quant_blocks.h):
// float32 x [M, K], uint8 w [N, K / 32 * block_bytes] in the packed layout, bias float32 [N] or none -> float32
// y [M, N].
//
// llama.cpp's arithmetic with 14-bit activations: x's rows are quantized per block of 32 to a = round(128 t)
// (e = max |x| / 127, t = x / e; llama.cpp's int8 is round(t)), |a| <= 16320, stored in the form this build
// multiplies fastest (quant_activations.h).
// With its sum s, each output is a sum over blocks of exact int32 dot products with the weights' u, in float:
//   y[m, n] = fma(float(sum_j u_j a_j - offset * s), d_w * d_a, y)      then, Q4_1 / Q5_1,  (d_a = e / 128)
//   y[m, n] = fma(float(s), m_w * d_a, y)                               blocks in ascending order,
// then + bias. The integer sums are exact, so the result depends on x's row and W's row alone: it is the same
// bits whatever M is, whichever path (few rows streaming the weights once, many rows reusing a tile from
// cache, quant_lanes.h; or a widened copy of it, quant_tile.h) or thread computes it, and on AVX-512 (VNNI or
// not) and AVX2 alike; quant_linear_reference in scalar.
#include "torch_ops.h"

#include <algorithm>
#include <cmath>

#include "quant_tile.h"

#if SERVAL_SIMD

namespace {

namespace q = serval::quant;
using q::Activations;
using q::Format;
using q::kBlock;
using q::kGroup;
using q::kRows;
using q::kTileRows;
using q::kTileSets;
using q::lane_range;
using q::Problem;

// ---- The scalar reference (and the kernel's rows past the last whole group). ----

template <Format F>
SERVAL_EXACT_ORDER float dot_reference(const Problem& p, const Activations& act, int64_t m, int64_t n) {
  float y = 0.f;
  for (int64_t b = 0; b < act.blocks; ++b) {
    const q::RowBlock rb = q::row_block<F>(p.w, n, b, p.N, p.row_bytes);
    const int8_t* a = act.block(m, b);
    int32_t sum = 0;
    for (int j = 0; j < kBlock; ++j) sum += q::u_at<F>(rb, j) * q::value_at(a, j);
    const float da = act.d[m * act.blocks + b];
    const int32_t s = act.s[m * act.blocks + b];
    y = std::fma(static_cast<float>(sum - q::offset(F) * s), q::half_at(rb.d) * da, y);
    if constexpr (q::has_min(F)) y = std::fma(static_cast<float>(s), q::half_at(rb.m) * da, y);
  }
  return p.bias == nullptr ? y : y + p.bias[n];
}

// ---- The vector kernel: few rows, many rows. ----

template <Format F, int MR>
void few_rows(const Problem& p, const Activations& act, int64_t sets) {
  // Tiles of NV lane sets, about 16 K weights per task: small matrices stay on one thread, where a fork costs more.
  constexpr int NV = q::lane_sets<MR>();
  const int64_t tiles = (sets + NV - 1) / NV, grain = std::max<int64_t>(1, 16384 / (NV * kRows * p.K));
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    lane_range<F, MR>(p, act, 0, begin * NV, std::min(sets, end * NV));
  });
}

// many_rows's task: rows [m_begin, m_end) of x against lane sets [v0, v1), at most kTileSets of them.
template <Format F>
void tile_task(const Problem& p, const Activations& act, q::TileBuffer& buffer, int64_t m_begin, int64_t m_end,
               int64_t v0, int64_t v1) {
  if (m_end - m_begin >= q::wide_rows_from<F>()) {
    if (v1 - v0 == kTileSets) return q::wide_rows<F, kTileSets>(p, act, buffer, m_begin, m_end, v0);
    for (int64_t v = v0; v < v1; ++v) q::wide_rows<F, 1>(p, act, buffer, m_begin, m_end, v);
    return;
  }
  int64_t m = m_begin;
  for (; m + kTileRows <= m_end; m += kTileRows) lane_range<F, kTileRows>(p, act, m, v0, v1);
  for (; m < m_end; ++m) lane_range<F, 1>(p, act, m, v0, v1);
}

template <Format F>
void many_rows(const Problem& p, const Activations& act, int64_t sets) {
  // Tasks are (tile of lane sets, chunk of up to about 256 rows of x): the tile's weights stay in cache for the
  // chunk. The chunks are of one size (whole tiles of rows), so that the threads' equal shares of the tasks are
  // equal work: 257 rows as 256 + 1 left one thread all of it.
  constexpr int NV = kTileSets;
  const int64_t parts = (p.M + 255) / 256;
  const int64_t chunk = ((p.M + parts - 1) / parts + kTileRows - 1) / kTileRows * kTileRows;
  const int64_t tiles = (sets + NV - 1) / NV, chunks = (p.M + chunk - 1) / chunk;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / (NV * kRows * p.K * std::min(p.M, chunk)));
  at::parallel_for(0, tiles * chunks, grain, [&](int64_t begin, int64_t end) {
    q::TileBuffer buffer;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t v0 = task % tiles * NV, m_begin = task / tiles * chunk;
      tile_task<F>(p, act, buffer, m_begin, std::min(p.M, m_begin + chunk), v0, std::min(sets, v0 + NV));
    }
  });
}

template <Format F>
void kernel_rows(const Problem& p) {
  const Activations act = q::quantize_rows(p.x, p.M, p.K, false);
  const int64_t sets = p.N / kGroup * kGroup / kRows;
  switch (p.M) {
    case 1: few_rows<F, 1>(p, act, sets); break;
    case 2: few_rows<F, 2>(p, act, sets); break;
    case 3: few_rows<F, 3>(p, act, sets); break;
    case 4: few_rows<F, 4>(p, act, sets); break;
    default: many_rows<F>(p, act, sets);
  }
  for (int64_t m = 0; m < p.M; ++m)
    for (int64_t n = sets * kRows; n < p.N; ++n) p.y[m * p.N + n] = dot_reference<F>(p, act, m, n);
}

template <Format F>
void reference_rows(const Problem& p) {
  const Activations act = q::quantize_rows(p.x, p.M, p.K, true);
  for (int64_t m = 0; m < p.M; ++m)
    for (int64_t n = 0; n < p.N; ++n) p.y[m * p.N + n] = dot_reference<F>(p, act, m, n);
}

// ---- Checks and dispatch shared by the op and its reference. ----

struct Operands {
  torch::Tensor x, w, bias, y;
  Problem problem;
};

Operands operands(torch::Tensor x, torch::Tensor w, int64_t qtype, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(0 <= qtype && qtype <= 4,
              "qtype is a kernel_id: 0 (Q8_0), 1 (Q4_0), 2 (Q4_1), 3 (Q5_0) or 4 (Q5_1); got ", qtype);
  const auto format = static_cast<Format>(qtype);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "float32 x [M, K] expected");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8, "uint8 w [N, row_bytes] expected");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(K % kBlock == 0 && w.size(1) == K / kBlock * q::block_bytes(format),
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
  if (p.M == 0 || p.N == 0) return;
  switch (static_cast<Format>(qtype)) {
    case Format::kQ8_0: return Runner<Format::kQ8_0>::run(p);
    case Format::kQ4_0: return Runner<Format::kQ4_0>::run(p);
    case Format::kQ4_1: return Runner<Format::kQ4_1>::run(p);
    case Format::kQ5_0: return Runner<Format::kQ5_0>::run(p);
    case Format::kQ5_1: return Runner<Format::kQ5_1>::run(p);
  }
}

template <Format F>
struct Kernel {
  static void run(const Problem& p) { kernel_rows<F>(p); }
};
template <Format F>
struct Reference {
  static void run(const Problem& p) { reference_rows<F>(p); }
};

}  // namespace

// The K-quants (qtype 10 .. 12: super-blocks of 256) are kquant_linear.cpp's, under this op's contract.
torch::Tensor kquant_linear(torch::Tensor x, torch::Tensor w, int64_t qtype, c10::optional<torch::Tensor> bias,
                            bool reference);
constexpr bool is_kquant(int64_t qtype) { return 10 <= qtype && qtype <= 12; }

torch::Tensor quant_linear(torch::Tensor x, torch::Tensor w, int64_t qtype, c10::optional<torch::Tensor> bias) {
  if (is_kquant(qtype)) return kquant_linear(x, w, qtype, bias, false);
  Operands o = operands(x, w, qtype, bias);
  dispatch<Kernel>(qtype, o.problem);
  return o.y;
}

torch::Tensor quant_linear_reference(torch::Tensor x, torch::Tensor w, int64_t qtype,
                                     c10::optional<torch::Tensor> bias) {
  if (is_kquant(qtype)) return kquant_linear(x, w, qtype, bias, true);
  Operands o = operands(x, w, qtype, bias);
  dispatch<Reference>(qtype, o.problem);
  return o.y;
}

#endif  // SERVAL_SIMD
