// Linear over GGUF-style blocks of 32 weights with int8 activations, for few rows (decode), as
// llama.cpp's CPU backend runs Q4_1 / Q8_0 weights: each activation row is quantized per block of
// 32 (scale s = max|x| / 127, codes round-half-even(x * 127 / max|x|)), then each block's dot
// product is exact integer arithmetic and only the per-block sums are float:
//   out[r][n] = sum_b (d_b * s_rb) * (q_b . xq_rb) + sum_b m_b * (s_rb * sum(xq_rb))
// i.e. the dequantized weights against the dequantized codes. The min term from the codes, not
// from the float sum of x: with x's float sums the rounding error is multiplied by d*q (0..15 d,
// all of one sign) instead of the centred weight, and on SmolLM2 top-1 agreement with float32
// fell from 0.968 to 0.912.
// Converting nibbles to float bounded block_linear.cpp; here a block is 4 integer instructions per
// row (AVX2 vpmaddubsw + vpmaddwd, or one vpdpbusd where the build's CPU has AVX-VNNI).
// Every row goes through the same sequence of operations whatever its tile or batch, and its
// codes depend on that row only: a row's result is bitwise the same alone or batched.
// With AVX512-VNNI every row count runs block_q8_panels.h instead (one float accumulator per output,
// Q4_0's -8 folded into the integers), fast at prefill too; the kernels below are the other CPUs' path.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <type_traits>
#include <vector>

#include "block_common.h"
#include "block_q8_panels.h"
#include "block_q8_rows.h"

namespace {

using radixserve::BlockWeights;
using radixserve::check_blocks;
using radixserve::chunk_scales;
using radixserve::kBlock;
using radixserve::padded;
using radixserve::Q8Rows;
using radixserve::quantize_block;
using radixserve::quantize_rows;

// Rows sharing one decode of a weight block. Measured on SmolLM2's linears at 16 rows (2 accumulators
// per row, so 8 spill a few): tiles of 4, 6, 8 took 63, 61, 51 ms. Tiles of up to 10, balanced (11 rows: 6 + 5): a
// verify of 8 drafts is 9 rows, which as 8 + 1 decoded every weight again (Zen 3, `bench block-linears --paths
// kernel-q8`, ms a forward: 9 rows 32.4-32.6 -> 29.2-29.6, 16 rows 51.5-51.9 -> 50.4-50.6; 1-8 rows run the same
// code). One accumulator a row instead of two fit 10 rows without spilling but left one row 6% slower.
constexpr int kRowTile = 10;

#ifdef RADIXSERVE_BLOCK_AVX2
// 8 int32 lanes, lane i = sum of bytes 4i..4i+3 of u (unsigned) times s (signed). No saturation here:
// |u| <= 128 and |s| <= 127, so a pair of products fits int16. VNNI gives the same lanes in one instruction.
inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// Block b of a weight row as 32 unsigned bytes: Q4_1's nibbles in byte order (weights 0..15 low,
// 16..31 high), Q8_0's |w| (w's sign then moves onto x).
template <bool Q4>
inline __m256i load_weights(const uint8_t* qs, int64_t b) {
  if constexpr (Q4) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + b * 16));
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), _mm256_set1_epi8(0x0F));
  } else {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + b * kBlock));
  }
}

// acc[r] += float(q_b . xq_rb) * scale_rb for R rows, the weight block decoded once.
template <int R, bool Q4>
inline void add_block(const int8_t* xq, int64_t ldx, const float* scale, int64_t lds, const uint8_t* qs, int64_t b,
                      __m256* acc) {
  const __m256i w = load_weights<Q4>(qs, b);
  const __m256i u = Q4 ? w : _mm256_sign_epi8(w, w);
  for (int r = 0; r < R; ++r) {
    __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * ldx + b * kBlock));
    if constexpr (!Q4) x = _mm256_sign_epi8(x, w);
    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8(u, x)), _mm256_broadcast_ss(scale + r * lds + b), acc[r]);
  }
}

