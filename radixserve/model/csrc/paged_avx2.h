// paged_attention.h's three passes with AVX2 + FMA intrinsics, for CPUs without AVX512 (AMD Zen 2 / 3, older
// Intel), head dims a multiple of 8 (NC = D / 8 ymm registers a row) and float32, bfloat16 or int8 pools. Compiled
// only where the target has AVX2 and FMA and not AVX512F (the AVX512 paths keep those machines).
//
// Per work item (a few query rows against one K/V head's keys):
//   scores   keys in blocks of kBlock (their rows stay in L1 while every row block of the tile reads them), 4 keys
//            and up to 3 query rows a step: 12 accumulators of 8 lanes, each loaded key chunk (a bfloat16 or int8
//            one widened in registers) used by all the step's rows, then one reduction of 4 registers to 4 scores
//            (hadd, hadd, add the 128-bit halves) instead of a horizontal sum per (row, key);
//   softmax  per row, 8 scores at a time (fast_exp's polynomial);
//   values   keys in blocks of kBlock again, 3 rows x 32 dims a step (12 accumulators; 4 rows x 16 dims for an
//            extend tile), each loaded value chunk used by all the step's rows; the accumulators go back to memory
//            between blocks and chunks, which changes no bits.
// An 8-bit pool's key scales multiply the scores and its value scales the softmax weights (paged_attention.h's
// fold_scales), so code rows are only widened in registers, never dequantized into memory; its scores pass runs
// in integers where the head dim is a multiple of 32 (scores_int8_avx2.h: the same layout, q as int8 per row).
// Its values pass stays float: values_int8.h's scheme on AVX2 (p as int16 in 16-key blocks at fixed positions, two
// keys' codes interleaved as int16 pairs, vpmaddwd + vpaddd into int32, one scale x sum FMA per block; 4 or 3 rows
// x 16 dims a step) passed the tests but measured slower on Zen 3 (bench kv-attention --layers 1, 1 thread, thread
// clock, best of 7, A/B in one run: int8 decode b16 @ 2k 1.52-1.55 -> 1.61-1.66 ms, 2k prefill 74.7-76.2 ->
// 77.8-79.2 ms). Without VNNI a madd + add makes 16 products where two FMAs make 16, and vpmaddwd has half the FMAs'
// throughput here (8 independent madd + add 3.7 ns, 8 FMAs 1.6 ns): only the widening is saved, and the weights'
// quantization and per-block scale FMAs cost more than that. (The weights' int16 rounding also moved the output
// against float64 from 2.2e-6 to 4.9e-5 of its largest value.)
//
// Split invariance: a row's bits depend only on its own inputs and the keys' positions, never on the other rows of
// its tile or where its item starts. A score is its own dot product (dims in order, then the same 8-lane
// reduction for every key); a row's softmax sums its weights in 8-lane blocks counted from its own first visible
// key (a position), the lanes reduced in one fixed order; the values pass adds keys in position order, and the
// keys before a row's first or after its last add p = 0 (exactly nothing).
#pragma once

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "attention_common.h"

namespace radixserve::avx2 {

// Keys a block: 32 rows of head dim 128 in float32 are 16 KiB, half of Zen 3's L1.
constexpr int64_t kBlock = 32;
// Scattered pool rows are ~100 ns away and the passes spend a few ns a key: each block asks for the next one's.
constexpr int64_t kAhead = kBlock;

// 8 floats from p: float32 as is, bfloat16 widened (its bits are a float32's upper half), int8 codes widened (exact).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load8(const i8* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// Lane j of the result = the sum of a[j]'s 8 lanes, for every j the same adds: ((0+1)+(2+3)) + ((4+5)+(6+7)).
inline __m128 reduce4(const __m256* a) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// The 8 lanes' sum, in reduce4's order.
inline float reduce_sum(__m256 a) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a, a), a);  // lane 0: (0+1)+(2+3), lane 4: (4+5)+(6+7)
  return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}

// Lanes 0 .. 7 below n, as a mask (all bits of a lane set).
inline __m256i lanes_below(int64_t n) {
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::clamp<int64_t>(n, 0, 8))), iota);
}

// A step's 4 key rows j0..j0 + 3 (past n: ``zeros``, whose scores are padding), asking for the block ahead's.
template <typename kv_t>
inline void step_keys(const kv_t* k, const int64_t* slots, int64_t j0, int64_t n, int64_t ahead_limit, bool prefetch,
                      int64_t dim, const kv_t* zeros, const kv_t* (&row)[4]) {
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) {
    if (prefetch && j0 + j < n) prefetch_row<kAhead>(k, slots, j0 + j, ahead_limit, dim);
    row[j] = j0 + j < n ? k + slots[j0 + j] * dim : zeros;
  }
}

