// Paged attention over the KV pool, read in place: no per-layer copy of a request's context.
// Plain C++ (no torch headers) so it can be compiled and timed on its own; bound in
// paged_attention.cpp.
//
// Request b owns query rows q_starts[b] .. q_starts[b+1] (its new tokens) and context slots
// slots[ctx_starts[b] .. ctx_starts[b+1]] (cached prefix first, new tokens last). New token t
// (0-based) sees context 0 .. prefix_len + t, where prefix_len = ctx_len - extend_len; so one
// kernel serves decode, extend on a cached prefix and mixed batches.
//
//   q      [T, H, D]     out [T, H, D] (both float32, or both bfloat16: converted in the kernel)
//   k, v   [Hkv, N, D]   one layer of the pool (heads first: a slot's head row is contiguous)
//
// Work items are (request, K/V head, tile of query tokens, split of the context). The query
// heads sharing a K/V head are rows of one tile, so each K/V row is read once per tile; a long
// context is split when there are fewer requests than threads (flash-decoding), and the splits'
// softmax partials are merged at the end. Two passes per item, each a flat vectorisable loop:
// scores = q K^T over the item's keys, then p = softmax and acc = p V (with AVX512, for head dims
// 64, 96, 128 and 256 and float32, bfloat16 or int8 pools, paged_avx512.h's intrinsics; with AVX2 + FMA and no
// AVX512, paged_avx2.h's for the same head dims and pools). An 8-bit pool's
// codes are read in place and widened in registers; each key's scale multiplies its score, each value's
// its softmax weight (after the weights' sum), so no row is ever dequantized into memory; with AVX512 both
// passes are integer dot products against the codes (q as int8 with AVX512-VNNI, scores_int8.h, else int16; the
// weights as int16, values_int8.h); with AVX2 the scores pass is (q as int8, scores_int8_avx2.h). Requests that
// share a leading run of slots (SharedGroups) read it once, in shared_prefix.h's items, and only their
// own suffix here; every partial then meets in one log-sum-exp merge.
//
// A sliding window (Shape::window) starts each tile's items at the first key its first row sees, so a
// decode step reads its last ``window`` keys and nothing before them; rows of an extend tile that start
// later mask the few keys before their own first. In a windowed layer a shared prefix is read once only
// while every member's whole context fits the window (then the window hides nothing from any row);
// otherwise its members read their own windows, as requests without a group do.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "attention_common.h"
#include "paged_avx2.h"
#include "paged_avx512.h"
#include "scores_int8.h"
#include "scores_int8_avx2.h"
#include "shared_prefix.h"
#include "values_int8.h"

namespace radixserve {

constexpr int64_t kTokensPerTile = 8;

struct WorkItem {
  int64_t b, hkv, t0, t1, key0, key1, split;
};

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

// Per-thread scratch the items reuse: a decode item is a few microseconds, too short to allocate.
struct ItemScratch {
  std::vector<float> q, scores, key_scales, weight_scales;
  std::vector<int64_t> first, seen;
  std::vector<int16_t> weights;  // an 8-bit pool's softmax weights as int16 codes (values_int8.h)
};

// Row r of an item sees its keys [first[r], seen[r]) (item-relative): sc = softmax's p over them
// (the soft cap first, where the layer has one), 0 before them; returns (max, sum) through m and l.
inline void softmax_row(float* sc, int64_t first, int64_t seen, const Shape& s, float* m, float* l) {
  float* row = sc + first;
  const int64_t n = seen - first;
  if (s.softcap > 0.f) soft_cap(row, n, s.softcap);
  float mx = -std::numeric_limits<float>::infinity(), sum = 0.f;
  for (int64_t j = 0; j < n; ++j) mx = std::max(mx, row[j]);
  std::fill(sc, row, 0.f);
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) {
    row[j] = fast_exp(row[j] - mx);
    sum += row[j];
  }
  *m = mx;
  *l = sum;
}

inline ItemScratch& item_scratch() {
  static thread_local ItemScratch scratch;
  return scratch;
}

// An item's rows: row r sees its keys [first[r], seen[r]) of num_keys; scores rows are stride floats apart.
struct ItemRows {
  int64_t rows, stride, num_keys;
  const int64_t *first, *seen;
};

