// The value pass of paged_avx512.h over an 8-bit pool in integers: softmax weights times int8 codes with
// vpdpwssd (vpmaddwd + add without AVX512-VNNI), instead of widening every code to float and spending one
// float FMA per code and row, which cost as much as a bfloat16 pool's pass.
//
//   weights  row r's p[r][j] (the value scales already folded in, all >= 0) become int16 codes in blocks of
//            16 keys at fixed item positions, one scale per row and block: w = round(p * 32767 / max), max the
//            block's largest weight (so every weight keeps 2^-15 of its block's largest: far below the codes'
//            own 2^-8);
//   values   two keys' 64 codes (one column group, one cache line each) interleaved into four registers of
//            int16 pairs (key j, key j+1) per dim, dotted with the pair's broadcast weights into int32 sums,
//            exact in any order; per block one float FMA per accumulator adds scale x sum.
// The float sums run block by block in the order of paged_avx512.h's two streams (block j0, then block
// j0 + kStream), a function of the keys' positions only; a row's weights, scales and integer sums are its
// own, so its bits do not depend on the other rows of its block or on how many keys they see (their zero
// weights add +0). Head dims a multiple of 64 take this pass; others keep the float one.
#pragma once

#if defined(__AVX512BW__)
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "paged_avx512.h"
#include "simd_reduce.h"

namespace radixserve::avx512 {

constexpr int64_t kWeightBlock = 16;  // keys that share one weight scale and one int32 sum

// Rows [0, rows) of p [rows][stride] (stride a multiple of 16, 0 past each row's keys) as int16 codes w, same
// layout, and scales [rows][stride / 16]: p ~= w * scale.
inline void quantize_weights(const float* p, int64_t rows, int64_t stride, int16_t* w, float* scales) {
  const int64_t blocks = stride / kWeightBlock;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t at = r * stride + b * kWeightBlock;
      const __m512 x = _mm512_loadu_ps(p + at);
      const float mx = _mm512_reduce_max_ps(x);
      const __m512i codes = _mm512_cvtps_epi32(_mm512_mul_ps(x, _mm512_set1_ps(mx > 0.f ? 32767.f / mx : 0.f)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(w + at), _mm512_cvtepi32_epi16(codes));
      scales[r * blocks + b] = mx / 32767.f;
    }
}

// Keys a and b's 64 codes as int16 pairs: pair[k]'s lane 4L + i holds (a, b) of dim 16L + 4k + i. Each byte is
// doubled into an int16 whose top byte is the code, then shifted down with its sign.
inline void code_pairs(__m512i a, __m512i b, __m512i* pair) {
  const __m512i lo = _mm512_unpacklo_epi8(a, b), hi = _mm512_unpackhi_epi8(a, b);
  pair[0] = _mm512_srai_epi16(_mm512_unpacklo_epi8(lo, lo), 8);
  pair[1] = _mm512_srai_epi16(_mm512_unpackhi_epi8(lo, lo), 8);
  pair[2] = _mm512_srai_epi16(_mm512_unpacklo_epi8(hi, hi), 8);
  pair[3] = _mm512_srai_epi16(_mm512_unpackhi_epi8(hi, hi), 8);
}

// acc[r][64g .. 64g + 63] = sum_j p[r][j] v_j for NR rows over keys [0, num_keys): column group g of the rows
// (dims 64g .. 64g + 63, one cache line of each key's codes).
template <int NR>
void values_group(const int16_t* w, const float* scales, int64_t stride, const i8* v, const int64_t* slots,
                  int64_t num_keys, int64_t dim, int64_t g, float* acc) {
  alignas(64) static const i8 zeros[64] = {};
  const i8* col = v + 64 * g;
  __m512 af[NR][4];
#pragma GCC unroll 4
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) af[r][k] = _mm512_setzero_ps();
  auto block = [&](int64_t j0) {
    __m512i ai[NR][4];
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r)
#pragma GCC unroll 4
      for (int k = 0; k < 4; ++k) ai[r][k] = _mm512_setzero_si512();
    const int64_t j1 = std::min(j0 + kWeightBlock, num_keys);
    for (int64_t j = j0; j < j1; j += 2) {
      if (j + kAhead < num_keys) __builtin_prefetch(col + slots[j + kAhead] * dim);
      if (j + 1 + kAhead < num_keys) __builtin_prefetch(col + slots[j + 1 + kAhead] * dim);
      const i8* b = j + 1 < num_keys ? col + slots[j + 1] * dim : zeros;  // its weight is 0
      __m512i pair[4];
      code_pairs(_mm512_loadu_si512(col + slots[j] * dim), _mm512_loadu_si512(b), pair);
#pragma GCC unroll 4
      for (int r = 0; r < NR; ++r) {
        int32_t both;  // weights j, j + 1
        std::memcpy(&both, w + r * stride + j, sizeof both);
        const __m512i wp = _mm512_set1_epi32(both);
#pragma GCC unroll 4
        for (int k = 0; k < 4; ++k) ai[r][k] = dot_i16(ai[r][k], pair[k], wp);
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) {
      const __m512 s = _mm512_set1_ps(scales[r * (stride / kWeightBlock) + j0 / kWeightBlock]);
#pragma GCC unroll 4
      for (int k = 0; k < 4; ++k) af[r][k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ai[r][k]), s, af[r][k]);
    }
  };
  for (int64_t base = 0; base < num_keys; base += 2 * kStream)
    for (int64_t j0 = base; j0 < std::min(base + kStream, num_keys); j0 += kWeightBlock) {
      block(j0);
      if (j0 + kStream < num_keys) block(j0 + kStream);
    }
  for (int r = 0; r < NR; ++r) {
    alignas(64) float lanes[4][16];
    for (int k = 0; k < 4; ++k) _mm512_store_ps(lanes[k], af[r][k]);
    float* out = acc + r * dim + 64 * g;
    for (int l = 0; l < 4; ++l)
      for (int k = 0; k < 4; ++k)
        for (int i = 0; i < 4; ++i) out[16 * l + 4 * k + i] = lanes[k][4 * l + i];
  }
}