// scores[r * stride + j] = q_r . k_j for R rows, keys j < n (rounded up to 4: the pad scores a zero row); keys up to
// ``ahead_limit`` may be prefetched (the next block's).
template <int NC, int R, typename kv_t>
void scores_rows(const float* q, const kv_t* k, const int64_t* slots, int64_t n, int64_t ahead_limit, bool prefetch,
                 int64_t stride, float* scores) {
  constexpr int64_t dim = NC * 8;
  alignas(32) static const kv_t zeros[dim] = {};
  for (int64_t j0 = 0; j0 < n; j0 += 4) {
    const kv_t* row[4];
    step_keys(k, slots, j0, n, ahead_limit, prefetch, dim, zeros, row);
    __m256 acc[R][4];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm256_setzero_ps();
#pragma GCC unroll 4
    for (int c = 0; c < NC; ++c) {
      __m256 qv[R];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) qv[r] = _mm256_loadu_ps(q + r * dim + 8 * c);
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        const __m256 x = load8(row[j] + 8 * c);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) acc[r][j] = _mm256_fmadd_ps(qv[r], x, acc[r][j]);
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) _mm_storeu_ps(scores + r * stride + j0, reduce4(acc[r]));
  }
}

// scores for every row over keys [0, num_keys): the scores rows are written up to num_keys rounded up to 4.
template <int NC, typename kv_t>
void scores_pass(const float* q, int64_t rows, const kv_t* k, const int64_t* slots, int64_t num_keys, int64_t stride,
                 float* scores) {
  constexpr int64_t dim = NC * 8;
  for (int64_t kb = 0; kb < num_keys; kb += kBlock) {
    const int64_t n = std::min(kBlock, num_keys - kb);
    for (int64_t r0 = 0; r0 < rows; r0 += 3) {
      const float* qr = q + r0 * dim;
      float* out = scores + r0 * stride + kb;
      const bool first = r0 == 0;  // the first row block brings the keys in; the others find them in L1
      switch (std::min<int64_t>(3, rows - r0)) {
        case 1: scores_rows<NC, 1>(qr, k, slots + kb, n, num_keys - kb, first, stride, out); break;
        case 2: scores_rows<NC, 2>(qr, k, slots + kb, n, num_keys - kb, first, stride, out); break;
        default: scores_rows<NC, 3>(qr, k, slots + kb, n, num_keys - kb, first, stride, out); break;
      }
    }
  }
}

// exp(x) for x <= 0, 8 at a time: fast_exp's polynomial and its 2^n in the exponent bits.
inline __m256 exp8(__m256 x) {
  const __m256 t = _mm256_mul_ps(_mm256_max_ps(x, _mm256_set1_ps(kExpFloor)), _mm256_set1_ps(kLog2e));
  const __m256 n = _mm256_floor_ps(t), f = _mm256_sub_ps(t, n);
  __m256 p = _mm256_set1_ps(kExp2Poly[0]);
  for (int i = 1; i < kExp2Terms; ++i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2Poly[i]));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// Row r sees sc[first .. seen): sc[j] = exp(sc[j] - max) there, 0 for the other j < padded (a multiple of 16);
// returns (max, sum) through m and l. Blocks of 8 count from first (a position), so the sum's order is the row's own.
inline void softmax_row(float* sc, int64_t first, int64_t seen, int64_t padded, float* m, float* l) {
  float* row = sc + first;
  const int64_t n = seen - first, full = n / 8 * 8;
  const __m256 keep = _mm256_castsi256_ps(lanes_below(n - full));  // the tail's lanes (masked moves are slow: once)
  __m256 mx = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < full; j += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(row + j));
  if (full < n) mx = _mm256_max_ps(mx, _mm256_blendv_ps(mx, _mm256_maskload_ps(row + full, _mm256_castps_si256(keep)), keep));
  mx = _mm256_max_ps(mx, _mm256_permute2f128_ps(mx, mx, 1));
  mx = _mm256_max_ps(mx, _mm256_shuffle_ps(mx, mx, 0x4E));
  mx = _mm256_max_ps(mx, _mm256_shuffle_ps(mx, mx, 0xB1));
  __m256 sum = _mm256_setzero_ps();
  for (int64_t j = 0; j < full; j += 8) {
    const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(row + j), mx));
    _mm256_storeu_ps(row + j, p);
    sum = _mm256_add_ps(sum, p);
  }
  if (full < n) {
    const __m256 x = _mm256_maskload_ps(row + full, _mm256_castps_si256(keep));
    const __m256 p = _mm256_and_ps(exp8(_mm256_sub_ps(x, mx)), keep);
    _mm256_maskstore_ps(row + full, _mm256_castps_si256(keep), p);
    sum = _mm256_add_ps(sum, p);
  }
  std::fill(sc, row, 0.f);
  std::fill(sc + seen, sc + padded, 0.f);
  *m = _mm256_cvtss_f32(mx);
  *l = reduce_sum(sum);
}

