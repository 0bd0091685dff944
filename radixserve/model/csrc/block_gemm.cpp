// Linear over GGUF-style blocks of 32 weights for many rows (prefill, long extends, mixed batches), and
// the blocks' dequantization. Each tile of output channels is dequantized into one small float buffer
// that stays in cache, then multiplied by torch's own GEMM (at::mm_out) into its columns of the output:
// no call allocates or streams a whole float weight (SmolLM2's 30 layers: 425 MB written and read back
// per forward when the whole weight was dequantized per call, for an 80-token extend as for a 2k prefill).
// The GEMM's result for an output column depends only on x and that column's weights, so a tile's
// columns come out bitwise equal to the whole weight's GEMM (F.linear(x, W)): tests check it.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#include "block_common.h"

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

// The tiles of x [T, K] @ W.T into out [T, N] (x's dtype, contiguous), W dequantized about tile_columns output
// channels at a time: N // tile_columns tiles of near-equal widths, each starting at a multiple of 16 channels.
// A GEMM of a few columns alone takes another path in MKL (another summation order; measured: the 3-8 columns
// of a narrow last tile differed in their last bit), where the same columns inside a wider GEMM do not. As
// F.linear: addmm with a bias (the bias enters the GEMM's accumulator first), mm without, the tile in x's dtype
// (float32 values rounded as .to(dtype) rounds them). accumulate: out already holds the addend (a residual)
// and each tile's GEMM adds into its columns in place (addmm_: beta 1, no copy of the addend first).
void tiled_gemm(const at::Tensor& x, const BlockWeights& w, const std::optional<at::Tensor>& bias,
                int64_t tile_columns, at::Tensor& out, bool accumulate) {
  const int64_t out_features = out.size(1), in_features = w.blocks * kBlock;
  const at::Tensor xc = x.contiguous();
  const int64_t tiles = std::max<int64_t>(1, out_features / tile_columns);
  const auto start = [&](int64_t t) { return t == tiles ? out_features : t * out_features / tiles / 16 * 16; };
  int64_t widest = 0;
  for (int64_t t = 0; t < tiles; ++t) widest = std::max(widest, start(t + 1) - start(t));
  at::Tensor weight_buffer = at::empty({widest, in_features}, x.options());
  at::Tensor float_buffer;  // the float32 tile, for float32 x, or to be cast to x's dtype
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t n0 = start(t), width = start(t + 1) - n0;
    at::Tensor weight = weight_buffer.narrow(0, 0, width);
#ifdef RADIXSERVE_BLOCK_AVX512BF16
    if (x.scalar_type() == at::kBFloat16 && finite_scales(w, n0, n0 + width)) {
      uint16_t* wp = reinterpret_cast<uint16_t*>(weight_buffer.data_ptr<at::BFloat16>());
      at::parallel_for(n0, n0 + width, 8, [&](int64_t a, int64_t b) {
        dequantize_channels_bf16(w, a, b, wp + (a - n0) * in_features);
      });
    } else
#endif
    {
      if (x.scalar_type() == at::kFloat) float_buffer = weight_buffer;
      else if (!float_buffer.defined()) float_buffer = at::empty({widest, in_features}, x.options().dtype(at::kFloat));
      float* bp = float_buffer.data_ptr<float>();
      at::parallel_for(n0, n0 + width, 8, [&](int64_t a, int64_t b) {
        dequantize_channels(w, a, b, bp + (a - n0) * in_features);
      });
      if (x.scalar_type() != at::kFloat) weight.copy_(float_buffer.narrow(0, 0, width));
    }
    at::Tensor columns = out.narrow(1, n0, width);  // row stride N: a valid GEMM output in place
    if (accumulate) columns.addmm_(xc, weight.t());
    else if (bias.has_value()) at::addmm_out(columns, bias->narrow(bias->dim() - 1, n0, width), xc, weight.t());
    else at::mm_out(columns, xc, weight.t());
  }
}

void check_rows(const at::Tensor& x, int64_t in_features, int64_t tile_columns) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == in_features && x.device().is_cpu(), "x [M, K] on CPU, weights [N, K]");
  TORCH_CHECK(at::isFloatingType(x.scalar_type()), "x: a floating dtype");
  TORCH_CHECK(tile_columns > 0, "tile_columns must be positive");
}

// x [T, K] @ W.T (+ bias) -> [T, N] in x's dtype (tiled_gemm).
at::Tensor block_linear_tiled_op(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                                 const std::optional<at::Tensor>& m, const std::optional<at::Tensor>& bias,
                                 int64_t tile_columns) {
  const BlockWeights w = weights_of(qs, d, m, check_blocks(qs, d, m));
  const int64_t out_features = qs.size(0);
  check_rows(x, w.blocks * kBlock, tile_columns);
  // bias: [N], or [T, N] (a residual, added inside the GEMM as the float model's addmm adds it).
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == out_features) ||
                  (bias->dim() == 2 && bias->size(0) == x.size(0) && bias->size(1) == out_features),
              "bias [N] or [T, N]");
  at::Tensor out = at::empty({x.size(0), out_features}, x.options());
  tiled_gemm(x, w, bias, tile_columns, out, false);
  return out;
}

// residual [T, N] += x [T, K] @ W.T, in place: the bits of block_linear_tiled(x, ..., bias=residual) (the same
// GEMM calls adding into the same values), without copying the residual into each tile's output first (SmolLM2's
// 2k prefill: 60 such copies of [2048, 576], ~9.5 ms). For a caller that no longer needs the residual.
at::Tensor block_linear_tiled_add_op(at::Tensor& residual, const at::Tensor& x, const at::Tensor& qs,
                                     const at::Tensor& d, const std::optional<at::Tensor>& m, int64_t tile_columns) {
  const BlockWeights w = weights_of(qs, d, m, check_blocks(qs, d, m));
  check_rows(x, w.blocks * kBlock, tile_columns);
  TORCH_CHECK(residual.dim() == 2 && residual.size(0) == x.size(0) && residual.size(1) == qs.size(0) &&
                  residual.is_contiguous() && residual.scalar_type() == x.scalar_type(),
              "residual: contiguous [T, N] in x's dtype");
  tiled_gemm(x, w, std::nullopt, tile_columns, residual, true);
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
