// The GGUF row types with codes (Q4_K, Q5_K, Q6_K, Q5_0, Q5_1: gguf_rows.h's traits) as blocks of 32 for the
// int8-activation linear (gguf_rows_q8_linear.cpp): per block of 32 weights, unsigned codes q (one byte a weight,
// 4 to 6 bits), a float32 scale d and min m, and Q6_K's two int8 sub-block scales (its halves of 16):
//   Q4_K / Q5_K  w = (d * sc_j) q - dmin * m_j   -> d = d * sc_j, m = -(dmin * m_j) (exact products)
//   Q6_K         w = (d * sc_h) (q - 32)         -> d = d, sc = [sc_a, sc_b], the -32 as the dot's integer start
//   Q5_0         w = d (q - 16)                  -> d, the -16 as the dot's integer start
//   Q5_1         w = d q + m                     -> d, m
// so each block's dot with int8 activations is exact integer arithmetic (block_q8_panels.h's header).
//
// code(row, b, l) and block_scales (portable, every build) give those values; with AVX512-VNNI RowChannels reads 16
// channels' bytes a cache line at a time, transposes them (dword j of each channel in one register), and makes the
// panel kernel's dwords of codes there, 16 channels an instruction (a block_q8_panels.h Source). Decoding each
// channel's codes first and transposing those took ~2x the instructions at one row.
#pragma once

#include <climits>
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

// 16 channels' bytes from at[c] + offset transposed (r[j]: dword j of each channel): 64 bytes, or (`bytes` 32, the
// K-quants' high bits) 32 into r[0..7].
RADIXSERVE_ROWS_INLINE void load_transposed(const uint8_t* const* at, int64_t offset, int bytes, __m512i r[16]) {
  for (int c = 0; c < q8::kLanes; ++c)
    r[c] = bytes == 64 ? _mm512_loadu_si512(at[c] + offset) : _mm512_castsi256_si512(load32(at[c] + offset));
  q8::transpose16x16(r);
}

RADIXSERVE_ROWS_INLINE __m512i nibble(__m512i v, bool high) {
  return _mm512_and_si512(high ? _mm512_srli_epi16(v, 4) : v, _mm512_set1_epi8(0x0F));
}

// c + 16 for each of 4 codes a dword whose fifth bit is set: bits `bit`.. `bit` + 3 of byte `byte` of h's dword (Q5_0
// / Q5_1: a block's 32 fifth bits, weight i's bit i). Each dword's byte spread over its 4 bytes, then tested.
RADIXSERVE_ROWS_INLINE __m512i add_fifth_bits(__m512i c, __m512i h, int byte, int bit) {
  const __m512i pick = _mm512_add_epi32(_mm512_set4_epi32(0x0C0C0C0C, 0x08080808, 0x04040404, 0),
                                        _mm512_set1_epi32(byte * 0x01010101));
  const __mmask64 set = _mm512_test_epi8_mask(_mm512_shuffle_epi8(h, pick), _mm512_set1_epi32(0x08040201 << bit));
  return _mm512_mask_add_epi8(c, set, c, _mm512_set1_epi8(16));
}

// A Q5_0 / Q5_1 pair of blocks (`two`: else the first alone) of one channel packed into one register: the first's 16
// bytes of nibbles, the second's, then their 32 fifth bits each (dwords 8, 9).
template <typename T>
RADIXSERVE_ROWS_INLINE __m512i q5_pair(const uint8_t* u, bool two) {
#ifdef __AVX512VBMI__
  alignas(64) static constexpr uint8_t kIndex[64] = {
#define RADIXSERVE_Q5_INDEX(o) o, o + 1, o + 2, o + 3
      RADIXSERVE_Q5_INDEX(T::kHigh + 4), RADIXSERVE_Q5_INDEX(T::kHigh + 8), RADIXSERVE_Q5_INDEX(T::kHigh + 12),
      RADIXSERVE_Q5_INDEX(T::kHigh + 16), RADIXSERVE_Q5_INDEX(T::kBytes + T::kHigh + 4),
      RADIXSERVE_Q5_INDEX(T::kBytes + T::kHigh + 8), RADIXSERVE_Q5_INDEX(T::kBytes + T::kHigh + 12),
      RADIXSERVE_Q5_INDEX(T::kBytes + T::kHigh + 16), RADIXSERVE_Q5_INDEX(T::kHigh),
      RADIXSERVE_Q5_INDEX(T::kBytes + T::kHigh)};
#undef RADIXSERVE_Q5_INDEX
  const __mmask64 valid = two ? (uint64_t{1} << (2 * T::kBytes)) - 1 : (uint64_t{1} << T::kBytes) - 1;
  return _mm512_permutexvar_epi8(_mm512_load_si512(kIndex), _mm512_maskz_loadu_epi8(valid, u));
#else
  const __m128i first = _mm_loadu_si128(reinterpret_cast<const __m128i*>(u + T::kHigh + 4));
  const __m128i second = two ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(u + T::kBytes + T::kHigh + 4))
                             : _mm_setzero_si128();
  const __m128i high = _mm_setr_epi32(static_cast<int>(u32_at(u + T::kHigh)),
                                      two ? static_cast<int>(u32_at(u + T::kBytes + T::kHigh)) : 0, 0, 0);
  return _mm512_inserti32x4(_mm512_castsi256_si512(_mm256_set_m128i(second, first)), high, 2);
