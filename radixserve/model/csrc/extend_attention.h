// Multi-token (extend / prefill) attention over the KV pool with AVX512-BF16 dot products.
// Plain C++ (no torch headers); bound in extend_attention.cpp. Built only where the compiler
// targets AVX512-BF16 (-march=native on such a CPU): RADIXSERVE_EXTEND_BF16 says so.
//
// Request b owns query rows q_starts[b] .. q_starts[b+1] (its new tokens) and context slots
// slots[ctx_starts[b] .. ctx_starts[b+1]] (cached prefix first, new tokens last); new token t
// (0-based) sees context 0 .. prefix_len + t. A cold prefill is an extend with prefix_len 0.
//
//   q, out [T, H, D] bfloat16    k, v [Hkv, N, D] bfloat16 (one layer of the pool), or int8 codes with
//                                their bfloat16 scales (Shape::k_scale, v_scale): packed as code * scale in bf16
//
// Flash attention in two phases. (1) Pack: each (request, K/V head)'s context is copied once out
// of the pool into the pair layout vdpbf16ps multiplies: K as blocks of 16 keys [D/2][16][2]
// (pairs along the head dim), V as key pairs [D][2] (pairs along the keys), zero past the end.
// (2) Attend: work items are (request, K/V head, tile of query tokens); the query heads sharing
// a K/V head are rows of one tile. Keys go by in tiles of 128 from key 0: S = Q K^T (bf16 pairs,
// float32 sums), the online softmax in float32, P rounded to bf16, O += P V. Key tiles no row of
// the tile sees are skipped; the diagonal ones are masked per row.
//
// A row's arithmetic never depends on the other rows of its tile or on where the tile starts:
// key tiles are aligned to context positions and always visited in order, and a tile a row does
// not see leaves its sums bit for bit as they were. So a prompt prefilled whole, in chunks, or
// as a tail on a cached prefix gets the same bits from this kernel.
//
// A sliding window (Shape::window: row at position p sees keys p - window + 1 .. p) is a lower bound per
// row, masked like the causal upper one: a request packs only the tiles from its first new token's
// first visible key (the keys before that key packed as zeros: no new token sees them, and they are
// not read), and an item visits the tiles from its first row's (the tiles before a row's own window
// leave its sums as they were, so the bits stay the chunking's). A soft cap (Shape::softcap)
// caps the scaled scores before the online softmax, which then runs on them unscaled.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "attention_common.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>

#include "simd_reduce.h"
#define RADIXSERVE_EXTEND_BF16 1
#endif

namespace radixserve::extend {

constexpr int64_t kKeyBlock = 16;   // keys per vector of scores
constexpr int64_t kKeyTile = 128;   // keys per online-softmax step; contexts are packed to a multiple of it
constexpr int kTileVectors = kKeyTile / kKeyBlock;
constexpr int64_t kRowBlock = 6;    // query rows per micro-kernel pass (6 x 4 accumulators)
constexpr int64_t kTileRows = 48;   // query rows (tokens x heads of a group) per work item, about

struct Shape {
  int64_t num_heads, num_kv_heads, dim, num_slots, group, q_token_stride;
  float scale;
  int64_t window;  // 0: none
  float softcap;   // 0: none
  // An 8-bit pool (k, v int8 [Hkv, N, D]): its scales, bfloat16 bits [Hkv, N]; nullptr for a bfloat16 pool.
  const uint16_t* k_scale = nullptr;
  const uint16_t* v_scale = nullptr;
};



// Where each request's packed context lies: its keys packed_from[b] .. ctx_len, padded to whole tiles,
// from packed_starts[b], per head. first_seen[b]: the first key its first new token sees (0 without a
// window); packed_from[b]: the start of that key's tile.
struct Layout {
  const int64_t *q_starts, *ctx_starts;
  int64_t batch;
  std::vector<int64_t> first_seen, packed_from;  // [batch]; packed_from: multiples of kKeyTile
  std::vector<int64_t> packed_starts;            // [batch + 1], multiples of kKeyTile
  int64_t tokens_per_tile;

