// Linear over the GGUF row types with codes (Q4_K, Q5_K, Q6_K, Q5_0, Q5_1; gguf_rows_q8.h) with int8 activations,
// as llama.cpp's CPU backend multiplies them (it quantizes activations to 8 bits for every quantized dot product;
// here per block of 32, block_q8_rows.h, as the Q4_0 / Q8_0 path does). Each block's dot product is exact integer
// arithmetic; the float steps are each kernel's own (below), the same at any row count and thread split (threads
// split output channels): a row's bits never depend on its batch.
//
// With AVX512-VNNI the panel kernel (block_q8_panels.h: one float32 accumulator per output, blocks in order) runs
// every row count; with AVX2 and no VNNI panels gguf_rows_q8_avx2.h's kernel (the same integers, its own float sums:
// 8 lanes a row, even and odd blocks apart, the terms without codes 8 blocks at a time); elsewhere a portable loop
// with the panels' integers and float operations (std::fma where the vector code fuses).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

#include "block_common.h"
#include "block_q8_panels.h"
#include "block_q8_rows.h"
#include "gguf_rows_q8.h"
#include "gguf_rows_q8_avx2.h"

namespace {

namespace gr = radixserve::gguf_rows;
using radixserve::kBlock;

// Each block's integer start (Q5_0: -16 sum; Q6_K: -32 sum of its first 16 codes) and Q6_K's of its last 16,
// [rows, ld] as x's scales.
struct Starts {
  std::vector<int32_t> first, second;
};

template <typename T>
Starts block_starts(const radixserve::Q8Rows& x) {
  constexpr int32_t offset = gr::kCodeOffset<T>;
  Starts s{std::vector<int32_t>(x.code_sums.size(), 0), {}};
  if constexpr (T::kType == gr::Q6_K) s.second.assign(x.code_sums.size(), 0);
  if (offset == 0) return s;
  const int64_t rows = x.codes.size(0), blocks = x.codes.size(1) / kBlock;
  const int8_t* q = x.codes.data_ptr<int8_t>();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t at = r * x.ld + b;
      if constexpr (T::kType == gr::Q6_K) {
        int32_t first = 0;
        for (int l = 0; l < 16; ++l) first += q[(r * blocks + b) * kBlock + l];
        s.first[at] = -offset * first;
        s.second[at] = -offset * (x.code_sums[at] - first);
      } else {
        s.first[at] = -offset * x.code_sums[at];
      }
    }
  return s;
}

// Row n's integer dot with block b of activation row r (gguf_rows_q8.h's math; q the row's codes).
template <typename T>
int32_t block_dot(const uint8_t* q, const int8_t* x, const Starts& s, int64_t at, int sc_a, int sc_b) {
  int32_t a = s.first[at], b = 0;
  for (int l = 0; l < 16; ++l) a += q[l] * x[l];
  if constexpr (T::kType == gr::Q6_K) {
    b = s.second[at];
    for (int l = 16; l < 32; ++l) b += q[l] * x[l];
    return sc_a * a + sc_b * b;
  }
  for (int l = 16; l < 32; ++l) a += q[l] * x[l];
  return a;
}

// The portable kernel: channel by channel, its codes and scales decoded once, then every row.
template <typename T>
void linear_portable(const radixserve::Q8Rows& x, const Starts& s, const gr::RowWeights& w, int64_t n0, int64_t n1,
                     const radixserve::Epilogue& out) {
  const int64_t rows = x.codes.size(0), blocks = w.in_features / kBlock;
  std::vector<uint8_t> q(w.in_features);
  std::vector<float> d(blocks), m(blocks);
  std::vector<int> sc(2 * blocks);
  const int8_t* xq = x.codes.data_ptr<int8_t>();
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w.raw + n * w.row_bytes;
    for (int64_t b = 0; b < blocks; ++b)
      for (int l = 0; l < kBlock; ++l) q[b * kBlock + l] = static_cast<uint8_t>(gr::code<T>(row, b, l));
    for (int64_t u = 0; u < w.in_features / T::kWeights; ++u)
      gr::block_scales<T>(row + u * T::kBytes, [&](int j, float dj, float mj, int sa, int sb) {
        const int64_t b = u * T::kWeights / kBlock + j;
        d[b] = dj, m[b] = mj, sc[2 * b] = sa, sc[2 * b + 1] = sb;
      });
    for (int64_t r = 0; r < rows; ++r) {
      float acc = 0.f;
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t at = r * x.ld + b;
        const int32_t dot = block_dot<T>(q.data() + b * kBlock, xq + (r * blocks + b) * kBlock, s, at, sc[2 * b],
                                         sc[2 * b + 1]);
        acc = std::fma(static_cast<float>(dot), d[b] * x.scales[at], acc);
        if (T::kType == gr::Q4_K || T::kType == gr::Q5_K || T::kType == gr::Q5_1) acc = std::fma(m[b], x.sums[at], acc);
      }
      out.store(r, n, acc);
    }
  }
}

