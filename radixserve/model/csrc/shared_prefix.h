// Shared-prefix (cascade) attention: the requests whose contexts begin with the same slots (a radix
// hit hands them the same KV slots) read that prefix once per step, not once per request.
//
// A group's query rows are every (member token, query head of one K/V head): 16 decoding
// requests x a GQA group of 3 = 48 rows. One work item takes a block of those rows against a
// span of the prefix's keys (<= kSharedKeysPerItem, so two threads get work even at batch 2)
// and returns each row's softmax partial (max, sum, unnormalised p V), which the driver merges
// with the row's own suffix by log-sum-exp. Every member token sees the whole prefix (the
// planner keeps the prefix within each member's cached part, and in a windowed layer keeps a group
// only while every member's context fits the window), so there is no mask here.
//
// The arithmetic is a small blocked GEMM with the rows as the vector lanes, so each K/V element
// is loaded once per item and reused across the rows from a register:
//
//   qt  [D][R/L] vecf    q transposed (rows padded to L, the lanes of a vector), scaled
//   st  [keys][R/L]      scores^T = K qt, then p = exp(st - max)   (max, sum over keys per lane)
//   acct[D][R/L]         (p^T V)^T, accumulated tile by tile
//
// K/V rows are gathered (and converted to float) a tile at a time into a small buffer first.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "attention_common.h"

namespace radixserve {

// One vector register of floats, which GCC and Clang lower to the target's registers: a zmm (16
// lanes) with AVX512, else a ymm (8: AVX2). aligned(4): loads from plain float buffers, no
// alignment promise needed.
// kStep: keys (scores) or head dims (values) a step, kStep x kRowVecs accumulators (of 32
// registers with AVX512, 16 with AVX2).
#if defined(__AVX512F__)
typedef float vecf __attribute__((vector_size(64), aligned(4)));
constexpr int64_t kLanes = 16, kStep = 8;
#else
typedef float vecf __attribute__((vector_size(32), aligned(4)));
constexpr int64_t kLanes = 8, kStep = 4;
#endif
constexpr int64_t kSharedTile = 64, kSharedKeysPerItem = 512, kSharedMaxRows = 48, kRowVecs = 3;

struct SharedItem {
  int64_t group, hkv, tok0, tok1, key0, key1;  // tokens index the group's token list; keys its prefix
};

// tile[j] = float(head[slots[j]]) for j < n, zero rows up to n_pad; prefetching rows ahead. An 8-bit pool's
// rows are widened and multiplied by their scales (``scale``: the head's, bfloat16 bits; nullptr for a float
// pool) on the way into the tile.
template <typename kv_t>
void gather_tile(const kv_t* head, const uint16_t* scale, const int64_t* slots, int64_t n, int64_t n_pad,
                 int64_t remaining, int64_t dim, float* tile) {
  for (int64_t j = 0; j < n; ++j) {
    prefetch_row(head, slots, j, remaining, dim);
    const kv_t* row = head + slots[j] * dim;
    float* dst = tile + j * dim;
    const float f = scale != nullptr ? bf16_to_float(scale[slots[j]]) : 1.f;
#pragma omp simd
    for (int64_t i = 0; i < dim; ++i) dst[i] = load(row, i) * f;
  }
  std::fill(tile + n * dim, tile + n_pad * dim, 0.f);
}

// st[j][v0 + v] = sum_i kb[j][i] * qt[i][v0 + v], kStep keys at a time (kStep x NV accumulators).
template <int NV>
void shared_scores(const float* kb, int64_t n_pad, const vecf* qt, int64_t nvt, int64_t v0, int64_t dim, vecf* st) {
  for (int64_t j = 0; j < n_pad; j += kStep) {
    vecf acc[kStep][NV] = {};
    for (int64_t i = 0; i < dim; ++i) {
      vecf qv[NV];
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) qv[v] = qt[i * nvt + v0 + v];
#pragma GCC unroll 8
      for (int jj = 0; jj < kStep; ++jj) {
        const float b = kb[(j + jj) * dim + i];
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) acc[jj][v] += b * qv[v];
      }
    }
    for (int jj = 0; jj < kStep; ++jj)
      for (int v = 0; v < NV; ++v) st[(j + jj) * nvt + v0 + v] = acc[jj][v];
  }
}

// acct[d][v0 + v] += sum_j p[j][v0 + v] * vb[j][d] over the tile's n keys, kStep dims at a time.
template <int NV>
void shared_values(const vecf* p, int64_t n, const float* vb, int64_t dim, int64_t nvt, int64_t v0, vecf* acct) {
  for (int64_t d = 0; d < dim; d += kStep) {
    vecf acc[kStep][NV];
    for (int dd = 0; dd < kStep; ++dd)
      for (int v = 0; v < NV; ++v) acc[dd][v] = acct[(d + dd) * nvt + v0 + v];
    for (int64_t j = 0; j < n; ++j) {
      vecf pv[NV];
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) pv[v] = p[j * nvt + v0 + v];
#pragma GCC unroll 8
      for (int dd = 0; dd < kStep; ++dd) {
        const float b = vb[j * dim + d + dd];
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) acc[dd][v] += b * pv[v];
      }
    }
    for (int dd = 0; dd < kStep; ++dd)
      for (int v = 0; v < NV; ++v) acct[(d + dd) * nvt + v0 + v] = acc[dd][v];
  }
}