  Layout(const int64_t* qs, const int64_t* cs, int64_t b, int64_t group, int64_t window)
      : q_starts(qs), ctx_starts(cs), batch(b), first_seen(b, 0), packed_from(b, 0), packed_starts(b + 1, 0),
        tokens_per_tile(std::max<int64_t>(1, kTileRows / group)) {
    for (int64_t i = 0; i < b; ++i) {
      first_seen[i] = first_visible(ctx_len(i) - extend_len(i) + 1, window);
      packed_from[i] = first_seen[i] / kKeyTile * kKeyTile;
      packed_starts[i + 1] = packed_starts[i] + (ctx_len(i) + kKeyTile - 1) / kKeyTile * kKeyTile - packed_from[i];
    }
  }
  int64_t extend_len(int64_t b) const { return q_starts[b + 1] - q_starts[b]; }
  int64_t ctx_len(int64_t b) const { return ctx_starts[b + 1] - ctx_starts[b]; }
  int64_t packed_len() const { return packed_starts[batch]; }
};

struct Item {
  int64_t b, hkv, t0, t1, tile0, num_tiles;  // it visits key tiles tile0 .. num_tiles - 1 (its cost)
};

#ifdef RADIXSERVE_EXTEND_BF16

inline __m512bh as_bh(__m512i x) { return (__m512bh)x; }  // a bit cast: 32 bf16 = 16 pairs

// 2^x for finite x <= 0: 2^floor(x) (vscalefps) times a degree-4 polynomial of the fraction (relative
// error 3e-6, far below P's rounding to bf16), exact 1 at x = 0. Below -126 a subnormal or 0, which
// vcvtne2ps2bf16 flushes to a bf16 0 and which is too small to move l (>= 1): the scores use it
// as it is and zero masked keys after it.
inline __m512 exp2_finite(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.34267101e-2f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.22424295e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.41280228e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.93044841e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// 2^x for any x <= 0, -inf included (a row's first max): exp2_finite from -126 up, 0 below.
inline __m512 exp2_neg(__m512 x) {
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.f), _CMP_GE_OQ);
  return _mm512_maskz_mov_ps(live, exp2_finite(_mm512_max_ps(x, _mm512_set1_ps(-126.f))));
}

// 16 keys (slots into one head of the pool; those before ``skip`` and from ``count`` on are zeros, not
// read) -> one K block [D/2][16] of bf16 pairs.
inline void pack_k_block(const uint16_t* head, const int64_t* slots, int64_t skip, int64_t count, int64_t dim,
                         uint32_t* out) {
  alignas(64) int32_t idx[kKeyBlock] = {};
  for (int64_t j = skip; j < count; ++j) idx[j] = static_cast<int32_t>(slots[j] * dim / 2);
  const __m512i index = _mm512_load_si512(idx);
  const __mmask16 valid = static_cast<__mmask16>(((1u << count) - 1u) & ~((1u << skip) - 1u));
  const int32_t* base = reinterpret_cast<const int32_t*>(head);
  for (int64_t p = 0; p < dim / 2; ++p)
    _mm512_store_si512(out + p * kKeyBlock,
                       _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), valid, index, base + p, 4));
}

// v[k] = 16 pairs of key k -> v[p] = pair p of the 16 keys (a 16 x 16 transposition of 32-bit lanes).
inline void transpose16(__m512i v[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    v[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    v[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    v[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    v[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 4; ++j) {
      t[8 * i + j] = _mm512_shuffle_i32x4(v[8 * i + j], v[8 * i + j + 4], 0x88);
      t[8 * i + j + 4] = _mm512_shuffle_i32x4(v[8 * i + j], v[8 * i + j + 4], 0xDD);
    }
  for (int j = 0; j < 8; ++j) {
    v[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
    v[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xDD);
  }
}

// pack_k_block for 16 keys in consecutive slots from ``first`` (a cold prefill's, mostly), head dim a multiple
// of 32: 16 rows of the pool transposed 16 pairs at a time, where the gathers took ~19 cycles per 16 lanes.
inline void pack_k_block_consecutive(const uint16_t* first, int64_t dim, uint32_t* out) {
  const uint32_t* rows = reinterpret_cast<const uint32_t*>(first);
  const int64_t pairs = dim / 2;
  for (int64_t p0 = 0; p0 < pairs; p0 += 16) {
    __m512i v[16];
    for (int k = 0; k < 16; ++k) v[k] = _mm512_loadu_si512(rows + k * pairs + p0);
    transpose16(v);
    for (int p = 0; p < 16; ++p) _mm512_store_si512(out + (p0 + p) * kKeyBlock, v[p]);
  }
}

inline bool consecutive(const int64_t* slots) {
  for (int i = 1; i < kKeyBlock; ++i)
    if (slots[i] != slots[0] + i) return false;
  return true;
}

// Two keys' V rows (nullptr: zeros) -> [D][2] bf16, interleaved 16 dims at a time.
inline void pack_v_pair(const uint16_t* a, const uint16_t* b, int64_t dim, uint32_t* out) {
  alignas(64) static const uint16_t kInterleave[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                       8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i perm = _mm512_load_si512(kInterleave);
  for (int64_t d = 0; d < dim; d += 16) {
    const __m256i lo = a ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + d)) : _mm256_setzero_si256();
    const __m256i hi = b ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + d)) : _mm256_setzero_si256();
    const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    _mm512_store_si512(out + d, _mm512_permutexvar_epi16(perm, both));
  }
}

// 16 int8 codes times their row's scale, rounded to bfloat16 (its bits in each 32-bit lane's low half).
inline __m512i dequant16_bf16(const int8_t* codes, float scale) {
  const __m512 x = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes))));
  return bf16_bits16(_mm512_mul_ps(x, _mm512_set1_ps(scale)));
}

