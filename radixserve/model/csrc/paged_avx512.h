// The decode-shaped hot loops of paged_attention.h with AVX512 intrinsics, for head dims that are
// a multiple of 16 (NC = D / 16 zmm registers a row) and float32 or bfloat16 pools. Compiled only
// where the target has AVX512F; paged_attention.h keeps the portable loops for every other case.
//
// Per work item (a few query rows against one K/V head's keys [key0, key1)):
//   scores   16 keys at a time: each key's row is converted once (bfloat16 widens by a shift),
//            each query row's 16 partial dot products are summed by one transposed reduction
//            (15 adds, 16 scores in a register) instead of 16 horizontal sums; with AVX512-BF16
//            a bfloat16 row is not converted at all (vdpbf16ps against q in bfloat16, two keys a
//            register, 8 keys a step: scores_dp_rows);
//   softmax  per row, 16 scores at a time (the same polynomial as fast_exp);
//   values   each V row converted once, accumulated into up to 24 zmm registers (a block of rows); an 8-bit
//            pool's codes are not converted at all (values_int8.h: int16 weights dotted with them).
// Both passes walk an item's keys as two interleaved streams: one core reads a 2k-key context out of DRAM
// ~20% faster with two streams in flight than with one (the hardware prefetcher runs each stream only so far
// ahead of a loop this dense in compute). The scores pass pairs key j with key half + j (each score is its own
// dot product: the order changes no bits); the values pass pairs key j with key j + kStream within blocks of
// 2 x kStream keys, an order fixed by the keys' positions, so a row's sum does not depend on how many keys the
// other rows of its block see (split invariance: a row's bits do not move with where its extend starts).
#pragma once

#if defined(__AVX512F__)
#include <algorithm>
#include <cstdint>
#include <limits>
#include <cstring>
#include <type_traits>
#include <vector>

#include "attention_common.h"
#include "simd_reduce.h"

namespace radixserve::avx512 {

// Scattered pool rows are ~100 ns away: ask for them this many keys ahead (the loops below spend a
// few ns a key, so the portable loops' distance would leave most of each miss exposed).
constexpr int64_t kAhead = 32;

using simd::reduce16;

#if defined(__AVX512BW__)
// acc + a . b over int16 pairs into int32 lanes, exactly: vpdpwssd, or vpmaddwd + add without AVX512-VNNI.
inline __m512i dot_i16(__m512i acc, __m512i a, __m512i b) {
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(acc, a, b);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}
#endif

// scores[r * stride + j] = q_r . k_j for keys [0, num_keys), rows [0, rows); scores is written up to
// num_keys rounded up to 16 (the pad holds zeros' dot products: 0).
template <int NC, typename kv_t>
void scores_pass(const float* q, int64_t rows, const kv_t* k, const int64_t* slots, int64_t num_keys, int64_t stride,
                 float* scores) {
  constexpr int64_t dim = NC * 16;
  alignas(64) static thread_local float tile[16 * dim];
  for (int64_t j0 = 0; j0 < num_keys; j0 += 16) {
    const int64_t n = std::min<int64_t>(16, num_keys - j0);
    const float* row[16];
    for (int64_t j = 0; j < 16; ++j) {
      if (j >= n) {
        std::fill(tile + j * dim, tile + (j + 1) * dim, 0.f);
        row[j] = tile + j * dim;
        continue;
      }
      prefetch_row<kAhead>(k, slots + j0, j, num_keys - j0, dim);
      const kv_t* src = k + slots[j0 + j] * dim;
      if constexpr (std::is_same_v<kv_t, float>) {
        row[j] = src;
      } else {
#pragma GCC unroll 8
        for (int c = 0; c < NC; ++c) _mm512_store_ps(tile + j * dim + 16 * c, load16(src + 16 * c));
        row[j] = tile + j * dim;
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      __m512 qv[NC], part[16];
#pragma GCC unroll 8
      for (int c = 0; c < NC; ++c) qv[c] = _mm512_loadu_ps(q + r * dim + 16 * c);
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j) {
        part[j] = _mm512_mul_ps(qv[0], _mm512_loadu_ps(row[j]));
#pragma GCC unroll 8
        for (int c = 1; c < NC; ++c) part[j] = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(row[j] + 16 * c), part[j]);
      }
      _mm512_storeu_ps(scores + r * stride + j0, reduce16(part));
    }
  }
}

