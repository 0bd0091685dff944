// The AVX512-VNNI int8-activation linear (block_q8_linear.cpp) at any row count: one kernel for decode and
// prefill, so a row's bits never depend on how many rows share its call (split invariance) and prefill runs at
// integer-GEMM speed. Included by block_q8_linear.cpp and gguf_rows_q8_linear.cpp; plain C++ with intrinsics.
//
// The math of output (row r, channel c), for Q4_0, Q4_1 and Q8_0 weights, and (gguf_rows_q8.h) the GGUF row types
// Q4_K, Q5_K, Q6_K, Q5_0, Q5_1, each a block of 32 weights = unsigned codes q with a float scale (and min):
//   I_b   = the exact integer dot product of block b (Q4_0: q . x - 8 sum(x); Q4_1, Q4_K, Q5_K, Q5_1: q . x;
//           Q5_0: q . x - 16 sum(x); Q8_0: w . x; Q6_K: sc_a (q_a . x_a - 32 sum(x_a)) + sc_b (..b), a and b its
//           halves of 16 weights, sc their int8 sub-block scales)
//   acc   = 0; for b = 0, 1, ...: acc = fma(float(I_b), d_cb * s_rb, acc)        (d * s rounded first)
//                                with a min: acc = fma(m_cb, s_rb * sum(x_b), acc) (s * sum rounded first)
// (Q4_K / Q5_K: d = d * sc_j and m = -dmin * m_j of its sub-block, exact products; Q6_K: d its super-block's)
// one float32 accumulator per (row, channel), blocks in order, no final reduction. The integers are exact
// however they are summed, so the weights can be laid out for the instruction (below) and the float steps are
// the only rounding, the same sequence at every row count.
//
// Weights go through a panel: 16 channels' codes rearranged once per call so that one vpdpbusd takes 4 codes
// of each of the 16 channels against 4 codes of a row broadcast: dword t of a block's 512 bytes holds weights
// 4t..4t+3 of channels 0..15 (Q4: unsigned 0..15; Q8_0: w + 128, made up by a -128 sum(x) start), so a
// block is 8 vpdpbusd per 16 channels with no horizontal sum, and the panel (blocks * 512 bytes, in L1/L2) is
// read again by every tile of rows. Up to kStreamRows rows (decode) skip the panel: each cache line of weights is
// rearranged in registers and used at once (stream_tile), the same integers and float steps.
//
// Where the weights come from is a Source (Channels<F> below for Q4_0 / Q4_1 / Q8_0 blocks, gguf_rows_q8.h's
// RowChannels for the GGUF row types): select(n0) picks 16 channels; lines(b0, count, panels, line) transposes a
// cache line of each (kBlocks blocks), dword(line, k, j) makes block k's panel dword j from it (16 channels an
// instruction), scales(d, m, sc) writes their [blocks][16] scales; where kLineScales, line_d(line, k) and
// line_m(line, k) give block k's from the line itself (the few-row kernel then skips scales).
//
// SmolLM2 Q4_0's 30 layers of linears, 1 thread, AMX Xeon: 512 rows 250 ms against the previous int8 kernel's
// 860 (which re-decoded each weight block for every tile of 8 rows and kept 8 float partial sums an output),
// 16 rows 14 against 27 ms, 1 row (weights from DRAM) 3.4-3.5 against 3.95-4.05 ms.
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__) && \
    defined(__F16C__)
