// What both block linears share (block_linear.cpp: float32 activations; block_q8_linear.cpp: int8
// activations): GGUF's block of 32, the per-row scales as float32, and the weights' checks.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <optional>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define RADIXSERVE_BLOCK_AVX2 1
#endif
// AVX512 (Zen 4/5, Intel since Skylake-SP): 16 floats a register, a block of 32 weights in two; with
// AVX512-BF16 a bfloat16 dot product of a whole block in one instruction (vdpbf16ps).
#if defined(RADIXSERVE_BLOCK_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define RADIXSERVE_BLOCK_AVX512 1
#if defined(__AVX512BF16__)
#define RADIXSERVE_BLOCK_AVX512BF16 1
#endif
#include "bf16.h"
#include "simd_reduce.h"
#endif

namespace radixserve {

constexpr int64_t kBlock = 32;

// Q4_0 (w = d * (q - 8), no m stored) runs as Q4_1 with m = -8d, made from d where a kernel reads its mins
// (q4_0_mins): exact in float32 (a power-of-two multiple of a float16), so the same bits as Q4_1 blocks with that m.
struct BlockWeights {
  const uint8_t* qs;     // Q4_0 / Q4_1: 16 bytes per block; Q8_0: 32 int8 per block
  const at::Half* d;     // [N, blocks]
  const at::Half* m;     // [N, blocks]; nullptr for Q8_0 and Q4_0
  int64_t blocks;        // per output row: K / 32
  int64_t qs_row_bytes;  // bytes of qs per output row
  bool q4() const { return qs_row_bytes == blocks * 16; }
};

// Q4_0's mins from its scales, already float32: m[i] = -8 * d[i] for count values (exact).
inline void q4_0_mins(const float* d, int64_t count, float* m) {
  for (int64_t i = 0; i < count; ++i) m[i] = -8.f * d[i];
}

// Scales of one output row, and x's block sums, are padded with zeros to a multiple of 8 blocks:
// the min term is then a plain 8-wide dot product.
inline int64_t padded(int64_t blocks) { return (blocks + 7) / 8 * 8; }

// d (or m) of one output row as float32 into out[padded(count)], zeros past count.
inline void row_scales(const at::Half* h, int64_t count, float* out) {
  int64_t i = 0;
#ifdef RADIXSERVE_BLOCK_AVX2
  for (; i + 8 <= count; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))));
  for (; i < count; ++i) out[i] = _cvtsh_ss(h[i].x);
#else
  for (; i < count; ++i) out[i] = static_cast<float>(h[i]);
#endif
  for (; i < padded(count); ++i) out[i] = 0.f;
}

// The scales (and Q4_1's mins) of output channels c0..c1 as float32, each row ld >= padded(blocks) apart: a chunk
// of channels is converted once, then read once per tile of activation rows.
template <bool Q4>
inline void chunk_scales(const BlockWeights& w, int64_t c0, int64_t c1, float* d, float* m, int64_t ld) {
  for (int64_t n = c0; n < c1; ++n) {
    row_scales(w.d + n * w.blocks, w.blocks, d + (n - c0) * ld);
    if constexpr (Q4) {
      if (w.m != nullptr) row_scales(w.m + n * w.blocks, w.blocks, m + (n - c0) * ld);
      else q4_0_mins(d + (n - c0) * ld, padded(w.blocks), m + (n - c0) * ld);
    }
  }
}

#ifdef RADIXSERVE_BLOCK_AVX2
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// What a kernel does with a row's float32 sum for output channel n before storing it in out's dtype (float32,
// bfloat16 or float16, rounded to nearest even as at::Tensor::to rounds): times the channel's scale (int8
// weight-only: per-channel scales), plus the bias, plus the residual row (residual + linear(x) in one pass).
// The residual is added before the one rounding (as addmm adds it: the float model's and q4_1-exact's GEMM
// path), or with round_before_residual after rounding the product, then rounded again: the bits of
// `residual + linear(x)` in torch ops, as the paths whose prefill adds that way (int8 weights or activations)
// do, so a row's decode and prefill round alike. bias, scales [N] and residual [M, N] are in out's dtype.
struct Epilogue {
  void* out;
  at::ScalarType dtype;
  int64_t out_features;
  const void* scales = nullptr;
  const void* bias = nullptr;
  const void* residual = nullptr;
  bool round_before_residual = false;

  template <typename T>
  void store_as(int64_t row, int64_t n, float v) const {
    const int64_t at = row * out_features + n;
    if (scales != nullptr) v *= static_cast<float>(static_cast<const T*>(scales)[n]);
    if (bias != nullptr) v += static_cast<float>(static_cast<const T*>(bias)[n]);
    if (residual != nullptr && round_before_residual) v = static_cast<float>(static_cast<T>(v));
    if (residual != nullptr) v += static_cast<float>(static_cast<const T*>(residual)[at]);
    static_cast<T*>(out)[at] = static_cast<T>(v);
  }

