// What both attention passes share: the problem's shape, a vectorisable exp, typed loads and
// the prefetch of scattered pool rows. Plain C++, no torch headers.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "bf16.h"

namespace radixserve {

// window > 0: the query at context position p sees keys max(0, p - window + 1) .. p (transformers'
// sliding window: kv_idx > q_idx - window); 0: keys 0 .. p. softcap > 0: scores = softcap *
// tanh(scores / softcap) after the scale, before the softmax (Gemma 2); 0: none.
// k_scale / v_scale: an 8-bit pool's scales (bfloat16 bits [num_kv_heads, num_slots], one per token and head:
// a row's values are code * scale), nullptr for a float pool.
struct Shape {
  int64_t num_heads, num_kv_heads, dim, num_slots, group;
  float scale;
  int64_t window;
  float softcap;
  const uint16_t* k_scale = nullptr;
  const uint16_t* v_scale = nullptr;
};

// The first key a query sees whose keys end before ``limit`` (its position + 1).
inline int64_t first_visible(int64_t limit, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, limit - window) : 0;
}

// fast_exp's constants, shared by its vector forms (exp16, exp8): inputs clamped at kExpFloor, 2^(x log2 e) as
// 2^n times a degree-6 polynomial in the fraction f (Horner, highest power first).
constexpr float kExpFloor = -87.f;
constexpr float kLog2e = 1.44269504f;
constexpr int kExp2Terms = 7;
constexpr float kExp2Poly[kExp2Terms] = {1.5403530e-4f, 1.3333558e-3f, 9.6181291e-3f, 5.5504109e-2f,
                                         2.4022651e-1f, 6.9314718e-1f, 1.f};

// exp for x <= 0 (softmax after subtracting the max), vectorisable: 2^(x log2 e) split into
// 2^n (exponent bits) times a degree-6 polynomial of the fraction; relative error ~2e-7.
inline float fast_exp(float x) {
  const float t = std::max(x, kExpFloor) * kLog2e;
  const float n = std::floor(t), f = t - n;
  float p = kExp2Poly[0];
  for (int i = 1; i < kExp2Terms; ++i) p = p * f + kExp2Poly[i];
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// tanh(x) as Cephes' tanhf computes it, vectorisable (no branch): an odd polynomial below |x| = 0.625,
// else (1 - e) / (1 + e) with e = exp(-2|x|) (fast_exp: no overflow for any x); relative error ~3e-7.
inline float fast_tanh(float x) {
  const float a = std::fabs(x), z = a * a;
  float p = -5.70498872745e-3f;
  p = p * z + 2.06390887954e-2f;
  p = p * z - 5.37397155531e-2f;
  p = p * z + 1.33314422036e-1f;
  p = p * z - 3.33332819422e-1f;
  const float e = fast_exp(-2.f * a);
  return std::copysign(a < 0.625f ? a + a * z * p : (1.f - e) / (1.f + e), x);
}

// scores[j] = cap * tanh(scores[j] / cap) for j < n: the logit soft cap.
inline void soft_cap(float* scores, int64_t n, float cap) {
  const float inv = 1.f / cap;
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) scores[j] = cap * fast_tanh(scores[j] * inv);
}

// Slots are scattered over the pool: ask for the rows a few keys ahead so their cache misses
// overlap (a row of head_dim 64 in float32 spans four cache lines).
constexpr int64_t kPrefetchAhead = 8;

template <int64_t ahead = kPrefetchAhead, typename kv_t>
inline void prefetch_row(const kv_t* base, const int64_t* slots, int64_t j, int64_t num_keys, int64_t dim) {
  if (j + ahead >= num_keys) return;
  const char* row = reinterpret_cast<const char*>(base + slots[j + ahead] * dim);
  for (int64_t off = 0; off < dim * static_cast<int64_t>(sizeof(kv_t)); off += 64) __builtin_prefetch(row + off);
}

// A bfloat16 as its bits: the binding hands torch's BFloat16 storage over as this (the same 16
// bits), so the kernels widen it with a shift and need no torch header.
struct bf16 {
  uint16_t bits;
};

// An 8-bit pool's code (its row's scale applies apart: scale_scores, scale_weights).
struct i8 {
  int8_t v;
};