#endif
}

// 16 channels of a weight's rows (a block_q8_panels.h Source): rows row_bytes apart; a channel past n1 repeats the
// last one (its output is never stored). A line: K-quants 4 blocks (Q4_K / Q5_K: 64 bytes of nibbles, two blocks'
// low and high ones per 32, Q5_K's 32 bytes of high bits shifted to the line's 4 blocks; Q6_K: 64 bytes of low
// nibbles, the 4 blocks' 2 high bits a byte in 32), Q5_0 / Q5_1 2 blocks (q5_pair).
template <typename T>
struct RowChannels {
  static constexpr int64_t kBlocks = T::kWeights == 32 ? 2 : 4;
  const uint8_t* raw;
  int64_t row_bytes, blocks, n1;
  const uint8_t* rows[q8::kLanes] = {};
  __m512i offsets = _mm512_setzero_si512();  // each channel's row from rows[0], bytes

  void select(int64_t n0) {
    alignas(64) int32_t at[q8::kLanes];
    for (int c = 0; c < q8::kLanes; ++c) {
      const int64_t n = std::min(n0 + c, n1 - 1);
      rows[c] = raw + n * row_bytes;
      at[c] = static_cast<int32_t>((n - n0) * row_bytes);
    }
    offsets = _mm512_load_si512(at);
  }

  // The 4 bytes at `offset` of each channel's row, one dword a lane.
  RADIXSERVE_ROWS_INLINE __m512i gather(int64_t offset) const {
    return _mm512_i32gather_epi32(offsets, rows[0] + offset, 1);
  }

  // Blocks b0 .. b0 + count - 1 (b0 a multiple of kBlocks) of the 16 channels; prefetching `panels` panels on.
  RADIXSERVE_ROWS_INLINE void lines(int64_t b0, int count, int panels, q8::Line& line) const {
    const int64_t ahead = panels * q8::kLanes * row_bytes;
    if constexpr (T::kWeights == 32) {
      for (int c = 0; c < q8::kLanes; ++c) {
        _mm_prefetch(reinterpret_cast<const char*>(rows[c] + b0 * T::kBytes + ahead), _MM_HINT_T0);
        line.r[c] = q5_pair<T>(rows[c] + b0 * T::kBytes, count > 1);
      }
      q8::transpose16x16(line.r);
      return;
    } else {
      const int64_t unit = b0 / 8 * T::kBytes, half = b0 % 8 / 4;
      for (int c = 0; c < q8::kLanes; ++c)
        _mm_prefetch(reinterpret_cast<const char*>(rows[c] + unit + half * T::kBytes / 2 + ahead), _MM_HINT_T0);
      if constexpr (T::kType == Q6_K) {
        load_transposed(rows, unit + 64 * half, 64, line.r);
        load_transposed(rows, unit + 128 + 32 * half, 32, line.h);
      } else {
        load_transposed(rows, unit + T::kCodeBytes + 64 * half, 64, line.r);
        if constexpr (T::kType == Q5_K) {
          __m512i h[16];
          load_transposed(rows, unit + 16, 32, h);
          for (int t = 0; t < 8; ++t) line.h[t] = _mm512_srli_epi16(h[t], 4 * static_cast<int>(half));
        }
      }
    }
  }

