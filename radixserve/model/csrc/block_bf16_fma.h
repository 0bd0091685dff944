// Bfloat16 rows against Q4 / Q8_0 blocks for several rows at once (a verify forward's 1 + k rows, small
// batches), with the bits of block_linear.cpp's vdpbf16ps kernel but its dot products in float32 FMAs.
//
// vdpbf16ps computes each lane as acc + x1 * w1 + x0 * w0 (the odd pair element first, each add rounded to
// nearest even; products of two bfloat16 are exact in float32), with denormal inputs read as zero and denormal
// results flushed to zero. Two FMAs on the pair's halves widened to float32, fma(x0, w0, fma(x1, w1, acc)), give
// the same bits wherever no input or intermediate is denormal. On the Xeons here vdpbf16ps issues once per two
// cycles and an FMA twice per cycle, so a Q4 block's x . (128 + q) then d * that (3 FMAs) runs ~1.7x the rate
// of vdpbf16ps + FMA, and a Q8_0 block (2 FMAs) ~2x; the weights' decode into float32 pairs is shared by a
// tile of up to 10 rows (balanced: 11 rows run as 6 + 5).
//
// When the FMAs' bits are the instruction's:
//  - activations: every nonzero |x| in [2^-88, 2^88) (fma_rows_in_range): every product x * w and every partial
//    sum is then a multiple of 2^(ex + ew - 14) >= 2^-126 (Q4's w = 128 + q, Q8_0's w >= 2^-24, a float16 scale
//    times a code), so nothing is denormal, and nothing overflows; otherwise the call runs the instruction;
//  - the CPU's vdpbf16ps rounds as described (fma_emulates_dpbf16: checked once on crafted pairs, cancellation
//    included; a CPU that rounds otherwise keeps the instruction for every call).
// Whether they are faster depends on the core (the instruction's issue rate): fma_choice, set from a timing.
// Q4 starts each block's pair sum from +0, as vdpbf16ps on a zeroed accumulator: fma(x1, w1, +0) turns a -0
// product into +0 as the instruction's first add does.
#pragma once

#include "block_common.h"

#if defined(RADIXSERVE_BLOCK_AVX512BF16)

#include <atomic>
#include <random>