// x [M, K] @ W.T (+ bias) (+ residual) in x's dtype for rows of a type with codes (gguf_rows_q8.h), x's rows as int8
// blocks of 32. The residual is added after rounding, then rounded again, as the GEMM path's residual + linear(x)
// (radixserve::Epilogue), as block_linear_q8.
at::Tensor linear_q8_op(const at::Tensor& x, const at::Tensor& raw, int64_t qtype, int64_t in_features,
                        const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& residual) {
  const gr::RowWeights w = gr::check_raw(raw, qtype, in_features);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == in_features && x.device().is_cpu(), "x [M, K] on CPU, weights [N, K]");
  at::Tensor out;
  const radixserve::Epilogue epilogue = radixserve::make_epilogue(x, raw.size(0), out, std::nullopt, bias, residual,
                                                                  /*round_before_residual=*/true);
  const radixserve::Q8Rows xq = radixserve::quantize_rows(x);
  gr::dispatch(qtype, [&](auto t) {
    using T = decltype(t);
    if constexpr (!gr::kQ8Rows<T>) {
      TORCH_CHECK(false, "gguf_rows_linear_q8: qtype ", qtype, " has no codes (Q4_K, Q5_K, Q6_K, Q5_0, Q5_1 do)");
    } else {
      const Starts s = block_starts<T>(xq);
#ifdef RADIXSERVE_Q8_PANELS
      const radixserve::q8::Rows rows{xq.codes.data_ptr<int8_t>(), xq.scales.data(), xq.sums.data(),
                                      s.first.data(), in_features, xq.ld, s.second.empty() ? nullptr : s.second.data()};
      const auto store = [&](int64_t row, int64_t n0, int64_t count, const float* v) {
        epilogue.store_row(row, n0, count, v);
      };
      at::parallel_for(0, raw.size(0), 16, [&](int64_t n0, int64_t n1) {
        gr::RowChannels<T> channels{w.raw, w.row_bytes, in_features / kBlock, n1};
        radixserve::q8::linear_channels<gr::kFormat<T>>(rows, x.size(0), channels, n0, store);
      });
#elif defined(RADIXSERVE_ROWS_Q8_AVX2)
      const int32_t* second = s.second.empty() ? nullptr : s.second.data();
      at::parallel_for(0, raw.size(0), 16, [&](int64_t n0, int64_t n1) {
        gr::q8avx2::linear_channels<T>(xq, s.first.data(), second, w, n0, n1, epilogue);
      });
#else
      at::parallel_for(0, raw.size(0), 16,
                       [&](int64_t n0, int64_t n1) { linear_portable<T>(xq, s, w, n0, n1, epilogue); });
#endif
    }
  });
  return out;
}

// Whether this build runs the int8 rows on SIMD code (AVX512-VNNI: block_q8_panels.h; AVX2: gguf_rows_q8_avx2.h):
// elsewhere they take the portable loop, slower than the float rows' kernel.
bool q8_rows_simd() {
#if defined(RADIXSERVE_Q8_PANELS) || defined(RADIXSERVE_ROWS_Q8_AVX2)
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixserve, m) {
  m.def(
      "gguf_rows_linear_q8(Tensor x, Tensor raw, int qtype, int in_features, Tensor? bias=None, "
      "Tensor? residual=None) -> Tensor");
  m.def("gguf_rows_q8_simd() -> bool", &q8_rows_simd);
}

TORCH_LIBRARY_IMPL(radixserve, CPU, m) { m.impl("gguf_rows_linear_q8", &linear_q8_op); }
