// Weight-only linear over GGUF-style blocks of 32 weights, for few rows (decode), float32 activations.
//   Q4_1: w = d * q + m, q in 0..15 (byte j of a block: low nibble = weight j, high nibble = weight j + 16)
//   Q8_0: w = d * q,     q int8
// d and m are float16, one per block. Batch-1 decode is bound by reading weights: Q4_1 reads
// 0.625 bytes per weight where float32 reads 4. The min is folded out of the inner loop:
//   out[r][n] = sum_b d_b * (x_rb . q_b) + sum_b m_b * sum(x_rb)
// so the inner loop converts q to float and multiplies; sum(x_rb) is taken once per call.
// Each block of a weight row is decoded once into registers per tile of up to 8 rows.
// Every row goes through the same sequence of operations whatever its tile or batch: a
// row's result is bitwise the same alone or batched (batch composition changes nothing).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <cstdint>
#include <optional>
#include <type_traits>
#include <vector>

#include "block_common.h"
#include "block_bf16_fma.h"

namespace {

using radixserve::BlockWeights;
using radixserve::check_blocks;
using radixserve::chunk_scales;
using radixserve::kBlock;
using radixserve::padded;
#ifdef RADIXSERVE_BLOCK_AVX2
using radixserve::hsum;
#endif

// Rows sharing one decode of a weight block: 4 decoded + 10 accumulators + the scale and a product fill
// AVX2's 16 registers. Measured on SmolLM2's linears at 16 rows: tiles of 4, 6, 8 ran 0.91x, 0.76x, 0.68x float32's
// time; on a Zen 3 (`bench block-linears --paths kernel`), 9 rows as one tile of 9 took 38.7 ms against 45.1 as 8 + 1
// (8 rows 34.9): a verify of 8 drafts is 9 rows.
constexpr int kRowTile = 10;

#ifdef RADIXSERVE_BLOCK_AVX2
// One 32-bit word of codes, broadcast to 8 lanes, shifted by 4 bits more in each lane: lanes hold
// weights 4t, 4t+16, 4t+1, 4t+17, ... (word t's low and high nibbles in turn). No lane-crossing
// shuffles (the port they share was the bottleneck); x is permuted to this order once per call.
inline void decode_q4(const uint8_t* q, __m256* w) {
  const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
  const __m256i mask = _mm256_set1_epi32(0x0F);
  for (int t = 0; t < 4; ++t) {
    int32_t word;
    std::memcpy(&word, q + 4 * t, sizeof(word));
    w[t] = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(word), shifts), mask));
  }
}

// x in decode_q4's lane order, block by block: [rows, K] -> [rows, K].
at::Tensor q4_lane_order(const at::Tensor& x) {
  at::Tensor out = at::empty_like(x);
  const float* src = x.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  for (int64_t base = 0; base < x.numel(); base += kBlock)
    for (int t = 0; t < 4; ++t)
      for (int j = 0; j < 4; ++j) {
        dst[base + 8 * t + 2 * j] = src[base + 4 * t + j];
        dst[base + 8 * t + 2 * j + 1] = src[base + 4 * t + j + 16];
      }
  return out;
}

inline void decode_q8(const uint8_t* q, __m256* w) {
  for (int i = 0; i < 4; ++i)
    w[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * i))));
}