#define RADIXSERVE_Q8_PANELS 1
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace radixserve::q8 {

enum class Format { kQ4_0, kQ4_1, kQ8_0, kQ4_K, kQ5_K, kQ6_K, kQ5_0, kQ5_1 };

// The formats whose blocks add a min term (m times the activation block's s * sum).
constexpr bool has_min(Format f) {
  return f == Format::kQ4_1 || f == Format::kQ4_K || f == Format::kQ5_K || f == Format::kQ5_1;
}

constexpr int kLanes = 16;                   // channels per panel (one zmm of float32 or int32)
constexpr int64_t kPanelBlock = 8 * 64;      // bytes of one block of a panel: 8 dwords x 16 channels
constexpr int kRowTile = 6;                  // rows per tile (at most)
constexpr int kMaxPanels = 4;                // panels filled at once (64 channels)
constexpr int kStreamRows = 4;               // up to these rows, weights are read as the dot products go
constexpr int panels_for(int rows) { return rows <= 2 ? 4 : 2; }  // panels per tile: accumulators R x C <= 12
// Q6_K holds a second integer per output (its first half's scaled dot) while the second half sums: 4 rows a tile.
constexpr int row_tile(Format f) { return f == Format::kQ6_K ? 4 : kRowTile; }

// The weights a few-row call streams are prefetched kPrefetchPanels panels ahead into L2 (T1), not L1 (T0), whose
// few miss buffers each prefetch held for the whole trip. SmolLM2 Q8_0's linears, a decode step's worth of one-row
// calls (bare ops, 1 thread, thread time, load ~5): main's T0 two panels on 15.0 ms, this (and the Q8_0 / Q4
// scales' prefetch in Channels::scales) 14.8; a wall-clock sweep at load ~4 read 24.2 (T0, 2), 23.5 (T0, 4), 17.4
// (T1, 4), 18.0 (T1, 8), 17.7 (T2, 4), 45.5 (none). Q4_K_M's (its Q5_0 arithmetic the bound) within noise.
constexpr int kPrefetchPanels = 4;
__attribute__((always_inline)) inline void prefetch(const void* p) {
  _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1);
}

// Activation rows as int8 blocks (block_q8_rows.h's Q8Rows, as pointers): scales s, s * sum(codes) (the min
// term) and the integer start of each block's dot (Q4_0: -8 sum; Q5_0: -16 sum; Q8_0: -128 sum; Q6_K: -32 sum of
// the first 16 codes, starts2 of the last 16; with a min: unused), [rows, ld].
struct Rows {
  const int8_t* codes;  // [rows, in_features]
  const float* scales;
  const float* sums;
  const int32_t* starts;
  int64_t in_features, ld;
  const int32_t* starts2 = nullptr;  // Q6_K
};

struct Panels {
  const uint8_t* codes;  // [panels][blocks][kPanelBlock]
  const float* d;        // [panels][blocks][16]
  const float* m;        // [panels][blocks][16] (with a min)
  int64_t blocks;
  const int32_t* sc = nullptr;  // [panels][blocks][2][16] (Q6_K: each half's sub-block scale)
};

// r[c] -> r[j] lane c = r[c] lane j (a 16 x 16 transpose of dwords): unpacks of dwords and of pairs give each
// 128-bit lane four rows of a column, then a 4 x 4 transpose of those lanes.
__attribute__((always_inline)) inline void transpose16x16(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // u[4i + j]'s lane L: column 4L + j of rows 4i .. 4i + 3
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int j = 0; j < 4; ++j) {
    const __m512i a = _mm512_shuffle_i32x4(u[j], u[4 + j], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512i b = _mm512_shuffle_i32x4(u[j], u[4 + j], _MM_SHUFFLE(3, 2, 3, 2));
    const __m512i c = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512i d = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], _MM_SHUFFLE(3, 2, 3, 2));
    r[j] = _mm512_shuffle_i32x4(a, c, _MM_SHUFFLE(2, 0, 2, 0));
    r[4 + j] = _mm512_shuffle_i32x4(a, c, _MM_SHUFFLE(3, 1, 3, 1));
    r[8 + j] = _mm512_shuffle_i32x4(b, d, _MM_SHUFFLE(2, 0, 2, 0));
    r[12 + j] = _mm512_shuffle_i32x4(b, d, _MM_SHUFFLE(3, 1, 3, 1));
  }
}