// R rows of codes against one weight row. Even and odd blocks go to two accumulators per row: one
// row alone would otherwise wait on the FMA's latency every block.
template <int R, bool Q4>
void dot_rows(const int8_t* xq, int64_t ldx, const float* scale, const float* xsum, int64_t ldxs, const uint8_t* qs,
              const float* m, int64_t blocks, float* sums) {
  __m256 even[R], odd[R];
  for (int r = 0; r < R; ++r) even[r] = odd[r] = _mm256_setzero_ps();
  int64_t b = 0;
  for (; b + 2 <= blocks; b += 2) {
    add_block<R, Q4>(xq, ldx, scale, ldxs, qs, b, even);
    add_block<R, Q4>(xq, ldx, scale, ldxs, qs, b + 1, odd);
  }
  if (b < blocks) add_block<R, Q4>(xq, ldx, scale, ldxs, qs, b, even);
  if constexpr (Q4) {
    for (b = 0; b < padded(blocks); b += 8) {
      const __m256 mins = _mm256_loadu_ps(m + b);
      for (int r = 0; r < R; ++r) odd[r] = _mm256_fmadd_ps(mins, _mm256_loadu_ps(xsum + r * ldxs + b), odd[r]);
    }
  }
  for (int r = 0; r < R; ++r) sums[r] = radixserve::hsum(_mm256_add_ps(even[r], odd[r]));
}
#else
template <int R, bool Q4>
void dot_rows(const int8_t* xq, int64_t ldx, const float* scale, const float* xsum, int64_t ldxs, const uint8_t* qs,
              const float* m, int64_t blocks, float* sums) {
  float acc[R] = {};
  for (int64_t b = 0; b < blocks; ++b) {
    int32_t w[kBlock];
    for (int j = 0; j < kBlock; ++j) {
      const uint8_t byte = Q4 ? qs[b * 16 + (j & 15)] : 0;
      w[j] = Q4 ? (j < 16 ? (byte & 0x0F) : (byte >> 4)) : static_cast<int8_t>(qs[b * kBlock + j]);
    }
    for (int r = 0; r < R; ++r) {
      const int8_t* x = xq + r * ldx + b * kBlock;
      int32_t dot = 0;
      for (int j = 0; j < kBlock; ++j) dot += w[j] * x[j];
      acc[r] += static_cast<float>(dot) * scale[r * ldxs + b];
    }
  }
  if constexpr (Q4)
    for (int r = 0; r < R; ++r)
      for (int64_t b = 0; b < blocks; ++b) acc[r] += m[b] * xsum[r * ldxs + b];
  for (int r = 0; r < R; ++r) sums[r] = acc[r];
}
#endif

template <bool Q4>
void tile_rows(int rows, const int8_t* xq, int64_t ldx, const float* scale, const float* xsum, int64_t ldxs,
               const uint8_t* qs, const float* m, int64_t blocks, float* sums) {
  switch (rows) {
#define RADIXSERVE_TILE(R) \
  case R: return dot_rows<R, Q4>(xq, ldx, scale, xsum, ldxs, qs, m, blocks, sums);
    RADIXSERVE_TILE(1) RADIXSERVE_TILE(2) RADIXSERVE_TILE(3) RADIXSERVE_TILE(4)
    RADIXSERVE_TILE(5) RADIXSERVE_TILE(6) RADIXSERVE_TILE(7) RADIXSERVE_TILE(8) RADIXSERVE_TILE(9)
#undef RADIXSERVE_TILE
    default: return dot_rows<kRowTile, Q4>(xq, ldx, scale, xsum, ldxs, qs, m, blocks, sums);
  }
}