// Row blocks of up to kRowVecs vectors.
template <typename Fn>
void for_row_blocks(int64_t nvt, Fn fn) {
  for (int64_t v0 = 0; v0 < nvt; v0 += kRowVecs) {
    const int64_t nv = std::min(kRowVecs, nvt - v0);
    if (nv == 3)
      fn(v0, std::integral_constant<int, 3>{});
    else if (nv == 2)
      fn(v0, std::integral_constant<int, 2>{});
    else
      fn(v0, std::integral_constant<int, 1>{});
  }
}

// p = exp(st - max) in place over the first n key rows; per lane: row_max, row_sum.
inline void shared_softmax(float* st, int64_t n, int64_t lanes, float* row_max, float* row_sum) {
#if defined(__AVX512F__)
  for (int64_t r = 0; r < lanes; r += 16) {  // lanes: a multiple of kLanes = 16
    __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity()), sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; ++j) m = _mm512_max_ps(m, _mm512_loadu_ps(st + j * lanes + r));
    for (int64_t j = 0; j < n; ++j) {
      const __m512 p = avx512::exp16(_mm512_sub_ps(_mm512_loadu_ps(st + j * lanes + r), m));
      _mm512_storeu_ps(st + j * lanes + r, p);
      sum = _mm512_add_ps(sum, p);
    }
    _mm512_storeu_ps(row_max + r, m);
    _mm512_storeu_ps(row_sum + r, sum);
  }
#else
  std::fill(row_max, row_max + lanes, -std::numeric_limits<float>::infinity());
  std::fill(row_sum, row_sum + lanes, 0.f);
  for (int64_t j = 0; j < n; ++j)
#pragma omp simd
    for (int64_t r = 0; r < lanes; ++r) row_max[r] = std::max(row_max[r], st[j * lanes + r]);
  for (int64_t j = 0; j < n; ++j)
#pragma omp simd
    for (int64_t r = 0; r < lanes; ++r) {
      st[j * lanes + r] = fast_exp(st[j * lanes + r] - row_max[r]);
      row_sum[r] += st[j * lanes + r];
    }
#endif
}

// One item: rows (toks[tok0 .. tok1) x the K/V head's query heads) against prefix keys [key0, key1).
// Writes acc [rows][D], row_max and row_sum [rows]; row r is token toks[tok0 + r / group],
// head hkv * group + r % group. Needs D % kStep == 0 (the planner checks).
template <typename kv_t, typename q_t>
void run_shared_item(const SharedItem& w, const Shape& s, const q_t* q, const int64_t* toks, const kv_t* k,
                     const kv_t* v, const int64_t* prefix_slots, float* acc, float* row_max, float* row_sum) {
  const int64_t dim = s.dim, rows = (w.tok1 - w.tok0) * s.group, nvt = (rows + kLanes - 1) / kLanes;
  const int64_t lanes = nvt * kLanes, num_keys = w.key1 - w.key0;
  std::vector<float> qt(dim * lanes, 0.f), st(((num_keys + kStep - 1) / kStep * kStep) * lanes), acct(dim * lanes, 0.f);
  std::vector<float> tile(kSharedTile * dim), lane_max(lanes), lane_sum(lanes);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = toks[w.tok0 + r / s.group], h = w.hkv * s.group + r % s.group;
    for (int64_t i = 0; i < dim; ++i) qt[i * lanes + r] = load(q, (t * s.num_heads + h) * dim + i) * s.scale;
  }
  const int64_t head = w.hkv * s.num_slots * dim;
  const auto head_scale = [&](const uint16_t* scale) { return scale ? scale + w.hkv * s.num_slots : nullptr; };
  const int64_t* slots = prefix_slots + w.key0;
  auto* qv = reinterpret_cast<const vecf*>(qt.data());
  for (int64_t j0 = 0; j0 < num_keys; j0 += kSharedTile) {
    const int64_t n = std::min(kSharedTile, num_keys - j0), n_pad = (n + kStep - 1) / kStep * kStep;
    gather_tile(k + head, head_scale(s.k_scale), slots + j0, n, n_pad, num_keys - j0, dim, tile.data());
    auto* out = reinterpret_cast<vecf*>(st.data() + j0 * lanes);
    for_row_blocks(nvt, [&](int64_t v0, auto nv) { shared_scores<nv()>(tile.data(), n_pad, qv, nvt, v0, dim, out); });
  }
  if (s.softcap > 0.f) {
#if defined(__AVX512F__)
    avx512::soft_cap16(st.data(), num_keys * lanes, 1.f / s.softcap, s.softcap);
#else
    soft_cap(st.data(), num_keys * lanes, s.softcap);
#endif
  }
  shared_softmax(st.data(), num_keys, lanes, lane_max.data(), lane_sum.data());
  auto* av = reinterpret_cast<vecf*>(acct.data());
  for (int64_t j0 = 0; j0 < num_keys; j0 += kSharedTile) {
    const int64_t n = std::min(kSharedTile, num_keys - j0);
    gather_tile(v + head, head_scale(s.v_scale), slots + j0, n, n, num_keys - j0, dim, tile.data());
    auto* p = reinterpret_cast<const vecf*>(st.data() + j0 * lanes);
    for_row_blocks(nvt, [&](int64_t v0, auto nv) { shared_values<nv()>(p, n, tile.data(), dim, nvt, v0, av); });
  }
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < dim; ++i) acc[r * dim + i] = acct[i * lanes + r];
    row_max[r] = lane_max[r];
    row_sum[r] = lane_sum[r];
  }
}

}  // namespace radixserve
