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

// 16 channels' 64 bytes from at[c] + offset transposed (r[j]: dword j of each channel).
RADIXSERVE_ROWS_INLINE void load_transposed(const uint8_t* const* at, int64_t offset, __m512i r[16]) {
  for (int c = 0; c < q8::kLanes; ++c) r[c] = _mm512_loadu_si512(at[c] + offset);
  q8::transpose16x16(r);
}

// 16 channels' 32 bytes from at[c] + offset transposed into r[0..7] (the K-quants' high bits): channels c and c + 8
// share a register, then an 8 x 8 transpose of dwords in each half, 24 shuffles (transpose16x16 on half-empty
// registers took 64, on the port the line's other transpose is bound by).
RADIXSERVE_ROWS_INLINE void load_transposed32(const uint8_t* const* at, int64_t offset, __m512i r[8]) {
  __m512i v[8], t[8];
  for (int c = 0; c < 8; ++c)
    v[c] = _mm512_inserti64x4(_mm512_castsi256_si512(load32(at[c] + offset)), load32(at[c + 8] + offset), 1);
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {  // v[4i + j]'s 128-bit lane L: dword 4 (L % 2) + j of channels 4i + 8 (L / 2) + 0..3
    v[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    v[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    v[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    v[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  const __m512i low = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13), high = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
  for (int j = 0; j < 4; ++j) {  // channels 0..3 from v[j], 4..7 from v[4 + j], 8..11, 12..15 likewise
    r[j] = _mm512_permutex2var_epi64(v[j], low, v[4 + j]);
    r[4 + j] = _mm512_permutex2var_epi64(v[j], high, v[4 + j]);
  }
}

RADIXSERVE_ROWS_INLINE __m512i nibble(__m512i v, bool high) {
  return _mm512_and_si512(high ? _mm512_srli_epi16(v, 4) : v, _mm512_set1_epi8(0x0F));
}

// c + 16 for each of the 4 codes of dword j (weights 4j .. 4j + 3) whose fifth bit is set: bits 4j .. 4j + 3 of h's
// dword (Q5_0 / Q5_1: a block's 32 fifth bits, weight i's bit i). With AVX512-BITALG one vpshufbitqmb picks them
// (byte i's bit from its qword: 4j + i % 4, + 32 in the qword's high dword); else each dword's byte is spread over
// its 4 bytes, then tested (two shuffle-port instructions).
RADIXSERVE_ROWS_INLINE __m512i add_fifth_bits(__m512i c, __m512i h, int j) {
#ifdef __AVX512BITALG__
  const uint64_t bits = 0x2322212003020100ULL + static_cast<uint64_t>(4 * j) * 0x0101010101010101ULL;
  const __mmask64 set = _mm512_bitshuffle_epi64_mask(h, _mm512_set1_epi64(static_cast<int64_t>(bits)));
#else
  const __m512i pick = _mm512_add_epi32(_mm512_set4_epi32(0x0C0C0C0C, 0x08080808, 0x04040404, 0),
                                        _mm512_set1_epi32(j / 2 * 0x01010101));
  const __mmask64 set =
      _mm512_test_epi8_mask(_mm512_shuffle_epi8(h, pick), _mm512_set1_epi32(0x08040201 << (4 * (j % 2))));
#endif
  return _mm512_mask_add_epi8(c, set, c, _mm512_set1_epi8(16));
}

// The float16 low (`high` 0) or high halves of each dword of v, as float32.
RADIXSERVE_ROWS_INLINE __m512 half_lanes(__m512i v, int high) {
  return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(high ? _mm512_srli_epi32(v, 16) : v));
}

// A Q5_0 / Q5_1 pair of blocks (`two`: else the first alone) of one channel, each block's bytes in 24 of the
// register, dword-aligned: Q5_1's as stored (d, m, 32 fifth bits, 16 bytes of nibbles), Q5_0's 22 two bytes in (d
// the high half of the first dword). So block k is dwords 6k (d, m), 6k + 1 (fifth bits), 6k + 2 .. 6k + 5
// (nibbles): the line holds its blocks' scales too. Q5_1 is one masked load; Q5_0 one load and a byte permute
// (AVX512-VBMI; else a second, merging, masked load).
template <typename T>
struct Q5Index {  // register byte i <- loaded byte kIndex[i] (Q5_0's pad bytes: any)
  static constexpr int kPad = 24 - static_cast<int>(T::kBytes);
  alignas(64) uint8_t at[64] = {};
  constexpr Q5Index() {
    for (int i = kPad; i < 48; ++i)
      if (i % 24 >= kPad) at[i] = static_cast<uint8_t>(i / 24 * T::kBytes + i % 24 - kPad);
  }
};

template <typename T>
RADIXSERVE_ROWS_INLINE __m512i q5_pair(const uint8_t* u, bool two) {
  constexpr int kPad = Q5Index<T>::kPad;
  static_assert(T::kHigh + kPad == 4, "the fifth bits at dword 1 of a block's 24 bytes");
  constexpr uint64_t kFirst = ((uint64_t{1} << T::kBytes) - 1) << kPad;  // register bytes of the first block
  if constexpr (kPad == 0) {
    return _mm512_maskz_loadu_epi8(two ? (kFirst << 24) | kFirst : kFirst, u);
  } else {
#ifdef __AVX512VBMI__
    static constexpr Q5Index<T> kIndex{};
    const __mmask64 valid = (uint64_t{1} << ((two ? 2 : 1) * T::kBytes)) - 1;
    return _mm512_permutexvar_epi8(_mm512_load_si512(kIndex.at), _mm512_maskz_loadu_epi8(valid, u));
#else  // masked-out bytes are not read: the loads from before u (before a row's first block) cannot fault
    const __m512i first = _mm512_maskz_loadu_epi8(kFirst, u - kPad);
    return two ? _mm512_mask_loadu_epi8(first, kFirst << 24, u + T::kBytes - 24 - kPad) : first;
#endif
  }
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
        q8::prefetch(rows[c] + b0 * T::kBytes + ahead);
        line.r[c] = q5_pair<T>(rows[c] + b0 * T::kBytes, count > 1);
      }
      q8::transpose16x16(line.r);
      return;
    } else {
      const int64_t unit = b0 / 8 * T::kBytes, half = b0 % 8 / 4;
      for (int c = 0; c < q8::kLanes; ++c)
        q8::prefetch(rows[c] + unit + half * T::kBytes / 2 + ahead);
      if constexpr (T::kType == Q6_K) {
        load_transposed(rows, unit + 64 * half, line.r);
        load_transposed32(rows, unit + 128 + 32 * half, line.h);
      } else {
        load_transposed(rows, unit + T::kCodeBytes + 64 * half, line.r);
        if constexpr (T::kType == Q5_K) {
          __m512i h[8];
          load_transposed32(rows, unit + 16, h);
          for (int t = 0; t < 8; ++t) line.h[t] = _mm512_srli_epi16(h[t], 4 * static_cast<int>(half));
        }
      }
    }
  }

  // Panel dword j (codes 4j .. 4j + 3) of block k of the line.
  RADIXSERVE_ROWS_INLINE static __m512i dword(const q8::Line& line, int k, int j) {
    if constexpr (T::kWeights == 32) {  // j < 4: low nibbles (weights 4j..), else high (16 + 4(j - 4)..)
      const __m512i c = nibble(line.r[6 * k + 2 + j % 4], j >= 4);
      return add_fifth_bits(c, line.r[6 * k + 1], j);
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

  // Q5_0 / Q5_1: block k's d and m of the 16 channels straight from the line (q5_pair's dword 6k; the few-row
  // kernel then skips `scales`, a gather a block), the values `scales` writes.
  static constexpr bool kLineScales = T::kWeights == 32;
  RADIXSERVE_ROWS_INLINE static __m512 line_d(const q8::Line& line, int k) {
    return half_lanes(line.r[6 * k], T::kType == Q5_0);
  }
  RADIXSERVE_ROWS_INLINE static __m512 line_m(const q8::Line& line, int k) { return half_lanes(line.r[6 * k], 1); }

  // d (and m, and Q6_K's sc) of the 16 channels, [blocks][16] (sc [blocks][2][16]), gathered 16 channels at a time
  // (a channel at a time, the scales took longer than the codes at one row): block_scales's values.
  void scales(float* dp, float* mp, int32_t* sp) const {
    const auto negate = [](__m512 v) {  // -v, as block_scales's (-0 for 0)
      return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(v), _mm512_set1_epi32(INT32_MIN)));
    };
    for (int64_t u = 0; u < blocks * 32 / T::kWeights; ++u) {
      const int64_t base = u * T::kBytes, b0 = u * T::kWeights / 32;
      if constexpr (T::kWeights == 32) {
        const __m512i v = gather(base);
        _mm512_storeu_ps(dp + b0 * q8::kLanes, half_lanes(v, 0));
        if constexpr (T::kType == Q5_1) _mm512_storeu_ps(mp + b0 * q8::kLanes, half_lanes(v, 1));
      } else if constexpr (T::kType == Q6_K) {
        const __m512 d = half_lanes(gather(base + 206), 1);  // bytes 208, 209 (a dword at 208 would pass the unit)
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
        const __m512 d = half_lanes(dm, 0), dmin = half_lanes(dm, 1);
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
