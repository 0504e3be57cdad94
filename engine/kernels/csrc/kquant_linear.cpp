// y = x @ W^T (+ bias) with W in GGUF's K-quants (Q4_K, Q5_K, Q6_K: kquant_blocks.h), packed: quant_linear's
// contract (quant_linear.cpp) for qtype 10, 11, 12. x's rows are quantized per 32-weight block as there
// (quant_activations.h: a = round(128 t), scale d_a = e / 128, sum s); each block b of a super-block then adds,
// in float, blocks in ascending order:
//   Q4_K, Q5_K:  y = fma(float(sum_j u_j a_j), (d sc_b) d_a, y);  y = fma(-float(s), (dmin m_b) d_a, y)
//   Q6_K:        y = fma(float(sc_2b sum_{j<16} (u_j - 32) a_j + sc_2b+1 sum_{j>=16} (u_j - 32) a_j), d d_a, y)
// then + bias. d sc_b and dmin m_b are exact in float (11 by 6 bits), the integer sums exact (Q6_K's below 2^31:
// 32 * 32 * 128 * 16320), so a row's result depends on x's row and W's row alone: the same bits for any M, path,
// thread or ISA build, and as kquant_linear_reference's scalar code.
#include "torch_ops.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "kquant_tile.h"

#if SERVAL_SIMD

namespace {

namespace q = serval::quant;
namespace k = serval::kquant;
using k::KFormat;
using q::Activations;
using q::kGroup;
using q::kRows;
using q::Problem;
using serval::simd::vfloat;
namespace simd = serval::simd;

// ---- The scalar reference (and the kernel's rows past the last whole group). ----

template <KFormat F>
SERVAL_EXACT_ORDER float block_reference(const k::RowSuper& rs, const int8_t* a, float da, int32_t s, int b, float y) {
  using Fl = k::Fields<F>;
  if constexpr (F == KFormat::kQ6_K) {
    int32_t sum = 0;
    for (int h = 0; h < 2; ++h) {
      int32_t part = 0;
      for (int j = 16 * h; j < 16 * h + 16; ++j) part += (k::u_at<F>(rs, b, j) - 32) * q::value_at(a, j);
      sum += k::q6_scale(rs, 2 * b + h) * part;
    }
    return std::fma(static_cast<float>(sum), rs.half(Fl::d) * da, y);
  } else {
    int sc, m;
    k::scale_min<F>(rs, b, &sc, &m);
    int32_t sum = 0;
    for (int j = 0; j < q::kBlock; ++j) sum += k::u_at<F>(rs, b, j) * q::value_at(a, j);
    y = std::fma(static_cast<float>(sum), rs.half(Fl::d) * static_cast<float>(sc) * da, y);
    return std::fma(-static_cast<float>(s), rs.half(Fl::dmin) * static_cast<float>(m) * da, y);
  }
}

template <KFormat F>
SERVAL_EXACT_ORDER float dot_reference(const Problem& p, const Activations& act, int64_t m, int64_t n) {
  float y = 0.f;
  for (int64_t sb = 0; sb < p.K / k::kSuper; ++sb) {
    const k::RowSuper rs = k::row_super<F>(p.w, n, sb, p.N, p.row_bytes);
    for (int b = 0; b < k::kBlocks; ++b) {
      const int64_t block = sb * k::kBlocks + b, i = m * act.blocks + block;
      y = block_reference<F>(rs, act.block(m, block), act.d[i], act.s[i], b, y);
    }
  }
  return p.bias == nullptr ? y : y + p.bias[n];
}

// ---- The vector micro-kernel: one block b of super-block sb. ----

template <KFormat F, int B, int MR, int NV>
inline void q45_block(const k::KLanes<F, NV>& L, const k::RowBlocks<MR>& rows, int64_t sb,
                      const q::vint (&dw)[NV][3], const vfloat (&d)[NV], const vfloat (&dmin)[NV],
                      vfloat (&y)[MR][NV]) {
  k::Acc acc[MR][NV];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) k::clear(acc[m][v]);
  for (int c = 0; c < 8; ++c)
    for (int v = 0; v < NV; ++v) {
      const k::Quads w = k::prepare(k::quants<F, B>(L, v, sb, c));
      for (int m = 0; m < MR; ++m) k::dot_chunk(acc[m][v], w, rows.a[m], c);
    }
  for (int v = 0; v < NV; ++v) {
    q::vint sc, mn;
    k::scale_min(dw[v], B, &sc, &mn);
    vfloat ds = simd::mul(d[v], q::to_float(sc)), dm = simd::mul(dmin[v], q::to_float(mn));
    // (d sc) d_a as the reference rounds it: the module's -fassociative-math would fold the products otherwise.
    asm("" : "+v"(ds), "+v"(dm));
    for (int m = 0; m < MR; ++m) {
      y[m][v] = simd::fmadd(q::to_float(k::finish<0>(acc[m][v], 0)), simd::mul(ds, rows.da[m]), y[m][v]);
      y[m][v] = k::fnmadd(simd::set1(static_cast<float>(rows.s[m])), simd::mul(dm, rows.da[m]), y[m][v]);
    }
  }
}

