// Linear and dequantization over weights kept as a GGUF file's own row bytes (gguf_rows.h: Q4_K, Q5_K, Q6_K, Q5_0,
// Q5_1, F16, BF16, F32). Every value multiplied is gguf's dequantized weight: float32 x by the float32 value,
// bfloat16 x by that value rounded to bfloat16, as the GEMM path (gguf_rows_linear_tiled) multiplies.
//
// Decode (few rows): each unit of a weight row is decoded once into registers per tile of up to 8 rows (AVX2: 10) and
// several channels, prefetched ahead (batch 1 is bound by reading the weights). Each (row, channel) has one 16-lane
// accumulator that adds its units' groups of 32 in order, then one fixed reduction (reduce_tile): a row's result is
// bitwise the same alone or in any batch, whatever the thread split (threads split output channels only).
// Prefill (many rows): tiled_gemm.h, tiles of output channels dequantized into x's dtype, then torch's GEMM.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <type_traits>
#include <vector>

#include "block_common.h"
#include "gguf_rows.h"
#include "tiled_gemm.h"

namespace {

namespace gr = radixserve::gguf_rows;

using gr::check_raw;
using gr::RowWeights;

// Rows a..b as float32 (row n at out + (n - a) * K): gguf's values.
template <typename T>
void dequantize_rows(const RowWeights& w, int64_t a, int64_t b, float* out) {
  for (int64_t n = a; n < b; ++n)
    for (int64_t u = 0; u < w.in_features / T::kWeights; ++u)
      gr::dequantize_unit<T>(w.raw + n * w.row_bytes + u * T::kBytes, out + (n - a) * w.in_features + u * T::kWeights);
}

template <typename T>
void dequantize_rows_bf16(const RowWeights& w, int64_t a, int64_t b, uint16_t* out) {
  for (int64_t n = a; n < b; ++n)
    for (int64_t u = 0; u < w.in_features / T::kWeights; ++u)
      gr::dequantize_unit_bf16<T>(w.raw + n * w.row_bytes + u * T::kBytes,
                                    out + (n - a) * w.in_features + u * T::kWeights);
}

at::Tensor dequantize_op(const at::Tensor& raw, int64_t qtype, int64_t in_features) {
  const RowWeights w = check_raw(raw, qtype, in_features);
  at::Tensor out = at::empty({raw.size(0), in_features}, raw.options().dtype(at::kFloat));
  float* op = out.data_ptr<float>();
  gr::dispatch(qtype, [&](auto t) {
    using T = decltype(t);
    at::parallel_for(0, raw.size(0), 16, [&](int64_t a, int64_t b) {
      dequantize_rows<T>(w, a, b, op + a * in_features);
    });
  });
  return out;
}

// tiled_gemm.h's weights: every row type rounds to bfloat16 exactly as torch (bf16.h), so always directly.
struct RowTiles {
  const RowWeights& w;
  int64_t qtype;
  void to_float(int64_t a, int64_t b, float* out) const {
    gr::dispatch(qtype, [&](auto t) { dequantize_rows<decltype(t)>(w, a, b, out); });
  }
  bool bf16_direct(int64_t, int64_t) const { return true; }
  void to_bf16(int64_t a, int64_t b, uint16_t* out) const {
    gr::dispatch(qtype, [&](auto t) { dequantize_rows_bf16<decltype(t)>(w, a, b, out); });
  }
};

at::Tensor linear_tiled_op(const at::Tensor& x, const at::Tensor& raw, int64_t qtype, int64_t in_features,
                           const std::optional<at::Tensor>& bias, int64_t tile_columns) {
  const RowWeights w = check_raw(raw, qtype, in_features);
  radixserve::check_tiled_rows(x, in_features, tile_columns);
  radixserve::check_tiled_bias(bias, x.size(0), raw.size(0));
  at::Tensor out = at::empty({x.size(0), raw.size(0)}, x.options());
  radixserve::tiled_gemm(x, RowTiles{w, qtype}, in_features, bias, tile_columns, out, false);
  return out;
}

// residual [T, N] += x @ W.T in place: the bits of gguf_rows_linear_tiled(x, ..., bias=residual).
at::Tensor linear_tiled_add_op(at::Tensor& residual, const at::Tensor& x, const at::Tensor& raw, int64_t qtype,
                               int64_t in_features, int64_t tile_columns) {
  const RowWeights w = check_raw(raw, qtype, in_features);
  radixserve::check_tiled_rows(x, in_features, tile_columns);
  radixserve::check_tiled_residual(residual, x, raw.size(0));
  radixserve::tiled_gemm(x, RowTiles{w, qtype}, in_features, std::nullopt, tile_columns, residual, true);
  return residual;
}

// The portable decode path: a weight row dequantized (bfloat16 x: rounded to bfloat16) into a buffer once, then
// each row of x (float32) against it, 8 partial sums in a fixed order.
template <typename T>
void linear_portable(const float* x, int64_t rows, bool round_bf16, const RowWeights& w, int64_t n0, int64_t n1,
                     const radixserve::Epilogue& out) {
  const int64_t k = w.in_features;
  std::vector<float> wrow(k);
  for (int64_t n = n0; n < n1; ++n) {
    dequantize_rows<T>(w, n, n + 1, wrow.data());
    if (round_bf16)
      for (float& v : wrow) v = radixserve::bf16_to_float(radixserve::float_to_bf16(v));
    for (int64_t r = 0; r < rows; ++r) {
      float acc[8] = {};
      for (int64_t i = 0; i < k; ++i) acc[i % 8] += x[r * k + i] * wrow[i];
      out.store(r, n, ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])));
    }
  }
}