// R rows of x against one weight row: sum_b d_b * (x_rb . q_b) [+ sum_b m_b * xsum_rb].
template <int R, bool Q4>
void dot_rows(const float* x, int64_t ldx, const float* xsum, int64_t ldxs, const uint8_t* qs, const float* d,
              const float* m, int64_t blocks, float* sums) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m256 w[4];
    if constexpr (Q4) decode_q4(qs + b * 16, w);
    else decode_q8(qs + b * kBlock, w);
    const __m256 scale = _mm256_broadcast_ss(d + b);
    for (int r = 0; r < R; ++r) {
      const float* xb = x + r * ldx + b * kBlock;
      __m256 p = _mm256_mul_ps(_mm256_loadu_ps(xb), w[0]);
      p = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 8), w[1], p);
      p = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 16), w[2], p);
      p = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 24), w[3], p);
      acc[r] = _mm256_fmadd_ps(scale, p, acc[r]);
    }
  }
  if constexpr (Q4) {
    for (int64_t b = 0; b < padded(blocks); b += 8) {
      const __m256 mins = _mm256_loadu_ps(m + b);
      for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(mins, _mm256_loadu_ps(xsum + r * ldxs + b), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) sums[r] = hsum(acc[r]);
}
#else
template <int R, bool Q4>
void dot_rows(const float* x, int64_t ldx, const float* xsum, int64_t ldxs, const uint8_t* qs, const float* d,
              const float* m, int64_t blocks, float* sums) {
  float acc[R] = {};
  for (int64_t b = 0; b < blocks; ++b) {
    float w[kBlock];
    for (int64_t j = 0; j < kBlock; ++j) {
      if constexpr (Q4) {
        const uint8_t byte = qs[b * 16 + (j & 15)];
        w[j] = static_cast<float>(j < 16 ? (byte & 0x0F) : (byte >> 4));
      } else {
        w[j] = static_cast<float>(static_cast<int8_t>(qs[b * kBlock + j]));
      }
    }
    for (int r = 0; r < R; ++r) {
      const float* xb = x + r * ldx + b * kBlock;
      float p = 0.f;
      for (int64_t j = 0; j < kBlock; ++j) p += xb[j] * w[j];
      acc[r] += d[b] * p;
    }
  }
  if constexpr (Q4)
    for (int r = 0; r < R; ++r)
      for (int64_t b = 0; b < blocks; ++b) acc[r] += m[b] * xsum[r * ldxs + b];
  for (int r = 0; r < R; ++r) sums[r] = acc[r];
}
#endif

template <bool Q4>
void tile_rows(int rows, const float* x, int64_t ldx, const float* xsum, int64_t ldxs, const uint8_t* qs,
               const float* d, const float* m, int64_t blocks, float* sums) {
  switch (rows) {
    case 1: return dot_rows<1, Q4>(x, ldx, xsum, ldxs, qs, d, m, blocks, sums);
    case 2: return dot_rows<2, Q4>(x, ldx, xsum, ldxs, qs, d, m, blocks, sums);
    case 3: return dot_rows<3, Q4>(x, ldx, xsum, ldxs, qs, d, m, blocks, sums);
    case 4: return dot_rows<4, Q4>(x, ldx, xsum, ldxs, qs, d, m, blocks, sums);
    case 5: return dot_rows<5, Q4>(x, ldx, xsum, ldxs, qs, d, m, blocks, sums);
    case 6: return dot_rows<6, Q4>(x, ldx, xsum, ldxs, qs, d, m, blocks, sums);
    case 7: return dot_rows<7, Q4>(x, ldx, xsum, ldxs, qs, d, m, blocks, sums);
    case 8: return dot_rows<8, Q4>(x, ldx, xsum, ldxs, qs, d, m, blocks, sums);
    case 9: return dot_rows<9, Q4>(x, ldx, xsum, ldxs, qs, d, m, blocks, sums);
    default: return dot_rows<10, Q4>(x, ldx, xsum, ldxs, qs, d, m, blocks, sums);
  }
}

// Output channels n0..n1 of every row. xsum [rows, padded(blocks)]: each block's sum of x (Q4_1's min term).
// A chunk of channels' weights (a few KiB, kept in L1/L2) is read once per tile of rows, so a tile's
// x rows stay in L1; reading all rows' x per channel spilled L1 at 16 rows of 1,536 features.
template <bool Q4>
void linear_channels(const float* x, int64_t rows, int64_t in_features, const float* xsum, const BlockWeights& w,
                     int64_t n0, int64_t n1, const radixserve::Epilogue& out) {
  constexpr int64_t kChunk = 16;
  const int64_t ldxs = padded(w.blocks);
  std::vector<float> d(kChunk * ldxs), m(kChunk * ldxs);
  float sums[kRowTile];
  // Balanced tiles (11 rows: 6 + 5, not 10 + 1): a tile of few rows pays a whole decode of the weights for them.
  const int64_t tiles = (rows + kRowTile - 1) / kRowTile, row_tile = (rows + tiles - 1) / tiles;
  for (int64_t c0 = n0; c0 < n1; c0 += kChunk) {
    const int64_t c1 = std::min(n1, c0 + kChunk);
    chunk_scales<Q4>(w, c0, c1, d.data(), m.data(), ldxs);
    for (int64_t r0 = 0; r0 < rows; r0 += row_tile) {
      const int tile = static_cast<int>(std::min<int64_t>(row_tile, rows - r0));
      for (int64_t n = c0; n < c1; ++n) {
        tile_rows<Q4>(tile, x + r0 * in_features, in_features, xsum + r0 * ldxs, ldxs, w.qs + n * w.qs_row_bytes,
                      d.data() + (n - c0) * ldxs, m.data() + (n - c0) * ldxs, w.blocks, sums);
        for (int r = 0; r < tile; ++r) out.store(r0 + r, n, sums[r]);
      }
    }
  }
}

#ifdef RADIXSERVE_BLOCK_AVX512
// AVX512, 16 lanes a register, a block's codes in their own order (weights 0..15, then 16..31: no permuted x).
// Float32 activations: the same math as above (the min folded out of the block loop). Bfloat16 activations
// (AVX512-BF16): Q4 blocks the same math again, x . (128 + q) in one vdpbf16ps (exact products), times d, with
// the min term m - 128 d against x's block sums: the exact weights, not rounded to bfloat16 (the GEMM path,
// block_gemm.cpp, multiplies by them rounded); Q8_0 blocks their weights d * q (times the channel's scale,
// int8 weight-only) rounded to bfloat16, as the GEMM path. Each (row, channel) has one accumulator, its blocks
// added in order: a row's bits never depend on its tile or batch.
namespace avx512 {

constexpr int kRowTile = 8;  // rows sharing one decode of a weight block
constexpr int64_t kChunk = 16;
constexpr int64_t kPrefetch = 4096;  // bytes ahead in the codes (an eighth of that in the scales)

inline int64_t padded16(int64_t blocks) { return (blocks + 15) / 16 * 16; }

// The mins of 16 blocks from m (Q4_1; zeros past valid), or with m nullptr Q4_0's -8d from their scales dc (exact).
inline __m512 mins16(const at::Half* m, __mmask16 valid, __m512 dc) {
  return m != nullptr ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(valid, m)) : _mm512_mul_ps(dc, _mm512_set1_ps(-8.f));
}

// Block b's codes as float32: weights 0..15 in lo, 16..31 in hi.
template <bool Q4>
inline void codes_f32(const uint8_t* qs, int64_t b, __m512& lo, __m512& hi) {
  if constexpr (Q4) {
    const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + b * 16)));
    lo = _mm512_cvtepi32_ps(_mm512_and_si512(c, _mm512_set1_epi32(0x0F)));
    hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(c, 4));
  } else {
    const __m128i* q = reinterpret_cast<const __m128i*>(qs + b * kBlock);
    lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q)));
    hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1)));
  }
}

