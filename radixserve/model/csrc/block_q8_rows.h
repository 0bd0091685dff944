// Activation rows as int8 blocks of 32, as llama.cpp's CPU backend quantizes them for its Q4 / Q8_0 dot products
// (one scale a block): what both int8-activation linears take (block_q8_linear.cpp: Q4_0 / Q4_1 / Q8_0 blocks;
// gguf_rows_q8_linear.cpp: the GGUF row types). A row's codes depend on that row alone.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "block_common.h"

namespace radixserve {

// Activations as int8 blocks: codes [rows, K]; per block its scale and (Q4_1 min term) scale * sum of codes,
// [rows, ld] with ld = blocks padded to a multiple of 16 (zeros past the last block).
struct Q8Rows {
  at::Tensor codes;
  std::vector<float> scales, sums;
  std::vector<int32_t> code_sums;  // the integer sum of each block's codes
  int64_t ld;
};

inline int64_t padded16(int64_t blocks) { return (blocks + 15) / 16 * 16; }

// One block of 32: its codes, returns its scale; *sum = scale * the sum of the codes, *codes_total that sum.
inline float quantize_block(const float* x, int8_t* q, float* sum, int32_t* codes_total) {
#ifdef RADIXSERVE_BLOCK_AVX2
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 v[4], amax = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  const float top = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
  const __m256 inv = _mm256_set1_ps(top > 0.f ? 127.f / top : 0.f);
  __m256i c[4];
  for (int i = 0; i < 4; ++i) c[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));  // round half to even
  // packs interleave the two 128-bit lanes: int32 lanes 0..7 of c0..c3 come out as 0,4,1,5,2,6,3,7 (x 4 bytes).
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permutevar8x32_epi32(packed, order));
  const __m256i lanes = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), packed), _mm256_set1_epi16(1));
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(lanes), _mm256_extracti128_si256(lanes, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
  const int32_t codes_sum = _mm_cvtsi128_si32(_mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1)));
#else
  float top = 0.f;
  for (int j = 0; j < kBlock; ++j) top = std::max(top, std::fabs(x[j]));
  const float inv = top > 0.f ? 127.f / top : 0.f;
  int32_t codes_sum = 0;
  for (int j = 0; j < kBlock; ++j) {
    q[j] = static_cast<int8_t>(std::nearbyint(x[j] * inv));
    codes_sum += q[j];
  }
#endif
  const float scale = top / 127.f;
  *sum = scale * static_cast<float>(codes_sum);
  *codes_total = codes_sum;
  return scale;
}

template <typename T>
inline void convert_block(const T* x, float* out) {
  for (int j = 0; j < kBlock; ++j) out[j] = static_cast<float>(x[j]);
}

// x [rows, K] float32, bfloat16 or float16 (each block converted to float32 on the way).
inline Q8Rows quantize_rows(const at::Tensor& x) {
  const at::Tensor xc = x.contiguous();
  const int64_t rows = x.size(0), blocks = x.size(1) / kBlock, ld = padded16(blocks);
  Q8Rows out{at::empty(x.sizes(), x.options().dtype(at::kChar)), std::vector<float>(rows * ld, 0.f),
             std::vector<float>(rows * ld, 0.f), std::vector<int32_t>(rows * ld, 0), ld};
  int8_t* qp = out.codes.data_ptr<int8_t>();
  const void* xp = xc.data_ptr();
  float converted[kBlock];
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t block = r * blocks + b;
      const float* xb = converted;
      if (x.scalar_type() == at::kFloat) xb = static_cast<const float*>(xp) + block * kBlock;
      else if (x.scalar_type() == at::kBFloat16)
        convert_block(static_cast<const at::BFloat16*>(xp) + block * kBlock, converted);
      else convert_block(static_cast<const at::Half*>(xp) + block * kBlock, converted);
      const int64_t at = r * ld + b;
      out.scales[at] = quantize_block(xb, qp + block * kBlock, &out.sums[at], &out.code_sums[at]);
    }
  return out;
}

}  // namespace radixserve