#ifdef RADIXSERVE_BLOCK_AVX2
constexpr int64_t kPrefetch = 4096;  // bytes ahead in each weight row

// A tile's prologue for unit u (both vector paths): each of its C channels' unit (ldw bytes apart) fetched kPrefetch
// bytes ahead, and its scales into s[c]. Units under a line (Q5_0, Q5_1: 22, 24 bytes) prefetch a line ahead only
// where a new line starts in them.
template <typename T, int C>
inline void unit_scales(const uint8_t* unit, int64_t u, int64_t ldw, float (*s)[16]) {
  const bool prefetch = T::kBytes >= 64 || (u * T::kBytes) % 64 < T::kBytes;
  for (int c = 0; c < C; ++c) {
    const char* ahead = reinterpret_cast<const char*>(unit + c * ldw) + kPrefetch;
    for (int line = 0; prefetch && line < (T::kBytes + 63) / 64; ++line) _mm_prefetch(ahead + 64 * line, _MM_HINT_T0);
    T::scales(unit + c * ldw, s[c]);
  }
}
#endif

#ifdef RADIXSERVE_ROWS_AVX2
// AVX2 (no AVX512): linear_portable's arithmetic, vectorized. Each (row, channel) has one 8-lane accumulator; lane l
// adds x_i * w_i for i = l mod 8 in order of i, one FMA each (as the portable loop, contracted), then the portable
// reduction. Weights are decoded 8 at a time (gguf_rows.h: piece), once per tile of rows and channels, so a row's
// bits are the same alone, in any batch or tile, and with any thread split (threads split output channels).
namespace avx2 {

// Rows sharing one decode of a piece: 10 accumulators, the decoded piece and its decoding's temporaries fill AVX2's
// 16 registers (a verify of 8 drafts is 9 rows: with tiles of 8 its ninth row decoded every weight again).
constexpr int kRowTile = 10;
constexpr int64_t kChunk = 16;

// Channels per tile by rows: 8 accumulators (the FMA's latency times its throughput) in AVX2's 16 registers, each x
// piece loaded once for C channels, each weight piece decoded once for R rows.
constexpr int channels_for(int rows) { return rows <= 1 ? 8 : rows <= 2 ? 4 : rows <= 4 ? 2 : 1; }

// Whether a type's pieces are decoded (the quantized ones) or read as they are (the float ones).
template <typename T>
constexpr bool decodes() { return T::kType != gr::F32 && T::kType != gr::F16 && T::kType != gr::BF16; }

// linear_portable's reduction of its 8 partial sums: ((a0 + a4) + (a1 + a5)) + ((a2 + a6) + (a3 + a7)).
RADIXSERVE_ROWS_INLINE float reduce8(__m256 a) {
  const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 c = _mm_hadd_ps(b, b);  // b0 + b1, b2 + b3
  return _mm_cvtss_f32(_mm_hadd_ps(c, c));
}

// acc + x[0..7] * w, x read by the FMA itself (as intrinsics, the compiler kept a tile's x pieces in registers
// across its channels, and spilled).
RADIXSERVE_ROWS_INLINE __m256 fma_x(const float* x, __m256 w, __m256 acc) {
  __asm__("vfmadd231ps %2, %1, %0" : "+x"(acc) : "x"(w), "m"(*reinterpret_cast<const float(*)[8]>(x)));
  return acc;
}

// Rows a full tile has: the quantized types up to kRowTile, balanced (11 rows: 6 + 5, not 10 + 1: a tile of few rows
// pays a whole decode of the weights for them); the float types 8, or 4 past K = 768, where 8 rows of x (32 K bytes)
// no longer fit L1 beside the weights and are read from L2 for each channel (SmolLM2's 576 x 1,536 at 16 rows: F32
// 0.86 -> 0.73 ns a weight). The quantized types keep their tiles: decoding each piece for 4 rows cost more than that
// (Q6_K 0.75 -> 0.99).
inline int64_t row_tile(bool decodes, int64_t k, int64_t rows) {
  if (!decodes) return k <= 768 ? 8 : 4;
  const int64_t tiles = (rows + kRowTile - 1) / kRowTile;
  return std::max<int64_t>(1, (rows + tiles - 1) / tiles);
}

// x [rows, K] as tiles of row_tile rows (the last one shorter), each tile's R rows interleaved by pieces of 8:
// row r's piece p at tile + (p * R + r) * 8, a tile of R rows at r0 * K. Every x piece a tile's FMAs read is then a
// constant offset from one pointer (with rows ldx apart, the compiler kept the rows' offsets on the stack and
// loaded one for each FMA).
void interleave_rows(const float* x, int64_t rows, int64_t k, int64_t row_tile, float* out) {
  for (int64_t r0 = 0; r0 < rows; r0 += row_tile) {
    const int64_t tile = std::min<int64_t>(row_tile, rows - r0);
    for (int64_t r = 0; r < tile; ++r)
      for (int64_t p = 0; p < k / 8; ++p)
        _mm256_storeu_ps(out + r0 * k + (p * tile + r) * 8, _mm256_loadu_ps(x + (r0 + r) * k + 8 * p));
  }
}

// R rows of x (interleave_rows' tile) against C weight rows (ldw bytes apart): row r's sum for channel c at
// sums[r * kChunk + c]. Per unit: prefetch and the C channels' scales; per piece of 8 weights each channel decoded
// once (RoundBf16: rounded to bfloat16, as linear_portable rounds for bfloat16 x) and each x piece loaded once.
template <typename T, int R, int C, bool RoundBf16>
void dot_tile(const float* x, const uint8_t* w, int64_t ldw, int64_t units, float* sums) {
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  alignas(64) float s[C][16];
  for (int64_t u = 0; u < units; ++u) {
    const uint8_t* unit = w + u * T::kBytes;
    unit_scales<T, C>(unit, u, ldw, s);
    const float* xu = x + u * T::kWeights * R;
    // Quantized types: a group of 32 weights (4 pieces) of one channel at a time, its scales live only there (the
    // other channels' chains overlap it out of order). Float types, nothing to decode: piece by piece across the
    // channels, the C chains side by side (a channel's 4 pieces in a row left F32 at 1 row latency-bound: 1.2x).
    constexpr int kGroup = decodes<T>() ? 4 : 1;
#pragma GCC unroll 32
    for (int g = 0; g < T::kWeights / 8 / kGroup; ++g)
      for (int c = 0; c < C; ++c)
#pragma GCC unroll 4
        for (int p = kGroup * g; p < kGroup * g + kGroup; ++p) {
          __m256 wv = T::piece(unit + c * ldw, s[c], p);
          if constexpr (RoundBf16) wv = gr::round_bf16_8(wv);
          for (int r = 0; r < R; ++r) {
            const float* xp = xu + (p * R + r) * 8;
            // Float rows: intrinsics, so the compiler may fold the weight's load into the FMA instead (one row: 1.2x
            // faster than fma_x).
            if constexpr (decodes<T>()) acc[r][c] = fma_x(xp, wv, acc[r][c]);
            else acc[r][c] = _mm256_fmadd_ps(_mm256_loadu_ps(xp), wv, acc[r][c]);
          }
        }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) sums[r * kChunk + c] = reduce8(acc[r][c]);
}

// rows (1..kRowTile) against channels_for(rows) channels (or one when `single`); returns how many.
template <typename T, bool RoundBf16>
int tile_rows(int rows, bool single, const float* x, const uint8_t* w, int64_t ldw, int64_t units, float* sums) {
  switch (rows) {
#define RADIXSERVE_TILE(R)                                                          \
  case R:                                                                           \
    if (single) return dot_tile<T, R, 1, RoundBf16>(x, w, ldw, units, sums), 1;     \
    dot_tile<T, R, channels_for(R), RoundBf16>(x, w, ldw, units, sums);             \
    return channels_for(R);
    RADIXSERVE_TILE(1) RADIXSERVE_TILE(2) RADIXSERVE_TILE(3) RADIXSERVE_TILE(4)
#undef RADIXSERVE_TILE
    case 5: return dot_tile<T, 5, 1, RoundBf16>(x, w, ldw, units, sums), 1;
    case 6: return dot_tile<T, 6, 1, RoundBf16>(x, w, ldw, units, sums), 1;
    case 7: return dot_tile<T, 7, 1, RoundBf16>(x, w, ldw, units, sums), 1;
    case 8: return dot_tile<T, 8, 1, RoundBf16>(x, w, ldw, units, sums), 1;
    case 9: return dot_tile<T, 9, 1, RoundBf16>(x, w, ldw, units, sums), 1;
    default: return dot_tile<T, kRowTile, 1, RoundBf16>(x, w, ldw, units, sums), 1;
  }
}

// Output channels n0..n1 of every row of x ([rows, K] float32 as interleave_rows leaves it).
template <typename T, bool RoundBf16>
void linear_channels(const float* x, int64_t rows, const RowWeights& w, int64_t n0, int64_t n1,
                     const radixserve::Epilogue& out) {
  const int64_t k = w.in_features;
  const auto tile = [&](int64_t r0, int rows_here, int64_t n, int64_t c1, float* sums) {
    return tile_rows<T, RoundBf16>(rows_here, n + channels_for(rows_here) > c1, x + r0 * k, w.raw + n * w.row_bytes,
                                   w.row_bytes, k / T::kWeights, sums);
  };
  radixserve::walk_decode_tiles<kRowTile, kChunk>(rows, n0, n1, out, tile, row_tile(decodes<T>(), k, rows));
}

// Every row of xf ([rows, K] float32, contiguous; bfloat16 x widened, its weights then rounded) through the tiles,
// threads splitting the output channels.
template <typename T>
void linear(const at::Tensor& xf, bool bf16, const RowWeights& w, const radixserve::Epilogue& out) {
  const int64_t rows = xf.size(0), k = w.in_features;
  const at::Tensor xi = rows == 1 ? xf : at::empty_like(xf);  // one row is interleaved already
  if (rows > 1) interleave_rows(xf.data_ptr<float>(), rows, k, row_tile(decodes<T>(), k, rows), xi.data_ptr<float>());
  const float* xp = xi.data_ptr<float>();
  at::parallel_for(0, out.out_features, 16, [&](int64_t n0, int64_t n1) {
    if (bf16) linear_channels<T, true>(xp, rows, w, n0, n1, out);
    else linear_channels<T, false>(xp, rows, w, n0, n1, out);
  });
}

}  // namespace avx2
#endif

