// Linear over GGUF-style blocks of 32 weights for many rows (prefill, long extends, mixed batches), and
// the blocks' dequantization: tiled_gemm.h's cache-sized tiles of dequantized weights through torch's GEMM, bitwise
// equal to the whole weight's GEMM (F.linear(x, W)).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#include "block_common.h"
#include "tiled_gemm.h"

namespace {

using radixserve::BlockWeights;
using radixserve::check_blocks;
using radixserve::kBlock;
using radixserve::padded;
using radixserve::row_scales;

// Output channels n0..n1 as float32 rows of in_features, into out (row n at out + (n - n0) * in_features):
// w = d * q (+ m; Q4_0's m = -8d). d * q is exact in float32 (11 x 8 bits at most), so whether the compiler fuses
// the add or not, each value equals GGUF's own dequantization.
void dequantize_channels(const BlockWeights& w, int64_t n0, int64_t n1, float* out) {
  const int64_t blocks = w.blocks, in_features = blocks * kBlock;
  const bool q4 = w.q4();
  std::vector<float> dn(padded(blocks)), mn(padded(blocks), 0.f);
  for (int64_t n = n0; n < n1; ++n) {
    row_scales(w.d + n * blocks, blocks, dn.data());
    if (w.m != nullptr) row_scales(w.m + n * blocks, blocks, mn.data());
    else if (q4) radixserve::q4_0_mins(dn.data(), blocks, mn.data());
    const uint8_t* q = w.qs + n * w.qs_row_bytes;
    float* o = out + (n - n0) * in_features;
    for (int64_t b = 0; b < blocks; ++b) {
      float* ob = o + b * kBlock;
      if (q4) {
        const uint8_t* qb = q + b * 16;
#pragma omp simd
        for (int j = 0; j < 16; ++j) {
          ob[j] = dn[b] * static_cast<float>(qb[j] & 0x0F) + mn[b];
          ob[j + 16] = dn[b] * static_cast<float>(qb[j] >> 4) + mn[b];
        }
      } else {
        const int8_t* qb = reinterpret_cast<const int8_t*>(q + b * kBlock);
#pragma omp simd
        for (int j = 0; j < kBlock; ++j) ob[j] = dn[b] * static_cast<float>(qb[j]);
      }
    }
  }
}

#ifdef RADIXSERVE_BLOCK_AVX512BF16
// Whether every scale (and min) of channels n0..n1 is finite (a half's exponent bits not all ones). Then each
// w = d * q (+ m) is finite, and 0 or at least 2^-24 in magnitude (d, m and so d * q + m are multiples of
// 2^-24): never a float32 subnormal, which vcvtne2ps2bf16 would flush.
bool finite_scales(const BlockWeights& w, int64_t n0, int64_t n1) {
  for (const at::Half* h : {w.d, w.m}) {
    if (h == nullptr) continue;
    for (int64_t i = n0 * w.blocks; i < n1 * w.blocks; ++i)
      if ((h[i].x & 0x7C00) == 0x7C00) return false;
  }
  return true;
}

// dequantize_channels rounded to bfloat16 (bits, row n at out + (n - n0) * in_features) in registers: the same
// float32 values, rounded to nearest even by vcvtne2ps2bf16 as .to(torch.bfloat16) rounds them (no NaN and no
// subnormal can occur: finite_scales). One pass instead of a float32 tile written, read and cast (copy_).
void dequantize_channels_bf16(const BlockWeights& w, int64_t n0, int64_t n1, uint16_t* out) {
  const int64_t blocks = w.blocks, in_features = blocks * kBlock;
  std::vector<float> dn(padded(blocks)), mn(padded(blocks), 0.f);
  const __m512i low_nibble = _mm512_set1_epi32(0x0F);
  for (int64_t n = n0; n < n1; ++n) {
    row_scales(w.d + n * blocks, blocks, dn.data());
    uint16_t* o = out + (n - n0) * in_features;
    if (w.q4()) {
      if (w.m != nullptr) row_scales(w.m + n * blocks, blocks, mn.data());
      else radixserve::q4_0_mins(dn.data(), blocks, mn.data());
      const uint8_t* q = w.qs + n * w.qs_row_bytes;
      for (int64_t b = 0; b < blocks; ++b) {
        const __m512i codes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + b * 16)));
        const __m512 d = _mm512_set1_ps(dn[b]), m = _mm512_set1_ps(mn[b]);
        const __m512 lo = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_and_si512(codes, low_nibble)), m);
        const __m512 hi = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_srli_epi32(codes, 4)), m);
        _mm512_storeu_si512(o + b * kBlock, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
      }
    } else {
      const int8_t* q = reinterpret_cast<const int8_t*>(w.qs + n * w.qs_row_bytes);
      for (int64_t b = 0; b < blocks; ++b) {
        const __m512 d = _mm512_set1_ps(dn[b]);
        const __m512 lo = _mm512_mul_ps(
            d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + b * kBlock)))));
        const __m512 hi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                               _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + b * kBlock + 16)))));
        _mm512_storeu_si512(o + b * kBlock, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
      }
    }
  }
}
#endif