// Row r's softmax weights straight to int16 codes: w = exp(sc - max) over keys [first, seen) (0 elsewhere, up to
// padded, a multiple of 16), times v_scales (0 past the item's keys), quantized per block of 16 as quantize_weights
// does; (max, sum of the weights before the value scales) through m and l. The same operations as softmax_row, the
// scales' multiply and quantize_weights in turn, in one pass (the same bits). Blocks go 16 at a time: their
// largest weights in one transposed reduction (simd::reduce16_max: exact, as max is in any order) and both
// divisions by them in one vector each (IEEE division: the scalar's bits), instead of a horizontal max and two
// scalar divisions per block; this pass reads no memory, so what it computes is not hidden behind the pool's bytes.
inline void softmax_weights_row(const float* sc, int64_t first, int64_t seen, int64_t padded, const float* v_scales,
                                float* m, float* l, int16_t* w, float* scales) {
  const float row_max = masked_row_max(sc, first, seen);
  const __m512 mv = _mm512_set1_ps(row_max), most = _mm512_set1_ps(32767.f);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j0 = 0; j0 < padded; j0 += 16 * kWeightBlock) {
    const int64_t blocks = std::min<int64_t>(16, (padded - j0) / kWeightBlock);
    __m512 x[16];
#pragma GCC unroll 16
    for (int64_t b = 0; b < 16; ++b) {
      const int64_t j = j0 + b * kWeightBlock;
      if (b >= blocks) {
        x[b] = _mm512_setzero_ps();
        continue;
      }
      const __m512 p = _mm512_maskz_mov_ps(lanes_in(j, first, seen), exp16(_mm512_sub_ps(_mm512_loadu_ps(sc + j), mv)));
      sum = _mm512_add_ps(sum, p);
      x[b] = _mm512_mul_ps(p, _mm512_loadu_ps(v_scales + j));
    }
    const __m512 top = simd::reduce16_max(x);
    const __m512 inv = _mm512_maskz_div_ps(_mm512_cmp_ps_mask(top, _mm512_setzero_ps(), _CMP_GT_OQ), most, top);
    _mm512_mask_storeu_ps(scales + j0 / kWeightBlock, static_cast<__mmask16>((1u << blocks) - 1u),
                          _mm512_div_ps(top, most));
#pragma GCC unroll 16
    for (int64_t b = 0; b < blocks; ++b) {
      const __m512 by = _mm512_permutexvar_ps(_mm512_set1_epi32(static_cast<int>(b)), inv);
      const __m512i codes = _mm512_cvtps_epi32(_mm512_mul_ps(x[b], by));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(w + j0 + b * kWeightBlock), _mm512_cvtepi32_epi16(codes));
    }
  }
  *m = row_max;
  *l = _mm512_reduce_add_ps(sum);
}

// acc[r] = sum_j p[r][j] v_j from the weights' codes w [rows][stride] and their block scales [rows][stride / 16]:
// rows in blocks of up to 3 (3 x 4 int32 and 3 x 4 float accumulators), each column group of 64 dims in turn (a
// group reads its own cache line of each key).
template <int NC>
void values_pass_codes(const int16_t* w, const float* scales, int64_t rows, const int64_t* seen, int64_t stride,
                       const i8* v, const int64_t* slots, float* acc) {
  static_assert(NC % 4 == 0, "64-dim column groups");
  constexpr int64_t dim = NC * 16;
  for (int64_t r0 = 0; r0 < rows; r0 += 3) {
    const int64_t nr = std::min<int64_t>(3, rows - r0), keys = *std::max_element(seen + r0, seen + r0 + nr);
    const int16_t* wr = w + r0 * stride;
    const float* sr = scales + r0 * stride / kWeightBlock;
    for (int64_t g = 0; g < NC / 4; ++g) {
      float* out = acc + r0 * dim;
      if (nr == 1) values_group<1>(wr, sr, stride, v, slots, keys, dim, g, out);
      else if (nr == 2) values_group<2>(wr, sr, stride, v, slots, keys, dim, g, out);
      else values_group<3>(wr, sr, stride, v, slots, keys, dim, g, out);
    }
  }
}

// paged_avx512.h's values_pass for an 8-bit pool: p's weights quantized (quantize_weights), then values_pass_codes.
template <int NC>
void values_pass(const float* p, int64_t rows, const int64_t* seen, int64_t stride, const i8* v,
                 const int64_t* slots, float* acc) {
  if constexpr (NC % 4 != 0) {
    values_pass<NC, i8>(p, rows, seen, stride, v, slots, acc);
  } else {
    static thread_local std::vector<int16_t> w;
    static thread_local std::vector<float> scales;
    w.resize(rows * stride);
    scales.resize(rows * stride / kWeightBlock);
    quantize_weights(p, rows, stride, w.data(), scales.data());
    values_pass_codes<NC>(w.data(), scales.data(), rows, seen, stride, v, slots, acc);
  }
}

}  // namespace radixserve::avx512

#endif  // __AVX512BW__
