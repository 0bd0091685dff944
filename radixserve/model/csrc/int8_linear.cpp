// Weight-only int8 linear for few rows (decode): out[m][n] = scale[n] * sum_k x[m][k] * w[n][k].
// Batch-1 decode is bound by reading weights; this reads 1 byte per weight where a float32
// matmul reads 4. torch's own _weight_int8pack_mm is vectorised for AVX512 only and runs
// many times slower than float32 on AVX2; this one leaves vectorisation to the compiler
// (-march=native), which turns the loop into int8 -> float converts and FMAs on any x86.
// Each row's result depends on that row only: batch composition changes nothing.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kRowTile = 4;  // x rows sharing one pass over a weight row (kept in L1)

// Several rows: the weight row is converted to float once (into L1), then read per x row.
void int8_rows(const float* x, int64_t rows, const int8_t* w, const float* scales, int64_t n0, int64_t n1,
               int64_t in_features, int64_t out_features, float* out) {
  std::vector<float> wf(rows > 1 ? in_features : 0);
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* wr = w + n * in_features;
    if (rows == 1) {
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t k = 0; k < in_features; ++k) s += x[k] * static_cast<float>(wr[k]);
      out[n] = s * scales[n];
      continue;
    }
#pragma omp simd
    for (int64_t k = 0; k < in_features; ++k) wf[k] = static_cast<float>(wr[k]);
    for (int64_t m = 0; m < rows; ++m) {
      const float* xr = x + m * in_features;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t k = 0; k < in_features; ++k) s += xr[k] * wf[k];
      out[m * out_features + n] = s * scales[n];
    }
  }
}

at::Tensor int8_linear_op(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x [M, K], w [N, K]");
  TORCH_CHECK(w.scalar_type() == at::kChar && w.is_contiguous(), "w: contiguous int8");
  TORCH_CHECK(scales.numel() == w.size(0), "one scale per output channel");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const at::Tensor sf = scales.to(at::kFloat).contiguous();
  const int64_t rows = x.size(0), in_features = w.size(1), out_features = w.size(0);
  at::Tensor out = at::empty({rows, out_features}, x.options().dtype(at::kFloat));
  const float* xp = xf.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, out_features, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t m0 = 0; m0 < rows; m0 += kRowTile)
      int8_rows(xp + m0 * in_features, std::min(kRowTile, rows - m0), w.data_ptr<int8_t>(), sf.data_ptr<float>(),
                n0, n1, in_features, out_features, op + m0 * out_features);
  });
  return out.to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixserve, m) { m.def("int8_linear(Tensor x, Tensor w, Tensor scales) -> Tensor"); }

TORCH_LIBRARY_IMPL(radixserve, CPU, m) { m.impl("int8_linear", &int8_linear_op); }