#ifdef RADIXSERVE_BLOCK_AVX512BF16
// Block b of a Q4 weight row as 32 bfloat16 values 128 + q (exact: bits 0x4300 | q), codes in weight order. With
// bfloat16 x, x . (128 + q) is exact in each product, and the block's weights d * q + m = d * (128 + q) + (m - 128 d):
//   out = sum_b d_b * (x_b . (128 + q_b)) + sum_b (m_b - 128 d_b) * sum(x_b)
// One broadcast load, a widening, a shift, a ternary logic op: no table, no permute (a table of the block's 16
// weights d * q + m looked up by code took 1.5x the time: measured on a 3,072 x 576 GEMV in L2, 17 vs 26
// Gweights/s); and the weights are exact, not rounded to bfloat16.
inline __m512bh codes_bf16(const uint8_t* qs, int64_t b) {
  const __m512i z = _mm512_cvtepu8_epi16(_mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + b * 16))));
  const __m512i nibbles = _mm512_srlv_epi16(z, _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1));
  return (__m512bh)_mm512_ternarylogic_epi32(nibbles, _mm512_set1_epi16(0x0F), _mm512_set1_epi16(0x4300), 0xEA);
}

// The min term's weights of 16 Q4 blocks: m - 128 d (Q4_0: -136 d, exact; Q4_1: m and d float16, the difference
// rounded once in float32).
inline __m512 code_mins16(const at::Half* m, __mmask16 valid, __m512 dc) {
  return _mm512_fnmadd_ps(dc, _mm512_set1_ps(128.f), mins16(m, valid, dc));
}

// Block b of a Q8_0 weight row as the 32 bfloat16 weights the GEMM path multiplies by: scale * q rounded (scale:
// d, times the channel's wscale if any).
inline __m512bh q8_weights_bf16(const uint8_t* qs, int64_t b, float scale) {
  __m512 lo, hi;
  codes_f32<false>(qs, b, lo, hi);
  const __m512 sc = _mm512_set1_ps(scale);
  return _mm512_cvtne2ps_pbh(_mm512_mul_ps(sc, hi), _mm512_mul_ps(sc, lo));
}
#endif

#ifdef RADIXSERVE_BLOCK_AVX512BF16
// One (row, channel)'s block with bfloat16 x, the same in every kernel that runs it: Q4, + scale * (x . (128 + q));
// Q8_0, + x . bf16(scale * q).
template <bool Q4>
inline __m512 add_block_bf16(__m512 acc, __m512bh x, __m512bh w, float scale) {
  if constexpr (Q4) return _mm512_fmadd_ps(_mm512_set1_ps(scale), _mm512_dpbf16_ps(_mm512_setzero_ps(), x, w), acc);
  else return _mm512_dpbf16_ps(acc, x, w);
}
#endif