#if defined(__AVX512BW__)
// run_item_dim over an 8-bit pool, head dims a multiple of 64: scores (scores_int8.h with AVX512-VNNI: the key
// scales applied in the pass; else the int16 pass, then the key scales), the soft cap, then each row's softmax
// weights, value scales folded in, straight to int16 codes (values_int8.h), and the value pass on the codes.
template <int NC>
void run_item_int8(const ItemRows& ir, const Shape& s, int64_t hkv, const float* qf, const i8* k, const i8* v,
                   const int64_t* slots, ItemScratch& buf, float* acc, float* row_max, float* row_sum) {
  const int64_t rows = ir.rows, stride = ir.stride, num_keys = ir.num_keys;
  float *scores = buf.scores.data(), *scales = buf.key_scales.data();  // key_scales: stride floats
  const auto gather = [&](const uint16_t* scale) {
    gather_scales(scale + hkv * s.num_slots, slots, num_keys, scales);
    std::fill(scales + num_keys, scales + stride, 0.f);
  };
  gather(s.k_scale);
#if defined(__AVX512VNNI__)
  avx512::scores_pass_int8<NC>(qf, rows, k, slots, num_keys, scales, stride, scores);
#else
  avx512::scores_pass<NC>(qf, rows, k, slots, num_keys, stride, scores);
  scale_rows(scores, rows, stride, scales, num_keys);
#endif
  gather(s.v_scale);
  buf.weights.resize(rows * stride);
  buf.weight_scales.resize(rows * stride / avx512::kWeightBlock);
  for (int64_t r = 0; r < rows; ++r) {
    float* row = scores + r * stride;
    if (s.softcap > 0.f) avx512::soft_cap16(row, ir.seen[r], 1.f / s.softcap, s.softcap);
    avx512::softmax_weights_row(row, ir.first[r], ir.seen[r], stride, scales, row_max + r, row_sum + r,
                                buf.weights.data() + r * stride,
                                buf.weight_scales.data() + r * stride / avx512::kWeightBlock);
  }
  avx512::values_pass_codes<NC>(buf.weights.data(), buf.weight_scales.data(), rows, ir.seen, stride, v, slots, acc);
}
#endif

template <int64_t DIM, typename kv_t, typename q_t>
void run_item_dim(const WorkItem& w, const Shape& s, const q_t* q, const kv_t* k, const kv_t* v,
                  const int64_t* slots, int64_t prefix_len, float* acc, float* row_max, float* row_sum) {
  const int64_t rows = (w.t1 - w.t0) * s.group, dim = s.dim;
  const int64_t last = std::min(w.key1, prefix_len + w.t1);  // no row of the tile sees beyond
  const int64_t num_keys = std::max<int64_t>(0, last - w.key0);
  const int64_t stride = std::max<int64_t>(16, (num_keys + 15) / 16 * 16);  // rows of scores: 16-key blocks
  ItemScratch& buf = item_scratch();
  buf.q.resize(rows * dim);
  buf.scores.resize(rows * stride);
  buf.first.resize(rows);
  buf.seen.resize(rows);
  float *qf = buf.q.data(), *scores = buf.scores.data();
  int64_t *first = buf.first.data(), *seen = buf.seen.data();
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = w.t0 + r / s.group, h = w.hkv * s.group + r % s.group, limit = prefix_len + t + 1;
    for (int64_t i = 0; i < dim; ++i) qf[r * dim + i] = load(q, (t * s.num_heads + h) * dim + i) * s.scale;
    seen[r] = std::clamp<int64_t>(limit - w.key0, 0, num_keys);
    first[r] = std::clamp<int64_t>(first_visible(limit, s.window) - w.key0, 0, seen[r]);
  }
  const int64_t head = w.hkv * s.num_slots * dim;
  const int64_t* item_slots = slots + w.key0;
  // An 8-bit pool: scores of the codes times each key's scale (before the cap and the softmax), then the
  // softmax weights times each value's scale (after their sum): code rows are read as they lie, never dequantized.
  constexpr bool int8 = std::is_same_v<kv_t, i8>;
  buf.key_scales.resize(int8 ? stride : 0);
  float* key_scales = buf.key_scales.data();
  const auto fold_scales = [&](const uint16_t* scale) {
    if constexpr (int8) {
      gather_scales(scale + w.hkv * s.num_slots, item_slots, num_keys, key_scales);
      scale_rows(scores, rows, stride, key_scales, num_keys);
    }
  };