template <int B, int MR, int NV>
inline void q6_block(const k::KLanes<KFormat::kQ6_K, NV>& L, const k::RowBlocks<MR>& rows, int64_t sb,
                     const vfloat (&d)[NV], vfloat (&y)[MR][NV]) {
  q::vint sum[MR][NV];
  // Unrolled whole, as q45_block's loops are by the compiler's own choice: rolled, the accumulators live on the
  // stack (the step was 4x Q4_K's time for 1.5x its bytes).
#pragma GCC unroll 2
  for (int h = 0; h < 2; ++h) {
    k::Acc acc[MR][NV];
    for (int m = 0; m < MR; ++m)
      for (int v = 0; v < NV; ++v) k::clear(acc[m][v]);
#pragma GCC unroll 4
    for (int c = 4 * h; c < 4 * h + 4; ++c)
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) {
        const k::Quads w = k::prepare(k::quants<KFormat::kQ6_K, B>(L, v, sb, c));
        for (int m = 0; m < MR; ++m) k::dot_chunk(acc[m][v], w, rows.a[m], c);
      }
    for (int v = 0; v < NV; ++v) {
      const q::vint sc = k::q6_scale(L, v, sb, 2 * B + h);
      for (int m = 0; m < MR; ++m) {
        const int32_t a_sum = h == 0 ? rows.first_half[m] : rows.s[m] - rows.first_half[m];
        const q::vint part = k::mul32(k::finish<32>(acc[m][v], a_sum), sc);
        sum[m][v] = h == 0 ? part : k::add32(sum[m][v], part);
      }
    }
  }
  for (int v = 0; v < NV; ++v)
    for (int m = 0; m < MR; ++m)
      y[m][v] = simd::fmadd(q::to_float(sum[m][v]), simd::mul(d[v], rows.da[m]), y[m][v]);
}

// y[m0 .. m0 + MR, n0 .. n0 + NV * kRows) (+ bias).
template <KFormat F, int MR, int NV>
void micro(const Problem& p, const Activations& act, const int32_t* halves, int64_t m0, int64_t n0) {
  using Fl = k::Fields<F>;
  const k::KLanes<F, NV> L(p, n0);
  vfloat y[MR][NV];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) y[m][v] = simd::set1(0.f);
  for (int64_t sb = 0; sb < p.K / k::kSuper; ++sb) {
    const auto rows_of = [&](int b) { return k::RowBlocks<MR>(act, halves, m0, sb * k::kBlocks + b); };
    vfloat d[NV], dmin[NV];
    q::vint dw[NV][3];
    for (int v = 0; v < NV; ++v) {
      d[v] = L.half(v, sb, Fl::d);
      if constexpr (F != KFormat::kQ6_K) {
        dmin[v] = L.half(v, sb, Fl::dmin);
        for (int i = 0; i < 3; ++i) dw[v][i] = L.chunk(v, sb, Fl::scales, i);
      }
    }
    k::for_blocks([&](auto b) {  // the block's index a compile-time constant: its bits are shifts by immediates
      constexpr int B = decltype(b)::value;
      if constexpr (F == KFormat::kQ6_K) q6_block<B, MR, NV>(L, rows_of(B), sb, d, y);
      else q45_block<F, B, MR, NV>(L, rows_of(B), sb, dw, d, dmin, y);
    });
  }
  q::store_rows<MR, NV>(p, m0, n0, y);
}

