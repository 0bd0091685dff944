// The decoder layer's elementwise steps, one pass each on CPU (layers.py, attention.py):
//   rms_norm(x, weight, eps)                 RMSNorm of each row (bfloat16 or float32 in and out)
//   swiglu(gate_up, lanes)                   silu(gate) * up from the fused gate|up GEMM output
//   rotary_kv_write(qkv, cos, sin, slots, k_pool, v_pool, num_heads, num_kv_heads)
//                                            q and k rotated ("rotate half"), k and v written into the pool
//                                            at slots (an int8 pool: quantized, with k_scale / v_scale);
//                                            returns q [T, H, D]
// Before, these were ~7, 2 and ~7 torch ops, each a pass over [T, ...] with its own rounding.
//
// Each reproduces the torch ops it replaces bit for bit, roundings included (a bfloat16 torch op
// computes in float32 and rounds once; here every such rounding happens in the same place):
//   RMSNorm     bf16(w * bf16(x32 * rsqrt(mean(x32 * x32) + eps)))  (float32: (x * r) * w, F.rms_norm's)
//   SwiGLU      bf16(bf16(g / (1 + exp(-g))) * u)                   (float32: one rounding fewer)
//   rotary      bf16(bf16(x * cos) + bf16(rotate_half(x) * sin))    then the pool's dtype
// The mean's sum follows torch's cascade_sum over a contiguous row (SumKernel.cpp: four interleaved
// accumulators of 8 floats), and exp is torch's (Sleef's u10 over the chunks torch vectorises, std::exp
// on the tail of a row it leaves to scalar code; ``lanes`` = Vectorized<float>::size() of torch's CPU
// capability, 16 under AVX512, 8 below, sets where that tail starts), so a float32 model still equals
// transformers, and a bfloat16 step gives the bits the torch ops gave. Contracting a*b+c into an FMA
// would change them: this file is compiled without contraction (the pragma below).
//
// Rows are independent (OpenMP over rows): a row's result never depends on the batch, the chunking or
// the thread count, so a cache hit's tail, a chunked prefill and a decode row agree with a cold prefill.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "bf16.h"

#if defined(__AVX2__)
#include <immintrin.h>
#include <sleef.h>  // torch's copy (libtorch_cpu exports it): the exp of Vectorized<float>
#endif

#pragma GCC optimize("fp-contract=off")