// R rows of x (float32, or bfloat16 when BF16) against C weight rows (codes, d, m each ldq / blocks apart):
// sums[r * kChunk + c] = sum_b d_cb * (x_rb . q_cb) + m_c . xsum_r (Q4; BF16: codes_bf16's 128 + q and mins
// m - 128 d); Q8_0 with BF16, x_r . bf16(w_c) with w = (d * wscale_c) * q where wscale is given. Each x block is
// loaded once for the C channels; scales are converted from float16 16 blocks at a time (min term: those 16
// blocks' m . xsum, one FMA).
template <int R, int C, bool Q4, bool BF16>
void dot_tile(const void* x, int64_t ldx, const float* xsum, int64_t ldxs, const uint8_t* qs, int64_t ldq,
              const at::Half* d, const at::Half* m, const float* wscale, int64_t blocks, float* sums) {
  __m512 acc[R][C];  // R * C >= 8 chains in flight: FMA latency is no bound
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  alignas(64) float scales[C][16];
  const auto block = [&](int64_t b) {
    if constexpr (BF16) {
#ifdef RADIXSERVE_BLOCK_AVX512BF16
      __m512bh w[C];
      for (int c = 0; c < C; ++c)
        w[c] = Q4 ? codes_bf16(qs + c * ldq, b) : q8_weights_bf16(qs + c * ldq, b, scales[c][b % 16]);
      for (int r = 0; r < R; ++r) {
        const __m512bh xb = (__m512bh)_mm512_loadu_si512(static_cast<const uint16_t*>(x) + r * ldx + b * kBlock);
        for (int c = 0; c < C; ++c) acc[r][c] = add_block_bf16<Q4>(acc[r][c], xb, w[c], scales[c][b % 16]);
      }
#endif
    } else {
      __m512 scale[C];
      for (int c = 0; c < C; ++c) scale[c] = _mm512_set1_ps(scales[c][b % 16]);
      __m512 lo[C], hi[C];
      for (int c = 0; c < C; ++c) codes_f32<Q4>(qs + c * ldq, b, lo[c], hi[c]);
      for (int r = 0; r < R; ++r) {
        const float* xb = static_cast<const float*>(x) + r * ldx + b * kBlock;
        const __m512 xlo = _mm512_loadu_ps(xb), xhi = _mm512_loadu_ps(xb + 16);
        for (int c = 0; c < C; ++c) {
          const __m512 p = _mm512_fmadd_ps(xhi, hi[c], _mm512_mul_ps(xlo, lo[c]));
          acc[r][c] = _mm512_fmadd_ps(scale[c], p, acc[r][c]);
        }
      }
    }
  };
  for (int64_t g = 0; g < blocks; g += 16) {
    const int64_t count = std::min<int64_t>(16, blocks - g);
    const __mmask16 valid = static_cast<__mmask16>((1u << count) - 1);
    const auto half16 = [&](const at::Half* h) {
      return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(valid, h + g));  // zeros past the last block
    };
    for (int c = 0; c < C; ++c) {
      radixserve::prefetch_channel<Q4>(qs, ldq, d, m, blocks, c, g, kPrefetch);
      // With wscale (int8 weight-only, whose block scales d are 1) the block's scale is d * wscale_c.
      const __m512 dc = half16(d + c * blocks);
      _mm512_store_ps(scales[c], wscale == nullptr ? dc : _mm512_mul_ps(dc, _mm512_set1_ps(wscale[c])));
      if constexpr (Q4) {
        const at::Half* mg = m == nullptr ? m : m + c * blocks + g;
        const __m512 mc = BF16 ? code_mins16(mg, valid, dc) : mins16(mg, valid, dc);
        for (int r = 0; r < R; ++r)
          acc[r][c] = _mm512_fmadd_ps(mc, _mm512_loadu_ps(xsum + r * ldxs + g), acc[r][c]);
      }
    }
    for (int64_t b = g; b < g + count; ++b) block(b);
  }
  radixserve::reduce_tile(acc, sums, kChunk);  // row r at sums + r * kChunk: the walk's chunk
}

// Channels per tile by rows: 8-16 accumulators, and each x block loaded once for C channels (measured on
// SmolLM2 at 4 rows, bfloat16: C = 4 with one accumulator each took 0.6x the time of C = 2 with two).
// Every (row, channel) runs the same operations whatever its tile.
constexpr int channels_for(int rows) { return rows <= 2 ? 8 : rows <= 4 ? 4 : 2; }

// rows (1..kRowTile) of x against channels n..n + channels_for(rows) (or just n when `single`) of the chunk.
template <bool Q4, bool BF16>
int tile_rows(int rows, bool single, const void* x, int64_t ldx, const float* xsum, int64_t ldxs, const uint8_t* qs,
              int64_t ldq, const at::Half* d, const at::Half* m, const float* wscale, int64_t blocks, float* sums) {
  switch (rows) {
#define RADIXSERVE_TILE(R)                                                                            \
  case R:                                                                                             \
    if (single) return dot_tile<R, 1, Q4, BF16>(x, ldx, xsum, ldxs, qs, ldq, d, m, wscale, blocks, sums), 1; \
    dot_tile<R, channels_for(R), Q4, BF16>(x, ldx, xsum, ldxs, qs, ldq, d, m, wscale, blocks, sums);          \
    return channels_for(R);
    RADIXSERVE_TILE(1) RADIXSERVE_TILE(2) RADIXSERVE_TILE(3) RADIXSERVE_TILE(4)
    RADIXSERVE_TILE(5) RADIXSERVE_TILE(6) RADIXSERVE_TILE(7)
#undef RADIXSERVE_TILE
    default:
      if (single) return dot_tile<kRowTile, 1, Q4, BF16>(x, ldx, xsum, ldxs, qs, ldq, d, m, wscale, blocks, sums), 1;
      dot_tile<kRowTile, channels_for(kRowTile), Q4, BF16>(x, ldx, xsum, ldxs, qs, ldq, d, m, wscale, blocks, sums);
      return channels_for(kRowTile);
  }
}