#ifdef RADIXSERVE_BLOCK_AVX512
namespace avx512 {

constexpr int kRowTile = 8;  // rows sharing one decode of a unit
constexpr int64_t kChunk = 16;

// Channels per tile by rows: 8-16 accumulators, each x group loaded once for C channels (as block_linear.cpp).
constexpr int channels_for(int rows) { return rows <= 2 ? 8 : rows <= 4 ? 4 : 2; }

#ifdef RADIXSERVE_BLOCK_AVX512BF16
// Group j of a unit as the 32 bfloat16 weights the GEMM path multiplies by. The quantized types' values are 0 or
// at least 2^-24 in magnitude (multiples of float16's 2^-24), F16's too: never a float32 subnormal, which
// vcvtne2ps2bf16 would flush; F32 rows round as torch rounds (bf16.h); BF16 rows are their own bits.
template <typename T>
RADIXSERVE_ROWS_INLINE __m512bh group_bf16(const uint8_t* u, const float* s, int j) {
  if constexpr (T::kType == gr::BF16) {
    return (__m512bh)_mm512_loadu_si512(u);
  } else {
    __m512 lo, hi;
    T::group(u, s, j, lo, hi);
    if constexpr (T::kType != gr::F32) return _mm512_cvtne2ps_pbh(hi, lo);
    const __m256i l = _mm512_cvtepi32_epi16(radixserve::bf16_bits16(lo));
    const __m256i h = _mm512_cvtepi32_epi16(radixserve::bf16_bits16(hi));
    return (__m512bh)_mm512_inserti64x4(_mm512_castsi256_si512(l), h, 1);
  }
}
#endif

// R rows of x (float32, or bfloat16 when BF16; rows ldx apart) against C weight rows (ldw bytes apart): row r's sum
// for channel c at sums[r * kChunk + c]. Per unit: prefetch, the C channels' scales, then per group of 32 weights
// the C channels decoded once and each x group loaded once.
template <typename T, int R, int C, bool BF16>
void dot_tile(const void* x, int64_t ldx, const uint8_t* w, int64_t ldw, int64_t units, float* sums) {
  __m512 acc[R][C];  // R * C >= 8 chains in flight
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  alignas(64) float s[C][16];
  for (int64_t u = 0; u < units; ++u) {
    const uint8_t* unit = w + u * T::kBytes;
    unit_scales<T, C>(unit, u, ldw, s);
#pragma GCC unroll 8
    for (int j = 0; j < T::kWeights / 32; ++j) {
      const int64_t at = u * T::kWeights + 32 * j;
      if constexpr (BF16) {
#ifdef RADIXSERVE_BLOCK_AVX512BF16
        __m512bh wb[C];
        for (int c = 0; c < C; ++c) wb[c] = group_bf16<T>(unit + c * ldw, s[c], j);
        for (int r = 0; r < R; ++r) {
          const __m512bh xb = (__m512bh)_mm512_loadu_si512(static_cast<const uint16_t*>(x) + r * ldx + at);
          for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xb, wb[c]);
        }
#endif
      } else {
        __m512 lo[C], hi[C];
        for (int c = 0; c < C; ++c) T::group(unit + c * ldw, s[c], j, lo[c], hi[c]);
        for (int r = 0; r < R; ++r) {
          const float* xg = static_cast<const float*>(x) + r * ldx + at;
          const __m512 xlo = _mm512_loadu_ps(xg), xhi = _mm512_loadu_ps(xg + 16);
          for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(xhi, hi[c], _mm512_fmadd_ps(xlo, lo[c], acc[r][c]));
        }
      }
    }
  }
  radixserve::reduce_tile(acc, sums, kChunk);
}