// pack_tile for an 8-bit pool: each key's codes times its scale, rounded to bfloat16 (as torch rounds), into the
// same pair layouts; a key is packed the same wherever its tile starts, so the bits stay the chunking's.
inline void pack_tile_int8(const Layout& L, const Shape& s, const int8_t* k, const int8_t* v, const int64_t* slots,
                           int64_t b, int64_t h, int64_t key0, uint32_t* kp, uint32_t* vp) {
  const int64_t dim = s.dim, ctx_len = L.ctx_len(b), first = L.first_seen[b];
  const int64_t offset = (h * L.packed_len() + L.packed_starts[b] + key0 - L.packed_from[b]) * dim / 2;
  const int64_t* ctx = slots + L.ctx_starts[b];
  const int8_t *k_head = k + h * s.num_slots * dim, *v_head = v + h * s.num_slots * dim;
  const uint16_t *ks = s.k_scale + h * s.num_slots, *vs = s.v_scale + h * s.num_slots;
  alignas(64) uint16_t rows[kKeyBlock * 512];  // 16 keys dequantized (zeros where not live), then packed as bf16's
  const auto dequant_row = [&](const int8_t* codes, float scale, uint16_t* dst) {
    for (int64_t d = 0; d < dim; d += 16)
      _mm256_store_si256(reinterpret_cast<__m256i*>(dst + d), _mm512_cvtepi32_epi16(dequant16_bf16(codes + d, scale)));
  };
  alignas(64) static const int64_t kBlockSlots[kKeyBlock] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  for (int64_t j = key0; j < key0 + kKeyTile; j += kKeyBlock) {
    const int64_t count = std::clamp<int64_t>(ctx_len - j, 0, kKeyBlock);
    const int64_t skip = std::clamp<int64_t>(first - j, 0, count);
    for (int64_t i = 0; i < kKeyBlock; ++i) {
      if (i >= skip && i < count)
        dequant_row(k_head + ctx[j + i] * dim, bf16_to_float(ks[ctx[j + i]]), rows + i * dim);
      else
        std::memset(rows + i * dim, 0, dim * sizeof(uint16_t));
    }
    uint32_t* block = kp + offset + (j - key0) * dim / 2;
    if (dim % 32 == 0)
      pack_k_block_consecutive(rows, dim, block);
    else
      pack_k_block(rows, kBlockSlots, 0, kKeyBlock, dim, block);
  }
  uint16_t* row = rows;
  alignas(64) uint16_t other[512];
  for (int64_t j = key0; j < key0 + kKeyTile; j += 2) {  // V: pairs of keys, as pack_v_pair
    const uint16_t *a = nullptr, *c = nullptr;
    if (j + 1 >= first && j + 1 < ctx_len) {
      dequant_row(v_head + ctx[j + 1] * dim, bf16_to_float(vs[ctx[j + 1]]), other);
      c = other;
    }
    if (j >= first && j < ctx_len) {
      dequant_row(v_head + ctx[j] * dim, bf16_to_float(vs[ctx[j]]), row);
      a = row;
    }
    pack_v_pair(a, c, dim, vp + offset + (j - key0) * dim / 2);
  }
}

