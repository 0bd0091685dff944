// GGUF's row types as gguf_rows.py keeps them (a weight row = the file's bytes of that row), one trait per type:
// a unit (K-quants: a super-block of 256 weights; Q5_0 / Q5_1: a block of 32; F16 / BF16 / F32: 32 weights) and
// its values as float32, bit for bit gguf-py's dequantize_blocks (gguf/quants.py).
//
// Every product there is exact in float32: Q4_K / Q5_K D = d * sc (11 x 6 bits) and D * q (+ 4 or 5 bits),
// dm = dmin * m; Q6_K d * sc (11 x 7 bits) times q - 32 (5 bits); Q5_0 / Q5_1 d * q. So each weight has one
// rounding at most, gguf's last subtract (K-quants: D * q - dm) or add (Q5_1: d * q + m), and a fused multiply-add
// gives the same bits as numpy's multiply then add: the kernels may use either (and -march=native's contraction
// changes nothing).
//
// A trait T has kType (gguf's GGMLQuantizationType), kWeights and kBytes per unit, and
//   scales(unit, s): the unit's scales as float32 into s[16] (gguf's exact products), then
//   weight(unit, s, i): weight i of the unit (portable), and with AVX512
//   group(unit, s, j, lo, hi): weights 32j .. 32j + 15 into lo, 32j + 16 .. 32j + 31 into hi;
// with AVX2 (and no AVX512)
//   piece(unit, s, p): weights 8p .. 8p + 7 as 8 lanes, in order (the AVX2 kernels' unit of decode: a byte a weight
//   widened straight from memory, vpmovzxbd, so no lane-crossing shuffle).
// The quantized types (kCodes) also give, with AVX512-BF16, group j as small unsigned codes c and an affine map per
// half (16 weights): w = a * c + b. Their bfloat16 kernels multiply x by 128 + c (bfloat16 bits 0x4300 | c, exact
// for c < 128: x's products exact in float32), then scale by a, and add (b - 128 a) * sum(x) per half:
//   codes(unit, j): 32 words 0x4300 | c, weight order;
//   span(unit, groups, s, m): for the span of `groups` (<= 8) groups from unit on, the scales s[16] that scale()
//   reads, and each half's b - 128 a into m[16], the span's halves in order (zeros past them);
//   scale(s, j): lanes 0..7 group j's first half's a, 8..15 its second's (vdpbf16ps's lane i sums weights 2i and
//   2i + 1).
// A K-quant span is one unit; a Q5_0 / Q5_1 span is 8 units, whose scales are gathered in a few vector
// instructions (written one by one and read back as a vector, they stalled store forwarding: 0.8x the speed).
#pragma once

#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <utility>

#include "bf16.h"
#include "block_common.h"

namespace radixserve::gguf_rows {

// A unit's decode inlined into each kernel's loop, its group index a constant there (a call per group through the
// PLT, with lo and hi through memory, ran ~3x slower).
#define RADIXSERVE_ROWS_INLINE __attribute__((always_inline)) inline

// gguf's GGMLQuantizationType values.
enum Type : int64_t { F32 = 0, F16 = 1, Q5_0 = 6, Q5_1 = 7, Q4_K = 12, Q5_K = 13, Q6_K = 14, BF16 = 30 };

RADIXSERVE_ROWS_INLINE float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof bits);
#ifdef RADIXSERVE_BLOCK_AVX2
  return _cvtsh_ss(bits);  // F16C: exact, as c10::Half's conversion
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

RADIXSERVE_ROWS_INLINE uint32_t u32_at(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

#ifdef RADIXSERVE_BLOCK_AVX512
// 32 bytes of codes (uint8) as float32: bytes 0..15 into lo, 16..31 into hi.
RADIXSERVE_ROWS_INLINE void bytes_f32(__m256i q, __m512& lo, __m512& hi) {
  lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(q)));
  hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(q, 1)));
}

// Byte l of the result: bit `bit` of byte l of v, moved to bit 4 (a 5-bit code's high bit).
RADIXSERVE_ROWS_INLINE __m256i bit_to_16(__m256i v, int bit) {
  const __m256i one = _mm256_set1_epi8(1);
  return _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(bit)), one), 4);
}