  void store(int64_t row, int64_t n, float v) const {
    switch (dtype) {
      case at::kBFloat16: return store_as<at::BFloat16>(row, n, v);
      case at::kHalf: return store_as<at::Half>(row, n, v);
      default: return store_as<float>(row, n, v);
    }
  }

  // store() of channels n0 .. n0 + count of one row, v[i] being channel n0 + i's sum. With AVX512, float32 and
  // bfloat16 outputs go 16 channels at a time through the same operations (the scalar path spent ~20
  // instructions and a dtype switch an output: at 16 decode rows about as many as the dot products).
  void store_row(int64_t row, int64_t n0, int64_t count, const float* v) const {
#ifdef RADIXSERVE_BLOCK_AVX512
    if (dtype == at::kFloat || dtype == at::kBFloat16) {
      for (int64_t i = 0; i < count; i += 16) {
        const __mmask16 k = count - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (count - i)) - 1);
        store16(row * out_features + n0 + i, n0 + i, k, _mm512_maskz_loadu_ps(k, v + i));
      }
      return;
    }
#endif
    for (int64_t i = 0; i < count; ++i) store(row, n0 + i, v[i]);
  }

#ifdef RADIXSERVE_BLOCK_AVX512
 private:
  // 16 values of out's dtype (float32 or bfloat16) from p + i as float32; lanes outside k are 0.
  __m512 load16(const void* p, int64_t i, __mmask16 k) const {
    if (dtype == at::kFloat) return _mm512_maskz_loadu_ps(k, static_cast<const float*>(p) + i);
    const __m256i h = _mm256_maskz_loadu_epi16(k, static_cast<const uint16_t*>(p) + i);
    return bf16x16_to_float(h);
  }

  // v rounded to out's dtype and back (float32: as it is).
  __m512 round16(__m512 v) const { return dtype == at::kFloat ? v : round_bf16_16(v); }

  // store_as for the 16 channels n .. n + 16 (lanes in k) at flat index i; each step a separate instruction as in
  // store_as (no multiply-add contracted), so every output's bits are the scalar path's.
  void store16(int64_t i, int64_t n, __mmask16 k, __m512 v) const {
    if (scales != nullptr) {
      v = _mm512_mul_ps(v, load16(scales, n, k));
      __asm__("" : "+v"(v));
    }
    if (bias != nullptr) v = _mm512_add_ps(v, load16(bias, n, k));
    if (residual != nullptr && round_before_residual) v = round16(v);
    if (residual != nullptr) v = _mm512_add_ps(v, load16(residual, i, k));
    if (dtype == at::kFloat)
      _mm512_mask_storeu_ps(static_cast<float*>(out) + i, k, v);
    else
      _mm256_mask_storeu_epi16(static_cast<uint16_t*>(out) + i, k, _mm512_cvtepi32_epi16(bf16_bits16(v)));
  }
#endif
};

#ifdef RADIXSERVE_BLOCK_AVX512
// sums[r * ld + c] = the sum of acc[r][c]'s 16 lanes (R * C <= 16): one transposed reduction (simd::reduce16, the
// bits of _mm512_reduce_add_ps) instead of N, so a sum does not depend on how many share it. Inlined: as a call,
// the tile's accumulators went through the stack (at 16 bfloat16 rows, half the time of the tile's dot loop).
template <int R, int C>
__attribute__((always_inline)) inline void reduce_tile(const __m512 (&acc)[R][C], float* sums, int64_t ld) {
  static_assert(R * C <= 16, "a tile of up to 16 accumulators");
  __m512 v[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) v[i] = i < R * C ? acc[i / C][i % C] : _mm512_setzero_ps();
  alignas(64) float all[16];
  _mm512_store_ps(all, simd::reduce16(v));
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) sums[r * ld + c] = all[r * C + c];
}
#endif

// An epilogue writing into a new [rows, N] tensor of x's dtype (float32, bfloat16 or float16), with
// optional scales, bias and residual in that dtype. The tensors it points into must outlive the kernel.
inline Epilogue make_epilogue(const at::Tensor& x, int64_t out_features, at::Tensor& out,
                              const std::optional<at::Tensor>& scales, const std::optional<at::Tensor>& bias,
                              const std::optional<at::Tensor>& residual, bool round_before_residual) {
  const at::ScalarType dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "x: float32, bfloat16 or float16");
  const auto vector_ok = [&](const std::optional<at::Tensor>& t) {
    return !t.has_value() || (t->scalar_type() == dtype && t->is_contiguous() && t->numel() == out_features);
  };
  TORCH_CHECK(vector_ok(scales), "scales: contiguous [N] in x's dtype");
  TORCH_CHECK(vector_ok(bias), "bias: contiguous [N] in x's dtype");
  TORCH_CHECK(!residual.has_value() || (residual->scalar_type() == dtype && residual->is_contiguous() &&
                                        residual->dim() == 2 && residual->size(0) == x.size(0) &&
                                        residual->size(1) == out_features),
              "residual: contiguous [M, N] in x's dtype");
  out = at::empty({x.size(0), out_features}, x.options());
  const auto ptr = [](const std::optional<at::Tensor>& t) -> const void* {
    return t.has_value() ? t->data_ptr() : nullptr;
  };
  return {out.data_ptr(), dtype, out_features, ptr(scales), ptr(bias), ptr(residual), round_before_residual};
}

