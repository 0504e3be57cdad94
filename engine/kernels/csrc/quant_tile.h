// quant_linear's many-rows path where the weights take work to unpack: a task's tile of NV lane sets is unpacked
// once into cache and every row of x then reads it, nothing unpacked per row (measured in docs/lab-notes.md).
// * The pairs builds (AVX2, AVX-512 without VNNI), where each weight must be an int16 pair before vpmaddwd can
//   use it, every format: the tile widened to signed int16 pairs (q, not u, so no offset correction); two
//   vpmaddwd and two adds a step.
// * VNNI, the 5-bit formats only (vpdpbusd multiplies the other formats' bytes as they lie, or nearly): the tile's
//   bytes u made once (the nibbles with their fifth bits), in Q8_0's order; one vpdpbusd a step and digit.
// The sums are the same exact integers and the float steps quant_lanes.h's, so the same bits.
#pragma once

#include <limits>
#include <memory>

#include "quant_lanes.h"

#if SERVAL_SIMD

namespace serval::quant {

// Step s = 0 .. 7 of a block holds weights 4s .. 4s + 3 of each row (Q4, Q5: quad s / 4, chunk s % 4), so its
// activations are the block's values 4s .. 4s + 3 for every format.
constexpr int kSteps = kBlock / 4;
// The fewest rows of x that pay for unpacking a tile (measured, docs/lab-notes.md); on the pairs builds fewer for
// the 5-bit formats, whose widening costs more; never on VNNI but for the 5-bit formats.
template <Format F>
constexpr int64_t wide_rows_from() {
  if constexpr (SERVAL_QUANT_DIGITS) return has_high_bits(F) ? 16 : std::numeric_limits<int64_t>::max();
  return has_high_bits(F) ? 8 : 24;
}

// Room for a thread's tiles of up to kTileSets lane sets over K: int16 pairs (or bytes, half of it), and the scales
// (and mins) as float. Allocated at the first tile and not zeroed: a tile writes every value it reads.
struct TileBuffer {
  std::unique_ptr<vint[]> pairs;
  std::unique_ptr<float[]> scales;
  void reserve(int64_t K) {
    if (pairs) return;
    pairs.reset(new vint[K / kBlock * kSteps * kTileSets * 2]);
    scales.reset(new float[K / kBlock * kTileSets * kRows * 2]);
  }
};

// Lane set v's scales (and mins) of block b as float, at [block][lane set][kRows] of d (and m).
template <Format F, int NV>
inline void store_scales(const LaneSets<F, NV>& sets, int64_t b, int v, float* d, float* m) {
  const uint8_t* scales = sets.block(v, b) + 2 * sets.lane[v];
  simd::store(d + (b * NV + v) * kRows, halves(scales));
  if constexpr (has_min(F)) simd::store(m + (b * NV + v) * kRows, halves(scales + 2 * kGroup));
}

#if SERVAL_QUANT_DIGITS
// NV lane sets' bytes u from row n0 (the 5-bit formats': nibbles and fifth bits) made into the buffer: step s
// (weights 4s .. 4s + 3) of block b at bytes[(b * kSteps + s) * NV + v].
template <Format F, int NV>
struct ByteTile {
  static constexpr int kOffset = offset(F);  // the bytes are u: wide_micro subtracts offset * s
  static constexpr bool kHasMin = has_min(F);
  vint* bytes;
  float* d;  // [block][lane set][kRows]: the scales as float
  float* m;  // the same for the mins

  ByteTile(TileBuffer& buffer, const Problem& p, int64_t n0) {
    static_assert(NV <= kTileSets);
    buffer.reserve(p.K);
    bytes = buffer.pairs.get(), d = buffer.scales.get(), m = d + p.K / kBlock * NV * kRows;
    const LaneSets<F, NV> sets(p, n0);
    for (int64_t b = 0; b < p.K / kBlock; ++b)
      for (int v = 0; v < NV; ++v) {
        store_scales<F, NV>(sets, b, v, d, m);
        const vint high = sets.high(v, b);
        for_chunks<F>([&](auto c) {
          constexpr int C = decltype(c)::value;
          const vint chunk = sets.chunk(v, b, C);
          bytes[(b * kSteps + C) * NV + v] = quad_bytes<F, 0, C>(chunk, high);
          if constexpr (quads(F) == 2) bytes[(b * kSteps + 4 + C) * NV + v] = quad_bytes<F, 1, C>(chunk, high);
        });
      }
  }
  const vint* block(int64_t b) const { return bytes + b * kSteps * NV; }
};

// acc[m][v] = a block's exact int32 sums of x's row (its stored block a[m], two digits) with lane set v (bytes w).
template <int MR, int NV>
inline void byte_block_sums(const vint* w, const int8_t* const (&a)[MR], vint (&acc)[MR][NV]) {
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) acc[m][v] = zero();
  for (int digit = 0; digit < 2; ++digit) {
    if (digit == 1)
      for (int m = 0; m < MR; ++m)
        for (int v = 0; v < NV; ++v) acc[m][v] = shift_left<kDigitShift>(acc[m][v]);
#pragma GCC unroll 8
    for (int s = 0; s < kSteps; ++s)
      for (int m = 0; m < MR; ++m) {
        const vint a_s = bcast4(a[m] + digit * kBlock + 4 * s);
        for (int v = 0; v < NV; ++v) acc[m][v] = dot4(acc[m][v], w[s * NV + v], a_s);
      }
  }
}
#endif

// NV lane sets' weights from row n0, widened into the buffer.
template <Format F, int NV>
struct WideTile {
  static constexpr int kOffset = 0;  // the pairs are signed q
  static constexpr bool kHasMin = has_min(F);
  vint* pairs;  // [block][step][lane set][even, odd]
  float* d;     // [block][lane set][kRows]: the scales as float
  float* m;     // the same for the mins (Q4_1, Q5_1)