// Output channels n0..n1 of every row of x ([rows, K], float32, or bfloat16 when BF16); xsum [rows, padded16].
template <bool Q4, bool BF16>
void linear_channels(const at::Tensor& x, const float* xsum, const float* wscale, const BlockWeights& w, int64_t n0,
                     int64_t n1, const radixserve::Epilogue& out) {
  const int64_t rows = x.size(0), in_features = x.size(1), ldxs = padded16(w.blocks);
  const char* xp = static_cast<const char*>(x.data_ptr());
  const int64_t row_bytes = in_features * (BF16 ? 2 : 4);
  radixserve::walk_decode_tiles<kRowTile, kChunk>(rows, n0, n1, out, [&](int64_t r0, int tile, int64_t n, int64_t c1,
                                                                         float* sums) {
    return tile_rows<Q4, BF16>(tile, n + channels_for(tile) > c1, xp + r0 * row_bytes, in_features, xsum + r0 * ldxs,
                               ldxs, w.qs + n * w.qs_row_bytes, w.qs_row_bytes, w.d + n * w.blocks,
                               Q4 && w.m != nullptr ? w.m + n * w.blocks : nullptr,
                               wscale == nullptr ? nullptr : wscale + n, w.blocks,
                               sums);
  });
}

#ifdef RADIXSERVE_BLOCK_AVX512BF16
// A chunk of channels decoded once for every row tile (more rows than a tile, bfloat16 x): each block's 32
// bfloat16 weights (Q4: codes_bf16; Q8_0: q8_weights_bf16), and for Q4 each block's scale d and min m - 128 d
// as float32. Decoded per tile instead (dot_tile), 16 rows decode each block twice, on the ports the dot
// products need.
struct DecodedChunk {
  int64_t blocks, ld;           // blocks per channel; scales' row length, padded16(blocks)
  std::vector<uint16_t> w;      // channel c's block b at (c * blocks + b) * 32
  std::vector<float> d, m;      // Q4: channel c's block b at c * ld + b (zeros past the last block)
  DecodedChunk(int64_t blocks_) : blocks(blocks_), ld(padded16(blocks_)), w(kChunk * blocks_ * kBlock),
                                  d(kChunk * ld), m(kChunk * ld) {}
};

template <bool Q4>
void decode_chunk(const BlockWeights& w, const float* wscale, int64_t c0, int64_t c1, DecodedChunk& out) {
  alignas(64) float scales[16];
  for (int64_t n = c0; n < c1; ++n) {
    const uint8_t* qs = w.qs + n * w.qs_row_bytes;
    for (int64_t g = 0; g < w.blocks; g += 16) {
      const int64_t count = std::min<int64_t>(16, w.blocks - g);
      const __mmask16 valid = static_cast<__mmask16>((1u << count) - 1);
      const char* ahead = reinterpret_cast<const char*>(qs + g * (Q4 ? 16 : kBlock)) + kPrefetch;
      for (int line = 0; line < (Q4 ? 4 : 8); ++line) _mm_prefetch(ahead + 64 * line, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w.d + n * w.blocks + g) + kPrefetch / 8, _MM_HINT_T0);
      if (Q4 && w.m != nullptr)
        _mm_prefetch(reinterpret_cast<const char*>(w.m + n * w.blocks + g) + kPrefetch / 8, _MM_HINT_T0);
      const __m512 dc = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(valid, w.d + n * w.blocks + g));
      const int64_t at = (n - c0) * out.ld + g;
      if constexpr (Q4) {
        _mm512_storeu_ps(out.d.data() + at, dc);
        _mm512_storeu_ps(out.m.data() + at, code_mins16(w.m == nullptr ? w.m : w.m + n * w.blocks + g, valid, dc));
      } else {
        _mm512_store_ps(scales, wscale == nullptr ? dc : _mm512_mul_ps(dc, _mm512_set1_ps(wscale[n])));
      }
      for (int64_t b = g; b < g + count; ++b)
        _mm512_storeu_si512(out.w.data() + ((n - c0) * w.blocks + b) * kBlock,
                            (__m512i)(Q4 ? codes_bf16(qs, b) : q8_weights_bf16(qs, b, scales[b - g])));
    }
  }
}

// dot_tile's BF16 sums from a decoded chunk: R rows of x against its channels c0..c0 + C, the same operations
// in the same order (the min term of 16 blocks, then their blocks), so a row's bits are those it gets alone.
template <int R, int C, bool Q4>
void dot_tile_decoded(const uint16_t* x, int64_t ldx, const float* xsum, int64_t ldxs, const DecodedChunk& k,
                      int64_t c0, float* sums) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  const uint16_t* wbuf = k.w.data() + c0 * k.blocks * kBlock;
  const float* d = k.d.data() + c0 * k.ld;
  for (int64_t g = 0; g < k.blocks; g += 16) {
    if constexpr (Q4)
      for (int c = 0; c < C; ++c) {
        const __m512 mc = _mm512_loadu_ps(k.m.data() + (c0 + c) * k.ld + g);
        for (int r = 0; r < R; ++r)
          acc[r][c] = _mm512_fmadd_ps(mc, _mm512_loadu_ps(xsum + r * ldxs + g), acc[r][c]);
      }
    for (int64_t b = g; b < std::min<int64_t>(g + 16, k.blocks); ++b) {
      __m512bh w[C];
      for (int c = 0; c < C; ++c) w[c] = (__m512bh)_mm512_loadu_si512(wbuf + (c * k.blocks + b) * kBlock);
      for (int r = 0; r < R; ++r) {
        const __m512bh xb = (__m512bh)_mm512_loadu_si512(x + r * ldx + b * kBlock);
        for (int c = 0; c < C; ++c) acc[r][c] = add_block_bf16<Q4>(acc[r][c], xb, w[c], Q4 ? d[c * k.ld + b] : 0.f);
      }
    }
  }
  radixserve::reduce_tile(acc, sums, kChunk);
}