// Checks shapes and dtypes; true for Q4_1 / Q4_0 (qs uint8 [N, K/2]; m for Q4_1 only), false for Q8_0 (qs int8
// [N, K]).
inline bool check_blocks(const at::Tensor& qs, const at::Tensor& d, const std::optional<at::Tensor>& m) {
  const bool q4 = qs.scalar_type() == at::kByte;
  TORCH_CHECK(q4 || qs.scalar_type() == at::kChar, "qs: uint8 (Q4_1, Q4_0) or int8 (Q8_0)");
  TORCH_CHECK(qs.dim() == 2 && qs.is_contiguous() && qs.device().is_cpu(), "qs: contiguous [N, bytes] on CPU");
  const int64_t in_features = q4 ? 2 * qs.size(1) : qs.size(1);
  TORCH_CHECK(in_features % kBlock == 0, "in_features must be a multiple of 32");
  const auto scales_ok = [&](const at::Tensor& t) {
    return t.scalar_type() == at::kHalf && t.is_contiguous() && t.dim() == 2 && t.size(0) == qs.size(0) &&
           t.size(1) == in_features / kBlock;
  };
  TORCH_CHECK(scales_ok(d), "d: contiguous float16 [N, K / 32]");
  TORCH_CHECK(q4 || !m.has_value(), "m is given for Q4_1 only (Q8_0 and Q4_0 have none)");
  TORCH_CHECK(!m.has_value() || scales_ok(*m), "m: contiguous float16 [N, K / 32]");
  return q4;
}

// The decode kernels' walk over their output: chunks of kChunk channels (whose weights stay in cache across the
// row tiles), tiles of up to kRowTile rows, and within a tile as many channels per call as
// `tile(r0, rows, n, c1, sums)` computed (it returns that count and leaves row r's sums at sums + r * kChunk, in
// the chunk's buffer); then the tile's rows are stored a row at a time (Epilogue::store_row). ``row_tile``
// (<= kRowTile): the rows of a full tile, where a kernel balances its tiles.
template <int kRowTile, int64_t kChunk, typename Tile>
void walk_decode_tiles(int64_t rows, int64_t n0, int64_t n1, const Epilogue& out, const Tile& tile,
                       int64_t row_tile = kRowTile) {
  float chunk[kRowTile][kChunk];
  for (int64_t c0 = n0; c0 < n1; c0 += kChunk) {
    const int64_t c1 = std::min(n1, c0 + kChunk);
    for (int64_t r0 = 0; r0 < rows; r0 += row_tile) {
      const int tile_rows = static_cast<int>(std::min<int64_t>(row_tile, rows - r0));
      for (int64_t n = c0; n < c1;) n += tile(r0, tile_rows, n, c1, &chunk[0][n - c0]);
      for (int r = 0; r < tile_rows; ++r) out.store_row(r0 + r, c0, c1 - c0, chunk[r]);
    }
  }
}

#ifdef RADIXSERVE_BLOCK_AVX2
// Channel c's blocks from g on, fetched `ahead` bytes ahead in its codes (an eighth of that in its scales and Q4's
// mins; rows lie one after another): the hardware prefetcher alone left SmolLM2's batch-1 linears at ~9 GB/s from
// DRAM (2.2 ns a block, 0.9 in cache). qs: Q4 16 bytes a block, Q8_0 kBlock; ldq bytes a channel.
template <bool Q4>
inline void prefetch_channel(const uint8_t* qs, int64_t ldq, const at::Half* d, const at::Half* m, int64_t blocks,
                             int64_t c, int64_t g, int64_t ahead) {
  const char* codes = reinterpret_cast<const char*>(qs + c * ldq + g * (Q4 ? 16 : kBlock)) + ahead;
  for (int line = 0; line < (Q4 ? 4 : 8); ++line) _mm_prefetch(codes + 64 * line, _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(d + c * blocks + g) + ahead / 8, _MM_HINT_T0);
  if (Q4 && m != nullptr) _mm_prefetch(reinterpret_cast<const char*>(m + c * blocks + g) + ahead / 8, _MM_HINT_T0);
}
#endif

}  // namespace radixserve