// rows (1..kRowTile) against channels_for(rows) channels (or one when `single`); returns how many.
template <typename T, bool BF16>
int tile_rows(int rows, bool single, const void* x, int64_t ldx, const uint8_t* w, int64_t ldw, int64_t units,
              float* sums) {
  switch (rows) {
#define RADIXSERVE_TILE(R)                                                   \
  case R:                                                                    \
    if (single) return dot_tile<T, R, 1, BF16>(x, ldx, w, ldw, units, sums), 1; \
    dot_tile<T, R, channels_for(R), BF16>(x, ldx, w, ldw, units, sums);       \
    return channels_for(R);
    RADIXSERVE_TILE(1) RADIXSERVE_TILE(2) RADIXSERVE_TILE(3) RADIXSERVE_TILE(4)
    RADIXSERVE_TILE(5) RADIXSERVE_TILE(6) RADIXSERVE_TILE(7)
#undef RADIXSERVE_TILE
    default:
      if (single) return dot_tile<T, kRowTile, 1, BF16>(x, ldx, w, ldw, units, sums), 1;
      dot_tile<T, kRowTile, channels_for(kRowTile), BF16>(x, ldx, w, ldw, units, sums);
      return channels_for(kRowTile);
  }
}

#ifdef RADIXSERVE_BLOCK_AVX512BF16
// Bfloat16 x against a quantized type (T::kCodes, gguf_rows.h): per group of 32 weights a * (x . (128 + c)), one
// vdpbf16ps of exact products and one FMA by the halves' scales, and per span of 8 groups the min terms
// (b - 128 a) . (x's sums of 16) in one FMA. The exact weights, not rounded to bfloat16, and faster than converting
// each group to bfloat16 weights: 1 row, SmolLM2's shapes, in L2 (Gweights/s): Q5_0
// 3,072 x 576 9.9 -> 15.1, Q4_K 576 x 1,536 10.9 -> 12.1, Q6_K 10.0 -> 13.9. Few rows decode a span's groups in
// registers (SpanDecoder), more rows read a chunk decoded once (CodeSpan); add_span is the one place that adds a
// span, so a (row, channel) runs the same operations in the same order whichever path and tile it is in.
constexpr int kSpanGroups = 8;