template <int C, bool Q4>
void tile_decoded(int rows, const uint16_t* x, int64_t ldx, const float* xsum, int64_t ldxs, const DecodedChunk& k,
                  int64_t c0, float* sums) {
  switch (rows) {
#define RADIXSERVE_TILE(R) \
  case R: return dot_tile_decoded<R, C, Q4>(x, ldx, xsum, ldxs, k, c0, sums);
    RADIXSERVE_TILE(1) RADIXSERVE_TILE(2) RADIXSERVE_TILE(3) RADIXSERVE_TILE(4)
    RADIXSERVE_TILE(5) RADIXSERVE_TILE(6) RADIXSERVE_TILE(7)
#undef RADIXSERVE_TILE
    default: return dot_tile_decoded<kRowTile, C, Q4>(x, ldx, xsum, ldxs, k, c0, sums);
  }
}

// linear_channels<Q4, true> for rows > kRowTile: per chunk, decode once, then the row tiles (2 channels a tile).
template <bool Q4>
void linear_channels_decoded(const at::Tensor& x, const float* xsum, const float* wscale, const BlockWeights& w,
                             int64_t n0, int64_t n1, const radixserve::Epilogue& out) {
  const int64_t rows = x.size(0), ldx = x.size(1), ldxs = padded16(w.blocks);
  const uint16_t* xp = static_cast<const uint16_t*>(x.data_ptr());
  DecodedChunk chunk(w.blocks);
  std::vector<float> sums(rows * kChunk);
  for (int64_t c0 = n0; c0 < n1; c0 += kChunk) {
    const int64_t c1 = std::min(n1, c0 + kChunk);
    decode_chunk<Q4>(w, wscale, c0, c1, chunk);
    for (int64_t r0 = 0; r0 < rows; r0 += kRowTile) {
      const int tile = static_cast<int>(std::min<int64_t>(kRowTile, rows - r0));
      const float* xs = xsum + r0 * ldxs;
      for (int64_t n = c0; n < c1; n += 2) {
        float* at = sums.data() + r0 * kChunk + (n - c0);
        if (n + 2 <= c1) tile_decoded<2, Q4>(tile, xp + r0 * ldx, ldx, xs, ldxs, chunk, n - c0, at);
        else tile_decoded<1, Q4>(tile, xp + r0 * ldx, ldx, xs, ldxs, chunk, n - c0, at);
      }
    }
    for (int64_t r = 0; r < rows; ++r) out.store_row(r, c0, c1 - c0, sums.data() + r * kChunk);
  }
}
#endif

#ifdef RADIXSERVE_BLOCK_AVX512BF16
namespace bf16_fma = radixserve::bf16_fma;

// Rows in one tile of block_bf16_fma.h's kernel up to this many (a verify forward's 1 + 8 rows, batches of a
// few requests); more rows (prefill) keep the decoded-chunk path.
constexpr int64_t kFmaMaxRows = 32;

// Q8_0 block b as its bfloat16 weights (q8_weights_bf16) in float32 pair halves.
inline void q8_pairs(const uint8_t* qs, int64_t b, float scale, __m512& we, __m512& wo) {
  const __m512i w = (__m512i)q8_weights_bf16(qs, b, scale);
  we = bf16_fma::even_half(w);
  wo = bf16_fma::odd_half(w);
}

// rows (1..bf16_fma::kRowTile) against channels n..n + fma_channels(rows) (or just n when `single`).
template <bool Q4>
int fma_rows(int rows, bool single, const float* x, int64_t ldx, const float* xsum, int64_t ldxs, const uint8_t* qs,
             int64_t ldq, const at::Half* d, const at::Half* m, int64_t blocks, float* sums) {
  const auto q4 = [](const uint8_t* q, int64_t b, float, __m512& we, __m512& wo) { bf16_fma::q4_pairs(q, b, we, wo); };
  const auto weights = [&](const uint8_t* q, int64_t b, float scale, __m512& we, __m512& wo) {
    if constexpr (Q4) q4(q, b, scale, we, wo);
    else q8_pairs(q, b, scale, we, wo);
  };
  switch (rows) {
#define RADIXSERVE_TILE(R)                                                                                     \
  case R:                                                                                                      \
    if (single || bf16_fma::fma_channels(R) == 1)                                                             \
      return bf16_fma::fma_tile<R, 1, Q4>(x, ldx, xsum, ldxs, qs, ldq, d, m, blocks, sums, weights, code_mins16), 1; \
    bf16_fma::fma_tile<R, bf16_fma::fma_channels(R), Q4>(x, ldx, xsum, ldxs, qs, ldq, d, m, blocks, sums, weights,  \
                                                         code_mins16);                                         \
    return bf16_fma::fma_channels(R);
    RADIXSERVE_TILE(1) RADIXSERVE_TILE(2) RADIXSERVE_TILE(3) RADIXSERVE_TILE(4) RADIXSERVE_TILE(5)
    RADIXSERVE_TILE(6) RADIXSERVE_TILE(7) RADIXSERVE_TILE(8) RADIXSERVE_TILE(9)
    default: RADIXSERVE_TILE(bf16_fma::kRowTile)
#undef RADIXSERVE_TILE
  }
}