// 0, 1, .., 15 (the codes a table of a block's values is indexed by).
RADIXSERVE_ROWS_INLINE __m512 iota16() { return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }

// 16 bytes as 16 int32 lanes (zero-extended).
RADIXSERVE_ROWS_INLINE __m512i bytes16(const uint8_t* p) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

RADIXSERVE_ROWS_INLINE __m256i load32(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// 32 byte codes (each < 128) as the bfloat16 values 128 + c (bits 0x4300 | c), one word each.
RADIXSERVE_ROWS_INLINE __m512i codes_bf16(__m256i q) {
  return _mm512_or_si512(_mm512_cvtepu8_epi16(q), _mm512_set1_epi16(0x4300));
}

#endif

#if defined(RADIXSERVE_BLOCK_AVX2) && !defined(RADIXSERVE_BLOCK_AVX512)
#define RADIXSERVE_ROWS_AVX2 1
// 8 bytes from p, zero-extended to 8 int32 lanes: one vpmovzxbd from memory each time it is asked. (Written as the
// intrinsics, the compiler kept the bytes a K-quant's two nibbles share in registers from one sub-block to the
// next, spilling the tile's accumulators to the stack: 3x the time.)
RADIXSERVE_ROWS_INLINE __m256i bytes8(const uint8_t* p) {
  __m256i v;
  __asm__ volatile("vpmovzxbd %1, %0" : "=x"(v) : "m"(*reinterpret_cast<const uint8_t(*)[8]>(p)));
  return v;
}

// Low (nibble 0) or high (nibble 1) nibbles of 8 bytes widened by bytes8.
RADIXSERVE_ROWS_INLINE __m256i nibbles8(__m256i c, int nibble) {
  return nibble ? _mm256_srli_epi32(c, 4) : _mm256_and_si256(c, _mm256_set1_epi32(0x0F));
}

// float_to_bf16 (bf16.h) of 8 floats, each lane's bits in its low 16 bits: to nearest even, a NaN 0x7FC0.
RADIXSERVE_ROWS_INLINE __m256i bf16_bits8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), nan);
}

// 8 floats rounded to bfloat16 and widened back: bf16_to_float(float_to_bf16(v)) a lane.
RADIXSERVE_ROWS_INLINE __m256 round_bf16_8(__m256 v) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(v), 16));
}
#endif

// Q4_K and Q5_K's 8 sub-block scales and 8 mins, 6 bits each in 12 bytes (gguf's Q4_K.get_scale_min), as 16
// bytes: sc_0..7 then m_0..7 (llama.cpp's word masks: sc_j = q_j & 63, j < 4, else the low nibble of q_{j+4} and
// the top bits of q_{j-4}; m_j likewise from q_{j+4} and q_j).
RADIXSERVE_ROWS_INLINE void k_scale_min(const uint8_t* q, uint32_t out[4]) {
  uint32_t w[3];
  std::memcpy(w, q, sizeof w);
  const uint32_t six = 0x3F3F3F3F, nibble = 0x0F0F0F0F, two = 0x03030303;
  out[0] = w[0] & six;
  out[1] = (w[2] & nibble) | (((w[0] >> 6) & two) << 4);
  out[2] = w[1] & six;
  out[3] = ((w[2] >> 4) & nibble) | (((w[1] >> 6) & two) << 4);
}