  WideTile(TileBuffer& buffer, const Problem& p, int64_t n0) {
    static_assert(NV <= kTileSets);
    buffer.reserve(p.K);
    pairs = buffer.pairs.get(), d = buffer.scales.get(), m = d + p.K / kBlock * NV * kRows;
    const LaneSets<F, NV> sets(p, n0);
    for (int64_t b = 0; b < p.K / kBlock; ++b)
      for (int v = 0; v < NV; ++v) {
        store_scales<F, NV>(sets, b, v, d, m);
        widen_quad<0>(sets, b, v);
        if constexpr (quads(F) == 2) widen_quad<1>(sets, b, v);
      }
  }
  template <int Quad>
  void widen_quad(const LaneSets<F, NV>& sets, int64_t b, int v) {
    const vint high = sets.high(v, b);
    for_chunks<F>([&](auto c) {
      constexpr int C = decltype(c)::value;
      vint* at = pairs + ((b * kSteps + Quad * 4 + C) * NV + v) * 2;
      widen<F, Quad, C>(sets.chunk(v, b, C), high, at, at + 1);
      at[0] = sub16(at[0], offset(F));
      at[1] = sub16(at[1], offset(F));
    });
  }
  const vint* block(int64_t b) const { return pairs + b * kSteps * NV * 2; }
};

// acc[m][v] = a block's exact int32 sums of x's row (its stored block a[m]) with lane set v (its pairs w).
template <int MR, int NV>
inline void tile_block_sums(const vint* w, const int8_t* const (&a)[MR], vint (&acc)[MR][NV]) {
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) acc[m][v] = zero();
#pragma GCC unroll 8
  for (int s = 0; s < kSteps; ++s)
    for (int m = 0; m < MR; ++m) {
      const vint a_even = bcast4(a[m] + 8 * s), a_odd = bcast4(a[m] + 8 * s + 4);
      for (int v = 0; v < NV; ++v) {
        acc[m][v] = dot2(dot2(acc[m][v], w[(s * NV + v) * 2], a_even), w[(s * NV + v) * 2 + 1], a_odd);
        // One register a sum: unrolled, GCC otherwise reassociates the adds into a tree, runs the multiplies
        // ahead of them and spills their products (a third slower).
        asm("" : "+v"(acc[m][v]));
      }
    }
}

// y[m0 .. m0 + MR, the tile's rows) = x's rows times the tile (+ bias); micro's fused multiply-adds. A Tile has
// `block(b)` (its bytes or pairs), the scales `d` and mins `m` as float at [block][lane set][kRows], `kOffset` (the
// correction offset * s of unsigned bytes) and `kHasMin` (then y += s * m d_a after each block's d term).
template <int MR, int NV, typename Tile>
inline void wide_micro(const Problem& p, const Activations& act, const Tile& tile, int64_t m0, int64_t n0) {
  simd::vfloat y[MR][NV];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) y[m][v] = simd::set1(0.f);
  for (int64_t b = 0; b < act.blocks; ++b) {
    const int8_t* a[MR];
    for (int m = 0; m < MR; ++m) a[m] = act.block(m0 + m, b);
    vint acc[MR][NV];
#if SERVAL_QUANT_DIGITS
    byte_block_sums<MR, NV>(tile.block(b), a, acc);
#else
    tile_block_sums<MR, NV>(tile.block(b), a, acc);
#endif
    for (int m = 0; m < MR; ++m) {
      const int64_t i = (m0 + m) * act.blocks + b;
      const simd::vfloat da = simd::set1(act.d[i]);
      const vint correction = set32(Tile::kOffset * act.s[i]);
      for (int v = 0; v < NV; ++v) {
        const int64_t at = (b * NV + v) * kRows;
        const simd::vfloat sum = to_float(Tile::kOffset != 0 ? sub32(acc[m][v], correction) : acc[m][v]);
        y[m][v] = simd::fmadd(sum, simd::mul(simd::load(tile.d + at), da), y[m][v]);
        if constexpr (Tile::kHasMin)
          y[m][v] = simd::fmadd(simd::set1(static_cast<float>(act.s[i])), simd::mul(simd::load(tile.m + at), da),
                                y[m][v]);
      }
    }
  }
  store_rows<MR, NV>(p, m0, n0, y);
}

// Rows [m_begin, m_end) of x through one unpacked tile of NV lane sets from row n0.
template <int NV, typename Tile>
void tile_rows(const Problem& p, const Activations& act, const Tile& tile, int64_t m_begin, int64_t m_end,
               int64_t n0) {
  int64_t m = m_begin;
  for (; m + kTileRows <= m_end; m += kTileRows) wide_micro<kTileRows, NV>(p, act, tile, m, n0);
  for (; m < m_end; ++m) wide_micro<1, NV>(p, act, tile, m, n0);
}

#if SERVAL_QUANT_DIGITS
template <Format F, int NV>
using Tile = ByteTile<F, NV>;
#else
template <Format F, int NV>
using Tile = WideTile<F, NV>;
#endif

// Rows [m_begin, m_end) of x against lane sets [v0, v0 + NV), through one unpacked tile.
template <Format F, int NV>
void wide_rows(const Problem& p, const Activations& act, TileBuffer& buffer, int64_t m_begin, int64_t m_end,
               int64_t v0) {
  tile_rows<NV>(p, act, Tile<F, NV>(buffer, p, v0 * kRows), m_begin, m_end, v0 * kRows);
}

}  // namespace serval::quant

#endif  // SERVAL_SIMD