// A step of a Source's weights, 16 channels at once: the transpose of a cache line of each channel's bytes (r[j]:
// dword j of every channel), and of up to 8 more dwords (h: a K-quant's high bits), from which Source::dword makes
// the panel's dwords of each of the line's Source::kBlocks blocks.
struct Line {
  __m512i r[16];
  __m512i h[8];
};

// Float16 scales of 16 channels (h[c] + b0, `count` <= 16 blocks) as float32 into out[b][16] for b < count.
inline void scales_panel(const uint16_t* const* h, int64_t b0, int count, float* out) {
  const __mmask16 valid = static_cast<__mmask16>((1u << count) - 1);
  __m512i r[16];
  for (int c = 0; c < kLanes; ++c)
    r[c] = _mm512_castps_si512(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(valid, h[c] + b0)));
  transpose16x16(r);
  for (int b = 0; b < count; ++b) _mm512_storeu_si512(out + b * kLanes, r[b]);
}

// d (and Q4_1's m) of 16 channels as float32 [blocks][16].
inline void fill_scales(const uint16_t* const* d, const uint16_t* const* m, Format f, int64_t blocks, float* dp,
                        float* mp) {
  for (int64_t b0 = 0; b0 < blocks; b0 += 16) {
    const int count = static_cast<int>(std::min<int64_t>(16, blocks - b0));
    scales_panel(d, b0, count, dp + b0 * kLanes);
    if (f == Format::kQ4_1) scales_panel(m, b0, count, mp + b0 * kLanes);
  }
}

// Loads channels' cache lines (4 Q4 blocks, 2 Q8_0 ones, from block b0; count of them there) transposed: dword
// j of block k's codes is r[4k + j] (Q8_0: r[8k + j]).
__attribute__((always_inline)) inline void load_lines(const uint8_t* const* rows, int64_t b0, int count, int64_t bytes,
                                                     int64_t ahead, __m512i r[16]) {
  const __mmask16 valid = static_cast<__mmask16>((1u << (count * bytes / 4)) - 1);
  for (int c = 0; c < kLanes; ++c) {
    prefetch(rows[c] + b0 * bytes + ahead);
    r[c] = _mm512_maskz_loadu_epi32(valid, rows[c] + b0 * bytes);
  }
  transpose16x16(r);
}

// One panel: the 16 channels `src` selected (a partial panel repeats its last channel), a line of each channel at
// a time (src.lines), each of its blocks' 8 dwords made by Source::dword, and their scales (src.scales).
template <Format F, typename Source>
void fill_panel(const Source& src, int64_t blocks, uint8_t* codes, float* dp, float* mp, int32_t* sp) {
  constexpr int64_t per_line = Source::kBlocks;
  Line line;
  for (int64_t b0 = 0; b0 < blocks; b0 += per_line) {
    const int count = static_cast<int>(std::min<int64_t>(per_line, blocks - b0));
    src.lines(b0, count, 1, line);
#pragma GCC unroll 4
    for (int k = 0; k < per_line; ++k) {
      if (k >= count) break;
      __m512i* out = reinterpret_cast<__m512i*>(codes + (b0 + k) * kPanelBlock);
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) _mm512_storeu_si512(out + j, Source::dword(line, k, j));
    }
  }
  src.scales(dp, mp, sp);
}

// The float steps of block b for row r (see the header): acc = fma(float(dot), d * s, acc), then Q4_1's
// fma(m, s * sum, acc) where the format has a min; d (and m) 16 channels' scales of the block.
template <Format F>
__attribute__((always_inline)) inline __m512 add_block(__m512 acc, __m512i dot, __m512 d, __m512 m, const Rows& x,
                                                       int r, int64_t b) {
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d, _mm512_set1_ps(x.scales[r * x.ld + b])), acc);
  if constexpr (has_min(F)) acc = _mm512_fmadd_ps(m, _mm512_set1_ps(x.sums[r * x.ld + b]), acc);
  return acc;
}