// s[i] = (i < 8 ? lo : hi) * float(b[i]) for 16 small integers b (exact products, as gguf's float32 multiplies).
template <bool Signed>
RADIXSERVE_ROWS_INLINE void scale16(const void* b, float lo, float hi, float* s) {
#ifdef RADIXSERVE_BLOCK_AVX512
  const __m128i v = _mm_loadu_si128(static_cast<const __m128i*>(b));
  const __m512i wide = Signed ? _mm512_cvtepi8_epi32(v) : _mm512_cvtepu8_epi32(v);
  const __m512 scale = _mm512_shuffle_f32x4(_mm512_set1_ps(lo), _mm512_set1_ps(hi), 0x00);
  _mm512_store_ps(s, _mm512_mul_ps(scale, _mm512_cvtepi32_ps(wide)));
#elif defined(RADIXSERVE_ROWS_AVX2)
  const __m128i v = _mm_loadu_si128(static_cast<const __m128i*>(b)), v8 = _mm_srli_si128(v, 8);
  const __m256i low = Signed ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v);
  const __m256i high = Signed ? _mm256_cvtepi8_epi32(v8) : _mm256_cvtepu8_epi32(v8);
  _mm256_storeu_ps(s, _mm256_mul_ps(_mm256_set1_ps(lo), _mm256_cvtepi32_ps(low)));
  _mm256_storeu_ps(s + 8, _mm256_mul_ps(_mm256_set1_ps(hi), _mm256_cvtepi32_ps(high)));
#else
  for (int i = 0; i < 16; ++i) {
    const uint8_t byte = static_cast<const uint8_t*>(b)[i];
    s[i] = (i < 8 ? lo : hi) * static_cast<float>(Signed ? static_cast<int8_t>(byte) : byte);
  }
#endif
}

// Q4_K (144 bytes: d, dmin, 12 bytes of scales, 128 of codes) and Q5_K (176: the same with 32 bytes of high bits
// before the codes). Sub-block j (32 weights): w = (d * sc_j) * q - dmin * m_j; q = the low (j even) or high (j odd)
// nibbles of codes 32 (j / 2) .. + 31, Q5_K with bit j of high-bit byte l above nibble l. s = [D_0..7, dm_0..7].
template <bool Q5>
struct KQuant {
  static constexpr int64_t kType = Q5 ? Q5_K : Q4_K, kWeights = 256, kBytes = Q5 ? 176 : 144;
  static constexpr int64_t kCodeBytes = Q5 ? 48 : 16;  // where the nibbles start

  RADIXSERVE_ROWS_INLINE static void scales(const uint8_t* u, float* s) {
    uint32_t sc_m[4];
    k_scale_min(u + 4, sc_m);
    scale16<false>(sc_m, half_at(u), half_at(u + 2), s);
  }

  RADIXSERVE_ROWS_INLINE static float weight(const uint8_t* u, const float* s, int i) {
    const int j = i / 32, l = i % 32;
    int q = (u[kCodeBytes + 32 * (j / 2) + l] >> (4 * (j % 2))) & 0x0F;
    if constexpr (Q5) q |= ((u[16 + l] >> j) & 1) << 4;
    return s[j] * static_cast<float>(q) - s[8 + j];
  }

#ifdef RADIXSERVE_ROWS_AVX2
  // Sub-block j = p / 4's bytes 8 (p % 4) ..: D * q - dm in one FMA (D * q exact: gguf's bits).
  RADIXSERVE_ROWS_INLINE static __m256 piece(const uint8_t* u, const float* s, int p) {
    const int j = p / 4, l = 8 * (p % 4);
    __m256i q = nibbles8(bytes8(u + kCodeBytes + 32 * (j / 2) + l), j % 2);
    if constexpr (Q5) {
      const __m256i high = _mm256_and_si256(_mm256_srli_epi32(bytes8(u + 16 + l), j), _mm256_set1_epi32(1));
      q = _mm256_or_si256(q, _mm256_slli_epi32(high, 4));
    }
    return _mm256_fmsub_ps(_mm256_set1_ps(s[j]), _mm256_cvtepi32_ps(q), _mm256_set1_ps(s[8 + j]));
  }
#endif

#ifdef RADIXSERVE_BLOCK_AVX512
  // Q4_K: the sub-block's 16 values D * q - dm as a table, looked up by code (vpermps reads an index's low 4 bits:
  // the low nibbles need no mask); Q5_K: codes of 5 bits made in bytes, then converted.
  RADIXSERVE_ROWS_INLINE static void group(const uint8_t* u, const float* s, int j, __m512& lo, __m512& hi) {
    const __m512 d = _mm512_set1_ps(s[j]), dm = _mm512_set1_ps(s[8 + j]);
    if constexpr (!Q5) {
      const uint8_t* q = u + kCodeBytes + 32 * (j / 2);
      __m512i c0 = bytes16(q), c1 = bytes16(q + 16);
      if (j % 2) {
        c0 = _mm512_srli_epi32(c0, 4);
        c1 = _mm512_srli_epi32(c1, 4);
      }
      const __m512 table = _mm512_fmsub_ps(d, iota16(), dm);  // d * q exact: the bits of gguf's d * q - dm
      lo = _mm512_permutexvar_ps(c0, table);
      hi = _mm512_permutexvar_ps(c1, table);
    } else {
      __m256i q = load32(u + kCodeBytes + 32 * (j / 2));
      if (j % 2) q = _mm256_srli_epi16(q, 4);
      q = _mm256_or_si256(_mm256_and_si256(q, _mm256_set1_epi8(0x0F)), bit_to_16(load32(u + 16), j));
      bytes_f32(q, lo, hi);
      lo = _mm512_fmsub_ps(d, lo, dm);  // as above
      hi = _mm512_fmsub_ps(d, hi, dm);
    }
  }

