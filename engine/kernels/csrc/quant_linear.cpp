// y = x @ W^T (+ bias) with W in GGUF's Q8_0 / Q4_0 / Q4_1 blocks, packed (quant_blocks.h): float32 x [M, K],
// uint8 w [N, K / 32 * block_bytes] in the packed layout, bias float32 [N] or none -> float32 y [M, N].
//
// llama.cpp's arithmetic with 14-bit activations: x's rows are quantized per block of 32 to a = round(128 t)
// (e = max |x| / 127, t = x / e; llama.cpp's int8 is round(t)), |a| <= 16320, stored in the form this build
// multiplies fastest (quant_activations.h).
// With its sum s, each output is a sum over blocks of exact int32 dot products with the weights' u, in float:
//   y[m, n] = fma(float(sum_j u_j a_j - offset * s), d_w * d_a, y)      then, Q4_1 only,   (d_a = e / 128)
//   y[m, n] = fma(float(s), m_w * d_a, y)                               blocks in ascending order,
// then + bias. The integer sums are exact, so the result depends on x's row and W's row alone: it is the same
// bits whatever M is, whichever path (few rows streaming the weights once, many rows reusing a tile from
// cache) or thread computes it, and on AVX-512 (VNNI or not) and AVX2 alike; quant_linear_reference in scalar.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <memory>

#include "quant_activations.h"





































#if SERVAL_SIMD

namespace {

namespace simd = serval::simd;
namespace q = serval::quant;
using q::Format;
using q::kBlock;
using q::kGroup;
using q::kRows;
using q::Activations;

struct Problem {
  const float* x;
  const uint8_t* w;
  const float* bias;  // nullptr: none
  float* y;
  int64_t M, K, N, row_bytes;
};

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
    if constexpr (F == Format::kQ4_1) y = std::fma(static_cast<float>(s), q::half_at(rb.m) * da, y);
  }
  return p.bias == nullptr ? y : y + p.bias[n];
}

// ---- The vector kernel. ----

// NV lane sets of kRows weight rows each, from row n0 (a multiple of kRows) inside whole groups: set v's rows
// n0 + v * kRows .. lie in one group, at lane offset `lane[v]` of each 64-byte chunk (4 bytes a row) and of
// the scales (2 bytes a row).
template <Format F, int NV>
struct LaneSets {
  const uint8_t* group[NV];
  int64_t lane[NV];
  LaneSets(const Problem& p, int64_t n0) {
    for (int v = 0; v < NV; ++v) {
      const int64_t n = n0 + v * kRows;
      group[v] = p.w + n / kGroup * kGroup * p.row_bytes;
      lane[v] = n % kGroup;
    }
  }
  // Set v's bytes of block b: its scales d (and Q4_1's mins m after them), then the quant chunks at +header.
  const uint8_t* block(int v, int64_t b) const { return group[v] + b * kGroup * q::block_bytes(F); }
  static constexpr int64_t kHeader = kGroup * q::header_bytes(F);
};

#if SERVAL_QUANT_DIGITS
// acc[m][v] += digit D's (0: h, 1: l) dot products over chunk c (weights 4c .. 4c + 3, and for Q4 16 + 4c ..) for
// x's row m0 + m and lane set v: vpdpbusd on the weights' bytes as they lie.
template <Format F, int MR, int NV, int D>
inline void digit_sums(const LaneSets<F, NV>& sets, const Activations& act, int64_t m0, int64_t b, int c,
                       q::vint (&acc)[MR][NV]) {
  q::vint u[NV];
  for (int v = 0; v < NV; ++v) u[v] = q::load_bytes(sets.block(v, b) + sets.kHeader + 64 * c + 4 * sets.lane[v]);
  for (int m = 0; m < MR; ++m) {
    const int8_t* a = act.block(m0 + m, b) + D * kBlock + 4 * c;
    for (int v = 0; v < NV; ++v) {
      acc[m][v] = q::dot4(acc[m][v], q::quad_bytes<F, 0>(u[v]), q::bcast4(a));
      if constexpr (q::quads(F) == 2) acc[m][v] = q::dot4(acc[m][v], q::quad_bytes<F, 1>(u[v]), q::bcast4(a + 16));
    }
  }
}
#else
// acc[m][v] += quad `Quad`'s dot products over chunk c (weights 16 Quad + 4c .. + 3) for x's row m0 + m and lane set
// v: each lane set's weights widened to int16 pairs once, then two int16-pair multiply-adds a row of x.
template <Format F, int MR, int NV, int Quad>
inline void quad_sums(const LaneSets<F, NV>& sets, const Activations& act, int64_t m0, int64_t b, int c,
                      q::vint (&acc)[MR][NV]) {
  q::vint a_even[MR], a_odd[MR];  // the rows' activations first: then one lane set's weights are live at a time
  for (int m = 0; m < MR; ++m) {
    const int8_t* a = act.block(m0 + m, b) + 2 * (16 * Quad + 4 * c);
    a_even[m] = q::bcast4(a);
    a_odd[m] = q::bcast4(a + 4);
  }
  for (int v = 0; v < NV; ++v) {
    q::vint even, odd;
    q::widen<F, Quad>(q::load_bytes(sets.block(v, b) + sets.kHeader + 64 * c + 4 * sets.lane[v]), &even, &odd);
    for (int m = 0; m < MR; ++m) acc[m][v] = q::dot2(q::dot2(acc[m][v], even, a_even[m]), odd, a_odd[m]);
  }
}
#endif