// ---- Scheduling: few rows stream the weights once; many rows reuse a tile of them from cache. ----

// Q6_K (its u - 32 by the offset): each block's sum of its first 16 activations.
template <KFormat F>
std::vector<int32_t> first_halves(const Activations& act, int64_t M) {
  if (F != KFormat::kQ6_K) return {};
  std::vector<int32_t> sums(M * act.blocks);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < act.blocks; ++b) {
      int32_t s = 0;
      for (int j = 0; j < 16; ++j) s += q::value_at(act.block(m, b), j);
      sums[m * act.blocks + b] = s;
    }
  return sums;
}

// Lane sets per micro-kernel: MR x NV pairs of int32 accumulators and NV floats per row stay in the registers;
// Q6_K's on VNNI with its sub-block sums beside them: at 4 rows one lane set (4 x 2 spilled: 1.5-2.5x the time).
template <KFormat F, int MR>
constexpr int lane_sets() {
  if constexpr (simd::kRegisters != 32) return MR == 1 ? 2 : 1;
  if constexpr (F == KFormat::kQ6_K && SERVAL_QUANT_DIGITS && MR >= 4) return 1;
  return MR == 1 ? 4 : 2;
}
constexpr int kTileRows = simd::kRegisters == 32 ? 4 : 2;  // MR for many rows of x

template <KFormat F, int MR>
void lane_range(const Problem& p, const Activations& act, const int32_t* halves, int64_t m0, int64_t v_begin,
                int64_t v_end) {
  constexpr int NV = lane_sets<F, MR>();
  int64_t v = v_begin;
  for (; v + NV <= v_end; v += NV) micro<F, MR, NV>(p, act, halves, m0, v * kRows);
  for (; v < v_end; ++v) micro<F, MR, 1>(p, act, halves, m0, v * kRows);
}

template <KFormat F, int MR>
void few_rows(const Problem& p, const Activations& act, const int32_t* halves, int64_t sets) {
  constexpr int NV = lane_sets<F, MR>();  // tiles of about 16 K weights a task at least
  const int64_t tiles = (sets + NV - 1) / NV, grain = std::max<int64_t>(1, 16384 / (NV * kRows * p.K));
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    lane_range<F, MR>(p, act, halves, 0, begin * NV, std::min(sets, end * NV));
  });
}

// Many rows: from this many, a task's lane sets are unpacked once (kquant_tile.h), where the format has a tile.
constexpr int64_t kWideRowsFrom = SERVAL_QUANT_DIGITS ? 16 : 8;

// Rows [m_begin, m_end) of x against lane sets [v0, v1): through an unpacked tile, else the micro-kernel,
// kTileRows rows at a time.
template <KFormat F>
void tile_task(const Problem& p, const Activations& act, const int32_t* halves, q::TileBuffer& buffer,
               int64_t m_begin, int64_t m_end, int64_t v0, int64_t v1) {
  if constexpr (k::has_tile<F>())
    if (m_end - m_begin >= kWideRowsFrom) {
      if (v1 - v0 == q::kTileSets)
        return q::tile_rows<q::kTileSets>(p, act, k::KWideTile<F, q::kTileSets>(buffer, p, v0 * kRows), m_begin,
                                          m_end, v0 * kRows);
      for (int64_t v = v0; v < v1; ++v)
        q::tile_rows<1>(p, act, k::KWideTile<F, 1>(buffer, p, v * kRows), m_begin, m_end, v * kRows);
      return;
    }
  int64_t m = m_begin;
  for (; m + kTileRows <= m_end; m += kTileRows) lane_range<F, kTileRows>(p, act, halves, m, v0, v1);
  for (; m < m_end; ++m) lane_range<F, 1>(p, act, halves, m, v0, v1);
}