  static constexpr bool kCodes = true;

  RADIXSERVE_ROWS_INLINE static __m512i codes(const uint8_t* u, int j) {
    __m256i q = load32(u + kCodeBytes + 32 * (j / 2));
    if (j % 2) q = _mm256_srli_epi16(q, 4);
    q = _mm256_and_si256(q, _mm256_set1_epi8(0x0F));
    if constexpr (Q5) q = _mm256_or_si256(q, bit_to_16(load32(u + 16), j));
    return codes_bf16(q);
  }

  RADIXSERVE_ROWS_INLINE static __m512 scale(const float* s, int j) { return _mm512_set1_ps(s[j]); }

  // Half h of the unit: -dm - 128 D of its sub-block h / 2 (s = [D_0..7, dm_0..7]).
  RADIXSERVE_ROWS_INLINE static void span(const uint8_t* u, int, float* s, float* m) {
    scales(u, s);
    const __m512i sub = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    const __m512 sv = _mm512_load_ps(s);
    const __m512 d = _mm512_permutexvar_ps(sub, sv);
    const __m512 dm = _mm512_permutexvar_ps(_mm512_add_epi32(sub, _mm512_set1_epi32(8)), sv);
    _mm512_storeu_ps(m, _mm512_sub_ps(_mm512_setzero_ps(), _mm512_fmadd_ps(d, _mm512_set1_ps(128.f), dm)));
  }
#endif
};

// Q6_K (210 bytes: 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales, d). Weight i = 128 h + t:
// q = (nibble t / 64 of low byte 64 h + t % 64) | (bits 2 (t / 32) of high byte 32 h + t % 32) << 4, minus 32;
// w = (d * sc_{i / 16}) * q. s = the 16 products d * sc.
struct Q6K {
  static constexpr int64_t kType = Q6_K, kWeights = 256, kBytes = 210;

  RADIXSERVE_ROWS_INLINE static void scales(const uint8_t* u, float* s) {
    const float d = half_at(u + 208);
    scale16<true>(u + 192, d, d, s);
  }