  // Panel dword j (codes 4j .. 4j + 3) of block k of the line.
  RADIXSERVE_ROWS_INLINE static __m512i dword(const q8::Line& line, int k, int j) {
    if constexpr (T::kWeights == 32) {  // j < 4: low nibbles (weights 4j..), else high (16 + 4(j - 4)..)
      const __m512i c = nibble(line.r[4 * k + j % 4], j >= 4);
      return add_fifth_bits(c, line.r[8 + k], j / 2, 4 * (j % 2));
    } else if constexpr (T::kType == Q6_K) {  // low: dword 8 (k % 2) + j, nibble k / 2; high: bits 2k of dword j
      const __m512i low = nibble(line.r[8 * (k % 2) + j], k >= 2);
      const __m512i h = line.h[j], mask = _mm512_set1_epi8(0x30);
      const __m512i high = k == 3 ? _mm512_srli_epi16(h, 2) : _mm512_slli_epi16(h, 4 - 2 * k);
      return _mm512_ternarylogic_epi32(low, high, mask, 0xF8);  // low | (high & mask)
    } else {  // blocks 2p, 2p + 1 the low and high nibbles of dwords 8p..8p + 7; Q5_K: bit k of the shifted highs
      const __m512i c = nibble(line.r[8 * (k / 2) + j], k % 2 == 1);
      if constexpr (T::kType == Q4_K) return c;
      const __mmask64 set = _mm512_test_epi8_mask(line.h[j], _mm512_set1_epi8(static_cast<char>(1 << k)));
      return _mm512_mask_add_epi8(c, set, c, _mm512_set1_epi8(16));
    }
  }

  // d (and m, and Q6_K's sc) of the 16 channels, [blocks][16] (sc [blocks][2][16]), gathered 16 channels at a time
  // (a channel at a time, the scales took longer than the codes at one row): block_scales's values.
  void scales(float* dp, float* mp, int32_t* sp) const {
    const auto negate = [](__m512 v) {  // -v, as block_scales's (-0 for 0)
      return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(v), _mm512_set1_epi32(INT32_MIN)));
    };
    const auto halves = [](__m512i v, int high) {  // float16 low / high halves of each dword, as float32
      return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(high ? _mm512_srli_epi32(v, 16) : v));
    };
    for (int64_t u = 0; u < blocks * 32 / T::kWeights; ++u) {
      const int64_t base = u * T::kBytes, b0 = u * T::kWeights / 32;
      if constexpr (T::kWeights == 32) {
        const __m512i v = gather(base);
        _mm512_storeu_ps(dp + b0 * q8::kLanes, halves(v, 0));
        if constexpr (T::kType == Q5_1) _mm512_storeu_ps(mp + b0 * q8::kLanes, halves(v, 1));
      } else if constexpr (T::kType == Q6_K) {
        const __m512 d = halves(gather(base + 206), 1);  // bytes 208, 209 (a dword at 208 would pass the unit)
        for (int q = 0; q < 4; ++q) {
          const __m512i sc = gather(base + 192 + 4 * q);  // sub-blocks 4q .. 4q + 3: blocks 2q, 2q + 1
          for (int i = 0; i < 4; ++i)
            _mm512_storeu_si512(sp + (2 * (b0 + 2 * q) + i) * q8::kLanes,
                                _mm512_srai_epi32(_mm512_slli_epi32(sc, 24 - 8 * i), 24));
        }
        for (int j = 0; j < 8; ++j) _mm512_storeu_ps(dp + (b0 + j) * q8::kLanes, d);
      } else {  // k_scale_min's words, a lane per channel
        const __m512i dm = gather(base), w0 = gather(base + 4), w1 = gather(base + 8), w2 = gather(base + 12);
        const __m512i six = _mm512_set1_epi32(0x3F3F3F3F), nib = _mm512_set1_epi32(0x0F0F0F0F);
        const __m512i two = _mm512_set1_epi32(0x03030303);
        const __m512i sc[2] = {_mm512_and_si512(w0, six),
                               _mm512_or_si512(_mm512_and_si512(w2, nib),
                                               _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(w0, 6), two), 4))};
        const __m512i m[2] = {_mm512_and_si512(w1, six),
                              _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(w2, 4), nib),
                                              _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(w1, 6), two), 4))};
        const __m512 d = halves(dm, 0), dmin = halves(dm, 1);
        const __m512i byte = _mm512_set1_epi32(0xFF);
        for (int j = 0; j < 8; ++j) {
          const int shift = 8 * (j % 4);
          const __m512 s = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(sc[j / 4], shift), byte));
          const __m512 mj = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(m[j / 4], shift), byte));
          _mm512_storeu_ps(dp + (b0 + j) * q8::kLanes, _mm512_mul_ps(d, s));  // exact, as gguf's d * sc
          _mm512_storeu_ps(mp + (b0 + j) * q8::kLanes, negate(_mm512_mul_ps(dmin, mj)));
        }
      }
    }
  }
};
#endif

}  // namespace radixserve::gguf_rows