template <typename kv_t>
inline float load(const kv_t* p, int64_t i) {
  return static_cast<float>(p[i]);
}

template <>
inline float load(const bf16* p, int64_t i) {
  return bf16_to_float(p[i].bits);
}

template <>
inline float load(const i8* p, int64_t i) {
  return static_cast<float>(p[i].v);
}

// An 8-bit pool's scales of an item's keys: dst[j] = scale[slots[j]] for j < n (scale: one head's row). With
// AVX512, 16 keys in consecutive slots (a request's pages mostly are) take one load.
inline void gather_scales(const uint16_t* scale, const int64_t* slots, int64_t n, float* dst) {
  int64_t j = 0;
#if defined(__AVX512F__)
  const __m512i iota = _mm512_setr_epi64(0, 1, 2, 3, 4, 5, 6, 7), eight = _mm512_set1_epi64(8);
  for (; j + 16 <= n; j += 16) {
    const __m512i run = _mm512_add_epi64(_mm512_set1_epi64(slots[j]), iota);
    if (_mm512_cmpneq_epi64_mask(_mm512_loadu_si512(slots + j), run) == 0 &&
        _mm512_cmpneq_epi64_mask(_mm512_loadu_si512(slots + j + 8), _mm512_add_epi64(run, eight)) == 0) {
      _mm512_storeu_ps(dst + j, bf16x16_to_float(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scale + slots[j]))));
      continue;
    }
    for (int64_t i = j; i < j + 16; ++i) dst[i] = bf16_to_float(scale[slots[i]]);
  }
#endif
  for (; j < n; ++j) dst[j] = bf16_to_float(scale[slots[j]]);
}

// x[r * stride + j] *= f[j] for rows r < rows, j < n: the key scales into the scores q . code (a score is then
// q . k exactly as with the dequantized row), or the value scales into the softmax weights (after their sum).
inline void scale_rows(float* x, int64_t rows, int64_t stride, const float* f, int64_t n) {
  for (int64_t r = 0; r < rows; ++r) {
    float* row = x + r * stride;
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) row[j] *= f[j];
  }
}

#if defined(__AVX512F__)
namespace avx512 {

// 16 floats from p: float32 as is, bfloat16 widened (its bits are a float32's upper half).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return bf16x16_to_float(h);
}
// 16 int8 codes widened to float32 (exact).
inline __m512 load16(const i8* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// exp(x) for x <= 0, 16 at a time: fast_exp's polynomial, 2^n applied by scalef.
inline __m512 exp16(__m512 x) {
  const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(kExpFloor)), _mm512_set1_ps(kLog2e));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC), f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(kExp2Poly[0]);
  for (int i = 1; i < kExp2Terms; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExp2Poly[i]));
  return _mm512_scalef_ps(p, n);
}

// fast_tanh, 16 at a time (exp16 for the large half).
inline __m512 tanh16(__m512 x) {
  const __m512 a = _mm512_abs_ps(x), z = _mm512_mul_ps(a, a);
  __m512 p = _mm512_set1_ps(-5.70498872745e-3f);
  p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(2.06390887954e-2f));
  p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(-5.37397155531e-2f));
  p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(1.33314422036e-1f));
  p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(-3.33332819422e-1f));
  const __m512 small = _mm512_fmadd_ps(_mm512_mul_ps(a, z), p, a), one = _mm512_set1_ps(1.f);
  const __m512 e = exp16(_mm512_mul_ps(a, _mm512_set1_ps(-2.f)));
  const __m512 big = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
  const __m512 r = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, _mm512_set1_ps(0.625f), _CMP_LT_OQ), big, small);
  const __m512i sign = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(INT32_MIN));
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(r), sign));
}

// soft_cap with tanh16: s * mul, then cap * tanh, for j < n (the last 16 masked).
inline void soft_cap16(float* scores, int64_t n, float mul, float cap) {
  const __m512 m = _mm512_set1_ps(mul), c = _mm512_set1_ps(cap);
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 keep = n - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - j)) - 1);
    const __m512 x = _mm512_maskz_loadu_ps(keep, scores + j);
    _mm512_mask_storeu_ps(scores + j, keep, _mm512_mul_ps(c, tanh16(_mm512_mul_ps(x, m))));
  }
}

}  // namespace avx512
#endif

}  // namespace radixserve
