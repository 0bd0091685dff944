// paged_avx2.h's scores pass over an 8-bit pool with AVX2 integer dot products, for CPUs without AVX512 (no VNNI):
// q . code for 32 dims of a key in 4 instructions a row (sign, maddubs, madd, add) and one a key (|k|), against
// paged_avx2.h's float pass (4 widenings and 4 FMAs a row per 32 dims: the int8 pool's bottleneck there).
//
//   q       row r quantized to int8 with one scale (max|q_r| / 127), as scores_int8.h does with AVX512-VNNI;
//   dot     maddubs takes one unsigned and one signed operand, so the sign moves from the key onto q:
//           |k| (unsigned) x sign(q, k) = k x q for each byte, pairs summed in int16 (|k| <= 128 and |q| <= 127:
//           2 x 128 x 127 < 32767, never saturating), then madd with ones sums pairs of those into int32: each
//           32-dim chunk of a (row, key) adds 8 int32 partials into its accumulator, exact (|sum| < 2^24);
//   layout  as paged_avx2.h's float pass: 4 keys and up to 3 rows a step (12 accumulators), keys in blocks of
//           kBlock, one reduction of 4 registers to 4 scores (hadd, hadd, add the 128-bit halves) at the end;
//   scale   score = float(int) x q scale; the key scales follow (paged_attention.h's fold_scales), so a score is
//           (int x q scale) x key scale, the same two products in the same order for every row and key.
// Integer sums are exact, so a score is the same whatever its neighbours, row block or item (split invariance),
// and q is quantized per row, from the row alone. Head dims a multiple of 32; others keep the float pass.
#pragma once

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "paged_avx2.h"

namespace radixserve::avx2 {

// q [rows][dim] -> int8 codes [rows][dim] and scales [rows] (max|q_r| / 127): scores_int8.h's quantization.
inline void quantize_rows_i8(const float* q, int64_t rows, int64_t dim, int8_t* codes, float* scales) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = q + r * dim;
    float mx = 0.f;
    for (int64_t i = 0; i < dim; ++i) mx = std::max(mx, std::fabs(x[i]));
    const float inv = mx > 0.f ? 127.f / mx : 0.f;
    for (int64_t i = 0; i < dim; ++i) codes[r * dim + i] = static_cast<int8_t>(std::nearbyint(x[i] * inv));
    scales[r] = mx / 127.f;
  }
}

// Lane j of the result = the sum of a[j]'s 8 int32 lanes (exact: any order gives the same sum).
inline __m128i reduce4_epi32(const __m256i* a) {
  const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(a[0], a[1]), _mm256_hadd_epi32(a[2], a[3]));
  return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

// scores[r * stride + j] = (q_r . k_j) x q_scale[r] for R rows of codes, keys j < n (rounded up to 4: the pad
// scores a zero row); keys up to ``ahead_limit`` may be prefetched (the next block's).
template <int NB, int R>
void scores_rows_int8(const int8_t* q, const float* q_scale, const i8* k, const int64_t* slots, int64_t n,
                      int64_t ahead_limit, bool prefetch, int64_t stride, float* scores) {
  constexpr int64_t dim = NB * 32;
  alignas(32) static const i8 zeros[dim] = {};
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t j0 = 0; j0 < n; j0 += 4) {
    const i8* row[4];
    step_keys(k, slots, j0, n, ahead_limit, prefetch, dim, zeros, row);
    __m256i acc[R][4];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm256_setzero_si256();
#pragma GCC unroll 2
    for (int c = 0; c < NB; ++c) {
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row[j] + 32 * c));
        const __m256i ax = _mm256_sign_epi8(x, x);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          const __m256i qv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + r * dim + 32 * c));
          const __m256i pairs = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(qv, x));
          acc[r][j] = _mm256_add_epi32(acc[r][j], _mm256_madd_epi16(pairs, ones));
        }
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m128 dot = _mm_cvtepi32_ps(reduce4_epi32(acc[r]));
      _mm_storeu_ps(scores + r * stride + j0, _mm_mul_ps(dot, _mm_set1_ps(q_scale[r])));
    }
  }
}

// scores_pass over an 8-bit pool, the key scales not yet applied: rows written up to num_keys rounded up to 4.
template <int NC>
void scores_pass_int8(const float* q, int64_t rows, const i8* k, const int64_t* slots, int64_t num_keys,
                      int64_t stride, float* scores) {
  static_assert(NC % 4 == 0, "32-dim chunks");
  constexpr int NB = NC / 4;
  constexpr int64_t dim = NC * 8;
  static thread_local std::vector<int8_t> codes;
  static thread_local std::vector<float> q_scale;
  codes.resize(rows * dim);
  q_scale.resize(rows);
  quantize_rows_i8(q, rows, dim, codes.data(), q_scale.data());
  for (int64_t kb = 0; kb < num_keys; kb += kBlock) {
    const int64_t n = std::min(kBlock, num_keys - kb);
    for (int64_t r0 = 0; r0 < rows; r0 += 3) {
      const int8_t* c = codes.data() + r0 * dim;
      const float* qs = q_scale.data() + r0;
      float* out = scores + r0 * stride + kb;
      const bool first = r0 == 0;  // the first row block brings the keys in; the others find them in L1
      switch (std::min<int64_t>(3, rows - r0)) {
        case 1: scores_rows_int8<NB, 1>(c, qs, k, slots + kb, n, num_keys - kb, first, stride, out); break;
        case 2: scores_rows_int8<NB, 2>(c, qs, k, slots + kb, n, num_keys - kb, first, stride, out); break;
        default: scores_rows_int8<NB, 3>(c, qs, k, slots + kb, n, num_keys - kb, first, stride, out); break;
      }
    }
  }
}

}  // namespace radixserve::avx2

#endif  // __AVX2__ && __FMA__ && !__AVX512F__