// One key tile (kKeyTile keys from ``key0`` of request b, head h) into the packed K and V buffers.
inline void pack_tile(const Layout& L, const Shape& s, const uint16_t* k, const uint16_t* v, const int64_t* slots,
                      int64_t b, int64_t h, int64_t key0, uint32_t* kp, uint32_t* vp) {
  if (s.k_scale != nullptr)
    return pack_tile_int8(L, s, reinterpret_cast<const int8_t*>(k), reinterpret_cast<const int8_t*>(v), slots, b, h,
                          key0, kp, vp);
  const int64_t dim = s.dim, ctx_len = L.ctx_len(b), first = L.first_seen[b];
  const int64_t offset = (h * L.packed_len() + L.packed_starts[b] + key0 - L.packed_from[b]) * dim / 2;
  const int64_t* ctx = slots + L.ctx_starts[b];
  const uint16_t *k_head = k + h * s.num_slots * dim, *v_head = v + h * s.num_slots * dim;
  for (int64_t j = key0; j < key0 + kKeyTile; j += kKeyBlock) {
    const int64_t count = std::clamp<int64_t>(ctx_len - j, 0, kKeyBlock);
    const int64_t skip = std::clamp<int64_t>(first - j, 0, count);
    uint32_t* block = kp + offset + (j - key0) * dim / 2;
    if (count == kKeyBlock && skip == 0 && dim % 32 == 0 && consecutive(ctx + j))
      pack_k_block_consecutive(k_head + ctx[j] * dim, dim, block);
    else
      pack_k_block(k_head, ctx + j, skip, count, dim, block);
  }
  const auto v_row = [&](int64_t j) { return j >= first && j < ctx_len ? v_head + ctx[j] * dim : nullptr; };
  for (int64_t j = key0; j < key0 + kKeyTile; j += 2) {
    const uint16_t *a = v_row(j), *c = v_row(j + 1);
    pack_v_pair(a, c, dim, vp + offset + (j - key0) * dim / 2);
  }
}

// op over v[0 .. N) as a balanced tree: log2(N) dependent steps where a chain takes N - 1.
template <int N, typename Op>
inline __m512 tree(const __m512* v, Op op) {
  if constexpr (N == 1)
    return v[0];
  else
    return op(tree<N / 2>(v, op), tree<N - N / 2>(v + N / 2, op));
}

// S[r][0 .. 16 NB) = q_r . k for 16 NB keys (NB packed blocks) and kRowBlock rows (q as bf16 pairs, ``pairs``
// a row). With kMax, also each row's 16-lane maximum of its NB vectors into maxes[r * 32] (the softmax's
// first pass of a full tile then reads two vectors a row instead of eight; max is exact, so the same bits).
// kPairs > 0: pairs is that constant and the loop is unrolled whole (head dim 64: 5% faster a layer, the
// accumulators stored straight from registers instead of through the stack).
template <int NB, bool kMax, int kPairs>
inline void qk_rows(const uint32_t* q, int64_t pairs, const uint32_t* kp, float* scores, float* maxes) {
  __m512 acc[kRowBlock][NB];
  for (auto& row : acc)
    for (auto& a : row) a = _mm512_setzero_ps();
  const auto step = [&](int64_t p) {
    __m512bh kv[NB];
    for (int i = 0; i < NB; ++i) kv[i] = as_bh(_mm512_load_si512(kp + (i * pairs + p) * kKeyBlock));
    for (int r = 0; r < kRowBlock; ++r) {
      const __m512bh qb = as_bh(_mm512_set1_epi32(static_cast<int32_t>(q[r * pairs + p])));
      for (int i = 0; i < NB; ++i) acc[r][i] = _mm512_dpbf16_ps(acc[r][i], qb, kv[i]);
    }
  };
  if constexpr (kPairs > 0) {
#pragma GCC unroll 64
    for (int64_t p = 0; p < kPairs; ++p) step(p);
  } else {
    for (int64_t p = 0; p < pairs; ++p) step(p);
  }
  for (int r = 0; r < kRowBlock; ++r)
    for (int i = 0; i < NB; ++i) _mm512_store_ps(scores + r * kKeyTile + i * kKeyBlock, acc[r][i]);
  if constexpr (kMax)
    for (int r = 0; r < kRowBlock; ++r)
      _mm512_store_ps(maxes + r * 2 * kKeyBlock, tree<NB>(acc[r], [](__m512 a, __m512 b) { return _mm512_max_ps(a, b); }));
}