// Output channels n0..n1 of every row, x as bf16_fma::split_rows made it ([rows][blocks][32] float32).
template <bool Q4>
void linear_channels_fma(const float* x, int64_t rows, const float* xsum, const BlockWeights& w, int64_t n0,
                         int64_t n1, const radixserve::Epilogue& out) {
  const int64_t ldx = w.blocks * kBlock, ldxs = padded16(w.blocks);
  // Tiles of even size (11 rows: 6 + 5, not 10 + 1: a tile of one row decodes every block for itself).
  const int64_t tiles = (rows + bf16_fma::kRowTile - 1) / bf16_fma::kRowTile, row_tile = (rows + tiles - 1) / tiles;
  radixserve::walk_decode_tiles<bf16_fma::kRowTile, kChunk>(
      rows, n0, n1, out,
      [&](int64_t r0, int tile, int64_t n, int64_t c1, float* sums) {
        return fma_rows<Q4>(tile, n + bf16_fma::fma_channels(tile) > c1, x + r0 * ldx, ldx, xsum + r0 * ldxs, ldxs,
                            w.qs + n * w.qs_row_bytes, w.qs_row_bytes, w.d + n * w.blocks,
                            Q4 && w.m != nullptr ? w.m + n * w.blocks : nullptr, w.blocks, sums);
      },
      row_tile);
}

// Whether a bfloat16 call runs block_bf16_fma.h's kernel: 2..kFmaMaxRows rows, no channel scales (int8
// weight-only), a CPU whose vdpbf16ps the FMAs reproduce (and not turned off: bf16_fma::fma_enabled), and x in
// the range where they reproduce it.
inline bool fma_path(const at::Tensor& x, const float* wscale) {
  const int64_t rows = x.size(0);
  return rows >= 2 && rows <= kFmaMaxRows && wscale == nullptr && bf16_fma::fma_enabled() &&
         bf16_fma::fma_rows_in_range(static_cast<const uint16_t*>(x.data_ptr()), x.numel());
}
#endif

// Q4's min term: each block's sum of x (float32, or bfloat16 when BF16) in float32, [rows, padded16(blocks)],
// once per call and in the same order for every row.
template <bool BF16>
std::vector<float> block_sums(const at::Tensor& x, int64_t blocks) {
  using T = std::conditional_t<BF16, at::BFloat16, float>;
  const int64_t rows = x.size(0), ld = padded16(blocks);
  const T* xp = x.data_ptr<T>();
  std::vector<float> xsum(rows * ld, 0.f);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < blocks; ++b) {
      float s = 0.f;
      for (int64_t j = 0; j < kBlock; ++j) s += static_cast<float>(xp[(r * blocks + b) * kBlock + j]);
      xsum[r * ld + b] = s;
    }
  return xsum;
}

// x [rows, K] contiguous, float32 or (BF16) bfloat16; wscale: BF16's per-channel weight scales [N] or nullptr.
template <bool BF16>
void linear(const at::Tensor& x, const BlockWeights& w, bool q4, const float* wscale,
            const radixserve::Epilogue& epilogue) {
  const int64_t rows = x.size(0);
  const std::vector<float> xsum = q4 ? block_sums<BF16>(x, w.blocks) : std::vector<float>();
#ifdef RADIXSERVE_BLOCK_AVX512BF16
  if constexpr (BF16) {
    if (fma_path(x, wscale)) {
      std::vector<float> split(x.numel());
      bf16_fma::split_rows(static_cast<const uint16_t*>(x.data_ptr()), x.numel(), split.data());
      at::parallel_for(0, epilogue.out_features, 16, [&](int64_t n0, int64_t n1) {
        if (q4) linear_channels_fma<true>(split.data(), rows, xsum.data(), w, n0, n1, epilogue);
        else linear_channels_fma<false>(split.data(), rows, xsum.data(), w, n0, n1, epilogue);
      });
      return;
    }
  }
#endif
  at::parallel_for(0, epilogue.out_features, 16, [&](int64_t n0, int64_t n1) {
#ifdef RADIXSERVE_BLOCK_AVX512BF16
    if constexpr (BF16) {
      if (rows > kRowTile) {
        if (q4) linear_channels_decoded<true>(x, xsum.data(), wscale, w, n0, n1, epilogue);
        else linear_channels_decoded<false>(x, xsum.data(), wscale, w, n0, n1, epilogue);
        return;
      }
    }
#endif
    if (q4) linear_channels<true, BF16>(x, xsum.data(), wscale, w, n0, n1, epilogue);
    else linear_channels<false, BF16>(x, xsum.data(), wscale, w, n0, n1, epilogue);
  });
}

}  // namespace avx512
#endif