// acc[m][v] = block b's integer dot products of x's row m0 + m with lane set v's rows (quant_activations.h's forms).
template <Format F, int MR, int NV>
inline void block_sums(const LaneSets<F, NV>& sets, const Activations& act, int64_t m0, int64_t b,
                       q::vint (&acc)[MR][NV]) {
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) acc[m][v] = q::zero();
#if SERVAL_QUANT_DIGITS  // h, then l: two passes over the block (one with two sets of accumulators spills)
  for (int c = 0; c < q::chunks(F); ++c) digit_sums<F, MR, NV, 0>(sets, act, m0, b, c, acc);
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) acc[m][v] = q::shift_left<q::kDigitShift>(acc[m][v]);
  for (int c = 0; c < q::chunks(F); ++c) digit_sums<F, MR, NV, 1>(sets, act, m0, b, c, acc);
#else
  for (int c = 0; c < q::chunks(F); ++c) {
    quad_sums<F, MR, NV, 0>(sets, act, m0, b, c, acc);
    if constexpr (q::quads(F) == 2) quad_sums<F, MR, NV, 1>(sets, act, m0, b, c, acc);
  }
#endif
}

// y[m][v] += block b's sums in float: fma(sum - offset * s, d_w * d_a), then (Q4_1) fma(s, m_w * d_a).
template <Format F, int MR, int NV>
inline void scale_block(const LaneSets<F, NV>& sets, const Activations& act, int64_t m0, int64_t b,
                        const q::vint (&acc)[MR][NV], simd::vfloat (&y)[MR][NV]) {
  simd::vfloat d_w[NV], m_w[NV];  // the weights' scales (Q4_1: and mins), widened once for the MR rows
  for (int v = 0; v < NV; ++v) {
    const uint8_t* scales = sets.block(v, b) + 2 * sets.lane[v];
    d_w[v] = q::halves(scales);
    if constexpr (F == Format::kQ4_1) m_w[v] = q::halves(scales + 2 * kGroup);
  }
  for (int m = 0; m < MR; ++m) {
    const int64_t i = (m0 + m) * act.blocks + b;
    const simd::vfloat da = simd::set1(act.d[i]);
    const q::vint correction = q::set32(q::offset(F) * act.s[i]);
    for (int v = 0; v < NV; ++v) {
      const simd::vfloat sum = q::to_float(q::sub32(acc[m][v], correction));
      y[m][v] = simd::fmadd(sum, simd::mul(d_w[v], da), y[m][v]);
      if constexpr (F == Format::kQ4_1)
        y[m][v] = simd::fmadd(simd::set1(static_cast<float>(act.s[i])), simd::mul(m_w[v], da), y[m][v]);
    }
  }
}

// y[m0 .. m0 + MR, n0 .. n0 + NV * kRows) = acc + bias.
template <int MR, int NV>
inline void store_rows(const Problem& p, int64_t m0, int64_t n0, const simd::vfloat (&y)[MR][NV]) {
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) {
      const int64_t n = n0 + v * kRows;
      const simd::vfloat out = p.bias == nullptr ? y[m][v] : simd::add(y[m][v], simd::load(p.bias + n));
      simd::store(p.y + (m0 + m) * p.N + n, out);
    }
}

// y[m0 .. m0 + MR, n0 .. n0 + NV * kRows), + bias.
template <Format F, int MR, int NV>
inline void micro(const Problem& p, const Activations& act, int64_t m0, int64_t n0) {
  const LaneSets<F, NV> sets(p, n0);
  simd::vfloat y[MR][NV];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) y[m][v] = simd::set1(0.f);
  for (int64_t b = 0; b < act.blocks; ++b) {
    q::vint acc[MR][NV];
    block_sums<F, MR, NV>(sets, act, m0, b, acc);
    scale_block<F, MR, NV>(sets, act, m0, b, acc, y);
  }
  store_rows<MR, NV>(p, m0, n0, y);
}

// Lane sets (kRows weight rows each) per micro-kernel: few rows of x stream the weights (more streams in
// flight); many rows keep MR x NV int32 and float accumulators in the registers.
template <int MR>
constexpr int lane_sets() {
  return MR == 1 && simd::kRegisters == 32 ? 4 : 2;
}
constexpr int kTileRows = simd::kRegisters == 32 ? 4 : 3;  // MR for many rows of x: the fastest measured