// Scores of keys [0, live) of a tile (rounded up to a block of 16) for kRowBlock rows: 64 keys a pass, the
// diagonal tile's last pass only over the blocks some row sees. Scores past them are left as they were: masked.
template <int kPairs>
inline void qk_tile(const uint32_t* q, int64_t pairs, const uint32_t* kt, int64_t live, float* scores, float* maxes) {
  if (live == kKeyTile) {  // a full tile: its maxima too
    qk_rows<4, true, kPairs>(q, pairs, kt, scores, maxes);
    qk_rows<4, true, kPairs>(q, pairs, kt + 4 * kKeyBlock * pairs, scores + 4 * kKeyBlock, maxes + kKeyBlock);
    return;
  }
  int64_t j = 0;
  for (; j + 4 * kKeyBlock <= live; j += 4 * kKeyBlock) qk_rows<4, false, kPairs>(q, pairs, kt + j * pairs, scores + j, nullptr);
  switch ((live - j + kKeyBlock - 1) / kKeyBlock) {
    case 4: return qk_rows<4, false, kPairs>(q, pairs, kt + j * pairs, scores + j, nullptr);
    case 3: return qk_rows<3, false, kPairs>(q, pairs, kt + j * pairs, scores + j, nullptr);
    case 2: return qk_rows<2, false, kPairs>(q, pairs, kt + j * pairs, scores + j, nullptr);
    case 1: return qk_rows<1, false, kPairs>(q, pairs, kt + j * pairs, scores + j, nullptr);
    default: return;
  }
}

// O[r][d0 .. d0 + 16 NV) = alpha_r O[r] + P_r V over the first ``num_pairs`` key pairs of a tile (P as
// bf16 key pairs), kRowBlock rows.
template <int NV>
inline void pv_rows(const uint32_t* p, const uint32_t* vp, int64_t num_pairs, int64_t dim, int64_t d0,
                    const float* alpha, float* o) {
  __m512 acc[kRowBlock][NV];
  for (int r = 0; r < kRowBlock; ++r)
    for (int i = 0; i < NV; ++i)
      acc[r][i] = _mm512_mul_ps(_mm512_load_ps(o + r * dim + d0 + 16 * i), _mm512_set1_ps(alpha[r]));
  for (int64_t j = 0; j < num_pairs; ++j) {
    __m512bh vv[NV];
    for (int i = 0; i < NV; ++i) vv[i] = as_bh(_mm512_load_si512(vp + j * dim + d0 + 16 * i));
    for (int r = 0; r < kRowBlock; ++r) {
      const __m512bh pb = as_bh(_mm512_set1_epi32(static_cast<int32_t>(p[r * kKeyTile / 2 + j])));
      for (int i = 0; i < NV; ++i) acc[r][i] = _mm512_dpbf16_ps(acc[r][i], pb, vv[i]);
    }
  }
  for (int r = 0; r < kRowBlock; ++r)
    for (int i = 0; i < NV; ++i) _mm512_store_ps(o + r * dim + d0 + 16 * i, acc[r][i]);
}

// The soft cap on a row block's scores of keys [0, live) of a tile: s * mul (the scale over the cap), then
// cap * tanh. The rest of each row is masked.
inline void cap_scores(float* s, int64_t live, float mul, float cap) {
  for (int64_t r = 0; r < kRowBlock; ++r) radixserve::avx512::soft_cap16(s + r * kKeyTile, live, mul, cap);
}

// Scratch of one thread, reused across its items.
struct Scratch {
  std::vector<uint32_t> q, p;            // [rows][D/2], [rows][kKeyTile/2] bf16 pairs
  std::vector<float> s, o, m, l, alpha;  // [rows][kKeyTile], [rows][D], [rows] x 3
  std::vector<float> maxes;              // [rows][2][16]: a full tile's maxima from qk_rows
  std::vector<int64_t> start, limit;  // [rows]: the row sees keys [start, limit)
  explicit Scratch(int64_t rows, int64_t dim)
      : q(rows * dim / 2 + 16), p(rows * kKeyTile / 2 + 16), s(rows * kKeyTile + 16), o(rows * dim + 16),
        m(rows), l(rows), alpha(rows), maxes(rows * 2 * kKeyBlock + 16), start(rows), limit(rows) {}
};

inline float* aligned(std::vector<float>& v) { return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(v.data()) + 63) & ~uintptr_t{63}); }
inline uint32_t* aligned(std::vector<uint32_t>& v) {
  return reinterpret_cast<uint32_t*>((reinterpret_cast<uintptr_t>(v.data()) + 63) & ~uintptr_t{63});
}

