// Horizontal sums (and maxima) of many AVX512 registers at once, shared by the attention and block-linear kernels.
// Plain C++ (no torch headers).
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

namespace radixserve::simd {

// Lane j of the result = the sum of v[j]'s 16 lanes: halve, pair and add four times (8 + 4 + 2 + 1
// adds, two shuffles each), then one permute puts the sums back in order. Each sum takes the same
// adds in the same order as _mm512_reduce_add_ps (256-bit halves, 128-bit quarters, pairs, then
// neighbours), so its bits are that reduction's, in 15 adds for 16 registers instead of 64.
__attribute__((always_inline)) inline __m512 reduce16(const __m512* v) {
  __m512 w[8], x[4], y[2];
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j)  // 256-bit halves: w[j] = [v[j] 8 partials | v[j+8] 8 partials]
    w[j] = _mm512_add_ps(_mm512_shuffle_f32x4(v[j], v[j + 8], 0x44), _mm512_shuffle_f32x4(v[j], v[j + 8], 0xEE));
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j)  // 128-bit quarters
    x[j] = _mm512_add_ps(_mm512_shuffle_f32x4(w[j], w[j + 4], 0x88), _mm512_shuffle_f32x4(w[j], w[j + 4], 0xDD));
#pragma GCC unroll 2
  for (int j = 0; j < 2; ++j) {  // pairs of floats within each quarter
    const __m512d a = _mm512_castps_pd(x[j]), b = _mm512_castps_pd(x[j + 2]);
    y[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 z = _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], 0x88), _mm512_shuffle_ps(y[0], y[1], 0xDD));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15), z);
}

// Lane j = the maximum of v[j]'s 16 lanes (reduce16's transposition; max is exact in any order).
inline __m512 reduce16_max(const __m512* v) {
  __m512 w[8], x[4], y[2];
  for (int j = 0; j < 8; ++j)
    w[j] = _mm512_max_ps(_mm512_shuffle_f32x4(v[j], v[j + 8], 0x44), _mm512_shuffle_f32x4(v[j], v[j + 8], 0xEE));
  for (int j = 0; j < 4; ++j)
    x[j] = _mm512_max_ps(_mm512_shuffle_f32x4(w[j], w[j + 4], 0x88), _mm512_shuffle_f32x4(w[j], w[j + 4], 0xDD));
  for (int j = 0; j < 2; ++j) {
    const __m512d a = _mm512_castps_pd(x[j]), b = _mm512_castps_pd(x[j + 2]);
    y[j] = _mm512_max_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 z = _mm512_max_ps(_mm512_shuffle_ps(y[0], y[1], 0x88), _mm512_shuffle_ps(y[0], y[1], 0xDD));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15), z);
}

}  // namespace radixserve::simd

#endif  // __AVX512F__