// The halves' sums of x [rows, K] (bfloat16), float32 in order, rows ldxs = padded16(K / 16) apart, zeros past K.
at::Tensor half_sums(const at::Tensor& x) {
  const int64_t rows = x.size(0), halves = x.size(1) / 16, ld = (halves + 15) / 16 * 16;
  at::Tensor out = at::zeros({rows, ld}, x.options().dtype(at::kFloat));
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  float* op = out.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < halves; ++h) {
      float s = 0.f;
      for (int64_t i = 0; i < 16; ++i) s += static_cast<float>(xp[r * x.size(1) + 16 * h + i]);
      op[r * ld + h] = s;
    }
  return out;
}

// R rows of x (at the span's first weight) and C channels: src.group(c, i, w, a) gives group i's codes and scales,
// src.mins(c) the span's 16 min weights (zeros past its groups) once every group was asked for.
template <int R, int C, typename Source>
RADIXSERVE_ROWS_INLINE void add_span(__m512 (&acc)[R][C], const uint16_t* x, int64_t ldx, const float* xsum,
                                     int64_t ldxs, int groups, Source& src) {
#pragma GCC unroll 8
  for (int i = 0; i < groups; ++i) {
    __m512bh w[C];
    __m512 a[C];
    for (int c = 0; c < C; ++c) src.group(c, i, w[c], a[c]);
    for (int r = 0; r < R; ++r) {
      const __m512bh xb = (__m512bh)_mm512_loadu_si512(x + r * ldx + 32 * i);
      for (int c = 0; c < C; ++c)
        acc[r][c] = _mm512_fmadd_ps(a[c], _mm512_dpbf16_ps(_mm512_setzero_ps(), xb, w[c]), acc[r][c]);
    }
  }
  for (int c = 0; c < C; ++c) {
    const __m512 mc = src.mins(c);
    for (int r = 0; r < R; ++r) acc[r][c] = _mm512_fmadd_ps(mc, _mm512_loadu_ps(xsum + r * ldxs), acc[r][c]);
  }
}

// A span of C channels' weight rows (ldw bytes apart) decoded as add_span asks for each group. Spans start on a
// unit: K-quants' unit is a span (group i is the unit's group i), Q5_0 / Q5_1's a group.
template <typename T, int C>
struct SpanDecoder {
  static constexpr int kPerUnit = static_cast<int>(T::kWeights / 32);
  static_assert(kPerUnit == 1 || kPerUnit == kSpanGroups, "a span is one unit or whole units of one group");
  const uint8_t* w;
  int64_t ldw, g0;
  alignas(64) float s[C][16];
  alignas(64) float m[C][16];