// Online softmax over one key tile for rows [0, rows): scores -> P (bf16 pairs), m, l, alpha.
// m is kept in raw score units; c = scale * log2(e) turns a score into base-2 softmax units.
// Rows go 16 at a time, in two passes: each row's maximum (the diagonal tile's masked keys left out), then
// its exps. The 16 rows' horizontal maxima and sums are one transposed reduction each (the sums add as
// _mm512_reduce_add_ps adds: simd::reduce16), and their alphas and l one vector: a row at a time, those
// reductions, the alpha's exp and l's update were a third of the softmax's instructions and its longest
// dependency chains. Every row's arithmetic is its own, so its bits do not depend on the other rows.
template <bool masked>
void softmax_tile(const float* s, const float* maxes, uint32_t* p, int64_t rows, int64_t key0, Scratch& w, float c) {
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity()), scale = _mm512_set1_ps(c);
  const auto visible = [&](int64_t r, int i) {  // the keys of vector i that row r sees
    const int64_t seen = std::clamp<int64_t>(w.limit[r] - key0 - i * kKeyBlock, 0, kKeyBlock);
    const int64_t before = std::clamp<int64_t>(w.start[r] - key0 - i * kKeyBlock, 0, kKeyBlock);
    return static_cast<__mmask16>(((1u << seen) - 1u) & ~((1u << before) - 1u));
  };
  for (int64_t r0 = 0; r0 < rows; r0 += 16) {
    const int64_t n = std::min<int64_t>(16, rows - r0);
    const __mmask16 lanes = static_cast<__mmask16>((1u << n) - 1u);
    __m512 v[16];
    for (int64_t j = 0; j < 16; ++j) {
      if (j >= n) {
        v[j] = neg_inf;
        continue;
      }
      if constexpr (masked) {
        __m512 x[kTileVectors];
        for (int i = 0; i < kTileVectors; ++i)
          x[i] = _mm512_mask_mov_ps(neg_inf, visible(r0 + j, i), _mm512_load_ps(s + (r0 + j) * kKeyTile + i * kKeyBlock));
        v[j] = tree<kTileVectors>(x, [](__m512 a, __m512 b) { return _mm512_max_ps(a, b); });
      } else {  // all keys seen: qk_rows' maxima of the two halves
        const float* mx = maxes + (r0 + j) * 2 * kKeyBlock;
        v[j] = _mm512_max_ps(_mm512_load_ps(mx), _mm512_load_ps(mx + kKeyBlock));
      }
    }
    const __m512 m_old = _mm512_mask_loadu_ps(neg_inf, lanes, w.m.data() + r0);
    const __m512 m_new = _mm512_max_ps(m_old, simd::reduce16_max(v));
    alignas(64) float m_row[16];
    _mm512_store_ps(m_row, m_new);
    for (int64_t j = 0; j < 16; ++j) {
      const int64_t r = r0 + j;
      v[j] = _mm512_setzero_ps();
      if (j >= n) continue;
      if (m_row[j] == -std::numeric_limits<float>::infinity()) {  // nothing seen yet: P 0, O and l stay 0
        std::memset(p + r * kKeyTile / 2, 0, kKeyTile * 2);
        continue;
      }
      const __m512 shift = _mm512_set1_ps(-m_row[j] * c);
      __m512 e[kTileVectors];
      for (int i = 0; i < kTileVectors; ++i) {
        e[i] = exp2_finite(_mm512_fmadd_ps(_mm512_load_ps(s + r * kKeyTile + i * kKeyBlock), scale, shift));
        if constexpr (masked) e[i] = _mm512_maskz_mov_ps(visible(r, i), e[i]);
      }
      v[j] = tree<kTileVectors>(e, [](__m512 a, __m512 b) { return _mm512_add_ps(a, b); });
      for (int i = 0; i < kTileVectors; i += 2)
        _mm512_store_si512(p + r * kKeyTile / 2 + i * 8, (__m512i)_mm512_cvtne2ps_pbh(e[i + 1], e[i]));
    }
    // exp2(0) is exactly 1, so a standing maximum (or none yet) keeps alpha 1 and l as it was
    const __m512 alpha = _mm512_mask_mov_ps(exp2_neg(_mm512_mul_ps(_mm512_sub_ps(m_old, m_new), scale)),
                                            _mm512_cmp_ps_mask(m_old, m_new, _CMP_EQ_OQ), _mm512_set1_ps(1.f));
    const __m512 l = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(lanes, w.l.data() + r0), alpha, simd::reduce16(v));
    _mm512_mask_storeu_ps(w.l.data() + r0, lanes, l);
    _mm512_mask_storeu_ps(w.m.data() + r0, lanes, m_new);
    _mm512_mask_storeu_ps(w.alpha.data() + r0, lanes, alpha);
  }
}

