// GGUF's K-quant super-blocks (Q4_K, Q5_K, Q6_K: engine/model/quantization/kquants.py) as the CPU kernels read
// them, in the file's layout or the packed one (kquants.pack: rows in groups of 16; per group and super-block,
// field by field, an fp16 field as the 16 rows' 2 bytes, a byte field in 64-byte chunks of 4 bytes a row, row r's
// at 4 r), and the quants of each 32-weight block of a super-block as unsigned u:
//   Q4_K, Q5_K: block b (0 .. 7) is sub-block b: u = nibble b % 2 of qs[32 (b / 2) + j] (Q5_K: + 16 * bit b of
//     qh[j]), scale d * sc_b, min dmin * m_b (6 bits each, from the 12 scale bytes);
//   Q6_K: block b is 4 n + t of half n: u = nibble t / 2 of ql[64 n + 32 (t % 2) + j] + 16 * bits 2 t, 2 t + 1
//     of qh[32 n + j], weight d * sc[2 b + j / 16] * (u - 32).
// u_at is the scalar reference's (and the rows past the last group's) reader; the vector kernels read 64-byte
// chunks of the same bytes (kquant_linear.cpp).
#pragma once

#include <cstdint>

#include "quant_blocks.h"

namespace serval::kquant {

using quant::half_at;
using quant::kGroup;

enum class KFormat : int { kQ4_K = 10, kQ5_K = 11, kQ6_K = 12 };

constexpr int64_t kSuper = 256;  // weights per super-block
constexpr int kBlocks = 8;       // 32-weight blocks (activation blocks) per super-block

constexpr bool is_kquant(int64_t id) { return id >= 10 && id <= 12; }
constexpr int64_t block_bytes(KFormat f) { return f == KFormat::kQ4_K ? 144 : (f == KFormat::kQ5_K ? 176 : 210); }

// A field: its offset in the file's super-block and in the packed group's (16 rows), and whether it is an fp16.
struct Field {
  int64_t file, packed;
};
template <KFormat F>
struct Fields;
template <>
struct Fields<KFormat::kQ4_K> {
  static constexpr Field d{0, 0}, dmin{2, 32}, scales{4, 64}, qs{16, 256}, qh{0, 0};
};
template <>
struct Fields<KFormat::kQ5_K> {
  static constexpr Field d{0, 0}, dmin{2, 32}, scales{4, 64}, qh{16, 256}, qs{48, 768};
};
template <>
struct Fields<KFormat::kQ6_K> {  // qs: ql
  static constexpr Field d{208, 0}, dmin{0, 0}, scales{192, 32}, qs{0, 288}, qh{128, 2336};
};

// One row's super-block wherever it lies: packed (lane r of its group) or as the file has it.
struct RowSuper {
  const uint8_t* at;
  int64_t r;
  bool packed;
  uint8_t byte(Field f, int i) const { return packed ? at[f.packed + i / 4 * 64 + 4 * r + i % 4] : at[f.file + i]; }
  float half(Field f) const { return half_at(packed ? at + f.packed + 2 * r : at + f.file); }
};

template <KFormat F>
inline RowSuper row_super(const uint8_t* w, int64_t n, int64_t s, int64_t N, int64_t row_bytes) {
  constexpr int64_t bb = block_bytes(F);
  if (n < N / kGroup * kGroup) return {w + n / kGroup * kGroup * row_bytes + s * kGroup * bb, n % kGroup, true};
  return {w + n * row_bytes + s * bb, 0, false};
}

// Q4_K / Q5_K: sub-block b's 6-bit scale and min (ggml's get_scale_min_k4).
template <KFormat F>
inline void scale_min(const RowSuper& rs, int b, int* sc, int* m) {
  constexpr Field f = Fields<F>::scales;
  if (b < 4) {
    *sc = rs.byte(f, b) & 63;
    *m = rs.byte(f, b + 4) & 63;
  } else {
    *sc = (rs.byte(f, b + 4) & 0x0F) | ((rs.byte(f, b - 4) >> 6) << 4);
    *m = (rs.byte(f, b + 4) >> 4) | ((rs.byte(f, b) >> 6) << 4);
  }
}

// The unsigned quant u of weight j of block b.
template <KFormat F>
inline int32_t u_at(const RowSuper& rs, int b, int j) {
  using Fl = Fields<F>;
  if constexpr (F == KFormat::kQ6_K) {
    const int n = b / 4, t = b % 4;
    const int ql = rs.byte(Fl::qs, 64 * n + 32 * (t % 2) + j) >> (4 * (t / 2)) & 0x0F;
    return ql | ((rs.byte(Fl::qh, 32 * n + j) >> (2 * t) & 3) << 4);
  } else {
    const int q = rs.byte(Fl::qs, 32 * (b / 2) + j) >> (4 * (b % 2)) & 0x0F;
    if constexpr (F == KFormat::kQ5_K) return q | ((rs.byte(Fl::qh, j) >> b & 1) << 4);
    return q;
  }
}

// Q6_K's int8 scale i (0 .. 15).
inline int32_t q6_scale(const RowSuper& rs, int i) {
  return static_cast<int8_t>(rs.byte(Fields<KFormat::kQ6_K>::scales, i));
}

}  // namespace serval::kquant