  // The span's scales and mins, per channel (T::span).
  RADIXSERVE_ROWS_INLINE void start(int64_t first, int groups) {
    g0 = first;
    for (int c = 0; c < C; ++c) {
      const uint8_t* row = w + c * ldw + g0 / kPerUnit * T::kBytes;
      const char* ahead = reinterpret_cast<const char*>(row) + kPrefetch;
      for (int64_t line = 0; line < (groups * T::kBytes / kPerUnit + 63) / 64; ++line)
        _mm_prefetch(ahead + 64 * line, _MM_HINT_T0);
      T::span(row, groups, s[c], m[c]);
    }
  }
  RADIXSERVE_ROWS_INLINE void group(int c, int i, __m512bh& codes, __m512& scale) {
    const uint8_t* unit = w + c * ldw + (g0 + i) / kPerUnit * T::kBytes;
    codes = (__m512bh)T::codes(unit, kPerUnit == 1 ? 0 : i);
    scale = T::scale(s[c], i);
  }
  RADIXSERVE_ROWS_INLINE __m512 mins(int c) const { return _mm512_load_ps(m[c]); }
};

// A chunk's channels decoded once: channel c's span p at spans[c * per_channel + p].
struct alignas(64) CodeSpan {
  uint16_t codes[kSpanGroups][32];
  float a[kSpanGroups][16];
  float mins[16];  // zeros past the span's groups
};

struct SpanReader {
  const CodeSpan* spans;  // the span of channel 0
  int64_t per_channel;
  RADIXSERVE_ROWS_INLINE void group(int c, int i, __m512bh& codes, __m512& scale) const {
    codes = (__m512bh)_mm512_load_si512(spans[c * per_channel].codes[i]);
    scale = _mm512_load_ps(spans[c * per_channel].a[i]);
  }
  RADIXSERVE_ROWS_INLINE __m512 mins(int c) const { return _mm512_load_ps(spans[c * per_channel].mins); }
};

// R rows of x against C channels, span by span from src (SpanDecoder or SpanReader), then the one reduction.
template <int R, int C, typename Span>
void dot_tile_codes(const uint16_t* x, int64_t ldx, const float* xsum, int64_t ldxs, int64_t groups, Span&& next,
                    float* sums) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  int64_t g0 = 0;
  for (; g0 + kSpanGroups <= groups; g0 += kSpanGroups)  // whole spans: the group loop unrolled, j constant
    add_span<R, C>(acc, x + 32 * g0, ldx, xsum + 2 * g0, ldxs, kSpanGroups, next(g0, kSpanGroups));
  if (g0 < groups) {
    const int n = static_cast<int>(groups - g0);
    add_span<R, C>(acc, x + 32 * g0, ldx, xsum + 2 * g0, ldxs, n, next(g0, n));
  }
  radixserve::reduce_tile(acc, sums, kChunk);
}

// Few rows: rows (1..kRowTile) against channels_for(rows) channels (or one when `single`), decoded span by span.
template <typename T>
int tile_codes(int rows, bool single, const uint16_t* x, int64_t ldx, const float* xsum, int64_t ldxs,
               const uint8_t* w, int64_t ldw, int64_t groups, float* sums) {
  const auto run = [&](auto r_tag, auto c_tag) {
    constexpr int R = decltype(r_tag)::value, C = decltype(c_tag)::value;
    SpanDecoder<T, C> dec{w, ldw, 0};
    dot_tile_codes<R, C>(x, ldx, xsum, ldxs, groups, [&](int64_t g0, int n) -> SpanDecoder<T, C>& {
      dec.start(g0, n);
      return dec;
    }, sums);
    return C;
  };
  switch (rows) {
#define RADIXSERVE_TILE(R)                                                              \
  case R:                                                                               \
    if (single) return run(std::integral_constant<int, R>{}, std::integral_constant<int, 1>{}); \
    return run(std::integral_constant<int, R>{}, std::integral_constant<int, channels_for(R)>{});
    RADIXSERVE_TILE(1) RADIXSERVE_TILE(2) RADIXSERVE_TILE(3) RADIXSERVE_TILE(4)
    RADIXSERVE_TILE(5) RADIXSERVE_TILE(6) RADIXSERVE_TILE(7) RADIXSERVE_TILE(8)
#undef RADIXSERVE_TILE
    default: TORCH_CHECK(false, "a tile of 1..8 rows");
  }
}

// Channels c0..c1's spans, decoded once (the SpanDecoder's values, stored).
template <typename T>
void decode_code_chunk(const RowWeights& w, int64_t c0, int64_t c1, int64_t per_channel, CodeSpan* out) {
  const int64_t groups = w.in_features / 32;
  SpanDecoder<T, 1> dec{nullptr, 0, 0};
  for (int64_t n = c0; n < c1; ++n) {
    dec.w = w.raw + n * w.row_bytes;
    for (int64_t p = 0; p < per_channel; ++p) {
      const int count = static_cast<int>(std::min<int64_t>(kSpanGroups, groups - p * kSpanGroups));
      CodeSpan& span = out[(n - c0) * per_channel + p];
      dec.start(p * kSpanGroups, count);
      for (int i = 0; i < count; ++i) {
        __m512bh codes;
        __m512 scale;
        dec.group(0, i, codes, scale);
        _mm512_store_si512(span.codes[i], (__m512i)codes);
        _mm512_store_ps(span.a[i], scale);
      }
      _mm512_store_ps(span.mins, dec.mins(0));
    }
  }
}

