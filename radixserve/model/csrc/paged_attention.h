// Paged attention over the KV pool, read in place: no per-layer copy of a request's context.
// Plain C++ (no torch headers) so it can be compiled and timed on its own; bound in
// paged_attention.cpp.
//
// Request b owns query rows q_starts[b] .. q_starts[b+1] (its new tokens) and context slots
// slots[ctx_starts[b] .. ctx_starts[b+1]] (cached prefix first, new tokens last). New token t
// (0-based) sees context 0 .. prefix_len + t, where prefix_len = ctx_len - extend_len; so one
// kernel serves decode, extend on a cached prefix and mixed batches.
//
//   q      [T, H, D]     out [T, H, D] (both float32 here; the binding converts)
//   k, v   [Hkv, N, D]   one layer of the pool (heads first: a slot's head row is contiguous)
//
// Work items are (request, K/V head, tile of query tokens, split of the context). The query
// heads sharing a K/V head are rows of one tile, so each K/V row is read once per tile; a long
// context is split when there are fewer requests than threads (flash-decoding), and the splits'
// softmax partials are merged at the end. Two passes per item, each a flat vectorisable loop:
// scores = q K^T over the item's keys, then p = softmax and acc = p V.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace radixserve {

constexpr int64_t kTokensPerTile = 8;

struct WorkItem {
  int64_t b, hkv, t0, t1, key0, key1, split;
};

struct Shape {
  int64_t num_heads, num_kv_heads, dim, num_slots, group;
  float scale;
};

// exp for x <= 0 (softmax after subtracting the max), vectorisable: 2^(x log2 e) split into
// 2^n (exponent bits) times a degree-6 polynomial of the fraction; relative error ~2e-7.
inline float fast_exp(float x) {
  const float t = std::max(x, -87.f) * 1.44269504f;
  const float n = std::floor(t), f = t - n;
  float p = 1.5403530e-4f;
  p = p * f + 1.3333558e-3f;
  p = p * f + 9.6181291e-3f;
  p = p * f + 5.5504109e-2f;
  p = p * f + 2.4022651e-1f;
  p = p * f + 6.9314718e-1f;
  p = p * f + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// Slots are scattered over the pool: ask for the rows a few keys ahead so their cache misses
// overlap (a row of head_dim 64 in float32 spans four cache lines).
constexpr int64_t kPrefetchAhead = 8;

template <typename kv_t>
inline void prefetch_row(const kv_t* base, const int64_t* slots, int64_t j, int64_t num_keys, int64_t dim) {
  if (j + kPrefetchAhead >= num_keys) return;
  const char* row = reinterpret_cast<const char*>(base + slots[j + kPrefetchAhead] * dim);
  for (int64_t off = 0; off < dim * static_cast<int64_t>(sizeof(kv_t)); off += 64) __builtin_prefetch(row + off);
}

template <typename kv_t>
inline float load(const kv_t* p, int64_t i) {
  return static_cast<float>(p[i]);
}

// scores[r][j] = q_r . k_j for the tile's rows against keys [key0, key1); DIM > 0 fixes the
// head dim at compile time so the loops unroll and q rows stay in registers.
template <int64_t DIM, typename kv_t>
void scores_pass(const float* q, int64_t rows, const kv_t* k, const int64_t* slots, int64_t num_keys, int64_t dim_rt,
                 int64_t row_stride, float* scores) {
  const int64_t dim = DIM > 0 ? DIM : dim_rt;
  for (int64_t j = 0; j < num_keys; ++j) {
    prefetch_row(k, slots, j, num_keys, dim);
    const kv_t* kj = k + slots[j] * dim;
    float kf[DIM > 0 ? DIM : 256];
    const float* kr;
    if constexpr (std::is_same_v<kv_t, float>) {
      kr = kj;
    } else {
#pragma omp simd
      for (int64_t i = 0; i < dim; ++i) kf[i] = load(kj, i);
      kr = kf;
    }
    for (int64_t r = 0; r < rows; ++r) {
      const float* qr = q + r * dim;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t i = 0; i < dim; ++i) s += qr[i] * kr[i];
      scores[r * row_stride + j] = s;
    }
  }
}