#if defined(__AVX512BF16__)
// scores_pass for a bfloat16 pool with the BF16 dot product: key rows are read as they lie, no
// widening. q is split into bfloat16 pairs hi + lo (lo = q - hi, rounded: ~2^-16 of q left out);
// LO = false when every lo is 0, as when q comes from a bfloat16 model (scale is a power of 2).
//
// Two keys share a register: [key j's 16 dims | key j+1's same 16 dims] against [q's 16 | q's 16],
// so one vdpbf16ps serves two keys and each of the R rows (the K registers are built once for all
// of them), and a key's sum is 8 lanes, reduced for 8 keys at a time in 7 adds (against 15 adds
// and twice the shuffles for 16 lanes a key). Every key's sum runs the same ops in the same order
// wherever it lies in the block, so a score does not depend on its neighbours or on R. A step takes
// keys j0 .. j0+3 of the first half and half+j0 .. half+j0+3 of the second (two streams, see the top).
//
// An 8-bit pool's codes take the same path in integers: q is quantized to int16 per row (its max -> 32767: 2^-15 of
// the row's largest, finer than q's own bfloat16), each pair register is the two keys' codes widened to int16
// (key_pair), and vpdpwssd (vpmaddwd + add without AVX512-VNNI) sums q . code in int32, exactly; the caller
// multiplies each row by its q scale and each key by its scale. The same register layout and reductions.
inline __m512i key_pair(const bf16* a, const bf16* b, int c) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 16 * c))),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16 * c)), 1);
}
inline __m512i key_pair(const i8* a, const i8* b, int c) {
  const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a + 16 * c));
  const __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(lo),
                                               _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16 * c)), 1);
  return _mm512_cvtepi8_epi16(both);  // key a's 16 dims in the low half, b's in the high
}

// acc += q . k over one register: bf16 pairs, or int16 pairs into int32 lanes (kept in a float register's bits).
inline __m512 dot_pairs(__m512 acc, __m512i q, __m512i k, bf16*) { return _mm512_dpbf16_ps(acc, (__m512bh)q, (__m512bh)k); }
inline __m512 dot_pairs(__m512 acc, __m512i q, __m512i k, i8*) {
  return _mm512_castsi512_ps(dot_i16(_mm512_castps_si512(acc), q, k));
}
inline __m512 to_float(__m512 acc, bf16*) { return acc; }
inline __m512 to_float(__m512 acc, i8*) { return _mm512_cvtepi32_ps(_mm512_castps_si512(acc)); }

template <int NC, bool LO, int R, typename kv_t>
void scores_dp_rows(const uint16_t* qh, const uint16_t* ql, const kv_t* k, const int64_t* slots, int64_t num_keys,
                    int64_t stride, float* scores) {
  constexpr int64_t dim = NC * 16;
  alignas(64) static const kv_t zeros[dim] = {};
  __m512i qd[R][NC], qe[LO ? R : 1][NC];  // 16 dims of q twice, for both keys of a register
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < NC; ++c) {
      qd[r][c] = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh + r * dim + 16 * c)));
      if constexpr (LO)
        qe[r][c] = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + r * dim + 16 * c)));
    }
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  const int64_t half = (num_keys + 7) / 8 * 4;
  for (int64_t j0 = 0; j0 < half; j0 += 4) {
    const kv_t* row[8];
#pragma GCC unroll 8
    for (int64_t j = 0; j < 8; ++j) {
      const int64_t key = j < 4 ? j0 + j : half + j0 + j - 4;
      if (key < num_keys) prefetch_row<kAhead>(k, slots, key, num_keys, dim);
      row[j] = key < num_keys ? k + slots[key] * dim : zeros;
    }
    __m512 acc[R][4];
#pragma GCC unroll 4
    for (int pr = 0; pr < 4; ++pr) {
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) acc[r][pr] = _mm512_setzero_ps();
#pragma GCC unroll 8
      for (int c = 0; c < NC; ++c) {
        const __m512i kk = key_pair(row[2 * pr], row[2 * pr + 1], c);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          acc[r][pr] = dot_pairs(acc[r][pr], qd[r][c], kk, static_cast<kv_t*>(nullptr));
          if constexpr (LO) acc[r][pr] = dot_pairs(acc[r][pr], qe[r][c], kk, static_cast<kv_t*>(nullptr));
        }
      }
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) acc[r][pr] = to_float(acc[r][pr], static_cast<kv_t*>(nullptr));
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      // acc[r][p] = [key 2p: 8 lanes | key 2p+1: 8 lanes]. First the 8 lanes to 4 (quarters of keys
      // 0..3 and 4..7), then 4 to 1 within each quarter: lane 4q = key q, lane 4q+1 = key 4+q.
      const __m512 y0 = _mm512_add_ps(_mm512_shuffle_f32x4(acc[r][0], acc[r][1], 0x88),
                                      _mm512_shuffle_f32x4(acc[r][0], acc[r][1], 0xDD));
      const __m512 y1 = _mm512_add_ps(_mm512_shuffle_f32x4(acc[r][2], acc[r][3], 0x88),
                                      _mm512_shuffle_f32x4(acc[r][2], acc[r][3], 0xDD));
      const __m512 t = _mm512_add_ps(_mm512_unpacklo_ps(y0, y1), _mm512_unpackhi_ps(y0, y1));
      const __m512 u = _mm512_add_ps(t, _mm512_shuffle_ps(t, t, 0x4E));
      const __m512 w = _mm512_permutexvar_ps(order, u);
      _mm_storeu_ps(scores + r * stride + j0, _mm512_castps512_ps128(w));
      _mm_storeu_ps(scores + r * stride + half + j0, _mm512_extractf32x4_ps(w, 1));
    }
  }
}

