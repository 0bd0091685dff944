// The GGUF row types with codes (Q4_K, Q5_K, Q6_K, Q5_0, Q5_1: gguf_rows.h's traits) as blocks of 32 for the
// int8-activation linear (gguf_rows_q8_linear.cpp): per block of 32 weights, unsigned codes q (one byte a weight,
// 4 to 6 bits), a float32 scale d and min m, and Q6_K's two int8 sub-block scales (its halves of 16):
//   Q4_K / Q5_K  w = (d * sc_j) q - dmin * m_j   -> d = d * sc_j, m = -(dmin * m_j) (exact products)
//   Q6_K         w = (d * sc_h) (q - 32)         -> d = d, sc = [sc_a, sc_b], the -32 as the dot's integer start
//   Q5_0         w = d (q - 16)                  -> d, the -16 as the dot's integer start
//   Q5_1         w = d q + m                     -> d, m
// so each block's dot with int8 activations is exact integer arithmetic (block_q8_panels.h's header).
//
// code(row, b, l) and block_scales (portable, every build) give those values; with AVX512-VNNI RowChannels decodes
// two blocks of 16 channels a cache-line step into the panel kernel's transposed layout (a block_q8_panels.h Source).
#pragma once

#include <cstdint>

#include "block_q8_panels.h"
#include "gguf_rows.h"

namespace radixserve::gguf_rows {

// Whether type T's rows run the int8-activation kernel (the float types keep float activations).
template <typename T>
constexpr bool kQ8Rows = T::kType == Q4_K || T::kType == Q5_K || T::kType == Q6_K || T::kType == Q5_0 ||
                         T::kType == Q5_1;

// Code l (0..31) of block b of a row: unsigned, gguf's q (Q6_K: q + 32, 0..63).
template <typename T>
inline int code(const uint8_t* row, int64_t b, int l) {
  if constexpr (T::kWeights == 32) {  // Q5_0 / Q5_1
    const uint8_t* u = row + b * T::kBytes;
    return ((u[T::kHigh + 4 + l % 16] >> (4 * (l / 16))) & 0x0F) | ((u32_at(u + T::kHigh) >> l) & 1) << 4;
  } else if constexpr (T::kType == Q6_K) {
    const uint8_t* u = row + b / 8 * T::kBytes;
    const int h = b % 8 / 4, t = 32 * (b % 4) + l;
    return ((u[64 * h + t % 64] >> (4 * (t / 64))) & 0x0F) | ((u[128 + 32 * h + t % 32] >> (2 * (t / 32))) & 3) << 4;
  } else {
    const uint8_t* u = row + b / 8 * T::kBytes;
    const int j = static_cast<int>(b % 8);
    int q = (u[T::kCodeBytes + 32 * (j / 2) + l] >> (4 * (j % 2))) & 0x0F;
    if constexpr (T::kType == Q5_K) q |= ((u[16 + l] >> j) & 1) << 4;
    return q;
  }
}

// The integer each block's dot starts from, per activation sum of 32 (or, Q6_K, of each half of 16): -16 sum for
// Q5_0, -32 sum for Q6_K, none for the formats with a min.
template <typename T>
constexpr int32_t kCodeOffset = T::kType == Q5_0 ? 16 : T::kType == Q6_K ? 32 : 0;

// f(j, d, m, sc_a, sc_b) for each block j of the unit at u (K-quants 8, Q5 1): its float scale and min, Q6_K's
// sub-block scales (others 0).
template <typename T, typename F>
inline void block_scales(const uint8_t* u, const F& f) {
  if constexpr (T::kType == Q6_K) {
    const float d = half_at(u + 208);
    const auto* sc = reinterpret_cast<const int8_t*>(u + 192);
    for (int j = 0; j < 8; ++j) f(j, d, 0.f, sc[2 * j], sc[2 * j + 1]);
  } else if constexpr (T::kWeights == 256) {
    alignas(64) float s[16];
    T::scales(u, s);
    for (int j = 0; j < 8; ++j) f(j, s[j], -s[8 + j], 0, 0);
  } else {
    f(0, half_at(u), T::kType == Q5_1 ? half_at(u + 2) : 0.f, 0, 0);
  }
}

#ifdef RADIXSERVE_Q8_PANELS
template <typename T>
constexpr q8::Format kFormat = T::kType == Q4_K   ? q8::Format::kQ4_K
                               : T::kType == Q5_K ? q8::Format::kQ5_K
                               : T::kType == Q6_K ? q8::Format::kQ6_K
                               : T::kType == Q5_0 ? q8::Format::kQ5_0
                                                  : q8::Format::kQ5_1;

// A Q5_0 / Q5_1 block's 32 codes: the nibbles (weights 0..15 low, 16..31 high), the fifth bit where its 32 bits say.
template <typename T>
RADIXSERVE_ROWS_INLINE __m256i q5_codes(const uint8_t* u) {
  const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(u + T::kHigh + 4)), low = _mm_set1_epi8(0x0F);
  const __m256i c = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(qs, 4), low), _mm_and_si128(qs, low));
  return _mm256_mask_add_epi8(c, static_cast<__mmask32>(u32_at(u + T::kHigh)), c, _mm256_set1_epi8(16));
}