template <int NV, int kPairs>
void run_item(const Item& it, const Layout& L, const Shape& s, const uint16_t* q, const uint32_t* kp,
              const uint32_t* vp, uint16_t* out, Scratch& w) {
  const int64_t dim = s.dim, pairs = dim / 2, real_rows = (it.t1 - it.t0) * s.group;
  const int64_t rows = (real_rows + kRowBlock - 1) / kRowBlock * kRowBlock;
  const int64_t prefix_len = L.ctx_len(it.b) - L.extend_len(it.b), q0 = L.q_starts[it.b];
  uint32_t *qt = aligned(w.q), *pt = aligned(w.p);
  float *st = aligned(w.s), *ot = aligned(w.o), *mt = aligned(w.maxes);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = it.t0 + std::min(r, real_rows - 1) / s.group, h = it.hkv * s.group + r % s.group;
    if (r < real_rows)
      std::memcpy(qt + r * pairs, q + (q0 + t) * s.q_token_stride + h * dim, dim * 2);
    else
      std::memset(qt + r * pairs, 0, dim * 2);
    w.limit[r] = prefix_len + t + 1;
    w.start[r] = first_visible(w.limit[r], s.window);
    w.m[r] = -std::numeric_limits<float>::infinity();
    w.l[r] = 0.f;
  }
  std::memset(ot, 0, rows * dim * sizeof(float));
  // The packed keys start at the request's first packed key, not at key 0.
  const int64_t head_pairs = (it.hkv * L.packed_len() + L.packed_starts[it.b] - L.packed_from[it.b]) * pairs;
  const bool capped = s.softcap > 0.f;  // then the scores are scaled (and capped) before the softmax
  const float c = (capped ? 1.f : s.scale) * 1.44269504f;  // softmax in base 2
  // Rows see keys below their limits, from first_limit (the item's first token) up: tiles past it are masked;
  // with a window, from their starts, the last row's the latest: tiles before it are masked.
  const int64_t first_limit = prefix_len + it.t0 + 1, last_start = w.start[rows - 1];
  // A row block sees keys below its last row's limit: in the diagonal tiles its scores and P V stop there
  // (past it every row's P is 0, and alpha is 1 where a row sees nothing of the tile); none of a tile before
  // its first row's start.
  const auto block_live = [&](int64_t r, int64_t key0) {
    return w.start[r] < key0 + kKeyTile ? std::min(kKeyTile, w.limit[r + kRowBlock - 1] - key0) : 0;
  };
  for (int64_t tile = it.tile0; tile < it.num_tiles; ++tile) {
    const int64_t key0 = tile * kKeyTile;
    const uint32_t* kt = kp + (head_pairs + key0 * pairs);
    for (int64_t r = 0; r < rows; r += kRowBlock)
      if (const int64_t live = block_live(r, key0); live > 0) {
        qk_tile<kPairs>(qt + r * pairs, pairs, kt, live, st + r * kKeyTile, mt + r * 2 * kKeyBlock);
        if (capped) cap_scores(st + r * kKeyTile, live, s.scale / s.softcap, s.softcap);
      }
    if (capped || key0 + kKeyTile > first_limit || key0 < last_start)
      softmax_tile<true>(st, mt, pt, rows, key0, w, c);
    else
      softmax_tile<false>(st, mt, pt, rows, key0, w, c);
    const uint32_t* vt = vp + (head_pairs + key0 * pairs);
    for (int64_t r = 0; r < rows; r += kRowBlock)
      if (const int64_t live = block_live(r, key0); live > 0)
        for (int64_t d0 = 0; d0 < dim; d0 += 16 * NV)
          pv_rows<NV>(pt + r * kKeyTile / 2, vt, (live + 1) / 2, dim, d0, w.alpha.data() + r, ot + r * dim);
  }
  for (int64_t r = 0; r < real_rows; ++r) {
    const int64_t t = it.t0 + r / s.group, h = it.hkv * s.group + r % s.group;
    const __m512 inv = _mm512_set1_ps(1.f / w.l[r]);
    uint16_t* dst = out + ((q0 + t) * s.num_heads + h) * dim;
    for (int64_t d = 0; d < dim; d += 16) {
      const __m256bh y = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(ot + r * dim + d), inv));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d), (__m256i)y);
    }
  }
}