namespace radixserve::bf16_fma {

constexpr int kRowTile = 10;  // rows sharing one decode of a weight block: a verify forward's 1 + 8 rows and one more
constexpr int64_t kChunk = 16;
constexpr int64_t kPrefetch = 4096;  // as block_linear.cpp's dot_tile

// Pair lane i of a block's 32 bfloat16 x (elements 2i, 2i + 1) as float32: even elements, then odd ones.
inline __m512 even_half(__m512i pairs) { return _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16)); }
inline __m512 odd_half(__m512i pairs) {
  return _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// Whether fma(x0, w0, fma(x1, w1, acc)) is this CPU's vdpbf16ps, and fma(x0, w0, fma(x1, w1, +0)) its
// zero-accumulator form, bit for bit on normal values: pairs of random bfloat16 and pairs that cancel.
inline bool fma_emulates_dpbf16() {
  static const bool same = [] {
    std::mt19937 gen(7);
    std::normal_distribution<float> normal(0.f, 1.f);
    std::uniform_int_distribution<int> code(0, 15);
    alignas(64) uint16_t x[32], w[32], q[32];
    alignas(64) float acc[16];
    for (int trial = 0; trial < 4096; ++trial) {
      for (int i = 0; i < 32; ++i) {
        x[i] = float_to_bf16(normal(gen) * (1 << (trial % 7)));
        w[i] = float_to_bf16(normal(gen) * 0.01f);
        q[i] = static_cast<uint16_t>(0x4300 | code(gen));
      }
      for (int i = 0; trial % 2 && i < 32; i += 2) x[i] = x[i + 1] ^ 0x8000, w[i] = w[i + 1];  // x0 w0 = -x1 w1
      for (int i = 0; i < 16; ++i) acc[i] = normal(gen) * 4.f;
      const __m512i xi = _mm512_load_si512(x), wi = _mm512_load_si512(w), qi = _mm512_load_si512(q);
      const __m512 a = _mm512_load_ps(acc), zero = _mm512_setzero_ps();
      const __m512 xe = even_half(xi), xo = odd_half(xi);
      const __m512 dp = _mm512_dpbf16_ps(a, (__m512bh)xi, (__m512bh)wi);
      const __m512 fm = _mm512_fmadd_ps(xe, even_half(wi), _mm512_fmadd_ps(xo, odd_half(wi), a));
      const __m512 dq = _mm512_dpbf16_ps(zero, (__m512bh)xi, (__m512bh)qi);
      const __m512 fq = _mm512_fmadd_ps(xe, even_half(qi), _mm512_fmadd_ps(xo, odd_half(qi), zero));
      const __mmask16 differ = _mm512_cmpneq_epi32_mask(_mm512_castps_si512(dp), _mm512_castps_si512(fm)) |
                               _mm512_cmpneq_epi32_mask(_mm512_castps_si512(dq), _mm512_castps_si512(fq));
      if (differ != 0) return false;
    }
    return true;
  }();
  return same;
}

// Whether bfloat16 calls of 2 or more rows run the FMAs where they reproduce the instruction: 1 (the default) or 0
// (the instruction for every call). quant_blocks.py times both once and keeps the faster: the bits are the same.
inline std::atomic<int> fma_choice{1};

inline bool fma_enabled() { return fma_choice.load(std::memory_order_relaxed) != 0 && fma_emulates_dpbf16(); }

// Whether every value of x (bfloat16 [rows, K]) is 0 or of magnitude in [2^-88, 2^88): biased exponents 39..214.
inline bool fma_rows_in_range(const uint16_t* x, int64_t count) {
  __mmask32 bad = 0;
  int64_t i = 0;
  const __m512i lo = _mm512_set1_epi16(39), hi = _mm512_set1_epi16(214), magnitude = _mm512_set1_epi16(0x7FFF);
  for (; i + 32 <= count; i += 32) {
    const __m512i v = _mm512_and_si512(_mm512_loadu_si512(x + i), magnitude);
    const __m512i e = _mm512_srli_epi16(v, 7);
    bad |= _mm512_mask_cmpneq_epi16_mask(_mm512_cmplt_epu16_mask(e, lo) | _mm512_cmpgt_epu16_mask(e, hi), v,
                                          _mm512_setzero_si512());
  }
  for (; i < count; ++i) {
    const int e = (x[i] & 0x7FFF) >> 7;
    if ((x[i] & 0x7FFF) != 0 && (e < 39 || e > 214)) return false;
  }
  return bad == 0;
}

// x [rows, K] bfloat16 as float32 pair halves, block by block: [rows][blocks][even 16 | odd 16].
inline void split_rows(const uint16_t* x, int64_t count, float* out) {
  for (int64_t i = 0; i < count; i += 32) {
    const __m512i pairs = _mm512_loadu_si512(x + i);
    _mm512_storeu_ps(out + i, even_half(pairs));
    _mm512_storeu_ps(out + i + 16, odd_half(pairs));
  }
}

// Block b of a Q4 weight row as 128 + q in float32, pair lane i's even weight in we and odd one in wo (the
// pairing of block_linear.cpp's codes_bf16: weights 0..15 are byte j's low nibbles, 16..31 its high ones).
// Lane i < 8 holds word i = bytes 2i, 2i + 1; lanes 8..15 the same words for the high nibbles.
inline void q4_pairs(const uint8_t* qs, int64_t b, __m512& we, __m512& wo) {
  const __m512i words = _mm512_cvtepu16_epi32(
      _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + b * 16))));
  const __m512i even_shift = _mm512_setr_epi32(16, 16, 16, 16, 16, 16, 16, 16, 12, 12, 12, 12, 12, 12, 12, 12);
  const __m512i odd_shift = _mm512_setr_epi32(8, 8, 8, 8, 8, 8, 8, 8, 4, 4, 4, 4, 4, 4, 4, 4);
  const __m512i nibble = _mm512_set1_epi32(0x000F0000), exponent = _mm512_set1_epi32(0x43000000);  // 128.0f
  we = _mm512_castsi512_ps(_mm512_ternarylogic_epi32(_mm512_sllv_epi32(words, even_shift), nibble, exponent, 0xEA));
  wo = _mm512_castsi512_ps(_mm512_ternarylogic_epi32(_mm512_sllv_epi32(words, odd_shift), nibble, exponent, 0xEA));
}