#if !SERVAL_QUANT_DIGITS
// The pairs builds' many-rows tile: NV lane sets' weights widened once to signed int16 pairs (q, so no offset
// correction), then read from cache by every row of x: two vpmaddwd and adds a step, nothing unpacked.
// Step s = 0 .. 7 of a block holds weights 4s .. 4s + 3 of each row (Q4: quad s / 4, chunk s % 4), so its
// activations are the block's values 4s .. 4s + 3 for every format.
constexpr int kSteps = kBlock / 4;
constexpr int64_t kWideRows = 24;  // fewer rows of x do not pay for the widening (measured)

// Room for one tile of up to NV lane sets over K: its int16 pairs and its scales (and Q4_1's mins) as float.
// Not zeroed: a tile writes every value it reads.
template <int NV>
struct TileBuffer {
  std::unique_ptr<q::vint[]> pairs;
  std::unique_ptr<float[]> scales;
  explicit TileBuffer(int64_t K)
      : pairs(new q::vint[K / kBlock * kSteps * NV * 2]), scales(new float[K / kBlock * NV * kRows * 2]) {}
};

template <Format F, int NV>
struct WideTile {
  q::vint* pairs;  // [block][step][lane set][even, odd]
  float* d;        // [block][lane set][kRows]: the scales as float
  float* m;        // the same for Q4_1's mins

  template <int Room>
  WideTile(const TileBuffer<Room>& buffer, const Problem& p, int64_t n0)
      : pairs(buffer.pairs.get()), d(buffer.scales.get()), m(d + p.K / kBlock * NV * kRows) {
    static_assert(NV <= Room);
    const LaneSets<F, NV> sets(p, n0);
    for (int64_t b = 0; b < p.K / kBlock; ++b)
      for (int v = 0; v < NV; ++v) {
        const uint8_t* scales = sets.block(v, b) + 2 * sets.lane[v];
        simd::store(d + (b * NV + v) * kRows, q::halves(scales));
        if constexpr (F == Format::kQ4_1) simd::store(m + (b * NV + v) * kRows, q::halves(scales + 2 * kGroup));
        widen_quad<0>(sets, b, v);
        if constexpr (q::quads(F) == 2) widen_quad<1>(sets, b, v);
      }
  }
  template <int Quad>
  void widen_quad(const LaneSets<F, NV>& sets, int64_t b, int v) {
    for (int c = 0; c < q::chunks(F); ++c) {
      q::vint* at = pairs + ((b * kSteps + Quad * 4 + c) * NV + v) * 2;
      q::widen<F, Quad>(q::load_bytes(sets.block(v, b) + sets.kHeader + 64 * c + 4 * sets.lane[v]), at, at + 1);
      at[0] = q::sub16(at[0], q::offset(F));
      at[1] = q::sub16(at[1], q::offset(F));
    }
  }
  const q::vint* block(int64_t b) const { return pairs + b * kSteps * NV * 2; }
};

// y[m0 .. m0 + MR, the tile's rows) from the widened tile; the same sums and fused multiply-adds as micro's.
template <Format F, int MR, int NV>
inline void wide_micro(const Problem& p, const Activations& act, const WideTile<F, NV>& tile, int64_t m0,
                       int64_t n0) {
  simd::vfloat y[MR][NV];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) y[m][v] = simd::set1(0.f);
  for (int64_t b = 0; b < act.blocks; ++b) {
    const q::vint* w = tile.block(b);
    const int8_t* a[MR];
    q::vint acc[MR][NV];
    for (int m = 0; m < MR; ++m) {
      a[m] = act.block(m0 + m, b);
      for (int v = 0; v < NV; ++v) acc[m][v] = q::zero();
    }
#pragma GCC unroll 8
    for (int s = 0; s < kSteps; ++s)
      for (int m = 0; m < MR; ++m) {
        const q::vint a_even = q::bcast4(a[m] + 8 * s), a_odd = q::bcast4(a[m] + 8 * s + 4);
        for (int v = 0; v < NV; ++v) {
          acc[m][v] = q::dot2(q::dot2(acc[m][v], w[(s * NV + v) * 2], a_even), w[(s * NV + v) * 2 + 1], a_odd);
          asm("" : "+x"(acc[m][v]));
        }
      }
    for (int m = 0; m < MR; ++m) {
      const int64_t i = (m0 + m) * act.blocks + b;
      const simd::vfloat da = simd::set1(act.d[i]);
      for (int v = 0; v < NV; ++v) {
        const int64_t at = (b * NV + v) * kRows;
        y[m][v] = simd::fmadd(q::to_float(acc[m][v]), simd::mul(simd::load(tile.d + at), da), y[m][v]);
        if constexpr (F == Format::kQ4_1)
          y[m][v] = simd::fmadd(simd::set1(static_cast<float>(act.s[i])), simd::mul(simd::load(tile.m + at), da),
                                y[m][v]);
      }
    }
  }
  store_rows<MR, NV>(p, m0, n0, y);
}