// 16 channels' mins of a block (zeros for the formats without one: never read).
template <Format F>
__attribute__((always_inline)) inline __m512 load_mins(const float* m) {
  return has_min(F) ? _mm512_loadu_ps(m) : _mm512_setzero_ps();
}

// The integer start of block b's dot for row r, in every lane.
template <Format F>
__attribute__((always_inline)) inline __m512i block_start(const Rows& x, int r, int64_t b) {
  return has_min(F) ? _mm512_setzero_si512() : _mm512_set1_epi32(x.starts[r * x.ld + b]);
}

// Q6_K, after the first half's dwords: half = sc_a * dot (the first half's integer), dot restarts at the second
// half's start; after the second: dot = half + sc_b * dot. sc: 16 channels' [2][16] scales of the block.
__attribute__((always_inline)) inline void q6_first_half(__m512i& dot, __m512i& half, const int32_t* sc,
                                                         const Rows& x, int r, int64_t b) {
  half = _mm512_mullo_epi32(dot, _mm512_loadu_si512(sc));
  dot = _mm512_set1_epi32(x.starts2[r * x.ld + b]);
}

__attribute__((always_inline)) inline __m512i q6_both_halves(__m512i dot, __m512i half, const int32_t* sc) {
  return _mm512_add_epi32(half, _mm512_mullo_epi32(dot, _mm512_loadu_si512(sc + kLanes)));
}

// Four codes of row r from byte `at` of its block b, in every lane.
__attribute__((always_inline)) inline __m512i four_codes(const Rows& x, int r, int64_t b, int at) {
  int32_t four;
  std::memcpy(&four, x.codes + r * x.in_features + b * 32 + at, 4);
  return _mm512_set1_epi32(four);
}

// R (few: decode) rows against the 16 channels `src` selected, read straight from the weights: each cache line's
// transpose feeds the dot products at once, so reading the weights overlaps the arithmetic (through a filled
// panel, a read phase of its own, one row took 1.7x the time). The same integers and float steps as `tile`.
template <int R, Format F, typename Source>
void stream_tile(const Rows& x, const Source& src, const float* dp, const float* mp, const int32_t* sp,
                 int64_t blocks, float* out, int64_t ldo) {
  constexpr int64_t per_line = Source::kBlocks;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  Line line;
  for (int64_t b0 = 0; b0 < blocks; b0 += per_line) {
    const int count = static_cast<int>(std::min<int64_t>(per_line, blocks - b0));
    // Prefetched: the line kPrefetchPanels on (a channel's row is a few lines: too short a stream for the hardware's).
    src.lines(b0, count, kPrefetchPanels, line);
#pragma GCC unroll 4
    for (int k = 0; k < per_line; ++k) {
      if (k >= count) break;
      const int64_t b = b0 + k;
      __m512i dot[R], half[R];
      for (int r = 0; r < R; ++r) dot[r] = block_start<F>(x, r, b);
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        const __m512i w = Source::dword(line, k, j);
        for (int r = 0; r < R; ++r) dot[r] = _mm512_dpbusd_epi32(dot[r], w, four_codes(x, r, b, 4 * j));
        if constexpr (F == Format::kQ6_K)
          if (j == 3)
            for (int r = 0; r < R; ++r) q6_first_half(dot[r], half[r], sp + b * 2 * kLanes, x, r, b);
      }
      if constexpr (F == Format::kQ6_K)
        for (int r = 0; r < R; ++r) dot[r] = q6_both_halves(dot[r], half[r], sp + b * 2 * kLanes);
      __m512 d, m;
      if constexpr (Source::kLineScales) {
        d = Source::line_d(line, k);
        m = has_min(F) ? Source::line_m(line, k) : _mm512_setzero_ps();
      } else {
        d = _mm512_loadu_ps(dp + b * kLanes);
        m = load_mins<F>(has_min(F) ? mp + b * kLanes : nullptr);
      }
      for (int r = 0; r < R; ++r) acc[r] = add_block<F>(acc[r], dot[r], d, m, x, r, b);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * ldo, acc[r]);
}