// Output channels n0..n1 of every row: a chunk of channels' weights (a few KiB, kept in L1/L2) is read
// once per tile of rows, so a tile's codes stay in L1.
template <bool Q4>
void linear_channels(const Q8Rows& x, const BlockWeights& w, int64_t n0, int64_t n1, const radixserve::Epilogue& out) {
  constexpr int64_t kChunk = 16;
  const int64_t rows = x.codes.size(0), in_features = x.codes.size(1), ldxs = x.ld;
  const int8_t* xq = x.codes.data_ptr<int8_t>();
  const float* xs = x.scales.data();
  const float* xsum = x.sums.data();
  std::vector<float> d(kChunk * ldxs), m(kChunk * ldxs), scale(kRowTile * ldxs);
  float sums[kRowTile];
  const int64_t tiles = (rows + kRowTile - 1) / kRowTile, row_tile = (rows + tiles - 1) / tiles;  // balanced
  for (int64_t c0 = n0; c0 < n1; c0 += kChunk) {
    const int64_t c1 = std::min(n1, c0 + kChunk);
    chunk_scales<Q4>(w, c0, c1, d.data(), m.data(), ldxs);
    for (int64_t r0 = 0; r0 < rows; r0 += row_tile) {
      const int tile = static_cast<int>(std::min<int64_t>(row_tile, rows - r0));
      for (int64_t n = c0; n < c1; ++n) {
        // Each block's two scales as one product per row, 8 blocks an instruction, before the block loop.
        const float* dn = d.data() + (n - c0) * ldxs;
        for (int r = 0; r < tile; ++r)
#pragma omp simd
          for (int64_t b = 0; b < padded(w.blocks); ++b) scale[r * ldxs + b] = dn[b] * xs[(r0 + r) * ldxs + b];
        tile_rows<Q4>(tile, xq + r0 * in_features, in_features, scale.data(), xsum + r0 * ldxs, ldxs,
                      w.qs + n * w.qs_row_bytes, m.data() + (n - c0) * ldxs, w.blocks, sums);
        for (int r = 0; r < tile; ++r) out.store(r0 + r, n, sums[r]);
      }
    }
  }
}

#ifdef RADIXSERVE_Q8_PANELS
// The AVX512-VNNI kernel (block_q8_panels.h) for every row count: each block's integer start from x's code sums.
at::Tensor panels_linear(const Q8Rows& x, const BlockWeights& w, const radixserve::Epilogue& epilogue,
                         at::Tensor& out) {
  using radixserve::q8::Format;
  const Format f = !w.q4() ? Format::kQ8_0 : w.m == nullptr ? Format::kQ4_0 : Format::kQ4_1;
  const int32_t offset = f == Format::kQ4_0 ? 8 : f == Format::kQ8_0 ? 128 : 0;
  std::vector<int32_t> starts(x.code_sums.size());
  for (size_t i = 0; i < starts.size(); ++i) starts[i] = -offset * x.code_sums[i];
  const radixserve::q8::Rows rows{x.codes.data_ptr<int8_t>(), x.scales.data(), x.sums.data(), starts.data(),
                                  x.codes.size(1), x.ld};
  const auto store = [&](int64_t row, int64_t n0, int64_t count, const float* v) {
    epilogue.store_row(row, n0, count, v);
  };
  const auto* d = reinterpret_cast<const uint16_t*>(w.d);
  const auto* m = reinterpret_cast<const uint16_t*>(w.m);
  const int64_t num_rows = x.codes.size(0);
  at::parallel_for(0, epilogue.out_features, 16, [&](int64_t n0, int64_t n1) {
    const auto run = [&](auto format) {
      constexpr Format F = decltype(format)::value;
      radixserve::q8::Channels<F> channels{w.qs, d, m, w.qs_row_bytes, w.blocks, n1};
      radixserve::q8::linear_channels<F>(rows, num_rows, channels, n0, store);
    };
    switch (f) {
      case Format::kQ4_0: return run(std::integral_constant<Format, Format::kQ4_0>{});
      case Format::kQ4_1: return run(std::integral_constant<Format, Format::kQ4_1>{});
      default: return run(std::integral_constant<Format, Format::kQ8_0>{});
    }
  });
  return out;
}
#endif

