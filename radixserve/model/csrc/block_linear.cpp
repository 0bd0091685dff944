// Weight-only linear over GGUF-style blocks of 32 weights, for few rows (decode), float32 activations.
//   Q4_1: w = d * q + m, q in 0..15 (byte j of a block: low nibble = weight j, high nibble = weight j + 16)
//   Q8_0: w = d * q,     q int8
// d and m are float16, one per block. Batch-1 decode is bound by reading weights: Q4_1 reads
// 0.625 bytes per weight where float32 reads 4. The min is folded out of the inner loop:
//   out[r][n] = sum_b d_b * (x_rb . q_b) + sum_b m_b * sum(x_rb)
// so the inner loop converts q to float and multiplies; sum(x_rb) is taken once per call.
// Each block of a weight row is decoded once into registers per tile of up to 8 rows.
// Every row goes through the same sequence of operations whatever its tile or batch: a
// row's result is bitwise the same alone or batched (batch composition changes nothing).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <cstdint>
#include <optional>
#include <vector>

#include "block_common.h"

namespace {

using radixserve::BlockWeights;
using radixserve::check_blocks;
using radixserve::chunk_scales;
using radixserve::kBlock;
using radixserve::padded;
#ifdef RADIXSERVE_BLOCK_AVX2
using radixserve::hsum;
#endif

// Rows sharing one decode of a weight block: 4 decoded + 8 accumulators + the scale and a product fill
// AVX2's 16 registers. Measured on SmolLM2's linears at 16 rows: tiles of 4, 6, 8 ran 0.91x, 0.76x, 0.68x float32's time.
constexpr int kRowTile = 8;

#ifdef RADIXSERVE_BLOCK_AVX2
// One 32-bit word of codes, broadcast to 8 lanes, shifted by 4 bits more in each lane: lanes hold
// weights 4t, 4t+16, 4t+1, 4t+17, ... (word t's low and high nibbles in turn). No lane-crossing
// shuffles (the port they share was the bottleneck); x is permuted to this order once per call.
inline void decode_q4(const uint8_t* q, __m256* w) {
  const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
  const __m256i mask = _mm256_set1_epi32(0x0F);
  for (int t = 0; t < 4; ++t) {
    int32_t word;
    std::memcpy(&word, q + 4 * t, sizeof(word));
    w[t] = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(word), shifts), mask));
  }
}

// x in decode_q4's lane order, block by block: [rows, K] -> [rows, K].
at::Tensor q4_lane_order(const at::Tensor& x) {
  at::Tensor out = at::empty_like(x);
  const float* src = x.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  for (int64_t base = 0; base < x.numel(); base += kBlock)
    for (int t = 0; t < 4; ++t)
      for (int j = 0; j < 4; ++j) {
        dst[base + 8 * t + 2 * j] = src[base + 4 * t + j];
        dst[base + 8 * t + 2 * j + 1] = src[base + 4 * t + j + 16];
      }
  return out;
}

inline void decode_q8(const uint8_t* q, __m256* w) {
  for (int i = 0; i < 4; ++i)
    w[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * i))));
}