// acc[r] = sum_j p[r][j] v_j over the first seen[r] keys.
template <int64_t DIM, typename kv_t>
void values_pass(const float* p, int64_t rows, const int64_t* seen, const kv_t* v, const int64_t* slots,
                 int64_t num_keys, int64_t dim_rt, int64_t row_stride, float* acc) {
  const int64_t dim = DIM > 0 ? DIM : dim_rt;
  for (int64_t r = 0; r < rows; ++r) std::fill(acc + r * dim, acc + (r + 1) * dim, 0.f);
  for (int64_t j = 0; j < num_keys; ++j) {
    prefetch_row(v, slots, j, num_keys, dim);
    const kv_t* vj = v + slots[j] * dim;
    float vf[DIM > 0 ? DIM : 256];
#pragma omp simd
    for (int64_t i = 0; i < dim; ++i) vf[i] = load(vj, i);
    for (int64_t r = 0; r < rows; ++r) {
      if (j >= seen[r]) continue;
      const float pr = p[r * row_stride + j];
      float* a = acc + r * dim;
#pragma omp simd
      for (int64_t i = 0; i < dim; ++i) a[i] += pr * vf[i];
    }
  }
}

template <int64_t DIM, typename kv_t>
void run_item_dim(const WorkItem& w, const Shape& s, const float* q, const kv_t* k, const kv_t* v,
                  const int64_t* slots, int64_t prefix_len, float* acc, float* row_max, float* row_sum) {
  const int64_t rows = (w.t1 - w.t0) * s.group, dim = s.dim;
  const int64_t last = std::min(w.key1, prefix_len + w.t1);  // no row of the tile sees beyond
  const int64_t num_keys = std::max<int64_t>(0, last - w.key0);
  std::vector<float> qf(rows * dim), scores(rows * std::max<int64_t>(num_keys, 1));
  std::vector<int64_t> seen(rows);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = w.t0 + r / s.group, h = w.hkv * s.group + r % s.group;
    for (int64_t i = 0; i < dim; ++i) qf[r * dim + i] = q[(t * s.num_heads + h) * dim + i] * s.scale;
    seen[r] = std::clamp<int64_t>(prefix_len + t + 1 - w.key0, 0, num_keys);
  }
  const int64_t head = w.hkv * s.num_slots * dim;
  const int64_t* item_slots = slots + w.key0;
  scores_pass<DIM>(qf.data(), rows, k + head, item_slots, num_keys, dim, num_keys, scores.data());
  for (int64_t r = 0; r < rows; ++r) {
    float* sc = scores.data() + r * num_keys;
    float m = -std::numeric_limits<float>::infinity(), sum = 0.f;
    for (int64_t j = 0; j < seen[r]; ++j) m = std::max(m, sc[j]);
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < seen[r]; ++j) {
      sc[j] = fast_exp(sc[j] - m);
      sum += sc[j];
    }
    row_max[r] = m;
    row_sum[r] = sum;
  }
  values_pass<DIM>(scores.data(), rows, seen.data(), v + head, item_slots, num_keys, dim, num_keys, acc);
}

template <typename kv_t>
void run_item(const WorkItem& w, const Shape& s, const float* q, const kv_t* k, const kv_t* v, const int64_t* slots,
              int64_t prefix_len, float* acc, float* row_max, float* row_sum) {
  if (s.dim == 64)
    run_item_dim<64>(w, s, q, k, v, slots, prefix_len, acc, row_max, row_sum);
  else if (s.dim == 128)
    run_item_dim<128>(w, s, q, k, v, slots, prefix_len, acc, row_max, row_sum);
  else
    run_item_dim<0>(w, s, q, k, v, slots, prefix_len, acc, row_max, row_sum);
}