#if defined(__AVX512F__)
  if constexpr (DIM > 0 && DIM % 16 == 0 &&
                (std::is_same_v<kv_t, float> || std::is_same_v<kv_t, bf16> || std::is_same_v<kv_t, i8>)) {
#if defined(__AVX512BW__)
    if constexpr (int8 && DIM % 64 == 0) {
      const ItemRows ir{rows, stride, num_keys, first, seen};
      run_item_int8<DIM / 16>(ir, s, w.hkv, qf, k + head, v + head, item_slots, buf, acc, row_max, row_sum);
      return;
    }
#endif
    avx512::scores_pass<DIM / 16>(qf, rows, k + head, item_slots, num_keys, stride, scores);
    fold_scales(s.k_scale);
    for (int64_t r = 0; r < rows; ++r) {
      if (s.softcap > 0.f) avx512::soft_cap16(scores + r * stride, seen[r], 1.f / s.softcap, s.softcap);
      avx512::softmax_row(scores + r * stride, first[r], seen[r], stride, row_max + r, row_sum + r);
    }
    fold_scales(s.v_scale);
    avx512::values_pass<DIM / 16>(scores, rows, seen, stride, v + head, item_slots, acc);
    return;
  }
#endif
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
  if constexpr (DIM > 0 && DIM % 8 == 0 &&
                (std::is_same_v<kv_t, float> || std::is_same_v<kv_t, bf16> || std::is_same_v<kv_t, i8>)) {
    if constexpr (int8 && DIM % 32 == 0)  // integer dot products, q as int8 (scores_int8_avx2.h)
      avx2::scores_pass_int8<DIM / 8>(qf, rows, k + head, item_slots, num_keys, stride, scores);
    else
      avx2::scores_pass<DIM / 8>(qf, rows, k + head, item_slots, num_keys, stride, scores);
    fold_scales(s.k_scale);
    for (int64_t r = 0; r < rows; ++r) {
      float* row = scores + r * stride;
      if (s.softcap > 0.f) soft_cap(row + first[r], seen[r] - first[r], s.softcap);  // from the row's own first key
      avx2::softmax_row(row, first[r], seen[r], stride, row_max + r, row_sum + r);
    }
    fold_scales(s.v_scale);
    avx2::values_pass<DIM / 8>(scores, rows, seen, stride, v + head, item_slots, acc);
    return;
  }
#endif
  scores_pass<DIM>(qf, rows, k + head, item_slots, num_keys, dim, stride, scores);
  fold_scales(s.k_scale);
  for (int64_t r = 0; r < rows; ++r) softmax_row(scores + r * stride, first[r], seen[r], s, row_max + r, row_sum + r);
  fold_scales(s.v_scale);
  values_pass<DIM>(scores, rows, seen, v + head, item_slots, num_keys, dim, stride, acc);
}

template <typename kv_t, typename q_t>
void run_item(const WorkItem& w, const Shape& s, const q_t* q, const kv_t* k, const kv_t* v, const int64_t* slots,
              int64_t prefix_len, float* acc, float* row_max, float* row_sum) {
  if (s.dim == 64)
    run_item_dim<64>(w, s, q, k, v, slots, prefix_len, acc, row_max, row_sum);
  else if (s.dim == 128)
    run_item_dim<128>(w, s, q, k, v, slots, prefix_len, acc, row_max, row_sum);
  else if (s.dim == 96)  // Phi-3
    run_item_dim<96>(w, s, q, k, v, slots, prefix_len, acc, row_max, row_sum);
  else if (s.dim == 256)  // Gemma 2 and 3
    run_item_dim<256>(w, s, q, k, v, slots, prefix_len, acc, row_max, row_sum);
  else
    run_item_dim<0>(w, s, q, k, v, slots, prefix_len, acc, row_max, row_sum);
}