// R rows of x against one weight row: sum_b d_b * (x_rb . q_b) [+ sum_b m_b * xsum_rb].
template <int R, bool Q4>
void dot_rows(const float* x, int64_t ldx, const float* xsum, int64_t ldxs, const uint8_t* qs, const float* d,
              const float* m, int64_t blocks, float* sums) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m256 w[4];
    if constexpr (Q4) decode_q4(qs + b * 16, w);
    else decode_q8(qs + b * kBlock, w);
    const __m256 scale = _mm256_broadcast_ss(d + b);
    for (int r = 0; r < R; ++r) {
      const float* xb = x + r * ldx + b * kBlock;
      __m256 p = _mm256_mul_ps(_mm256_loadu_ps(xb), w[0]);
      p = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 8), w[1], p);
      p = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 16), w[2], p);
      p = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 24), w[3], p);
      acc[r] = _mm256_fmadd_ps(scale, p, acc[r]);
    }
  }
  if constexpr (Q4) {
    for (int64_t b = 0; b < padded(blocks); b += 8) {
      const __m256 mins = _mm256_loadu_ps(m + b);
      for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(mins, _mm256_loadu_ps(xsum + r * ldxs + b), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) sums[r] = hsum(acc[r]);
}
#else
template <int R, bool Q4>
void dot_rows(const float* x, int64_t ldx, const float* xsum, int64_t ldxs, const uint8_t* qs, const float* d,
              const float* m, int64_t blocks, float* sums) {
  float acc[R] = {};
  for (int64_t b = 0; b < blocks; ++b) {
    float w[kBlock];
    for (int64_t j = 0; j < kBlock; ++j) {
      if constexpr (Q4) {
        const uint8_t byte = qs[b * 16 + (j & 15)];
        w[j] = static_cast<float>(j < 16 ? (byte & 0x0F) : (byte >> 4));
      } else {
        w[j] = static_cast<float>(static_cast<int8_t>(qs[b * kBlock + j]));
      }
    }
    for (int r = 0; r < R; ++r) {
      const float* xb = x + r * ldx + b * kBlock;
      float p = 0.f;
      for (int64_t j = 0; j < kBlock; ++j) p += xb[j] * w[j];
      acc[r] += d[b] * p;
    }
  }
  if constexpr (Q4)
    for (int r = 0; r < R; ++r)
      for (int64_t b = 0; b < blocks; ++b) acc[r] += m[b] * xsum[r * ldxs + b];
  for (int r = 0; r < R; ++r) sums[r] = acc[r];
}
#endif

template <bool Q4>
void tile_rows(int rows, const float* x, int64_t ldx, const float* xsum, int64_t ldxs, const uint8_t* qs,
               const float* d, const float* m, int64_t blocks, float* sums) {
  switch (rows) {
    case 1: return dot_rows<1, Q4>(x, ldx, xsum, ldxs, qs, d, m, blocks, sums);
    case 2: return dot_rows<2, Q4>(x, ldx, xsum, ldxs, qs, d, m, blocks, sums);
    case 3: return dot_rows<3, Q4>(x, ldx, xsum, ldxs, qs, d, m, blocks, sums);
    case 4: return dot_rows<4, Q4>(x, ldx, xsum, ldxs, qs, d, m, blocks, sums);
    case 5: return dot_rows<5, Q4>(x, ldx, xsum, ldxs, qs, d, m, blocks, sums);
    case 6: return dot_rows<6, Q4>(x, ldx, xsum, ldxs, qs, d, m, blocks, sums);
    case 7: return dot_rows<7, Q4>(x, ldx, xsum, ldxs, qs, d, m, blocks, sums);
    default: return dot_rows<8, Q4>(x, ldx, xsum, ldxs, qs, d, m, blocks, sums);
  }
}

// Output channels n0..n1 of every row. xsum [rows, padded(blocks)]: each block's sum of x (Q4_1's min term).
// A chunk of channels' weights (a few KiB, kept in L1/L2) is read once per tile of rows, so a tile's
// x rows stay in L1; reading all rows' x per channel spilled L1 at 16 rows of 1,536 features.
template <bool Q4>
void linear_channels(const float* x, int64_t rows, int64_t in_features, const float* xsum, const BlockWeights& w,
                     int64_t n0, int64_t n1, int64_t out_features, float* out) {
  constexpr int64_t kChunk = 16;
  const int64_t ldxs = padded(w.blocks);
  std::vector<float> d(kChunk * ldxs), m(kChunk * ldxs);
  float sums[kRowTile];
  for (int64_t c0 = n0; c0 < n1; c0 += kChunk) {
    const int64_t c1 = std::min(n1, c0 + kChunk);
    chunk_scales<Q4>(w, c0, c1, d.data(), m.data());
    for (int64_t r0 = 0; r0 < rows; r0 += kRowTile) {
      const int tile = static_cast<int>(std::min<int64_t>(kRowTile, rows - r0));
      for (int64_t n = c0; n < c1; ++n) {
        tile_rows<Q4>(tile, x + r0 * in_features, in_features, xsum + r0 * ldxs, ldxs, w.qs + n * w.qs_row_bytes,
                      d.data() + (n - c0) * ldxs, m.data() + (n - c0) * ldxs, w.blocks, sums);
        for (int r = 0; r < tile; ++r) out[(r0 + r) * out_features + n] = sums[r];
      }
    }
  }
}

at::Tensor block_linear_op(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                           const std::optional<at::Tensor>& m) {
  const bool q4 = check_blocks(qs, d, m);
  const int64_t out_features = qs.size(0), blocks = d.size(1), in_features = blocks * kBlock;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == in_features, "x [M, K] against weights [N, K]");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const int64_t rows = xf.size(0);
  // Q4_1's min term: each block's sum of x, once per call, added in the same order for every row.
  at::Tensor xsum = at::zeros({q4 ? rows : 0, padded(blocks)}, xf.options());
  for (int64_t r = 0; r < xsum.size(0); ++r)
    for (int64_t b = 0; b < blocks; ++b) {
      const float* xb = xf.data_ptr<float>() + r * in_features + b * kBlock;
      float s = 0.f;
      for (int64_t j = 0; j < kBlock; ++j) s += xb[j];
      xsum.data_ptr<float>()[r * padded(blocks) + b] = s;
    }
  at::Tensor out = at::empty({rows, out_features}, xf.options());
#ifdef RADIXSERVE_BLOCK_AVX2
  const at::Tensor xk = q4 ? q4_lane_order(xf) : xf;
#else
  const at::Tensor& xk = xf;
#endif
  const BlockWeights w{static_cast<const uint8_t*>(qs.data_ptr()), d.data_ptr<at::Half>(),
                       q4 ? m->data_ptr<at::Half>() : nullptr, blocks, qs.size(1)};
  const float* xp = xk.data_ptr<float>();
  const float* sp = xsum.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, out_features, 16, [&](int64_t n0, int64_t n1) {
    if (q4) linear_channels<true>(xp, rows, in_features, sp, w, n0, n1, out_features, op);
    else linear_channels<false>(xp, rows, in_features, sp, w, n0, n1, out_features, op);
  });
  return out.to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixserve, m) {
  m.def("block_linear(Tensor x, Tensor qs, Tensor d, Tensor? m) -> Tensor");
}

TORCH_LIBRARY_IMPL(radixserve, CPU, m) {
  m.impl("block_linear", &block_linear_op);
}