// Rows [m_begin, m_end) of x against lane sets [v0, v0 + NV), through one widened tile.
template <Format F, int NV, int Room>
void wide_rows(const Problem& p, const Activations& act, const TileBuffer<Room>& buffer, int64_t m_begin,
               int64_t m_end, int64_t v0) {
  const WideTile<F, NV> tile(buffer, p, v0 * kRows);
  int64_t m = m_begin;
  for (; m + kTileRows <= m_end; m += kTileRows) wide_micro<F, kTileRows, NV>(p, act, tile, m, v0 * kRows);
  for (; m < m_end; ++m) wide_micro<F, 1, NV>(p, act, tile, m, v0 * kRows);
}
#endif

// Rows m0 .. m0 + MR of x against lane sets [v_begin, v_end).
template <Format F, int MR>
void lane_range(const Problem& p, const Activations& act, int64_t m0, int64_t v_begin, int64_t v_end) {
  constexpr int NV = lane_sets<MR>();
  int64_t v = v_begin;
  for (; v + NV <= v_end; v += NV) micro<F, MR, NV>(p, act, m0, v * kRows);
  for (; v < v_end; ++v) micro<F, MR, 1>(p, act, m0, v * kRows);
}

template <Format F, int MR>
void few_rows(const Problem& p, const Activations& act, int64_t sets) {
  // Tiles of NV lane sets, about 16 K weights per task: small matrices stay on one thread, where a fork costs more.
  constexpr int NV = lane_sets<MR>();
  const int64_t tiles = (sets + NV - 1) / NV, grain = std::max<int64_t>(1, 16384 / (NV * kRows * p.K));
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    lane_range<F, MR>(p, act, 0, begin * NV, std::min(sets, end * NV));
  });
}

template <Format F>
void many_rows(const Problem& p, const Activations& act, int64_t sets) {
  // Tasks are (tile of lane sets, chunk of up to about 256 rows of x): the tile's weights stay in cache for the
  // chunk. The chunks are of one size (whole tiles of rows), so that the threads' equal shares of the tasks are
  // equal work: 257 rows as 256 + 1 left one thread all of it.
  constexpr int NV = lane_sets<kTileRows>();
  const int64_t parts = (p.M + 255) / 256;
  const int64_t chunk = ((p.M + parts - 1) / parts + kTileRows - 1) / kTileRows * kTileRows;
  const int64_t tiles = (sets + NV - 1) / NV, chunks = (p.M + chunk - 1) / chunk;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / (NV * kRows * p.K * std::min(p.M, chunk)));
  at::parallel_for(0, tiles * chunks, grain, [&](int64_t begin, int64_t end) {
#if !SERVAL_QUANT_DIGITS
    const TileBuffer<NV> buffer(p.K);
#endif
    for (int64_t task = begin; task < end; ++task) {
      const int64_t v0 = task % tiles * NV, v1 = std::min(sets, v0 + NV);
      const int64_t m_begin = task / tiles * chunk, m_end = std::min(p.M, m_begin + chunk);
#if !SERVAL_QUANT_DIGITS
      if (m_end - m_begin >= kWideRows) {
        if (v1 - v0 == NV) wide_rows<F, NV>(p, act, buffer, m_begin, m_end, v0);
        else
          for (int64_t v = v0; v < v1; ++v) wide_rows<F, 1>(p, act, buffer, m_begin, m_end, v);
        continue;
      }
#endif
      int64_t m = m_begin;
      for (; m + kTileRows <= m_end; m += kTileRows) lane_range<F, kTileRows>(p, act, m, v0, v1);
      for (; m < m_end; ++m) lane_range<F, 1>(p, act, m, v0, v1);
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
  TORCH_CHECK(0 <= qtype && qtype <= 2, "qtype is a kernel_id: 0 (Q8_0), 1 (Q4_0) or 2 (Q4_1); got ", qtype);
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

torch::Tensor quant_linear(torch::Tensor x, torch::Tensor w, int64_t qtype, c10::optional<torch::Tensor> bias) {
  Operands o = operands(x, w, qtype, bias);
  dispatch<Kernel>(qtype, o.problem);
  return o.y;
}

torch::Tensor quant_linear_reference(torch::Tensor x, torch::Tensor w, int64_t qtype,
                                     c10::optional<torch::Tensor> bias) {
  Operands o = operands(x, w, qtype, bias);
  dispatch<Reference>(qtype, o.problem);
  return o.y;
}

#endif  // SERVAL_SIMD