// The AVX2 (or portable) path: float32 activations, the min term folded out of the block loop.
void block_linear_fold(const at::Tensor& x, const BlockWeights& w, bool q4, const radixserve::Epilogue& epilogue) {
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const int64_t rows = xf.size(0), blocks = w.blocks, in_features = blocks * kBlock;
  // Q4_1's min term: each block's sum of x, once per call, added in the same order for every row.
  std::vector<float> xsum(q4 ? rows * padded(blocks) : 0, 0.f);
  for (int64_t r = 0; q4 && r < rows; ++r)
    for (int64_t b = 0; b < blocks; ++b) {
      const float* xb = xf.data_ptr<float>() + r * in_features + b * kBlock;
      float s = 0.f;
      for (int64_t j = 0; j < kBlock; ++j) s += xb[j];
      xsum[r * padded(blocks) + b] = s;
    }
#ifdef RADIXSERVE_BLOCK_AVX2
  const at::Tensor xk = q4 ? q4_lane_order(xf) : xf;
#else
  const at::Tensor& xk = xf;
#endif
  const float* xp = xk.data_ptr<float>();
  at::parallel_for(0, epilogue.out_features, 16, [&](int64_t n0, int64_t n1) {
    if (q4) linear_channels<true>(xp, rows, in_features, xsum.data(), w, n0, n1, epilogue);
    else linear_channels<false>(xp, rows, in_features, xsum.data(), w, n0, n1, epilogue);
  });
}

// x [M, K] @ W.T for the blocks W [N, K], in x's dtype: (x @ W.T) * scales + bias + residual, each optional
// (radixserve::Epilogue).
at::Tensor block_linear_op(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                           const std::optional<at::Tensor>& m, const std::optional<at::Tensor>& bias,
                           const std::optional<at::Tensor>& residual, const std::optional<at::Tensor>& scales,
                           bool round_before_residual) {
  const bool q4 = check_blocks(qs, d, m);
  const int64_t out_features = qs.size(0), blocks = d.size(1), in_features = blocks * kBlock;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == in_features, "x [M, K] against weights [N, K]");
  TORCH_CHECK(!q4 || !scales.has_value(), "scales: for Q8_0 blocks (int8 weights) only");
  at::Tensor out;
  const radixserve::Epilogue epilogue =
      radixserve::make_epilogue(x, out_features, out, scales, bias, residual, round_before_residual);
  const BlockWeights w{static_cast<const uint8_t*>(qs.data_ptr()), d.data_ptr<at::Half>(),
                       m.has_value() ? m->data_ptr<at::Half>() : nullptr, blocks, qs.size(1)};
#ifdef RADIXSERVE_BLOCK_AVX512
#ifdef RADIXSERVE_BLOCK_AVX512BF16
  if (x.scalar_type() == at::kBFloat16) {  // the scales go into the weights, as the GEMM path's weights
    const at::Tensor wscale = scales.has_value() ? scales->to(at::kFloat) : at::Tensor();
    radixserve::Epilogue rest = epilogue;
    rest.scales = nullptr;
    avx512::linear<true>(x.contiguous(), w, q4, scales.has_value() ? wscale.data_ptr<float>() : nullptr, rest);
    return out;
  }
#endif
  avx512::linear<false>(x.to(at::kFloat).contiguous(), w, q4, nullptr, epilogue);
#else
  block_linear_fold(x, w, q4, epilogue);
#endif
  return out;
}

// Whether bfloat16 calls of 2 or more rows run block_bf16_fma.h's kernel: AVX512-BF16, its FMAs checked to be
// this CPU's vdpbf16ps, and not turned off. ``use``: turn them on (true, the default) or off (quant_blocks.py
// times both; the bits are the same).
bool block_linear_bf16_fma(std::optional<bool> use) {
#ifdef RADIXSERVE_BLOCK_AVX512BF16
  if (use.has_value()) radixserve::bf16_fma::fma_choice.store(*use ? 1 : 0);
  return radixserve::bf16_fma::fma_enabled();
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixserve, m) {
  m.def(
      "block_linear(Tensor x, Tensor qs, Tensor d, Tensor? m, Tensor? bias=None, Tensor? residual=None, "
      "Tensor? scales=None, bool round_before_residual=False) -> Tensor");
  m.def("block_linear_bf16_fma(bool? use=None) -> bool", &block_linear_bf16_fma);
}

TORCH_LIBRARY_IMPL(radixserve, CPU, m) {
  m.impl("block_linear", &block_linear_op);
}