// The work items, costliest first (they start first, so the threads finish together).
inline std::vector<Item> plan_items(const Layout& L, const Shape& s) {
  std::vector<Item> items;
  for (int64_t b = 0; b < L.batch; ++b) {
    const int64_t extend_len = L.extend_len(b), prefix_len = L.ctx_len(b) - extend_len;
    for (int64_t t0 = 0; t0 < extend_len; t0 += L.tokens_per_tile) {
      const int64_t t1 = std::min(extend_len, t0 + L.tokens_per_tile);
      const int64_t num_tiles = (prefix_len + t1 + kKeyTile - 1) / kKeyTile;  // the last row sees prefix + t1 keys
      const int64_t tile0 = first_visible(prefix_len + t0 + 1, s.window) / kKeyTile;  // the first row's first
      for (int64_t h = 0; h < s.num_kv_heads; ++h) items.push_back({b, h, t0, t1, tile0, num_tiles});
    }
  }
  const auto cost = [](const Item& x) { return x.num_tiles - x.tile0; };
  std::stable_sort(items.begin(), items.end(), [&](const Item& x, const Item& y) { return cost(x) > cost(y); });
  return items;
}

// The whole batch; parallel_for(n, fn) runs fn(begin, end) over [0, n) on the caller's threads.
template <typename ParallelFor>
void extend_attention(const uint16_t* q, const uint16_t* k, const uint16_t* v, const int64_t* slots,
                      const int64_t* q_starts, const int64_t* ctx_starts, int64_t batch, const Shape& s,
                      uint16_t* out, ParallelFor parallel_for) {
  const Layout L(q_starts, ctx_starts, batch, s.group, s.window);
  const int64_t packed_pairs = s.num_kv_heads * L.packed_len() * s.dim / 2;
  // Not zeroed: packing writes every element, padding included (a zeroed vector cost a memset).
  const std::unique_ptr<uint32_t[]> packed(new uint32_t[2 * packed_pairs + 16]);
  uint32_t* kp = reinterpret_cast<uint32_t*>((reinterpret_cast<uintptr_t>(packed.get()) + 63) & ~uintptr_t{63});
  uint32_t* vp = kp + packed_pairs;
  std::vector<int64_t> tile_starts(batch + 1, 0);  // pack items: (request, head, key tile)
  for (int64_t b = 0; b < batch; ++b) tile_starts[b + 1] = tile_starts[b] + L.packed_starts[b + 1] / kKeyTile - L.packed_starts[b] / kKeyTile;
  const int64_t num_pack = tile_starts[batch] * s.num_kv_heads;
  parallel_for(num_pack, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t h = i % s.num_kv_heads, tile = i / s.num_kv_heads;
      const int64_t b = std::upper_bound(tile_starts.begin(), tile_starts.end(), tile) - tile_starts.begin() - 1;
      pack_tile(L, s, k, v, slots, b, h, L.packed_from[b] + (tile - tile_starts[b]) * kKeyTile, kp, vp);
    }
  });
  const std::vector<Item> items = plan_items(L, s);
  const int64_t n = static_cast<int64_t>(items.size());
  const int64_t max_rows = (L.tokens_per_tile * s.group + kRowBlock - 1) / kRowBlock * kRowBlock;
  std::atomic<int64_t> next{0};
  parallel_for(n, [&](int64_t, int64_t) {
    Scratch w(max_rows, s.dim);
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) {
      if (s.dim == 64)
        run_item<4, 32>(items[i], L, s, q, kp, vp, out, w);
      else if (s.dim % 64 == 0)
        run_item<4, 0>(items[i], L, s, q, kp, vp, out, w);
      else if (s.dim % 32 == 0)
        run_item<2, 0>(items[i], L, s, q, kp, vp, out, w);
      else
        run_item<1, 0>(items[i], L, s, q, kp, vp, out, w);
    }
  });
}

#endif  // RADIXSERVE_EXTEND_BF16

}  // namespace radixserve::extend