// R rows (split_rows' layout, ldx floats apart) against C weight rows: the sums of block_linear.cpp's dot_tile
// with BF16 (Q4: per group of 16 blocks the min term, then each block's d * (x . (128 + q)); Q8_0: x . bf16(d q)
// into the accumulator), the instruction replaced as the header says. weights(qs, b, scale, we, wo) decodes a
// block into pair halves; mins(m, valid, d) gives Q4's min-term weights of 16 blocks (m - 128 d).
template <int R, int C, bool Q4, typename Weights, typename Mins>
void fma_tile(const float* x, int64_t ldx, const float* xsum, int64_t ldxs, const uint8_t* qs, int64_t ldq,
              const at::Half* d, const at::Half* m, int64_t blocks, float* sums, const Weights& weights,
              const Mins& mins) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  alignas(64) float scales[C][16];
  const __m512 zero = _mm512_setzero_ps();
  static_assert(R * C <= 32, "a tile of up to 32 accumulators");
  for (int64_t g = 0; g < blocks; g += 16) {
    const int64_t count = std::min<int64_t>(16, blocks - g);
    const __mmask16 valid = static_cast<__mmask16>((1u << count) - 1);
    for (int c = 0; c < C; ++c) {
      prefetch_channel<Q4>(qs, ldq, d, m, blocks, c, g, kPrefetch);
      const __m512 dc = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(valid, d + c * blocks + g));
      _mm512_store_ps(scales[c], dc);
      if constexpr (Q4) {
        const __m512 mc = mins(m == nullptr ? m : m + c * blocks + g, valid, dc);
        for (int r = 0; r < R; ++r) acc[r][c] = _mm512_fmadd_ps(mc, _mm512_loadu_ps(xsum + r * ldxs + g), acc[r][c]);
      }
    }
    for (int64_t b = g; b < g + count; ++b) {
      __m512 we[C], wo[C];
      for (int c = 0; c < C; ++c) weights(qs + c * ldq, b, scales[c][b - g], we[c], wo[c]);
      for (int r = 0; r < R; ++r) {
        const __m512 xe = _mm512_loadu_ps(x + r * ldx + b * kBlock), xo = _mm512_loadu_ps(x + r * ldx + b * kBlock + 16);
        for (int c = 0; c < C; ++c) {
          if constexpr (Q4) {
            const __m512 pair = _mm512_fmadd_ps(xe, we[c], _mm512_fmadd_ps(xo, wo[c], zero));
            acc[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(scales[c][b - g]), pair, acc[r][c]);
          } else {
            acc[r][c] = _mm512_fmadd_ps(xe, we[c], _mm512_fmadd_ps(xo, wo[c], acc[r][c]));
          }
        }
      }
    }
  }
  // Row r at sums + r * kChunk (the walk's chunk): reduce_tile over up to 16 accumulators at a time (its
  // compile-time indices keep them in registers; a loop over them put every update through the stack).
  if constexpr (R * C <= 16) {
    reduce_tile(acc, sums, kChunk);
  } else {
    constexpr int kHead = 16 / C;
    reduce_tile(reinterpret_cast<const __m512(&)[kHead][C]>(acc[0]), sums, kChunk);
    reduce_tile(reinterpret_cast<const __m512(&)[R - kHead][C]>(acc[kHead]), sums + kHead * kChunk, kChunk);
  }
}

// Channels per tile by rows: the accumulators, the decoded weights and a row's x fit the 32 registers.
constexpr int fma_channels(int rows) { return rows <= 4 ? 4 : 2; }

}  // namespace radixserve::bf16_fma

#endif  // RADIXSERVE_BLOCK_AVX512BF16