// More rows: each chunk of channels decoded once (decode_code_chunk), then every row tile reads it (2 channels a
// tile, as channels_for(kRowTile)).
template <typename T>
void linear_channels_codes(const at::Tensor& x, const at::Tensor& xsum, const RowWeights& w, int64_t n0, int64_t n1,
                           const radixserve::Epilogue& out) {
  const int64_t k = w.in_features, groups = k / 32, per_channel = (groups + kSpanGroups - 1) / kSpanGroups;
  const int64_t ldxs = xsum.size(1);
  const uint16_t* xp = static_cast<const uint16_t*>(x.data_ptr());
  const float* xs = xsum.data_ptr<float>();
  if (x.size(0) <= kRowTile) {
    radixserve::walk_decode_tiles<kRowTile, kChunk>(x.size(0), n0, n1, out, [&](int64_t r0, int tile, int64_t n,
                                                                                 int64_t c1, float* sums) {
      return tile_codes<T>(tile, n + channels_for(tile) > c1, xp + r0 * k, k, xs + r0 * ldxs, ldxs,
                           w.raw + n * w.row_bytes, w.row_bytes, groups, sums);
    });
    return;
  }
  std::vector<CodeSpan> chunk(kChunk * per_channel);
  int64_t first = n0, decoded_until = n0;  // chunk holds channels first..decoded_until
  radixserve::walk_decode_tiles<kRowTile, kChunk>(x.size(0), n0, n1, out, [&](int64_t r0, int tile, int64_t n,
                                                                               int64_t c1, float* sums) {
    if (n >= decoded_until) {
      decode_code_chunk<T>(w, n, c1, per_channel, chunk.data());
      first = n;
      decoded_until = c1;
    }
    SpanReader reader{chunk.data() + (n - first) * per_channel, per_channel};
    const auto next = [&](int64_t g0, int) -> SpanReader& {
      reader.spans = chunk.data() + (n - first) * per_channel + g0 / kSpanGroups;
      return reader;
    };
    const uint16_t* xr = xp + r0 * k;
    const float* xsr = xs + r0 * ldxs;
    const bool one = n + 2 > c1;
    switch (tile) {
#define RADIXSERVE_TILE(R)                                                                   \
  case R:                                                                                    \
    if (one) return dot_tile_codes<R, 1>(xr, k, xsr, ldxs, groups, next, sums), 1;           \
    return dot_tile_codes<R, 2>(xr, k, xsr, ldxs, groups, next, sums), 2;
      RADIXSERVE_TILE(1) RADIXSERVE_TILE(2) RADIXSERVE_TILE(3) RADIXSERVE_TILE(4)
      RADIXSERVE_TILE(5) RADIXSERVE_TILE(6) RADIXSERVE_TILE(7) RADIXSERVE_TILE(8)
#undef RADIXSERVE_TILE
      default: TORCH_CHECK(false, "a tile of 1..8 rows");
    }
  });
}
#endif

// Output channels n0..n1 of every row of x ([rows, K] contiguous, float32, or bfloat16 when BF16).
template <typename T, bool BF16>
void linear_channels(const at::Tensor& x, const RowWeights& w, int64_t n0, int64_t n1,
                     const radixserve::Epilogue& out) {
  const int64_t k = w.in_features;
  const char* xp = static_cast<const char*>(x.data_ptr());
  const int64_t x_row_bytes = k * (BF16 ? 2 : 4);
  radixserve::walk_decode_tiles<kRowTile, kChunk>(x.size(0), n0, n1, out, [&](int64_t r0, int tile, int64_t n,
                                                                               int64_t c1, float* sums) {
    return tile_rows<T, BF16>(tile, n + channels_for(tile) > c1, xp + r0 * x_row_bytes, k, w.raw + n * w.row_bytes,
                              w.row_bytes, k / T::kWeights, sums);
  });
}

#ifdef RADIXSERVE_BLOCK_AVX512BF16
// Channels c0..c1 decoded into buf as BF16 rows: the bits group_bf16 gives.
template <typename T>
void decode_chunk(const RowWeights& w, int64_t c0, int64_t c1, uint16_t* buf) {
  alignas(64) float s[16];
  for (int64_t n = c0; n < c1; ++n) {
    for (int64_t u = 0; u < w.in_features / T::kWeights; ++u) {
      const uint8_t* unit = w.raw + n * w.row_bytes + u * T::kBytes;
      _mm_prefetch(reinterpret_cast<const char*>(unit) + kPrefetch, _MM_HINT_T0);
      T::scales(unit, s);
#pragma GCC unroll 8
      for (int j = 0; j < T::kWeights / 32; ++j)
        _mm512_storeu_si512(buf + (n - c0) * w.in_features + u * T::kWeights + 32 * j,
                            (__m512i)group_bf16<T>(unit, s, j));
    }
  }
}