// Splits only for single-token rows (decode), and only into pieces of >= 256 keys.
inline std::vector<WorkItem> plan_items(const int64_t* q_starts, const int64_t* ctx_starts, int64_t batch,
                                        int64_t num_kv_heads, int64_t num_splits) {
  std::vector<WorkItem> items;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t extend_len = q_starts[b + 1] - q_starts[b], ctx_len = ctx_starts[b + 1] - ctx_starts[b];
    const int64_t splits = extend_len == 1 ? std::max<int64_t>(1, std::min(num_splits, ctx_len / 256)) : 1;
    const int64_t per_split = (ctx_len + splits - 1) / splits;
    for (int64_t h = 0; h < num_kv_heads; ++h)
      for (int64_t t0 = 0; t0 < extend_len; t0 += kTokensPerTile)
        for (int64_t sp = 0; sp < splits; ++sp)
          items.push_back({b, h, t0, std::min(extend_len, t0 + kTokensPerTile), sp * per_split,
                           std::min(ctx_len, (sp + 1) * per_split), sp});
  }
  return items;
}

// The whole batch; parallel_for(n, fn) runs fn(begin, end) over [0, n) on the caller's threads.
template <typename kv_t, typename ParallelFor>
void paged_attention(const float* q, const kv_t* k, const kv_t* v, const int64_t* slots, const int64_t* q_starts,
                     const int64_t* ctx_starts, int64_t batch, int64_t num_splits, const Shape& s, float* out,
                     ParallelFor parallel_for) {
  const std::vector<WorkItem> items = plan_items(q_starts, ctx_starts, batch, s.num_kv_heads, num_splits);
  const int64_t max_rows = kTokensPerTile * s.group, n_items = static_cast<int64_t>(items.size());
  std::vector<float> acc(n_items * max_rows * s.dim), row_max(n_items * max_rows), row_sum(n_items * max_rows);
  parallel_for(n_items, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const WorkItem& w = items[i];
      const int64_t ctx_len = ctx_starts[w.b + 1] - ctx_starts[w.b];
      const int64_t prefix_len = ctx_len - (q_starts[w.b + 1] - q_starts[w.b]);
      const int64_t o = i * max_rows;
      run_item(w, s, q + q_starts[w.b] * s.num_heads * s.dim, k, v, slots + ctx_starts[w.b], prefix_len,
               acc.data() + o * s.dim, row_max.data() + o, row_sum.data() + o);
    }
  });
  // Merge: the items of one (request, head, tile) are consecutive splits 0, 1, ...
  for (int64_t i = 0; i < n_items;) {
    int64_t n = 1;
    while (i + n < n_items && items[i + n].split > 0) ++n;
    const WorkItem& w = items[i];
    for (int64_t r = 0; r < (w.t1 - w.t0) * s.group; ++r) {
      float m = -std::numeric_limits<float>::infinity(), l = 0.f;
      for (int64_t j = 0; j < n; ++j)
        if (row_sum[(i + j) * max_rows + r] > 0.f) m = std::max(m, row_max[(i + j) * max_rows + r]);
      const int64_t t = q_starts[w.b] + w.t0 + r / s.group, h = w.hkv * s.group + r % s.group;
      float* dst = out + (t * s.num_heads + h) * s.dim;
      std::fill(dst, dst + s.dim, 0.f);
      for (int64_t j = 0; j < n; ++j) {
        const int64_t o = (i + j) * max_rows + r;
        if (row_sum[o] == 0.f) continue;
        const float c = std::exp(row_max[o] - m);
        l += row_sum[o] * c;
        for (int64_t d = 0; d < s.dim; ++d) dst[d] += c * acc[o * s.dim + d];
      }
      for (int64_t d = 0; d < s.dim; ++d) dst[d] /= l;
    }
    i += n;
  }
}

}  // namespace radixserve