namespace {

// Storage types: float, and uint16_t for bfloat16's bits (plain integer code the compiler vectorises).
using bf16 = uint16_t;

inline float to_float(float x) { return x; }
inline float to_float(bf16 bits) { return radixserve::bf16_to_float(bits); }

// float -> T, rounding to nearest even as torch's conversions do.
template <typename T>
inline T from_float(float x);
template <>
inline float from_float<float>(float x) {
  return x;
}
template <>
inline bf16 from_float<bf16>(float x) {
  return radixserve::float_to_bf16(x);
}

// x * y rounded to T, as a torch op on two T tensors computes it (float32 math, one rounding).
template <typename T>
inline float mul_in(float x, float y) {
  return to_float(from_float<T>(x * y));
}

template <typename T>
inline float add_in(float x, float y) {
  return to_float(from_float<T>(x + y));
}

// torch's utils::CeilLog2 for the cascade's level size.
inline int64_t ceil_log2(int64_t x) { return x <= 1 ? 0 : 64 - __builtin_clzll(static_cast<uint64_t>(x - 1)); }

// The sum of a contiguous float row as torch's cascade_sum adds it (vectorized_inner_sum -> row_sum ->
// multi_row_sum): vectors of L floats, vector i*4+k into accumulator k, the levels of the cascade, the
// four folded in order, the scalar tail first and then the L lanes, one by one. L = 1 is torch's scalar
// path, which it takes for rows shorter than one vector.
template <int L>
float torch_row_sum(const float* v, int64_t n) {
  using Acc = std::array<float, L>;
  constexpr int kIlp = 4, kLevels = 4;
  const int64_t vectors = n / L, rows = vectors / kIlp;
  const int64_t level_power = std::max<int64_t>(4, ceil_log2(rows) / kLevels);
  const int64_t level_step = int64_t{1} << level_power, level_mask = level_step - 1;
  Acc acc[kLevels][kIlp] = {};
  auto add_vector = [&](Acc& a, int64_t vector) {
    for (int l = 0; l < L; ++l) a[l] += v[vector * L + l];
  };
  auto add_acc = [](Acc& a, const Acc& b) {
    for (int l = 0; l < L; ++l) a[l] += b[l];
  };
  int64_t i = 0;
  while (i + level_step <= rows) {
    for (int64_t j = 0; j < level_step; ++j, ++i)
      for (int k = 0; k < kIlp; ++k) add_vector(acc[0][k], i * kIlp + k);
    for (int j = 1; j < kLevels; ++j) {
      for (int k = 0; k < kIlp; ++k) {
        add_acc(acc[j][k], acc[j - 1][k]);
        acc[j - 1][k] = Acc{};
      }
      if ((i & (level_mask << (j * level_power))) != 0) break;
    }
  }
  for (; i < rows; ++i)
    for (int k = 0; k < kIlp; ++k) add_vector(acc[0][k], i * kIlp + k);
  for (int j = 1; j < kLevels; ++j)
    for (int k = 0; k < kIlp; ++k) add_acc(acc[0][k], acc[j][k]);
  Acc sum = acc[0][0];
  for (int64_t vector = rows * kIlp; vector < vectors; ++vector) add_vector(sum, vector);
  for (int k = 1; k < kIlp; ++k) add_acc(sum, acc[0][k]);
  float total = 0.f;
  for (int64_t k = vectors * L; k < n; ++k) total += v[k];
  for (int l = 0; l < L; ++l) total += sum[l];
  return total;
}

// torch registers its sum kernel for AVX2 and below only (SumKernel.cpp: "slower with AVX512"), so on
// every x86 CPU it adds vectors of 8 floats.
float torch_sum(const float* v, int64_t n) { return n >= 8 ? torch_row_sum<8>(v, n) : torch_row_sum<1>(v, n); }

template <typename T>
void rms_norm_rows(const T* x, const T* w, T* out, int64_t rows, int64_t dim, int64_t stride, float eps) {
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(dim, 1));
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    std::vector<float> x32(dim), squares(dim);
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * stride;
      for (int64_t i = 0; i < dim; ++i) {
        x32[i] = to_float(xr[i]);
        squares[i] = x32[i] * x32[i];
      }
      const float mean = torch_sum(squares.data(), dim) / static_cast<float>(dim);
      const float inv = 1.f / std::sqrt(mean + eps);
      T* o = out + r * dim;
      for (int64_t i = 0; i < dim; ++i) {
        const float normed = to_float(from_float<T>(x32[i] * inv));
        o[i] = from_float<T>(to_float(w[i]) * normed);
      }
    }
  });
}

#if defined(__AVX512F__)
// Sleef's expf u10 (sleefsimdsp.c xexpf, its AVX512F/FMA helpers), written out so the compiler can
// inline it: the bits of Sleef_expf16_u10, checked against it for all 2^32 inputs.
inline __m512 sleef_expf_u10(__m512 d) {
  const __m512 r_ln2 = _mm512_set1_ps(1.442695040888963407359924681001892137426645954152985934135449406931f);
  const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(d, r_ln2));
  const __m512 qf = _mm512_cvtepi32_ps(q);
  __m512 s = _mm512_fmadd_ps(qf, _mm512_set1_ps(-0.693145751953125f), d);
  s = _mm512_fmadd_ps(qf, _mm512_set1_ps(-1.428606765330187045e-06f), s);
  __m512 u = _mm512_set1_ps(0.000198527617612853646278381f);
  u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.00139304355252534151077271f));
  u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.00833336077630519866943359f));
  u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.0416664853692054748535156f));
  u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.166666671633720397949219f));
  u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.5f));
  u = _mm512_add_ps(_mm512_set1_ps(1.f), _mm512_fmadd_ps(_mm512_mul_ps(s, s), u, s));
  auto pow2i = [](__m512i e) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(e, _mm512_set1_epi32(0x7f)), 23));
  };
  const __m512i half = _mm512_srai_epi32(q, 1);
  u = _mm512_mul_ps(_mm512_mul_ps(u, pow2i(half)), pow2i(_mm512_sub_epi32(q, half)));
  u = _mm512_mask_mov_ps(u, _mm512_cmp_ps_mask(d, _mm512_set1_ps(-104.f), _CMP_LT_OQ), _mm512_setzero_ps());
  return _mm512_mask_mov_ps(u, _mm512_cmp_ps_mask(_mm512_set1_ps(100.f), d, _CMP_LT_OQ),
                            _mm512_set1_ps(std::numeric_limits<float>::infinity()));
}