// Per-request items over keys [key_starts[b], ctx_len): a member of a shared-prefix group reads only
// its suffix here; with a window, a tile's items start at the first key its first row sees. Splits only
// for single-token rows (decode), and only into pieces of >= 256 keys; an empty suffix still gets one
// (empty) item, so every request has its place in the merge.
inline std::vector<WorkItem> plan_items(const int64_t* q_starts, const int64_t* ctx_starts, int64_t batch,
                                        int64_t num_kv_heads, int64_t num_splits, const int64_t* key_starts,
                                        int64_t window) {
  std::vector<WorkItem> items;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t extend_len = q_starts[b + 1] - q_starts[b], ctx_len = ctx_starts[b + 1] - ctx_starts[b];
    for (int64_t h = 0; h < num_kv_heads; ++h)
      for (int64_t t0 = 0; t0 < extend_len; t0 += kTokensPerTile) {
        const int64_t limit = ctx_len - extend_len + t0 + 1;  // the tile's first row sees keys below this
        const int64_t k0 = std::max(key_starts[b], first_visible(limit, window)), span = ctx_len - k0;
        const int64_t splits = extend_len == 1 ? std::max<int64_t>(1, std::min(num_splits, span / 256)) : 1;
        const int64_t per_split = (span + splits - 1) / splits;
        for (int64_t sp = 0; sp < splits; ++sp)
          items.push_back({b, h, t0, std::min(extend_len, t0 + kTokensPerTile), k0 + sp * per_split,
                           std::min(ctx_len, k0 + (sp + 1) * per_split), sp});
      }
  }
  return items;
}

// Groups of requests whose contexts begin with the same slots: group g's members are requests
// members[starts[g] .. starts[g+1]], its prefix the first lens[g] slots of each member's context.
// The caller guarantees lens[g] <= ctx_len - extend_len + 1 for every member (every new token
// sees the whole prefix) and that the slots agree; count 0 turns the shared pass off.
struct SharedGroups {
  const int64_t* members;
  const int64_t* starts;
  const int64_t* lens;
  int64_t count;
};

// Whether group gi's prefix is read once in a layer of this window: while every member's whole context
// fits the window, every row sees the whole prefix (the shared pass has no mask).
inline bool group_in_window(const SharedGroups& g, int64_t gi, const int64_t* ctx_starts, int64_t window) {
  for (int64_t m = g.starts[gi]; window > 0 && m < g.starts[gi + 1]; ++m)
    if (ctx_starts[g.members[m] + 1] - ctx_starts[g.members[m]] > window) return false;
  return true;
}

// Shared items: (group, K/V head, block of member tokens, span of the prefix). ``tokens`` gets
// each group's member tokens (query rows of q), group g's from token_starts[g]; a group not ``kept``
// has none.
inline std::vector<SharedItem> plan_shared(const SharedGroups& g, const std::vector<char>& kept,
                                           const int64_t* q_starts, const Shape& s, std::vector<int64_t>& tokens,
                                           std::vector<int64_t>& token_starts) {
  std::vector<SharedItem> items;
  const int64_t per_block = std::max<int64_t>(1, kSharedMaxRows / s.group);
  for (int64_t gi = 0; gi < g.count; ++gi) {
    token_starts.push_back(static_cast<int64_t>(tokens.size()));
    if (!kept[gi]) continue;
    for (int64_t m = g.starts[gi]; m < g.starts[gi + 1]; ++m)
      for (int64_t t = q_starts[g.members[m]]; t < q_starts[g.members[m] + 1]; ++t) tokens.push_back(t);
    const int64_t num_tokens = static_cast<int64_t>(tokens.size()) - token_starts.back(), len = g.lens[gi];
    const int64_t splits = std::max<int64_t>(1, (len + kSharedKeysPerItem - 1) / kSharedKeysPerItem);
    const int64_t per_split = (len + splits - 1) / splits;
    for (int64_t h = 0; h < s.num_kv_heads; ++h)
      for (int64_t t0 = 0; t0 < num_tokens; t0 += per_block)
        for (int64_t sp = 0; sp < splits; ++sp)
          items.push_back({gi, h, t0, std::min(num_tokens, t0 + per_block), sp * per_split,
                           std::min(len, (sp + 1) * per_split)});
  }
  return items;
}