  RADIXSERVE_ROWS_INLINE static float weight(const uint8_t* u, const float* s, int i) {
    const int h = i / 128, t = i % 128;
    const int low = (u[64 * h + t % 64] >> (4 * (t / 64))) & 0x0F;
    const int high = (u[128 + 32 * h + t % 32] >> (2 * (t / 32))) & 3;
    return s[i / 16] * static_cast<float>((low | high << 4) - 32);
  }

#ifdef RADIXSERVE_ROWS_AVX2
  // Weights i = 8p .. 8p + 7 share h, t / 32 and t / 64 (t = i % 128): consecutive low and high bytes.
  RADIXSERVE_ROWS_INLINE static __m256 piece(const uint8_t* u, const float* s, int p) {
    const int h = p / 16, t = 8 * (p % 16);
    const __m256i low = nibbles8(bytes8(u + 64 * h + t % 64), t / 64);
    const __m256i bits = bytes8(u + 128 + 32 * h + t % 32);  // bits 2 (t / 32) .. + 1, moved to bits 4, 5
    const int at = 2 * (t / 32);
    const __m256i moved = at < 4 ? _mm256_slli_epi32(bits, 4 - at) : at > 4 ? _mm256_srli_epi32(bits, at - 4) : bits;
    const __m256i q = _mm256_or_si256(low, _mm256_and_si256(moved, _mm256_set1_epi32(0x30)));
    // (d sc) (q - 32), not d sc q - 32 d sc: the same value, but at q = 32 with d sc < 0 gguf's zero is -0.
    return _mm256_mul_ps(_mm256_set1_ps(s[p / 2]), _mm256_cvtepi32_ps(_mm256_sub_epi32(q, _mm256_set1_epi32(32))));
  }
#endif

#ifdef RADIXSERVE_BLOCK_AVX512
  // Group j's codes q + 32 (0..63).
  RADIXSERVE_ROWS_INLINE static __m256i unsigned_codes(const uint8_t* u, int j) {
    const int h = j / 4, t = 32 * (j % 4);
    __m256i low = load32(u + 64 * h + t % 64);
    if (t >= 64) low = _mm256_srli_epi16(low, 4);
    low = _mm256_and_si256(low, _mm256_set1_epi8(0x0F));
    const __m256i shifted = _mm256_srl_epi16(load32(u + 128 + 32 * h), _mm_cvtsi32_si128(2 * (j % 4)));
    const __m256i high = _mm256_slli_epi16(_mm256_and_si256(shifted, _mm256_set1_epi8(3)), 4);
    return _mm256_or_si256(low, high);
  }

  RADIXSERVE_ROWS_INLINE static void group(const uint8_t* u, const float* s, int j, __m512& lo, __m512& hi) {
    const __m256i q = _mm256_sub_epi8(unsigned_codes(u, j), _mm256_set1_epi8(32));
    lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q)));
    hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1)));
    lo = _mm512_mul_ps(_mm512_set1_ps(s[2 * j]), lo);
    hi = _mm512_mul_ps(_mm512_set1_ps(s[2 * j + 1]), hi);
  }

  static constexpr bool kCodes = true;

  RADIXSERVE_ROWS_INLINE static __m512i codes(const uint8_t* u, int j) { return codes_bf16(unsigned_codes(u, j)); }

  RADIXSERVE_ROWS_INLINE static __m512 scale(const float* s, int j) {
    return _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(s[2 * j]), _mm512_set1_ps(s[2 * j + 1]));
  }

  // Half h: (d sc_h) (c - 32) = a c - 32 a, so -160 a.
  RADIXSERVE_ROWS_INLINE static void span(const uint8_t* u, int, float* s, float* m) {
    scales(u, s);
    _mm512_storeu_ps(m, _mm512_mul_ps(_mm512_load_ps(s), _mm512_set1_ps(-160.f)));
  }
#endif
};

// Q5_0 (22 bytes: d, 32 high bits, 16 bytes of nibbles) and Q5_1 (24: d, m, then the same). Weight l < 16: the
// low nibble of byte l, weight l + 16 its high nibble; bit i of the 32 is weight i's fifth bit.
// Q5_0: w = d * (q - 16); Q5_1: w = d * q + m. s = [d, m].
template <bool Q5_1_>
struct Q5Block {
  static constexpr int64_t kType = Q5_1_ ? Q5_1 : Q5_0, kWeights = 32, kBytes = Q5_1_ ? 24 : 22;
  static constexpr int64_t kHigh = Q5_1_ ? 4 : 2;

  RADIXSERVE_ROWS_INLINE static void scales(const uint8_t* u, float* s) {
    s[0] = half_at(u);
    s[1] = Q5_1_ ? half_at(u + 2) : 0.f;
  }