// R rows against C panels (16 C channels): out[r * ldo + 16 c + lane] = the (row, channel) sum of the header.
template <int R, int C, Format F>
void tile(const Rows& x, const Panels& w, float* out, int64_t ldo) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  const int64_t codes_stride = w.blocks * kPanelBlock, floats_stride = w.blocks * kLanes;
  for (int64_t b = 0; b < w.blocks; ++b) {
    __m512i dot[R][C], half[R][C];
    for (int r = 0; r < R; ++r) {
      const __m512i start = block_start<F>(x, r, b);
      for (int c = 0; c < C; ++c) dot[r][c] = start;
    }
    const uint8_t* block = w.codes + b * kPanelBlock;
#pragma GCC unroll 8
    for (int t = 0; t < 8; ++t) {
      __m512i wt[C];
      for (int c = 0; c < C; ++c) wt[c] = _mm512_loadu_si512(block + c * codes_stride + 64 * t);
      for (int r = 0; r < R; ++r) {
        const __m512i xr = four_codes(x, r, b, 4 * t);
        for (int c = 0; c < C; ++c) dot[r][c] = _mm512_dpbusd_epi32(dot[r][c], wt[c], xr);
      }
      if constexpr (F == Format::kQ6_K)
        if (t == 3)
          for (int r = 0; r < R; ++r)
            for (int c = 0; c < C; ++c)
              q6_first_half(dot[r][c], half[r][c], w.sc + 2 * (c * floats_stride + b * kLanes), x, r, b);
    }
    if constexpr (F == Format::kQ6_K)
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c)
          dot[r][c] = q6_both_halves(dot[r][c], half[r][c], w.sc + 2 * (c * floats_stride + b * kLanes));
    for (int c = 0; c < C; ++c) {
      const __m512 d = _mm512_loadu_ps(w.d + c * floats_stride + b * kLanes);
      const __m512 m = load_mins<F>(has_min(F) ? w.m + c * floats_stride + b * kLanes : nullptr);
      for (int r = 0; r < R; ++r) acc[r][c] = add_block<F>(acc[r][c], dot[r][c], d, m, x, r, b);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(out + r * ldo + kLanes * c, acc[r][c]);
}

template <Format F>
void run_tile(int rows, int panels, const Rows& x, const Panels& w, float* out, int64_t ldo) {
  switch (rows) {
#define RADIXSERVE_Q8_TILE(R)                                                    \
  case R:                                                                        \
    if (panels < panels_for(R)) return tile<R, 1, F>(x, w, out, ldo);            \
    return tile<R, panels_for(R), F>(x, w, out, ldo);
    RADIXSERVE_Q8_TILE(1) RADIXSERVE_Q8_TILE(2) RADIXSERVE_Q8_TILE(3)
#undef RADIXSERVE_Q8_TILE
    case 4:
      if (panels < panels_for(4)) return tile<4, 1, F>(x, w, out, ldo);
      return tile<4, panels_for(4), F>(x, w, out, ldo);
    case 5:
      if constexpr (row_tile(F) >= 5) {
        if (panels < panels_for(5)) return tile<5, 1, F>(x, w, out, ldo);
        return tile<5, panels_for(5), F>(x, w, out, ldo);
      }
      [[fallthrough]];
    default:
      if (panels < panels_for(row_tile(F))) return tile<row_tile(F), 1, F>(x, w, out, ldo);
      return tile<row_tile(F), panels_for(row_tile(F)), F>(x, w, out, ldo);
  }
}

// The 16 channels of a panel of Q4_0 / Q4_1 / Q8_0 blocks (a Source, as gguf_rows_q8.h's RowChannels): qs rows
// row_bytes apart, d and m (float16 bits) blocks apart; a channel past n1 is a copy of the last one (its output is
// never stored). select(n0) picks channels n0..n0+15; lines and scales read them.
template <Format F>
struct Channels {
  const uint8_t* qs;
  const uint16_t *d, *m;
  int64_t row_bytes, blocks, n1;
  const uint8_t* rows[kLanes] = {};
  const uint16_t *ds[kLanes] = {}, *ms[kLanes] = {};