using radixserve::round_bf16_16;

// silu(g) * u for 16 floats: silu rounded to T first where T is bfloat16 (torch's two ops).
template <bool kRoundSilu>
inline __m512 silu_mul_t(__m512 g, __m512 u) {
  const __m512 e = sleef_expf_u10(_mm512_sub_ps(_mm512_setzero_ps(), g));
  const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e));
  return _mm512_mul_ps(kRoundSilu ? round_bf16_16(silu) : silu, u);
}
inline __m512 silu_mul(__m512 g, __m512 u) { return silu_mul_t<false>(g, u); }

// 32 bfloat16 in natural order, both roundings by vcvtne2ps2bf16 (round to nearest even, as from_float)
// where no value is subnormal: the instruction flushes subnormals to zero, from_float keeps them. A
// chunk with one (a product under 2^-126) is redone by the integer rounding.
#if defined(__AVX512BF16__)
inline void silu_mul_bf16x32(const bf16* gate, const bf16* up, bf16* out) {
  auto widen = [](const bf16* p) {
    return radixserve::bf16x16_to_float(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  };
  const __m512 g0 = widen(gate), g1 = widen(gate + 16);
  auto silu = [](__m512 g) {
    return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), sleef_expf_u10(_mm512_sub_ps(_mm512_setzero_ps(), g))));
  };
  const __m512 s0 = silu(g0), s1 = silu(g1);
  const __m512i sb = (__m512i)_mm512_cvtne2ps_pbh(s1, s0);
  const __m512 p0 = _mm512_mul_ps(radixserve::bf16x16_to_float(_mm512_castsi512_si256(sb)), widen(up));
  const __m512 p1 = _mm512_mul_ps(radixserve::bf16x16_to_float(_mm512_extracti64x4_epi64(sb, 1)), widen(up + 16));
  constexpr int kSubnormal = 0x20;
  if ((_mm512_fpclass_ps_mask(s0, kSubnormal) | _mm512_fpclass_ps_mask(s1, kSubnormal) |
       _mm512_fpclass_ps_mask(p0, kSubnormal) | _mm512_fpclass_ps_mask(p1, kSubnormal)) == 0) {
    _mm512_storeu_si512(out, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
    return;
  }
  for (int h = 0; h < 32; h += 16) {
    const __m512 p = round_bf16_16(_mm512_mul_ps(round_bf16_16(silu(widen(gate + h))), widen(up + h)));
    const __m256i bits = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(p), 16));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + h), bits);
  }
}
#else
// 32 bfloat16: each 128-bit lane's 8 values widened as 4 (unpacklo) + 4 (unpackhi) floats, and packed
// back in the same order (packus of the high halves), so no permute is needed.
inline void silu_mul_bf16x32(const bf16* gate, const bf16* up, bf16* out) {
  const __m512i zero = _mm512_setzero_si512();
  const __m512i g = _mm512_loadu_si512(gate), u = _mm512_loadu_si512(up);
  auto lo = [&](__m512i v) { return _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, v)); };
  auto hi = [&](__m512i v) { return _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, v)); };
  const __m512 a = round_bf16_16(silu_mul_t<true>(lo(g), lo(u))), b = round_bf16_16(silu_mul_t<true>(hi(g), hi(u)));
  const __m512i packed = _mm512_packus_epi32(_mm512_srli_epi32(_mm512_castps_si512(a), 16),
                                             _mm512_srli_epi32(_mm512_castps_si512(b), 16));
  _mm512_storeu_si512(out, packed);
}
#endif  // __AVX512BF16__
#endif