  RADIXSERVE_ROWS_INLINE static float weight(const uint8_t* u, const float* s, int i) {
    const int nibble = (u[kHigh + 4 + i % 16] >> (4 * (i / 16))) & 0x0F;
    const int q = nibble | ((u32_at(u + kHigh) >> i) & 1) << 4;
    if constexpr (Q5_1_) return s[0] * static_cast<float>(q) + s[1];
    return s[0] * static_cast<float>(q - 16);
  }

#ifdef RADIXSERVE_ROWS_AVX2
  // Weights 8p ..: nibble p / 2 of bytes 8 (p % 2) .., the fifth bits from the block's 32 shifted per lane.
  RADIXSERVE_ROWS_INLINE static __m256 piece(const uint8_t* u, const float* s, int p) {
    const __m256i low = nibbles8(bytes8(u + kHigh + 4 + 8 * (p % 2)), p / 2);
    const __m256i bits = _mm256_set1_epi32(static_cast<int>(u32_at(u + kHigh)));  // one broadcast for the unit
    const __m256i at = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(8 * p));
    const __m256i fifth = _mm256_and_si256(_mm256_srlv_epi32(bits, at), _mm256_set1_epi32(1));
    const __m256i q = _mm256_or_si256(low, _mm256_slli_epi32(fifth, 4));
    if constexpr (Q5_1_) return _mm256_fmadd_ps(_mm256_set1_ps(s[0]), _mm256_cvtepi32_ps(q), _mm256_set1_ps(s[1]));
    return _mm256_mul_ps(_mm256_set1_ps(s[0]), _mm256_cvtepi32_ps(_mm256_sub_epi32(q, _mm256_set1_epi32(16))));
  }
#endif

#ifdef RADIXSERVE_BLOCK_AVX512
  // The block's 32 values as two tables (codes 0..15, 16..31) looked up by code (vpermt2ps reads 5 bits): the
  // nibbles as int32 lanes, the fifth bit set where the block's 32 bits say.
  RADIXSERVE_ROWS_INLINE static void group(const uint8_t* u, const float* s, int, __m512& lo, __m512& hi) {
    const __m512i c = bytes16(u + kHigh + 4), sixteen = _mm512_set1_epi32(16);
    const uint32_t qh = u32_at(u + kHigh);
    const __m512i low = _mm512_and_si512(c, _mm512_set1_epi32(0x0F)), high = _mm512_srli_epi32(c, 4);
    const __m512i i0 = _mm512_mask_or_epi32(low, static_cast<__mmask16>(qh), low, sixteen);
    const __m512i i1 = _mm512_mask_or_epi32(high, static_cast<__mmask16>(qh >> 16), high, sixteen);
    const __m512 d = _mm512_set1_ps(s[0]), iota = iota16();
    __m512 t0, t1;
    if constexpr (Q5_1_) {  // d * q exact: the bits of gguf's d * q + m
      t0 = _mm512_fmadd_ps(d, iota, _mm512_set1_ps(s[1]));
      t1 = _mm512_fmadd_ps(d, _mm512_add_ps(iota, _mm512_set1_ps(16.f)), _mm512_set1_ps(s[1]));
    } else {  // d * (q - 16)
      t0 = _mm512_mul_ps(d, _mm512_sub_ps(iota, _mm512_set1_ps(16.f)));
      t1 = _mm512_mul_ps(d, iota);
    }
    lo = _mm512_permutex2var_ps(t0, i0, t1);
    hi = _mm512_permutex2var_ps(t0, i1, t1);
  }

  static constexpr bool kCodes = true;

  // The 16 bytes of nibbles widened twice into 32 words (the second copy shifted to its high nibbles), then the
  // fifth bits added where the block's 32 bits say.
  RADIXSERVE_ROWS_INLINE static __m512i codes(const uint8_t* u, int) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(u + kHigh + 4));
    const __m512i both = _mm512_cvtepu8_epi16(_mm256_broadcastsi128_si256(bytes));
    const __m512i nibbles = _mm512_srlv_epi16(both, _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1));
    const __m512i c = _mm512_ternarylogic_epi32(nibbles, _mm512_set1_epi16(0x0F), _mm512_set1_epi16(0x4300), 0xEA);
    return _mm512_mask_add_epi16(c, static_cast<__mmask32>(u32_at(u + kHigh)), c, _mm512_set1_epi16(16));
  }

  RADIXSERVE_ROWS_INLINE static __m512 scale(const float* s, int i) { return _mm512_set1_ps(s[i]); }

  // Units i < groups: s[i] = d_i; both halves of unit i: b - 128 d, b = m (Q5_1) or -16 d (Q5_0). One gather of
  // each unit's first 4 bytes (d, then Q5_1's m) for the 8 units.
  RADIXSERVE_ROWS_INLINE static void span(const uint8_t* u, int groups, float* s, float* m) {
    const __m256i at = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(kBytes));
    const __mmask8 valid = static_cast<__mmask8>((1u << groups) - 1);
    const __m256i words = _mm256_mmask_i32gather_epi32(_mm256_setzero_si256(), valid, at, u, 1);
    const __m512 d = _mm512_castps256_ps512(_mm256_cvtph_ps(_mm256_cvtepi32_epi16(words)));
    const __m512 b = Q5_1_ ? _mm512_castps256_ps512(_mm256_cvtph_ps(_mm256_cvtepi32_epi16(_mm256_srli_epi32(words, 16))))
                           : _mm512_mul_ps(d, _mm512_set1_ps(-16.f));
    _mm512_storeu_ps(s, d);
    const __m512i unit = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    const __m512 mins = _mm512_fnmadd_ps(d, _mm512_set1_ps(128.f), b);
    _mm512_storeu_ps(m, _mm512_permutexvar_ps(unit, mins));
  }