BlockWeights weights_of(const at::Tensor& qs, const at::Tensor& d, const std::optional<at::Tensor>& m, bool q4) {
  const at::Half* mins = q4 && m.has_value() ? m->data_ptr<at::Half>() : nullptr;  // nullptr: Q8_0, or Q4_0
  return {static_cast<const uint8_t*>(qs.data_ptr()), d.data_ptr<at::Half>(), mins, d.size(1), qs.size(1)};
}

// Float32 [N, K] weights from the blocks (the whole weight: loading, the embedding, tests).
at::Tensor block_dequantize_op(const at::Tensor& qs, const at::Tensor& d, const std::optional<at::Tensor>& m) {
  const BlockWeights w = weights_of(qs, d, m, check_blocks(qs, d, m));
  at::Tensor out = at::empty({qs.size(0), w.blocks * kBlock}, d.options().dtype(at::kFloat));
  float* op = out.data_ptr<float>();
  at::parallel_for(0, qs.size(0), 16, [&](int64_t n0, int64_t n1) {
    dequantize_channels(w, n0, n1, op + n0 * w.blocks * kBlock);
  });
  return out;
}

// tiled_gemm.h's weights: the blocks' channels as float32, or (AVX512-BF16, finite scales) straight to bfloat16.
struct BlockTiles {
  const BlockWeights& w;
  void to_float(int64_t a, int64_t b, float* out) const { dequantize_channels(w, a, b, out); }
#ifdef RADIXSERVE_BLOCK_AVX512BF16
  bool bf16_direct(int64_t n0, int64_t n1) const { return finite_scales(w, n0, n1); }
  void to_bf16(int64_t a, int64_t b, uint16_t* out) const { dequantize_channels_bf16(w, a, b, out); }
#else
  bool bf16_direct(int64_t, int64_t) const { return false; }
  void to_bf16(int64_t, int64_t, uint16_t*) const {}
#endif
};

// x [T, K] @ W.T (+ bias) -> [T, N] in x's dtype (tiled_gemm).
at::Tensor block_linear_tiled_op(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                                 const std::optional<at::Tensor>& m, const std::optional<at::Tensor>& bias,
                                 int64_t tile_columns) {
  const BlockWeights w = weights_of(qs, d, m, check_blocks(qs, d, m));
  const int64_t out_features = qs.size(0);
  radixserve::check_tiled_rows(x, w.blocks * kBlock, tile_columns);
  radixserve::check_tiled_bias(bias, x.size(0), out_features);
  at::Tensor out = at::empty({x.size(0), out_features}, x.options());
  radixserve::tiled_gemm(x, BlockTiles{w}, w.blocks * kBlock, bias, tile_columns, out, false);
  return out;
}

// residual [T, N] += x [T, K] @ W.T, in place: the bits of block_linear_tiled(x, ..., bias=residual) (the same
// GEMM calls adding into the same values), without copying the residual into each tile's output first (SmolLM2's
// 2k prefill: 60 such copies of [2048, 576], ~9.5 ms). For a caller that no longer needs the residual.
at::Tensor block_linear_tiled_add_op(at::Tensor& residual, const at::Tensor& x, const at::Tensor& qs,
                                     const at::Tensor& d, const std::optional<at::Tensor>& m, int64_t tile_columns) {
  const BlockWeights w = weights_of(qs, d, m, check_blocks(qs, d, m));
  radixserve::check_tiled_rows(x, w.blocks * kBlock, tile_columns);
  radixserve::check_tiled_residual(residual, x, qs.size(0));
  radixserve::tiled_gemm(x, BlockTiles{w}, w.blocks * kBlock, std::nullopt, tile_columns, residual, true);
  return residual;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixserve, m) {
  m.def("block_dequantize(Tensor qs, Tensor d, Tensor? m) -> Tensor");
  m.def("block_linear_tiled(Tensor x, Tensor qs, Tensor d, Tensor? m, Tensor? bias, int tile_columns) -> Tensor");
  m.def(
      "block_linear_tiled_add_(Tensor(a!) residual, Tensor x, Tensor qs, Tensor d, Tensor? m, int tile_columns) -> "
      "Tensor(a!)");
}

TORCH_LIBRARY_IMPL(radixserve, CPU, m) {
  m.impl("block_dequantize", &block_dequantize_op);
  m.impl("block_linear_tiled", &block_linear_tiled_op);
  m.impl("block_linear_tiled_add_", &block_linear_tiled_add_op);
}
