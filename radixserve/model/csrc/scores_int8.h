// The scores pass of paged_avx512.h over an 8-bit pool with vpdpbusd (AVX512-VNNI): q . code for 64 dims of a key
// in one instruction (on average), against paged_avx512.h's int16 pairs (vpdpwssd: two instructions and two
// widenings a key).
//
//   q       row r quantized to int8 with one scale (max|q_r| / 127) and its codes' sum; each 16-byte block of the
//           row broadcast to the four 128-bit lanes of a register (vpdpbusd's signed side);
//   keys    the codes plus 128 (a sign flip: vpdpbusd's unsigned side), so q . (k + 128) - 128 sum(q) = q . k,
//           exactly in int32 (|sum| < 64 x 128 x 255 per 64 dims);
//   layout  four keys' 64-code rows transposed by 128-bit blocks (8 shuffles): register b = block b of each key, so
//           one vpdpbusd per block adds each key's 16 codes into its own 128-bit lane; keys g, g+4, g+8, g+12 make
//           group g, so after 4 vpdpbusd per group x 4 groups the four lanes of each key reduce (7 shuffles, 3 adds)
//           to 16 scores already in key order;
//   scale   score = int x (q scale x key scale): the item's key scales (a bfloat16 each) are multiplied in here, so
//           the scores leave this pass as q . k of the dequantized rows (to q's int8 rounding).
// Integer sums are exact, so a score is the same whatever its neighbours, row block or item (split invariance).
// Keys run in blocks of 16 along two streams (block i, then block half + i): see paged_avx512.h's top. Head dims a
// multiple of 64 with AVX512-VNNI; others keep paged_avx512.h's pass.
#pragma once

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "paged_avx512.h"

namespace radixserve::avx512 {

// q [rows][dim] -> int8 codes [rows][dim], scales [rows] (max|q_r| / 127) and the codes' sums [rows].
inline void quantize_rows_i8(const float* q, int64_t rows, int64_t dim, int8_t* codes, float* scales, int32_t* sums) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = q + r * dim;
    float mx = 0.f;
    for (int64_t i = 0; i < dim; ++i) mx = std::max(mx, std::fabs(x[i]));
    const float inv = mx > 0.f ? 127.f / mx : 0.f;
    int32_t sum = 0;
    for (int64_t i = 0; i < dim; ++i) {
      codes[r * dim + i] = static_cast<int8_t>(std::nearbyint(x[i] * inv));
      sum += codes[r * dim + i];
    }
    scales[r] = mx / 127.f;
    sums[r] = sum;
  }
}

// Four keys' 64 codes (plus 128) transposed by 128-bit blocks: t[b] = [block b of key 0 | of key 1 | 2 | 3].
inline void transpose_blocks(const i8* k0, const i8* k1, const i8* k2, const i8* k3, __m512i* t) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const auto row = [&](const i8* p) { return _mm512_xor_si512(_mm512_loadu_si512(p), flip); };
  const __m512i a0 = row(k0), a1 = row(k1), a2 = row(k2), a3 = row(k3);
  const __m512i lo01 = _mm512_shuffle_i32x4(a0, a1, 0x44), hi01 = _mm512_shuffle_i32x4(a0, a1, 0xEE);
  const __m512i lo23 = _mm512_shuffle_i32x4(a2, a3, 0x44), hi23 = _mm512_shuffle_i32x4(a2, a3, 0xEE);
  t[0] = _mm512_shuffle_i32x4(lo01, lo23, 0x88);
  t[1] = _mm512_shuffle_i32x4(lo01, lo23, 0xDD);
  t[2] = _mm512_shuffle_i32x4(hi01, hi23, 0x88);
  t[3] = _mm512_shuffle_i32x4(hi01, hi23, 0xDD);
}

// acc[g] (lane 4L + i: key g + 4L's partial i) -> 16 sums, lane j = key j.
inline __m512i reduce_groups(const __m512i* acc) {
  const __m512i s01 = _mm512_add_epi32(_mm512_unpacklo_epi32(acc[0], acc[1]), _mm512_unpackhi_epi32(acc[0], acc[1]));
  const __m512i s23 = _mm512_add_epi32(_mm512_unpacklo_epi32(acc[2], acc[3]), _mm512_unpackhi_epi32(acc[2], acc[3]));
  return _mm512_add_epi32(_mm512_unpacklo_epi64(s01, s23), _mm512_unpackhi_epi64(s01, s23));
}

// Scores of R rows for the 16 keys at rows[0..15] (NB blocks of 64 dims each): out[r * stride + j] =
// (q_r . k_j) x q scale x key_scale[j]. qb [R][NB][4] registers: q's 16-byte blocks, broadcast.
template <int NB, int R>
inline void scores_block16(const __m512i* qb, const int32_t* offset, const float* q_scale, const i8* const* rows,
                           __m512 key_scale, int64_t stride, float* out) {
  __m512i acc[R][4];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int g = 0; g < 4; ++g) acc[r][g] = _mm512_setzero_si512();
