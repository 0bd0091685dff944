// Linear over weights kept in a compact form (GGUF blocks: block_gemm.cpp; GGUF rows: gguf_rows_linear.cpp) for many
// rows (prefill, long extends, mixed batches). Each tile of output channels is dequantized into one small buffer of
// x's dtype that stays in cache, then multiplied by torch's own GEMM (at::mm_out) into its columns of the output: no
// call allocates or streams a whole float weight (SmolLM2's 30 layers: 425 MB written and read back per forward when
// the whole weight was dequantized per call, for an 80-token extend as for a 2k prefill). The GEMM's result for an
// output column depends only on x and that column's weights, so a tile's columns come out bitwise equal to the whole
// weight's GEMM (F.linear(x, W)): tests check it.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <optional>

namespace radixserve {

// The tiles of x [T, K] @ W.T into out [T, N] (x's dtype, contiguous), W dequantized about tile_columns output
// channels at a time: N // tile_columns tiles of near-equal widths, each starting at a multiple of 16 channels.
// A GEMM of a few columns alone takes another path in MKL (another summation order; measured: the 3-8 columns
// of a narrow last tile differed in their last bit), where the same columns inside a wider GEMM do not. As
// F.linear: addmm with a bias (the bias enters the GEMM's accumulator first), mm without, the tile in x's dtype
// (float32 values rounded as .to(dtype) rounds them). accumulate: out already holds the addend (a residual)
// and each tile's GEMM adds into its columns in place (addmm_: beta 1, no copy of the addend first).
//
// `weights` dequantizes output channels a..b (row n at out + (n - a) * K), called in parallel on disjoint ranges:
//   to_float(a, b, float* out): the float32 values;
//   bf16_direct(n0, n1): whether to_bf16 gives channels n0..n1 as to_float's values rounded by .to(torch.bfloat16);
//   to_bf16(a, b, uint16_t* out): those bfloat16 bits (else the float32 tile is cast: copy_).
template <typename Weights>
void tiled_gemm(const at::Tensor& x, const Weights& weights, int64_t in_features, const std::optional<at::Tensor>& bias,
                int64_t tile_columns, at::Tensor& out, bool accumulate) {
  const int64_t out_features = out.size(1);
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
    if (x.scalar_type() == at::kBFloat16 && weights.bf16_direct(n0, n0 + width)) {
      uint16_t* wp = reinterpret_cast<uint16_t*>(weight_buffer.data_ptr<at::BFloat16>());
      at::parallel_for(n0, n0 + width, 8, [&](int64_t a, int64_t b) {
        weights.to_bf16(a, b, wp + (a - n0) * in_features);
      });
    } else {
      if (x.scalar_type() == at::kFloat) float_buffer = weight_buffer;
      else if (!float_buffer.defined()) float_buffer = at::empty({widest, in_features}, x.options().dtype(at::kFloat));
      float* bp = float_buffer.data_ptr<float>();
      at::parallel_for(n0, n0 + width, 8, [&](int64_t a, int64_t b) {
        weights.to_float(a, b, bp + (a - n0) * in_features);
      });
      if (x.scalar_type() != at::kFloat) weight.copy_(float_buffer.narrow(0, 0, width));
    }
    at::Tensor columns = out.narrow(1, n0, width);  // row stride N: a valid GEMM output in place
    if (accumulate) columns.addmm_(xc, weight.t());
    else if (bias.has_value()) at::addmm_out(columns, bias->narrow(bias->dim() - 1, n0, width), xc, weight.t());
    else at::mm_out(columns, xc, weight.t());
  }
}

inline void check_tiled_rows(const at::Tensor& x, int64_t in_features, int64_t tile_columns) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == in_features && x.device().is_cpu(), "x [M, K] on CPU, weights [N, K]");
  TORCH_CHECK(at::isFloatingType(x.scalar_type()), "x: a floating dtype");
  TORCH_CHECK(tile_columns > 0, "tile_columns must be positive");
}

// bias of the tiled op: [N], or [T, N] (a residual, added inside the GEMM as the float model's addmm adds it).
inline void check_tiled_bias(const std::optional<at::Tensor>& bias, int64_t rows, int64_t out_features) {
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == out_features) ||
                  (bias->dim() == 2 && bias->size(0) == rows && bias->size(1) == out_features),
              "bias [N] or [T, N]");
}

// residual of the in-place tiled add: contiguous [T, N] in x's dtype.
inline void check_tiled_residual(const at::Tensor& residual, const at::Tensor& x, int64_t out_features) {
  TORCH_CHECK(residual.dim() == 2 && residual.size(0) == x.size(0) && residual.size(1) == out_features &&
                  residual.is_contiguous() && residual.scalar_type() == x.scalar_type(),
              "residual: contiguous [T, N] in x's dtype");
}

}  // namespace radixserve