// exp(-g) for a chunk of floats, with the exp torch's silu uses there (the AVX2 and portable builds;
// AVX512 builds run swiglu_row's register loops instead).
template <int N>
void neg_exp_vector(const float* g, float* e) {
#if defined(__AVX2__)
  for (int i = 0; i < N; i += 8)
    _mm256_storeu_ps(e + i, Sleef_expf8_u10(_mm256_sub_ps(_mm256_setzero_ps(), _mm256_loadu_ps(g + i))));
#else
  for (int i = 0; i < N; ++i) e[i] = std::exp(-g[i]);
#endif
}

// silu(gate) * up on one row. torch's silu runs Sleef's exp over chunks of two vectors of T (64
// bfloat16 or 32 floats under AVX512: 4 * lanes / sizeof(T)) and std::exp on the rest of the row.
template <typename T>
void swiglu_row(const T* gate, const T* up, T* out, int64_t n, int64_t lanes) {
  constexpr int kChunk = 64;
  const int64_t vector_chunk = 2 * lanes * static_cast<int64_t>(sizeof(float) / sizeof(T));
  const int64_t vectorised = n - n % vector_chunk;
  alignas(64) float g[kChunk], e[kChunk];
  auto finish = [&](int64_t base, int64_t count) {
    for (int64_t i = 0; i < count; ++i) {
      const float silu = to_float(from_float<T>(g[i] / (1.f + e[i])));
      out[base + i] = from_float<T>(silu * to_float(up[base + i]));
    }
  };
  int64_t i = 0;
#if defined(__AVX512F__)
  // In registers, several independent chains abreast (one alone is a ~90-cycle dependency chain: exp,
  // divide, two roundings); ``vectorised`` is a multiple of 32 bfloat16 / 16 floats.
  if constexpr (std::is_same_v<T, bf16>) {
    for (; i + 64 <= vectorised; i += 64) {
      silu_mul_bf16x32(gate + i, up + i, out + i);
      silu_mul_bf16x32(gate + i + 32, up + i + 32, out + i + 32);
    }
    for (; i + 32 <= vectorised; i += 32) silu_mul_bf16x32(gate + i, up + i, out + i);
  } else {
    for (; i + 64 <= vectorised; i += 64)
      for (int j = 0; j < 64; j += 16)
        _mm512_storeu_ps(out + i + j, silu_mul(_mm512_loadu_ps(gate + i + j), _mm512_loadu_ps(up + i + j)));
    for (; i + 16 <= vectorised; i += 16)
      _mm512_storeu_ps(out + i, silu_mul(_mm512_loadu_ps(gate + i), _mm512_loadu_ps(up + i)));
  }
#endif
  for (; i + kChunk <= vectorised; i += kChunk) {
    for (int j = 0; j < kChunk; ++j) g[j] = to_float(gate[i + j]);
    neg_exp_vector<kChunk>(g, e);
    finish(i, kChunk);
  }
  for (; i + 16 <= vectorised; i += 16) {  // 32-float chunks under AVX512 float32, 16 under AVX2
    for (int j = 0; j < 16; ++j) g[j] = to_float(gate[i + j]);
    neg_exp_vector<16>(g, e);
    finish(i, 16);
  }
  for (; i < n; ++i) {
    g[0] = to_float(gate[i]);
    e[0] = std::exp(-g[0]);
    finish(i, 1);
  }
}

template <typename T>
void swiglu_rows(const T* x, T* out, int64_t rows, int64_t inter, int64_t stride, int64_t lanes) {
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(inter, 1));
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) swiglu_row(x + r * stride, x + r * stride + inter, out + r * inter, inter, lanes);
  });
}

// One head of one token, rotated: out[i] = x[i] * cos[i] + rotate_half(x)[i] * sin[i], each product and
// the sum rounded to T (torch's three ops).
template <typename T>
inline void rotate(const T* x, const T* cos, const T* sin, float* out, int64_t dim) {
  const int64_t half = dim / 2;
  auto at = [&](int64_t i, float rotated) {
    return add_in<T>(mul_in<T>(to_float(x[i]), to_float(cos[i])), mul_in<T>(rotated, to_float(sin[i])));
  };
  for (int64_t i = 0; i < half; ++i) out[i] = at(i, -to_float(x[i + half]));
  for (int64_t i = half; i < dim; ++i) out[i] = at(i, to_float(x[i - half]));
}