// Rows in blocks of up to 4 (4 x 4 accumulators; the q registers are reloaded when they do not fit).
template <int NC, bool LO, typename kv_t>
void scores_dp(const uint16_t* qh, const uint16_t* ql, int64_t rows, const kv_t* k, const int64_t* slots,
               int64_t num_keys, int64_t stride, float* scores) {
  constexpr int64_t dim = NC * 16;
  for (int64_t r0 = 0; r0 < rows; r0 += 4) {
    const uint16_t *h = qh + r0 * dim, *l = ql + r0 * dim;
    float* out = scores + r0 * stride;
    switch (std::min<int64_t>(4, rows - r0)) {
      case 1: scores_dp_rows<NC, LO, 1>(h, l, k, slots, num_keys, stride, out); break;
      case 2: scores_dp_rows<NC, LO, 2>(h, l, k, slots, num_keys, stride, out); break;
      case 3: scores_dp_rows<NC, LO, 3>(h, l, k, slots, num_keys, stride, out); break;
      default: scores_dp_rows<NC, LO, 4>(h, l, k, slots, num_keys, stride, out); break;
    }
  }
}

// q [rows][dim] float -> hi, lo bfloat16 (round to nearest even); true when some lo is not 0.
inline bool split_bf16(const float* q, int64_t n, uint16_t* hi, uint16_t* lo) {
  bool any = false;
  for (int64_t i = 0; i < n; ++i) {
    hi[i] = float_to_bf16(q[i]);
    lo[i] = float_to_bf16(q[i] - bf16_to_float(hi[i]));
    any |= (lo[i] & 0x7FFF) != 0;
  }
  return any;
}

// scores_pass for a bfloat16 pool, or an 8-bit pool's codes (kv_t = i8), with the BF16 dot product.
// q [rows][dim] -> int16 codes (bits in ``codes``) with one scale per row: max|q_r| / 32767.
inline void quantize_rows_i16(const float* q, int64_t rows, int64_t dim, uint16_t* codes, float* scales) {
  for (int64_t r = 0; r < rows; ++r) {
    float mx = 0.f;
    for (int64_t i = 0; i < dim; ++i) mx = std::max(mx, std::fabs(q[r * dim + i]));
    scales[r] = mx / 32767.f;
    const float inv = mx > 0.f ? 32767.f / mx : 0.f;
    for (int64_t i = 0; i < dim; ++i)
      codes[r * dim + i] = static_cast<uint16_t>(static_cast<int16_t>(std::nearbyint(q[r * dim + i] * inv)));
  }
}

template <int NC, typename kv_t>
void scores_pass_dp(const float* q, int64_t rows, const kv_t* k, const int64_t* slots, int64_t num_keys,
                    int64_t stride, float* scores) {
  static thread_local std::vector<uint16_t> split;
  split.resize(2 * rows * NC * 16);
  uint16_t *hi = split.data(), *lo = hi + rows * NC * 16;
  if constexpr (std::is_same_v<kv_t, i8>) {
    static thread_local std::vector<float> q_scales;
    q_scales.resize(rows);
    quantize_rows_i16(q, rows, NC * 16, hi, q_scales.data());
    scores_dp<NC, false>(hi, lo, rows, k, slots, num_keys, stride, scores);
    const int64_t padded = (num_keys + 15) / 16 * 16;  // what scores_dp wrote
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < padded; ++j) scores[r * stride + j] *= q_scales[r];
    return;
  }
  if (split_bf16(q, rows * NC * 16, hi, lo))
    scores_dp<NC, true>(hi, lo, rows, k, slots, num_keys, stride, scores);
  else
    scores_dp<NC, false>(hi, lo, rows, k, slots, num_keys, stride, scores);
}
template <int NC>
void scores_pass(const float* q, int64_t rows, const bf16* k, const int64_t* slots, int64_t num_keys, int64_t stride,
                 float* scores) {
  scores_pass_dp<NC>(q, rows, k, slots, num_keys, stride, scores);
}
template <int NC>
void scores_pass(const float* q, int64_t rows, const i8* k, const int64_t* slots, int64_t num_keys, int64_t stride,
                 float* scores) {
  scores_pass_dp<NC>(q, rows, k, slots, num_keys, stride, scores);
}
#endif