#endif
};

// F32, F16, BF16 rows: the values themselves (F16 widened exactly; BF16 the upper half of a float32).
template <int64_t kT>
struct Float {
  static constexpr int64_t kType = kT, kWeights = 32, kBytes = kT == F32 ? 128 : 64;
  static constexpr bool kCodes = false;  // their values are no small integers: bfloat16 x multiplies them rounded

  RADIXSERVE_ROWS_INLINE static void scales(const uint8_t*, float*) {}

  RADIXSERVE_ROWS_INLINE static float weight(const uint8_t* u, const float*, int i) {
    if constexpr (kT == F16) return half_at(u + 2 * i);
    if constexpr (kT == BF16) return bf16_to_float(static_cast<uint16_t>(u[2 * i] | u[2 * i + 1] << 8));
    float v;
    std::memcpy(&v, u + 4 * i, sizeof v);
    return v;
  }

#ifdef RADIXSERVE_ROWS_AVX2
  RADIXSERVE_ROWS_INLINE static __m256 piece(const uint8_t* u, const float*, int p) {
    if constexpr (kT == F32) return _mm256_loadu_ps(reinterpret_cast<const float*>(u) + 8 * p);
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(u + 16 * p));
    if constexpr (kT == F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
#endif

#ifdef RADIXSERVE_BLOCK_AVX512
  RADIXSERVE_ROWS_INLINE static void group(const uint8_t* u, const float*, int, __m512& lo, __m512& hi) {
    if constexpr (kT == F32) {
      lo = _mm512_loadu_ps(u);
      hi = _mm512_loadu_ps(u + 64);
    } else if constexpr (kT == F16) {
      lo = _mm512_cvtph_ps(load32(u));
      hi = _mm512_cvtph_ps(load32(u + 32));
    } else {
      lo = bf16x16_to_float(load32(u));
      hi = bf16x16_to_float(load32(u + 32));
    }
  }
#endif
};

// The unit at u as float32 into out[kWeights]: gguf's values.
template <typename T>
inline void dequantize_unit(const uint8_t* u, float* out) {
  alignas(64) float s[16];
  T::scales(u, s);
#ifdef RADIXSERVE_BLOCK_AVX512
  for (int j = 0; j < T::kWeights / 32; ++j) {
    __m512 lo, hi;
    T::group(u, s, j, lo, hi);
    _mm512_storeu_ps(out + 32 * j, lo);
    _mm512_storeu_ps(out + 32 * j + 16, hi);
  }
#elif defined(RADIXSERVE_ROWS_AVX2)
#pragma GCC unroll 32
  for (int p = 0; p < T::kWeights / 8; ++p) _mm256_storeu_ps(out + 8 * p, T::piece(u, s, p));
#else
  for (int i = 0; i < T::kWeights; ++i) out[i] = T::weight(u, s, i);
#endif
}

// The unit at u as bfloat16 bits into out[kWeights]: its float32 values rounded as .to(torch.bfloat16) rounds them
// (bf16.h; subnormal F32 weights and NaN included).
template <typename T>
inline void dequantize_unit_bf16(const uint8_t* u, uint16_t* out) {
  alignas(64) float s[16];
  T::scales(u, s);
#ifdef RADIXSERVE_BLOCK_AVX512
  for (int j = 0; j < T::kWeights / 32; ++j) {
    __m512 lo, hi;
    T::group(u, s, j, lo, hi);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32 * j), _mm512_cvtepi32_epi16(bf16_bits16(lo)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32 * j + 16), _mm512_cvtepi32_epi16(bf16_bits16(hi)));
  }