#if defined(__AVX512F__)
// rotate() of a bfloat16 head whose half is a multiple of 16, 16 dims at a time (the same two products and
// sum, each rounded as from_float rounds: round_bf16_16), into bf16 bits. The scalar loop ran ~0.6 ms a
// layer for a 2k prefill.
inline void rotate_bf16(const bf16* x, const bf16* cos, const bf16* sin, bf16* out, int64_t dim) {
  const int64_t half = dim / 2;
  auto widen = [](const bf16* p) {
    return radixserve::bf16x16_to_float(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  };
  const __m512 sign = _mm512_set1_ps(-0.f);
  for (int64_t i = 0; i < dim; i += 16) {
    const __m512 rotated = i < half ? _mm512_xor_ps(widen(x + i + half), sign) : widen(x + i - half);
    const __m512 y = round_bf16_16(_mm512_add_ps(round_bf16_16(_mm512_mul_ps(widen(x + i), widen(cos + i))),
                                                 round_bf16_16(_mm512_mul_ps(rotated, widen(sin + i)))));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i),
                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(y), 16)));
  }
}
#endif

// An 8-bit pool's row by kv_quant.quantize_absmax's rule (scale = max|x| / 127, at least 1e-30, rounded to
// bfloat16; code = x / scale rounded half to even, within +-127): the fused write stores what KVPool.write does.
inline void quantize_row(const float* x, int64_t dim, int8_t* codes, bf16* scale) {
  float mx = 0.f;
  for (int64_t i = 0; i < dim; ++i) mx = std::max(mx, std::fabs(x[i]));
  const bf16 bits = radixserve::float_to_bf16(std::max(mx / 127.f, 1e-30f));
  const float sf = radixserve::bf16_to_float(bits);
  for (int64_t i = 0; i < dim; ++i) codes[i] = static_cast<int8_t>(std::clamp(std::nearbyint(x[i] / sf), -127.f, 127.f));
  *scale = bits;
}

template <typename T, typename P>
void rotary_kv_rows(const T* qkv, int64_t qkv_stride, const T* cos, const T* sin, int64_t cs_stride,
                    const int64_t* slots, P* k_pool, P* v_pool, int64_t num_slots, T* q_out, int64_t rows,
                    int64_t heads, int64_t kv_heads, int64_t dim, bf16* k_scale = nullptr, bf16* v_scale = nullptr) {
  const int64_t grain = std::max<int64_t>(1, 8192 / ((heads + 2 * kv_heads) * dim));
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    std::vector<float> rotated(dim);
    for (int64_t t = r0; t < r1; ++t) {
      const T* row = qkv + t * qkv_stride;
      const T *c = cos + t * cs_stride, *s = sin + t * cs_stride;
#if defined(__AVX512F__)
      if constexpr (std::is_same_v<T, bf16> && std::is_same_v<P, bf16>) {
        if (dim % 32 == 0) {
          for (int64_t h = 0; h < heads; ++h) rotate_bf16(row + h * dim, c, s, q_out + (t * heads + h) * dim, dim);
          const int64_t slot = slots[t];
          for (int64_t h = 0; h < kv_heads; ++h) {
            rotate_bf16(row + (heads + h) * dim, c, s, k_pool + (h * num_slots + slot) * dim, dim);
            std::memcpy(v_pool + (h * num_slots + slot) * dim, row + (heads + kv_heads + h) * dim, dim * sizeof(bf16));
          }
          continue;
        }
      }
#endif
      for (int64_t h = 0; h < heads; ++h) {
        rotate(row + h * dim, c, s, rotated.data(), dim);
        T* o = q_out + (t * heads + h) * dim;
        for (int64_t i = 0; i < dim; ++i) o[i] = from_float<T>(rotated[i]);
      }
      const int64_t slot = slots[t];
      if constexpr (std::is_same_v<P, int8_t>) {  // an 8-bit pool: codes and a scale per row
        for (int64_t h = 0; h < kv_heads; ++h) {
          const int64_t at = h * num_slots + slot;
          rotate(row + (heads + h) * dim, c, s, rotated.data(), dim);
          quantize_row(rotated.data(), dim, k_pool + at * dim, k_scale + at);
          const T* v = row + (heads + kv_heads + h) * dim;
          for (int64_t i = 0; i < dim; ++i) rotated[i] = to_float(v[i]);
          quantize_row(rotated.data(), dim, v_pool + at * dim, v_scale + at);
        }
      } else {
        for (int64_t h = 0; h < kv_heads; ++h) {
          rotate(row + (heads + h) * dim, c, s, rotated.data(), dim);
          P* k = k_pool + (h * num_slots + slot) * dim;
          for (int64_t i = 0; i < dim; ++i) k[i] = from_float<P>(rotated[i]);  // already T-exact
          const T* v = row + (heads + kv_heads + h) * dim;
          P* vo = v_pool + (h * num_slots + slot) * dim;
          for (int64_t i = 0; i < dim; ++i) vo[i] = from_float<P>(to_float(v[i]));
        }
      }
    }
  });
}