  void select(int64_t n0) {
    for (int c = 0; c < kLanes; ++c) {
      const int64_t n = std::min(n0 + c, n1 - 1);
      rows[c] = qs + n * row_bytes;
      ds[c] = d + n * blocks;
      ms[c] = m == nullptr ? nullptr : m + n * blocks;
    }
  }

  // Q4: a line is 4 blocks of 16 bytes, weights 0..15 the low nibbles, 16..31 the high ones, so the panel's dwords
  // j and 4 + j of block k are the low and high nibbles of dword 4k + j; Q8_0: 2 blocks, dword 8k + j, made
  // unsigned (w + 128: the start's -128 sum(x) makes up for it).
  static constexpr int64_t kBlocks = F == Format::kQ8_0 ? 2 : 4;
  static constexpr bool kLineScales = false;  // scales() converts them (a line holds codes only)
  static __m512 line_d(const Line&, int) { return _mm512_setzero_ps(); }
  static __m512 line_m(const Line&, int) { return _mm512_setzero_ps(); }

  // The selected channels' cache lines from block b0 on (count blocks), transposed; prefetching `panels` panels on.
  __attribute__((always_inline)) void lines(int64_t b0, int count, int panels, Line& line) const {
    constexpr int64_t bytes = F == Format::kQ8_0 ? 32 : 16;
    load_lines(rows, b0, count, bytes, panels * kLanes * blocks * bytes, line.r);
  }

  __attribute__((always_inline)) static __m512i dword(const Line& line, int k, int j) {
    if constexpr (F == Format::kQ8_0) return _mm512_xor_si512(line.r[8 * k + j], _mm512_set1_epi8(-128));
    const __m512i v = line.r[4 * k + j % 4];
    return _mm512_and_si512(j < 4 ? v : _mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F));
  }

  // Also prefetches the scales (and mins) of the panel kPrefetchPanels on: a stream apart from the codes, whose
  // misses stalled each panel's start (the wall-clock sweep above at T0, 2 panels: 29.5 -> 24.2 ms).
  void scales(float* dp, float* mp, int32_t*) const {
    const int64_t ahead = 2 * kPrefetchPanels * kLanes * blocks, bytes = 2 * kLanes * blocks;  // bytes of float16
    for (int64_t at = 0; at < bytes; at += 64) {
      prefetch(reinterpret_cast<const uint8_t*>(ds[0]) + ahead + at);  // a prefetch past the end never faults
      if (F == Format::kQ4_1) prefetch(reinterpret_cast<const uint8_t*>(ms[0]) + ahead + at);
    }
    fill_scales(ds, ms, F, blocks, dp, mp);
  }
};

template <Format F, typename Source>
void run_stream_tile(int rows, const Rows& x, const Source& src, const float* dp, const float* mp, const int32_t* sp,
                     int64_t blocks, float* out, int64_t ldo) {
  switch (rows) {
    case 1: return stream_tile<1, F>(x, src, dp, mp, sp, blocks, out, ldo);
    case 2: return stream_tile<2, F>(x, src, dp, mp, sp, blocks, out, ldo);
    case 3: return stream_tile<3, F>(x, src, dp, mp, sp, blocks, out, ldo);
    default: return stream_tile<kStreamRows, F>(x, src, dp, mp, sp, blocks, out, ldo);
  }
}

