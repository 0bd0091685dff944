// bfloat16 as its 16 bits (the upper half of a float32): widening, and rounding as torch rounds
// (c10::BFloat16: to nearest even, a NaN becomes 0x7FC0). One definition for every kernel that reads
// or writes bfloat16, so all of them round alike. Plain C++, no torch headers.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace radixserve {

inline float bf16_to_float(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline uint16_t float_to_bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return x != x ? uint16_t{0x7FC0} : static_cast<uint16_t>(rounded);
}

#if defined(__AVX512F__)
// float_to_bf16 of 16 floats, each lane's bits in its low 16 bits.
inline __m512i bf16_bits16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  return _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
}

// 16 bfloat16 (their bits) widened to float32.
inline __m512 bf16x16_to_float(__m256i bits) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// 16 floats rounded to bfloat16 and widened back (the low half of each lane zero).
inline __m512 round_bf16_16(__m512 v) { return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits16(v), 16)); }
#endif

}  // namespace radixserve