// Log-sum-exp merge of softmax partials into out [T, H, D]: fold each partial row (max m, sum l,
// unnormalised acc) into its output row, then divide by the total sum once.
class PartialMerge {
 public:
  PartialMerge(float* out, int64_t rows, int64_t dim)
      : out_(out), dim_(dim), max_(rows, -std::numeric_limits<float>::infinity()), sum_(rows, 0.f) {
    std::fill(out, out + rows * dim, 0.f);
  }
  void fold(int64_t row, const float* acc, float m, float l) {
    fold_row(out_ + row * dim_, dim_, acc, m, l, max_[row], sum_[row]);
  }
  void finish() {
    for (size_t row = 0; row < sum_.size(); ++row) finish_row(out_ + row * dim_, dim_, sum_[row]);
  }
  // A row that has one partial: what the merge makes of it (the same operations on a fresh row),
  // so an item can write it itself.
  static void write_single(float* dst, int64_t dim, const float* acc, float m, float l) {
    float row_max = -std::numeric_limits<float>::infinity(), row_sum = 0.f;
    std::fill(dst, dst + dim, 0.f);
    fold_row(dst, dim, acc, m, l, row_max, row_sum);
    finish_row(dst, dim, row_sum);
  }

 private:
  static void fold_row(float* dst, int64_t dim, const float* acc, float m, float l, float& row_max, float& row_sum) {
    if (l == 0.f) return;  // no key of this partial is visible to the row
    const float m_new = std::max(row_max, m), a = std::exp(row_max - m_new), c = std::exp(m - m_new);
    for (int64_t d = 0; d < dim; ++d) dst[d] = dst[d] * a + acc[d] * c;
    row_sum = row_sum * a + l * c;
    row_max = m_new;
  }
  static void finish_row(float* dst, int64_t dim, float row_sum) {
    if (row_sum > 0.f)
      for (int64_t d = 0; d < dim; ++d) dst[d] /= row_sum;
  }

  float* out_;
  int64_t dim_;
  std::vector<float> max_, sum_;
};

// Every work item of a batch: shared-prefix items first (the big ones start first), then the
// per-request ones; offsets[i] is item i's first partial row.
struct Plan {
  std::vector<SharedItem> shared;
  std::vector<WorkItem> items;
  std::vector<int64_t> tokens, token_starts, offsets;

  int64_t size() const { return static_cast<int64_t>(shared.size() + items.size()); }
  bool is_shared(int64_t i) const { return i < static_cast<int64_t>(shared.size()); }
  const WorkItem& item(int64_t i) const { return items[i - shared.size()]; }
  // Partial row r of item i belongs to query row (token, head) = the returned index into [T * H].
  int64_t target(int64_t i, int64_t r, const int64_t* q_starts, const Shape& s) const {
    const int64_t hkv = is_shared(i) ? shared[i].hkv : item(i).hkv;
    const int64_t t = is_shared(i) ? tokens[token_starts[shared[i].group] + shared[i].tok0 + r / s.group]
                                   : q_starts[item(i).b] + item(i).t0 + r / s.group;
    return t * s.num_heads + hkv * s.group + r % s.group;
  }
};

inline Plan make_plan(const int64_t* q_starts, const int64_t* ctx_starts, int64_t batch, int64_t num_splits,
                      const SharedGroups& groups, const Shape& s) {
  Plan plan;
  const bool cascade = s.dim % kStep == 0;  // the blocked shared pass steps the head dim by kStep
  std::vector<int64_t> key_starts(batch, 0);
  std::vector<char> kept(groups.count, 0);
  for (int64_t g = 0; cascade && g < groups.count; ++g) {
    kept[g] = group_in_window(groups, g, ctx_starts, s.window);
    for (int64_t m = groups.starts[g]; kept[g] && m < groups.starts[g + 1]; ++m)
      key_starts[groups.members[m]] = groups.lens[g];
  }
  if (cascade) plan.shared = plan_shared(groups, kept, q_starts, s, plan.tokens, plan.token_starts);
  plan.items = plan_items(q_starts, ctx_starts, batch, s.num_kv_heads, num_splits, key_starts.data(), s.window);
  plan.offsets.assign(plan.size() + 1, 0);
  for (int64_t i = 0; i < plan.size(); ++i)
    plan.offsets[i + 1] = plan.offsets[i] + s.group * (plan.is_shared(i) ? plan.shared[i].tok1 - plan.shared[i].tok0
                                                                         : plan.item(i).t1 - plan.item(i).t0);
  return plan;
}