// Scratch for one panel's scales (and up to kMaxPanels'): d, the mins, Q6_K's integer scales.
template <Format F>
struct PanelScales {
  std::vector<float> d, m;
  std::vector<int32_t> sc;
  PanelScales(int64_t blocks, int panels)
      : d(panels * blocks * kLanes), m(has_min(F) ? d.size() : 0), sc(F == Format::kQ6_K ? 2 * d.size() : 0) {}
  float* dp(int64_t p, int64_t blocks) { return d.data() + p * blocks * kLanes; }
  float* mp(int64_t p, int64_t blocks) { return has_min(F) ? m.data() + p * blocks * kLanes : nullptr; }
  int32_t* sp(int64_t p, int64_t blocks) { return F == Format::kQ6_K ? sc.data() + 2 * p * blocks * kLanes : nullptr; }
};

// Up to kStreamRows rows (decode): a panel at a time, its weights read as the dot products go (stream_tile).
template <Format F, typename Source, typename Store>
void stream_channels(const Rows& x, int64_t rows, Source& src, int64_t n0, const Store& store) {
  PanelScales<F> s(src.blocks, 1);
  float sums[kStreamRows * kLanes];
  for (int64_t c0 = n0; c0 < src.n1; c0 += kLanes) {
    src.select(c0);
    if constexpr (!Source::kLineScales) src.scales(s.dp(0, src.blocks), s.mp(0, src.blocks), s.sp(0, src.blocks));
    run_stream_tile<F>(static_cast<int>(rows), x, src, s.dp(0, src.blocks), s.mp(0, src.blocks),
                       s.sp(0, src.blocks), src.blocks, sums, kLanes);
    for (int r = 0; r < rows; ++r) store(r, c0, std::min<int64_t>(kLanes, src.n1 - c0), sums + r * kLanes);
  }
}

// Every row's outputs for channels n0..src.n1 through `store(row, n, count, sums)`. Few rows: stream_channels;
// more: up to kMaxPanels panels filled (their codes rearranged once), then every tile of rows against them.
template <Format F, typename Source, typename Store>
void linear_channels(const Rows& x, int64_t rows, Source& src, int64_t n0, const Store& store) {
  if (rows <= kStreamRows) return stream_channels<F>(x, rows, src, n0, store);
  const int64_t blocks = src.blocks;
  std::vector<uint8_t> codes(kMaxPanels * blocks * kPanelBlock);
  PanelScales<F> s(blocks, kMaxPanels);
  std::vector<float> sums(kRowTile * kMaxPanels * kLanes);
  for (int64_t c0 = n0; c0 < src.n1; c0 += kMaxPanels * kLanes) {
    const int64_t c1 = std::min(src.n1, c0 + kMaxPanels * kLanes);
    const int panels = static_cast<int>((c1 - c0 + kLanes - 1) / kLanes);
    for (int p = 0; p < panels; ++p) {
      src.select(c0 + p * kLanes);
      fill_panel<F>(src, blocks, codes.data() + p * blocks * kPanelBlock, s.dp(p, blocks), s.mp(p, blocks),
                    s.sp(p, blocks));
    }
    constexpr int64_t ldo = kMaxPanels * kLanes;
    for (int64_t r0 = 0; r0 < rows; r0 += row_tile(F)) {
      const int tile_rows = static_cast<int>(std::min<int64_t>(row_tile(F), rows - r0));
      const Rows xr{x.codes + r0 * x.in_features, x.scales + r0 * x.ld, x.sums + r0 * x.ld, x.starts + r0 * x.ld,
                    x.in_features, x.ld, x.starts2 == nullptr ? nullptr : x.starts2 + r0 * x.ld};
      for (int p = 0; p < panels;) {
        const Panels panel{codes.data() + p * blocks * kPanelBlock, s.dp(p, blocks), s.mp(p, blocks), blocks,
                           s.sp(p, blocks)};
        const int left = panels - p;
        run_tile<F>(tile_rows, left, xr, panel, sums.data() + p * kLanes, ldo);
        p += left < panels_for(tile_rows) ? 1 : panels_for(tile_rows);
      }
      for (int r = 0; r < tile_rows; ++r) store(r0 + r, c0, c1 - c0, sums.data() + r * ldo);
    }
  }
}

}  // namespace radixserve::q8

#endif