template <typename T>
T* ptr(const at::Tensor& t) {
  return static_cast<T*>(t.data_ptr());
}

bool float_or_bf16(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16;
}

at::Tensor rms_norm_op(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.device().is_cpu() && float_or_bf16(x) && weight.scalar_type() == x.scalar_type(),
              "rms_norm: float32 or bfloat16 CPU tensors of one dtype");
  const int64_t dim = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == dim && weight.is_contiguous(), "rms_norm: weight [dim]");
  const at::Tensor rows = x.reshape({-1, dim});
  const at::Tensor xr = rows.stride(1) == 1 ? rows : rows.contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  const float e = static_cast<float>(eps);
  if (x.scalar_type() == at::kFloat)
    rms_norm_rows(ptr<float>(xr), ptr<float>(weight), ptr<float>(out), xr.size(0), dim,
                  xr.stride(0), e);
  else
    rms_norm_rows(ptr<bf16>(xr), ptr<bf16>(weight), ptr<bf16>(out), xr.size(0), dim,
                  xr.stride(0), e);
  return out;
}

at::Tensor swiglu_op(const at::Tensor& gate_up, int64_t lanes) {
  TORCH_CHECK(gate_up.device().is_cpu() && float_or_bf16(gate_up) && gate_up.dim() == 2 && gate_up.size(1) % 2 == 0,
              "swiglu: float32 or bfloat16 [T, 2 * intermediate] on CPU");
  const at::Tensor x = gate_up.stride(1) == 1 ? gate_up : gate_up.contiguous();
  const int64_t rows = x.size(0), inter = x.size(1) / 2;
  at::Tensor out = at::empty({rows, inter}, x.options().memory_format(at::MemoryFormat::Contiguous));
  if (x.scalar_type() == at::kFloat)
    swiglu_rows(ptr<float>(x), ptr<float>(out), rows, inter, x.stride(0), lanes);
  else
    swiglu_rows(ptr<bf16>(x), ptr<bf16>(out), rows, inter, x.stride(0), lanes);
  return out;
}

template <typename T>
void rotary_kv_dispatch_pool(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                             const at::Tensor& slots, at::Tensor& k_pool, at::Tensor& v_pool, at::Tensor& q,
                             int64_t heads, int64_t kv_heads, int64_t dim, const c10::optional<at::Tensor>& k_scale,
                             const c10::optional<at::Tensor>& v_scale) {
  const int64_t rows = qkv.size(0), num_slots = k_pool.size(1);
  auto run = [&](auto* k, auto* v, bf16* ks = nullptr, bf16* vs = nullptr) {
    rotary_kv_rows(ptr<T>(qkv), qkv.stride(0), ptr<T>(cos), ptr<T>(sin), cos.stride(0),
                   slots.data_ptr<int64_t>(), k, v, num_slots, ptr<T>(q), rows, heads, kv_heads, dim, ks, vs);
  };
  if (k_pool.scalar_type() == at::kFloat)
    run(ptr<float>(k_pool), ptr<float>(v_pool));
  else if (k_pool.scalar_type() == at::kChar)
    run(ptr<int8_t>(k_pool), ptr<int8_t>(v_pool), ptr<bf16>(*k_scale), ptr<bf16>(*v_scale));
  else
    run(ptr<bf16>(k_pool), ptr<bf16>(v_pool));
}