// acc[r][c0 * 8 .. (c0 + W) * 8) += sum_j p[r][j] v_j over keys j < n for R rows: W x 8 dims, R x W accumulators.
template <int NC, int W, int R, typename kv_t>
void values_chunk(const float* p, int64_t stride, const kv_t* const* row, int64_t n, int c0, float* acc) {
  constexpr int64_t dim = NC * 8;
  __m256 a[R][W];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < W; ++c) a[r][c] = _mm256_loadu_ps(acc + r * dim + 8 * (c0 + c));
  for (int64_t j = 0; j < n; ++j) {
    __m256 pr[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) pr[r] = _mm256_broadcast_ss(p + r * stride + j);
#pragma GCC unroll 4
    for (int c = 0; c < W; ++c) {
      const __m256 x = load8(row[j] + 8 * (c0 + c));
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) a[r][c] = _mm256_fmadd_ps(pr[r], x, a[r][c]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < W; ++c) _mm256_storeu_ps(acc + r * dim + 8 * (c0 + c), a[r][c]);
}

// values_chunk over every W-register chunk of the head dim (the last one narrower where NC % W != 0).
template <int NC, int W, int R, typename kv_t>
void values_rows(const float* p, int64_t stride, const kv_t* const* row, int64_t n, float* acc) {
  int c0 = 0;
  for (; c0 + W <= NC; c0 += W) values_chunk<NC, W, R>(p, stride, row, n, c0, acc);
  if constexpr (NC % W != 0) values_chunk<NC, NC % W, R>(p, stride, row, n, c0, acc);
}

// values_rows for nr <= RB rows: R is a compile-time count, so pick it by counting down.
template <int NC, int W, int RB, typename kv_t>
void values_block(int64_t nr, const float* p, int64_t stride, const kv_t* const* row, int64_t n, float* acc) {
  if constexpr (RB > 1)
    if (nr < RB) return values_block<NC, W, RB - 1>(nr, p, stride, row, n, acc);
  values_rows<NC, W, RB>(p, stride, row, n, acc);
}

// acc[r] = sum_j p[r][j] v_j over the first seen[r] keys, keys in position order (p is 0 outside a row's keys),
// rows in blocks of RB, dims in chunks of W registers.
template <int NC, int RB, int W, typename kv_t>
void values_blocks(const float* p, int64_t rows, const int64_t* seen, int64_t stride, const kv_t* v,
                   const int64_t* slots, float* acc) {
  constexpr int64_t dim = NC * 8;
  std::fill(acc, acc + rows * dim, 0.f);
  const int64_t num_keys = rows > 0 ? *std::max_element(seen, seen + rows) : 0;
  const kv_t* row[kBlock];
  for (int64_t kb = 0; kb < num_keys; kb += kBlock) {
    const int64_t n = std::min(kBlock, num_keys - kb);
    for (int64_t j = 0; j < n; ++j) {
      prefetch_row<kAhead>(v, slots + kb, j, num_keys - kb, dim);
      row[j] = v + slots[kb + j] * dim;
    }
    for (int64_t r0 = 0; r0 < rows; r0 += RB) {
      const int64_t nr = std::min<int64_t>(RB, rows - r0);
      const int64_t keys = std::clamp<int64_t>(*std::max_element(seen + r0, seen + r0 + nr) - kb, 0, n);
      if (keys > 0) values_block<NC, W, RB>(nr, p + r0 * stride + kb, stride, row, keys, acc + r0 * dim);
    }
  }
}

// A decode's few rows: 3 rows x 4 registers a step, each value row read once a block; an extend tile's rows: 4 x 2,
// ~10% faster there. Both add each (row, dim)'s terms in the same order: the same bits.
template <int NC, typename kv_t>
void values_pass(const float* p, int64_t rows, const int64_t* seen, int64_t stride, const kv_t* v,
                 const int64_t* slots, float* acc) {
  if (rows <= 3)
    values_blocks<NC, 3, 4>(p, rows, seen, stride, v, slots, acc);
  else
    values_blocks<NC, 4, 2>(p, rows, seen, stride, v, slots, acc);
}

}  // namespace radixserve::avx2

#endif