// The lanes j0 .. j0 + 15 that lie in [first, seen).
inline __mmask16 lanes_in(int64_t j0, int64_t first, int64_t seen) {
  const int64_t hi = std::clamp<int64_t>(seen - j0, 0, 16), lo = std::clamp<int64_t>(first - j0, 0, 16);
  return static_cast<__mmask16>(((1u << hi) - 1u) & ~((1u << lo) - 1u));
}

// The largest sc[j] for first <= j < seen (the softmax passes' shift).
inline float masked_row_max(const float* sc, int64_t first, int64_t seen) {
  __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = first / 16 * 16; j < seen; j += 16)
    mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(mx, lanes_in(j, first, seen), sc + j));
  return _mm512_reduce_max_ps(mx);
}

// sc[j] = exp(sc[j] - max) for first <= j < seen, 0 for the other j < padded (a multiple of 16);
// returns (max, sum) of the row through *m and *l.
inline void softmax_row(float* sc, int64_t first, int64_t seen, int64_t padded, float* m, float* l) {
  const float row_max = masked_row_max(sc, first, seen);
  const __m512 mv = _mm512_set1_ps(row_max);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < padded; j += 16) {
    const __mmask16 keep = lanes_in(j, first, seen);
    const __m512 p = _mm512_maskz_mov_ps(keep, exp16(_mm512_sub_ps(_mm512_loadu_ps(sc + j), mv)));
    _mm512_storeu_ps(sc + j, p);
    sum = _mm512_add_ps(sum, p);
  }
  *m = row_max;
  *l = _mm512_reduce_add_ps(sum);
}

// The values pass's second stream runs this many keys after the first (see the top).
constexpr int64_t kStream = 256;

// acc[r] = sum_j p[r][j] v_j for NR rows over keys [0, num_keys) (p is 0 past a row's last key, and adding
// 0 x v changes no bits), summed in the order 0, kStream, 1, kStream + 1, ..., then from 2 x kStream on the
// same way: each key's place in the sum depends only on its position (see the top).
template <int NC, int NR, typename kv_t>
void values_block(const float* p, int64_t stride, const kv_t* v, const int64_t* slots, int64_t num_keys, float* acc) {
  constexpr int64_t dim = NC * 16;
  __m512 a[NR][NC];
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < NC; ++c) a[r][c] = _mm512_setzero_ps();
  auto key = [&](int64_t j) {
    prefetch_row<kAhead>(v, slots, j, num_keys, dim);
    const kv_t* vj = v + slots[j] * dim;
    __m512 pr[NR];
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) pr[r] = _mm512_set1_ps(p[r * stride + j]);
#pragma GCC unroll 8
    for (int c = 0; c < NC; ++c) {
      const __m512 x = load16(vj + 16 * c);
#pragma GCC unroll 8
      for (int r = 0; r < NR; ++r) a[r][c] = _mm512_fmadd_ps(pr[r], x, a[r][c]);
    }
  };
  for (int64_t base = 0; base < num_keys; base += 2 * kStream) {
    const int64_t first = std::min(kStream, num_keys - base);
    for (int64_t j = base; j < base + first; ++j) {
      key(j);
      if (j + kStream < num_keys) key(j + kStream);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc + r * dim + 16 * c, a[r][c]);
}

// values_block for nr <= NR rows: NR is a compile-time count, so pick it by counting down.
template <int NC, int NR, typename kv_t>
void values_rows(int64_t nr, const float* p, int64_t stride, const kv_t* v, const int64_t* slots, int64_t num_keys,
                 float* acc) {
  if constexpr (NR > 1)
    if (nr < NR) return values_rows<NC, NR - 1>(nr, p, stride, v, slots, num_keys, acc);
  values_block<NC, NR>(p, stride, v, slots, num_keys, acc);
}

// Rows in blocks of up to 24 / NC (24 accumulators: with the V row's chunk and the row weights they
// fit the 32 zmm registers); each block reads the keys its rows see.
template <int NC, typename kv_t>
void values_pass(const float* p, int64_t rows, const int64_t* seen, int64_t stride, const kv_t* v,
                 const int64_t* slots, float* acc) {
  constexpr int max_rows = 24 / NC;
  for (int64_t r0 = 0; r0 < rows; r0 += max_rows) {
    const int64_t nr = std::min<int64_t>(max_rows, rows - r0), keys = *std::max_element(seen + r0, seen + r0 + nr);
    values_rows<NC, max_rows>(nr, p + r0 * stride, stride, v, slots, keys, acc + r0 * NC * 16);
  }
}

}  // namespace radixserve::avx512

#endif  // __AVX512F__