// bfloat16 x, more rows than a tile: each chunk of channels is decoded once (decode_chunk) and every row tile reads
// it as BF16 rows. Decoded per tile instead, 16 rows decode each unit twice: Q4_K at 16 rows took 1.4x the time.
// (Float32 x: a chunk decoded to float32, 96 KiB at K = 1,536, ran 1.2x slower than decoding per tile.) The same
// weights and the same operations per (row, channel): a row's bits are those it gets alone.
template <typename T>
void linear_channels_decoded(const at::Tensor& x, const RowWeights& w, int64_t n0, int64_t n1,
                             const radixserve::Epilogue& out) {
  using Decoded = gr::Float<gr::BF16>;
  if constexpr (std::is_same_v<T, Decoded>) return linear_channels<T, true>(x, w, n0, n1, out);  // decoded already
  const int64_t k = w.in_features, ldw = k * 2;
  std::vector<uint16_t> buf(kChunk * k);
  int64_t chunk = n0, decoded_until = n0;  // buf holds channels chunk..decoded_until
  const uint16_t* xp = static_cast<const uint16_t*>(x.data_ptr());
  radixserve::walk_decode_tiles<kRowTile, kChunk>(x.size(0), n0, n1, out, [&](int64_t r0, int tile, int64_t n,
                                                                               int64_t c1, float* sums) {
    if (n >= decoded_until) {  // a chunk's first tile
      decode_chunk<T>(w, n, c1, buf.data());
      chunk = n;
      decoded_until = c1;
    }
    const uint8_t* rows = reinterpret_cast<const uint8_t*>(buf.data() + (n - chunk) * k);
    return tile_rows<Decoded, true>(tile, n + channels_for(tile) > c1, xp + r0 * k, k, rows, ldw, k / 32, sums);
  });
}
#endif

}  // namespace avx512
#endif

// x [M, K] @ W.T (+ bias) (+ residual) in x's dtype, summed in float32, added before the one rounding (Epilogue).
at::Tensor linear_op(const at::Tensor& x, const at::Tensor& raw, int64_t qtype, int64_t in_features,
                     const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& residual) {
  const RowWeights w = check_raw(raw, qtype, in_features);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == in_features && x.device().is_cpu(), "x [M, K] on CPU, weights [N, K]");
  at::Tensor out;
  const radixserve::Epilogue epilogue =
      radixserve::make_epilogue(x, raw.size(0), out, std::nullopt, bias, residual, false);
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  gr::dispatch(qtype, [&](auto t) {
    using T = decltype(t);
#ifdef RADIXSERVE_BLOCK_AVX512BF16
    if constexpr (T::kCodes) {
      if (bf16) {
        const at::Tensor xc = x.contiguous(), xsum = avx512::half_sums(xc);
        at::parallel_for(0, raw.size(0), 16, [&](int64_t n0, int64_t n1) {
          avx512::linear_channels_codes<T>(xc, xsum, w, n0, n1, epilogue);
        });
        return;
      }
    }
    if (bf16) {
      const at::Tensor xc = x.contiguous();
      at::parallel_for(0, raw.size(0), 16, [&](int64_t n0, int64_t n1) {
        if (x.size(0) > avx512::kRowTile) avx512::linear_channels_decoded<T>(xc, w, n0, n1, epilogue);
        else avx512::linear_channels<T, true>(xc, w, n0, n1, epilogue);
      });
      return;
    }
#endif
    const at::Tensor xf = x.to(at::kFloat).contiguous();
#ifdef RADIXSERVE_BLOCK_AVX512
    if (!bf16) {
      at::parallel_for(0, raw.size(0), 16, [&](int64_t n0, int64_t n1) {
        avx512::linear_channels<T, false>(xf, w, n0, n1, epilogue);
      });
      return;
    }
#endif
#ifdef RADIXSERVE_ROWS_AVX2
    return avx2::linear<T>(xf, bf16, w, epilogue);
#endif
    at::parallel_for(0, raw.size(0), 16, [&](int64_t n0, int64_t n1) {
      linear_portable<T>(xf.data_ptr<float>(), x.size(0), bf16, w, n0, n1, epilogue);
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixserve, m) {
  m.def("gguf_rows_dequantize(Tensor raw, int qtype, int in_features) -> Tensor");
  m.def(
      "gguf_rows_linear(Tensor x, Tensor raw, int qtype, int in_features, Tensor? bias=None, "
      "Tensor? residual=None) -> Tensor");
  m.def(
      "gguf_rows_linear_tiled(Tensor x, Tensor raw, int qtype, int in_features, Tensor? bias, int tile_columns) -> "
      "Tensor");
  m.def(
      "gguf_rows_linear_tiled_add_(Tensor(a!) residual, Tensor x, Tensor raw, int qtype, int in_features, "
      "int tile_columns) -> Tensor(a!)");
}

TORCH_LIBRARY_IMPL(radixserve, CPU, m) {
  m.impl("gguf_rows_dequantize", &dequantize_op);
  m.impl("gguf_rows_linear", &linear_op);
  m.impl("gguf_rows_linear_tiled", &linear_tiled_op);
  m.impl("gguf_rows_linear_tiled_add_", &linear_tiled_add_op);
}