#pragma GCC unroll 2
  for (int c = 0; c < NB; ++c)
#pragma GCC unroll 4
    for (int g = 0; g < 4; ++g) {
      __m512i t[4];
      transpose_blocks(rows[g] + 64 * c, rows[g + 4] + 64 * c, rows[g + 8] + 64 * c, rows[g + 12] + 64 * c, t);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int b = 0; b < 4; ++b) acc[r][g] = _mm512_dpbusd_epi32(acc[r][g], t[b], qb[(r * NB + c) * 4 + b]);
    }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    const __m512 dot = _mm512_cvtepi32_ps(_mm512_sub_epi32(reduce_groups(acc[r]), _mm512_set1_epi32(offset[r])));
    const __m512 scale = _mm512_mul_ps(key_scale, _mm512_set1_ps(q_scale[r]));
    _mm512_storeu_ps(out + r * stride, _mm512_mul_ps(dot, scale));
  }
}

// R rows of scores over keys [0, num_keys) (key_scales: num_keys rounded up to 16, zero past num_keys).
template <int NB, int R>
void scores_rows_int8(const int8_t* codes, const float* q_scale, const int32_t* sums, const i8* k,
                      const int64_t* slots, int64_t num_keys, const float* key_scales, int64_t stride, float* scores) {
  constexpr int64_t dim = NB * 64;
  alignas(64) static const i8 zeros[dim] = {};
  __m512i qb[R * NB * 4];
  int32_t offset[R];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    offset[r] = 128 * sums[r];
#pragma GCC unroll 8
    for (int b = 0; b < NB * 4; ++b)
      qb[r * NB * 4 + b] =
          _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + r * dim + 16 * b)));
  }
  const int64_t blocks = (num_keys + 15) / 16, half = (blocks + 1) / 2;
  const auto block = [&](int64_t j0) {
    const i8* rows[16];
    if (j0 + 16 <= num_keys && slots[j0 + 15] - slots[j0] == 15) {  // a run of 16 slots (a page's, mostly)
      const i8* base = k + slots[j0] * dim;
      if (j0 + 16 + kAhead <= num_keys) {  // the 16 keys kAhead on, read as a run too (else a wasted prefetch)
        const i8* ahead = k + slots[j0 + kAhead] * dim;
#pragma GCC unroll 16
        for (int64_t j = 0; j < 16 * NB; ++j) __builtin_prefetch(ahead + 64 * j);
      }
#pragma GCC unroll 16
      for (int64_t j = 0; j < 16; ++j) rows[j] = base + j * dim;
    } else {
#pragma GCC unroll 16
      for (int64_t j = 0; j < 16; ++j) {
        const int64_t key = j0 + j;
        if (key < num_keys) prefetch_row<kAhead>(k, slots, key, num_keys, dim);
        rows[j] = key < num_keys ? k + slots[key] * dim : zeros;
      }
    }
    scores_block16<NB, R>(qb, offset, q_scale, rows, _mm512_loadu_ps(key_scales + j0), stride, scores + j0);
  };
  for (int64_t i = 0; i < half; ++i) {
    block(16 * i);
    if (half + i < blocks) block(16 * (half + i));
  }
}

// paged_avx512.h's scores_pass for an 8-bit pool, the key scales applied: scores [rows][stride] up to num_keys
// rounded up to 16 (0 past num_keys). key_scales as above.
template <int NC>
void scores_pass_int8(const float* q, int64_t rows, const i8* k, const int64_t* slots, int64_t num_keys,
                      const float* key_scales, int64_t stride, float* scores) {
  static_assert(NC % 4 == 0, "64-dim blocks");
  constexpr int NB = NC / 4;
  constexpr int64_t dim = NC * 16;
  static thread_local std::vector<int8_t> codes;
  static thread_local std::vector<float> q_scale;
  static thread_local std::vector<int32_t> sums;
  codes.resize(rows * dim);
  q_scale.resize(rows);
  sums.resize(rows);
  quantize_rows_i8(q, rows, dim, codes.data(), q_scale.data(), sums.data());
  for (int64_t r0 = 0; r0 < rows; r0 += 3) {
    const int8_t* c = codes.data() + r0 * dim;
    const float* qs = q_scale.data() + r0;
    const int32_t* su = sums.data() + r0;
    float* out = scores + r0 * stride;
    switch (std::min<int64_t>(3, rows - r0)) {
      case 1: scores_rows_int8<NB, 1>(c, qs, su, k, slots, num_keys, key_scales, stride, out); break;
      case 2: scores_rows_int8<NB, 2>(c, qs, su, k, slots, num_keys, key_scales, stride, out); break;
      default: scores_rows_int8<NB, 3>(c, qs, su, k, slots, num_keys, key_scales, stride, out); break;
    }
  }
}

}  // namespace radixserve::avx512

#endif  // __AVX512BW__ && __AVX512VNNI__