at::Tensor rotary_kv_write_op(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                              const at::Tensor& slots, at::Tensor k_pool, at::Tensor v_pool, int64_t num_heads,
                              int64_t num_kv_heads, const c10::optional<at::Tensor>& k_scale,
                              const c10::optional<at::Tensor>& v_scale) {
  TORCH_CHECK(qkv.device().is_cpu() && float_or_bf16(qkv) && cos.scalar_type() == qkv.scalar_type() &&
                  sin.scalar_type() == qkv.scalar_type(),
              "rotary_kv_write: qkv, cos, sin float32 or bfloat16 CPU tensors of one dtype");
  const bool int8 = k_pool.scalar_type() == at::kChar;
  TORCH_CHECK((float_or_bf16(k_pool) || int8) && v_pool.scalar_type() == k_pool.scalar_type(),
              "pool float32, bfloat16 or int8");
  for (const auto* scale : {&k_scale, &v_scale})  // an 8-bit pool's: bfloat16 [Hkv, N]
    TORCH_CHECK(int8 == scale->has_value() && (!int8 || ((*scale)->scalar_type() == at::kBFloat16 &&
                                                         (*scale)->is_contiguous() && (*scale)->dim() == 2 &&
                                                         (*scale)->size(0) == k_pool.size(0) &&
                                                         (*scale)->size(1) == k_pool.size(1))),
                "rotary_kv_write: an int8 pool and only it comes with bfloat16 scales [Hkv, N]");
  TORCH_CHECK(k_pool.dim() == 3 && k_pool.sizes() == v_pool.sizes() && k_pool.is_contiguous() &&
                  v_pool.is_contiguous() && k_pool.size(0) == num_kv_heads,
              "k/v pools: contiguous [Hkv, N, D]");
  const int64_t dim = k_pool.size(2), rows = qkv.size(0);
  TORCH_CHECK(dim % 2 == 0 && qkv.dim() == 2 && qkv.size(1) == (num_heads + 2 * num_kv_heads) * dim &&
                  qkv.stride(1) == 1,
              "qkv: [T, (H + 2 Hkv) D], rows dense");
  const at::Tensor c = cos.reshape({rows, dim}), s = sin.reshape({rows, dim});
  TORCH_CHECK(c.stride(1) == 1 && s.stride(1) == 1 && c.stride(0) == s.stride(0), "cos, sin: [T, D] rows dense");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == rows, "slots: int64 [T]");
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < rows; ++t) TORCH_CHECK(sl[t] >= 0 && sl[t] < k_pool.size(1), "slot outside the pool");
  at::Tensor q = at::empty({rows, num_heads, dim}, qkv.options().memory_format(at::MemoryFormat::Contiguous));
  if (qkv.scalar_type() == at::kFloat)
    rotary_kv_dispatch_pool<float>(qkv, c, s, slots, k_pool, v_pool, q, num_heads, num_kv_heads, dim, k_scale,
                                   v_scale);
  else
    rotary_kv_dispatch_pool<bf16>(qkv, c, s, slots, k_pool, v_pool, q, num_heads, num_kv_heads, dim, k_scale,
                                  v_scale);
  return q;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixserve, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("swiglu(Tensor gate_up, int lanes) -> Tensor");
  m.def(
      "rotary_kv_write(Tensor qkv, Tensor cos, Tensor sin, Tensor slots, Tensor(a!) k_pool, Tensor(b!) v_pool, "
      "int num_heads, int num_kv_heads, Tensor(c!)? k_scale=None, Tensor(d!)? v_scale=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(radixserve, CPU, m) {
  m.impl("rms_norm", &rms_norm_op);
  m.impl("swiglu", &swiglu_op);
  m.impl("rotary_kv_write", &rotary_kv_write_op);
}