#elif defined(RADIXSERVE_ROWS_AVX2)
#pragma GCC unroll 32
  for (int p = 0; p < T::kWeights / 8; ++p) {
    const __m256i bits = bf16_bits8(T::piece(u, s, p));
    const __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 8 * p), words);
  }
#else
  for (int i = 0; i < T::kWeights; ++i) out[i] = float_to_bf16(T::weight(u, s, i));
#endif
}

inline bool is_row_type(int64_t type) {
  return type == F32 || type == F16 || type == Q5_0 || type == Q5_1 || type == Q4_K || type == Q5_K ||
         type == Q6_K || type == BF16;
}

// f(T{}) for the trait of gguf type `type`; an unknown type is an error naming the kept ones.
template <typename F>
inline auto dispatch(int64_t type, const F& f) {
  TORCH_CHECK(is_row_type(type), "qtype ", type, " is not a GGUF row type (F32 0, F16 1, Q5_0 6, Q5_1 7, Q4_K 12, ",
              "Q5_K 13, Q6_K 14, BF16 30)");
  switch (type) {
    case Q4_K: return f(KQuant<false>{});
    case Q5_K: return f(KQuant<true>{});
    case Q6_K: return f(Q6K{});
    case Q5_0: return f(Q5Block<false>{});
    case Q5_1: return f(Q5Block<true>{});
    case F16: return f(Float<F16>{});
    case BF16: return f(Float<BF16>{});
    default: return f(Float<F32>{});
  }
}

// One weight [N, K] as the file's rows of units.
struct RowWeights {
  const uint8_t* raw;
  int64_t row_bytes;
  int64_t in_features;
};

// raw: uint8 [N, bytes of a row of in_features weights of qtype], contiguous, on CPU.
inline RowWeights check_raw(const at::Tensor& raw, int64_t qtype, int64_t in_features) {
  const auto [weights, bytes] = dispatch(qtype, [](auto t) {
    return std::pair<int64_t, int64_t>{decltype(t)::kWeights, decltype(t)::kBytes};
  });
  TORCH_CHECK(in_features > 0 && in_features % weights == 0, "qtype ", qtype, " stores rows of whole units of ",
              weights, " weights, not ", in_features);
  const int64_t row_bytes = in_features / weights * bytes;
  TORCH_CHECK(raw.scalar_type() == at::kByte && raw.dim() == 2 && raw.size(1) == row_bytes, "raw: uint8 [N, ",
              row_bytes, "] for rows of ", in_features, " weights of qtype ", qtype, ", got ", raw.sizes());
  TORCH_CHECK(raw.is_contiguous() && raw.device().is_cpu(), "raw: contiguous, on CPU");
  return {raw.data_ptr<uint8_t>(), row_bytes, in_features};
}

}  // namespace radixserve::gguf_rows