// Output rows as float32, or bfloat16 (rounded to nearest even, as torch's conversion): a bfloat16 model's q
// and output travel in its own dtype, with no conversion of either around the call.
inline void store_rows(float* dst, const float* src, int64_t n) { std::copy(src, src + n, dst); }
inline void store_rows(bf16* dst, const float* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i].bits = float_to_bf16(src[i]);
}

// The whole batch; parallel_for(n, fn) runs fn(begin, end) over [0, n) on the caller's threads. q and out are
// float32 or bfloat16 (io_t): the kernel widens q as it scales it and rounds each output row as it writes it.
// Items are taken from a shared counter rather than the ranges handed out: a shared-prefix item
// costs many suffix items, and a static split would leave a thread idle.
// Where no request's keys are split among items (no split, no shared prefix: a batch-16 decode
// at 1 or 2 threads) each output row has exactly one partial, and the items write their rows
// themselves, in parallel, instead of one thread merging all of them after the items: that merge
// was serial work in every layer's call while the other threads waited. Same bits either way.
template <typename kv_t, typename io_t, typename ParallelFor>
void paged_attention(const io_t* q, const kv_t* k, const kv_t* v, const int64_t* slots, const int64_t* q_starts,
                     const int64_t* ctx_starts, int64_t batch, int64_t num_splits, const SharedGroups& groups,
                     const Shape& s, io_t* out, ParallelFor parallel_for) {
  const Plan plan = make_plan(q_starts, ctx_starts, batch, num_splits, groups, s);
  const int64_t n = plan.size(), num_rows = plan.offsets[n], dim = s.dim;
  const bool direct = plan.shared.empty() &&
                      std::none_of(plan.items.begin(), plan.items.end(), [](const WorkItem& w) { return w.split > 0; });
  std::vector<float> acc(num_rows * dim), row_max(num_rows), row_sum(num_rows);
  std::atomic<int64_t> next{0};
  parallel_for(n, [&](int64_t, int64_t) {
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) {
      const int64_t o = plan.offsets[i];
      if (plan.is_shared(i)) {
        const SharedItem& w = plan.shared[i];
        const int64_t lead = groups.members[groups.starts[w.group]];
        run_shared_item(w, s, q, plan.tokens.data() + plan.token_starts[w.group], k, v, slots + ctx_starts[lead],
                        acc.data() + o * dim, row_max.data() + o, row_sum.data() + o);
        continue;
      }
      const WorkItem& w = plan.item(i);
      const int64_t prefix_len = ctx_starts[w.b + 1] - ctx_starts[w.b] - (q_starts[w.b + 1] - q_starts[w.b]);
      run_item(w, s, q + q_starts[w.b] * s.num_heads * dim, k, v, slots + ctx_starts[w.b], prefix_len,
               acc.data() + o * dim, row_max.data() + o, row_sum.data() + o);
      for (int64_t r = o; direct && r < plan.offsets[i + 1]; ++r) {
        float row[256];  // the op checks dim <= 256
        io_t* dst = out + plan.target(i, r - o, q_starts, s) * dim;
        float* into = std::is_same_v<io_t, float> ? reinterpret_cast<float*>(dst) : row;
        PartialMerge::write_single(into, dim, acc.data() + r * dim, row_max[r], row_sum[r]);
        if constexpr (!std::is_same_v<io_t, float>) store_rows(dst, row, dim);
      }
    }
  });
  if (direct) return;
  const int64_t out_rows = q_starts[batch] * s.num_heads;
  std::vector<float> merged(std::is_same_v<io_t, float> ? 0 : out_rows * dim);
  float* into = std::is_same_v<io_t, float> ? reinterpret_cast<float*>(out) : merged.data();
  PartialMerge merge(into, out_rows, dim);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t o = plan.offsets[i]; o < plan.offsets[i + 1]; ++o)
      merge.fold(plan.target(i, o - plan.offsets[i], q_starts, s), acc.data() + o * dim, row_max[o], row_sum[o]);
  merge.finish();
  if constexpr (!std::is_same_v<io_t, float>) store_rows(out, into, out_rows * dim);
}

}  // namespace radixserve