// x [M, K] @ W.T for the blocks W [N, K] with x's rows as int8 blocks, in x's dtype: + bias, then rounded, + residual
// (each optional): the residual's rounding as the GEMM path's `residual + linear(x)` (radixserve::Epilogue).
at::Tensor block_linear_q8_op(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                              const std::optional<at::Tensor>& m, const std::optional<at::Tensor>& bias,
                              const std::optional<at::Tensor>& residual) {
  const bool q4 = check_blocks(qs, d, m);
  const int64_t out_features = qs.size(0), blocks = d.size(1);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == blocks * kBlock, "x [M, K] against weights [N, K]");
  at::Tensor out;
  const radixserve::Epilogue epilogue =
      radixserve::make_epilogue(x, out_features, out, std::nullopt, bias, residual, /*round_before_residual=*/true);
  const Q8Rows xq = quantize_rows(x);
  const BlockWeights w{static_cast<const uint8_t*>(qs.data_ptr()), d.data_ptr<at::Half>(),
                       m.has_value() ? m->data_ptr<at::Half>() : nullptr, blocks, qs.size(1)};
#ifdef RADIXSERVE_Q8_PANELS
  return panels_linear(xq, w, epilogue, out);
#else
  at::parallel_for(0, out_features, 16, [&](int64_t n0, int64_t n1) {
    if (q4) linear_channels<true>(xq, w, n0, n1, epilogue);
    else linear_channels<false>(xq, w, n0, n1, epilogue);
  });
#endif
  return out;
}

// The activation codes alone, for tests: (codes int8 [M, K], scales float32 [M, K / 32]).
std::tuple<at::Tensor, at::Tensor> quantize_rows_q8_op(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % kBlock == 0, "x [M, K], K a multiple of 32");
  const Q8Rows q = quantize_rows(x);
  const int64_t blocks = x.size(1) / kBlock, ld = q.ld;
  at::Tensor scales = at::empty({x.size(0), blocks}, x.options().dtype(at::kFloat));
  for (int64_t r = 0; r < x.size(0); ++r)
    std::copy_n(q.scales.data() + r * ld, blocks, scales.data_ptr<float>() + r * blocks);
  return {q.codes, scales};
}

// x's rows as the values of their int8 codes (codes * scale, exact in float32), float32 [M, K], in one
// pass: the GEMM path's input (prefill rows), where torch ops took ~7 passes over x.
at::Tensor dequantized_rows_q8_op(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % kBlock == 0, "x [M, K], K a multiple of 32");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor out = at::empty_like(xf);
  const int64_t blocks = xf.numel() / kBlock;
  const float* xp = xf.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, blocks, 256, [&](int64_t b0, int64_t b1) {
    int8_t codes[kBlock];
    float sum;
    int32_t total;
    for (int64_t b = b0; b < b1; ++b) {
      const float scale = quantize_block(xp + b * kBlock, codes, &sum, &total);
      for (int j = 0; j < kBlock; ++j) op[b * kBlock + j] = static_cast<float>(codes[j]) * scale;
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixserve, m) {
  m.def(
      "block_linear_q8(Tensor x, Tensor qs, Tensor d, Tensor? m, Tensor? bias=None, Tensor? residual=None) -> Tensor");
  m.def("quantize_rows_q8(Tensor x) -> (Tensor, Tensor)");
  m.def("dequantized_rows_q8(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(radixserve, CPU, m) {
  m.impl("block_linear_q8", &block_linear_q8_op);
  m.impl("quantize_rows_q8", &quantize_rows_q8_op);
  m.impl("dequantized_rows_q8", &dequantized_rows_q8_op);
}

// Whether this build runs block_q8_panels.h (AVX512-VNNI): Q4_0's -8 is then folded into the integer dot
// products, and prefill runs at integer-GEMM speed; otherwise the kernel above (Q4_0 as Q4_1 with m = -8d).
TORCH_LIBRARY_FRAGMENT(radixserve, m) {
  m.def("block_q8_panels() -> bool", [] {
#ifdef RADIXSERVE_Q8_PANELS
    return true;
#else
    return false;
#endif
  });
}