template <KFormat F>
void many_rows(const Problem& p, const Activations& act, const int32_t* halves, int64_t sets) {
  // Tasks (tile of NV lane sets, chunk of up to about 256 rows of x), the chunks of one size: quant_linear.cpp's.
  constexpr int NV = SERVAL_QUANT_DIGITS ? lane_sets<F, kTileRows>() : q::kTileSets;
  const int64_t parts = (p.M + 255) / 256;
  const int64_t chunk = ((p.M + parts - 1) / parts + kTileRows - 1) / kTileRows * kTileRows;
  const int64_t tiles = (sets + NV - 1) / NV, chunks = (p.M + chunk - 1) / chunk;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / (NV * kRows * p.K * std::min(p.M, chunk)));
  at::parallel_for(0, tiles * chunks, grain, [&](int64_t begin, int64_t end) {
    q::TileBuffer buffer;  // allocated by the first widened tile, if any
    for (int64_t task = begin; task < end; ++task) {
      const int64_t v0 = task % tiles * NV, m_begin = task / tiles * chunk;
      tile_task<F>(p, act, halves, buffer, m_begin, std::min(p.M, m_begin + chunk), v0, std::min(sets, v0 + NV));
    }
  });
}

template <KFormat F>
void run(const Problem& p, bool reference) {
  const Activations act = q::quantize_rows(p.x, p.M, p.K, reference);
  const int64_t sets = reference ? 0 : p.N / kGroup * kGroup / kRows;
  const std::vector<int32_t> sums = reference ? std::vector<int32_t>() : first_halves<F>(act, p.M);
  const int32_t* halves = sums.empty() ? nullptr : sums.data();
  if (sets > 0) {
    switch (p.M) {
      case 1: few_rows<F, 1>(p, act, halves, sets); break;
      case 2: few_rows<F, 2>(p, act, halves, sets); break;
      case 3: few_rows<F, 3>(p, act, halves, sets); break;
      case 4: few_rows<F, 4>(p, act, halves, sets); break;
      default: many_rows<F>(p, act, halves, sets);
    }
  }
  for (int64_t m = 0; m < p.M; ++m)
    for (int64_t n = sets * kRows; n < p.N; ++n) p.y[m * p.N + n] = dot_reference<F>(p, act, m, n);
}

}  // namespace

torch::Tensor kquant_linear(torch::Tensor x, torch::Tensor w, int64_t qtype, c10::optional<torch::Tensor> bias,
                            bool reference) {
  TORCH_CHECK(k::is_kquant(qtype), "kquant_linear: qtype 10 (Q4_K), 11 (Q5_K) or 12 (Q6_K) expected, got ", qtype);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "float32 x [M, K] expected");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8, "uint8 w [N, row_bytes] expected");
  const auto format = static_cast<KFormat>(qtype);
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(K % k::kSuper == 0 && w.size(1) == K / k::kSuper * k::block_bytes(format), "w's rows must hold K = ",
              K, " weights in super-blocks of 256 of this format; got ", w.size(1), " bytes");
  const torch::Tensor xc = x.contiguous(), wc = w.contiguous();
  torch::Tensor b, y = torch::empty({M, N}, x.options());
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->numel() == N, "float32 bias [N] expected");
    b = bias->contiguous();
  }
  const Problem p{xc.data_ptr<float>(), wc.data_ptr<uint8_t>(), b.defined() ? b.data_ptr<float>() : nullptr,
                  y.data_ptr<float>(), M, K, N, w.size(1)};
  if (M == 0 || N == 0) return y;
  switch (format) {
    case KFormat::kQ4_K: run<KFormat::kQ4_K>(p, reference); break;
    case KFormat::kQ5_K: run<KFormat::kQ5_K>(p, reference); break;
    case KFormat::kQ6_K: run<KFormat::kQ6_K>(p, reference); break;
  }
  return y;
}

#endif  // SERVAL_SIMD