// Blocks b0 (even) and b0 + 1 of a row as 64 code bytes (b0 + 1's zero when `two` is false: the row's last block).
template <typename T>
RADIXSERVE_ROWS_INLINE __m512i pair_codes(const uint8_t* row, int64_t b0, bool two) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  if constexpr (T::kWeights == 32) {
    const __m256i first = q5_codes<T>(row + b0 * T::kBytes);
    const __m256i second = two ? q5_codes<T>(row + (b0 + 1) * T::kBytes) : _mm256_setzero_si256();
    return _mm512_inserti64x4(_mm512_castsi256_si512(first), second, 1);
  } else if constexpr (T::kType == Q6_K) {  // blocks 2p, 2p + 1: low bytes 64 h.. (one nibble), high 32 h..
    const uint8_t* u = row + b0 / 8 * T::kBytes;
    const int j = static_cast<int>(b0 % 8), h = j / 4, shift = 2 * (j % 4);
    __m512i ql = _mm512_loadu_si512(u + 64 * h);
    if (j % 4) ql = _mm512_srli_epi16(ql, 4);
    const __m256i qh = load32(u + 128 + 32 * h), three = _mm256_set1_epi8(3);
    const __m256i a = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(shift)), three);
    const __m256i b = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(shift + 2)), three);
    const __m512i high = _mm512_slli_epi16(_mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1), 4);
    return _mm512_or_si512(_mm512_and_si512(ql, _mm512_set1_epi8(0x0F)), high);
  } else {  // K-quant blocks 2p, 2p + 1: the low and high nibbles of codes 32 p..
    const uint8_t* u = row + b0 / 8 * T::kBytes;
    const int j = static_cast<int>(b0 % 8);
    const __m256i v = load32(u + T::kCodeBytes + 16 * j);
    __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    if constexpr (T::kType == Q5_K) {
      const __m256i qh = load32(u + 16);
      lo = _mm256_or_si256(lo, bit_to_16(qh, j));
      hi = _mm256_or_si256(hi, bit_to_16(qh, j + 1));
    }
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
  }
}

// 16 channels of a weight's rows (a block_q8_panels.h Source): rows row_bytes apart; a channel past n1 repeats the
// last one (its output is never stored).
template <typename T>
struct RowChannels {
  const uint8_t* raw;
  int64_t row_bytes, blocks, n1;
  const uint8_t* rows[q8::kLanes] = {};

  void select(int64_t n0) {
    for (int c = 0; c < q8::kLanes; ++c) rows[c] = raw + std::min(n0 + c, n1 - 1) * row_bytes;
  }

  // Blocks b0, b0 + 1 of the 16 channels, transposed (r[j]: dword j of block b0 of each channel, r[8 + j] of
  // b0 + 1); prefetching the same bytes `panels` panels on.
  RADIXSERVE_ROWS_INLINE void lines(int64_t b0, int count, int panels, __m512i r[16]) const {
    const int64_t at = T::kWeights == 32 ? b0 * T::kBytes : b0 / 8 * T::kBytes + b0 % 8 * T::kBytes / 8;
    const int64_t ahead = panels * q8::kLanes * row_bytes;
    for (int c = 0; c < q8::kLanes; ++c) {
      _mm_prefetch(reinterpret_cast<const char*>(rows[c] + at + ahead), _MM_HINT_T0);
      r[c] = pair_codes<T>(rows[c], b0, count > 1);
    }
    q8::transpose16x16(r);
  }

  // d (and m, and Q6_K's sc) of the 16 channels, [blocks][16] (sc [blocks][2][16]).
  void scales(float* dp, float* mp, int32_t* sp) const {
    for (int c = 0; c < q8::kLanes; ++c)
      for (int64_t u = 0; u < blocks * 32 / T::kWeights; ++u) {
        const int64_t b0 = u * T::kWeights / 32;
        block_scales<T>(rows[c] + u * T::kBytes, [&](int j, float d, float m, int sc_a, int sc_b) {
          const int64_t at = (b0 + j) * q8::kLanes + c;
          dp[at] = d;
          if (mp != nullptr) mp[at] = m;
          if (sp != nullptr) {
            sp[2 * (b0 + j) * q8::kLanes + c] = sc_a;
            sp[(2 * (b0 + j) + 1) * q8::kLanes + c] = sc_b;
          }
        });
      }
  }
};
#endif

}  // namespace radixserve::gguf_rows
