// Linear over GGUF-style blocks of 32 weights (Q4_1, Q4_0 as Q4_1 with m = -8d, Q8_0) for bfloat16 rows with
// AMX-BF16 tiles, for any row count: a row's result is bitwise the same alone as among thousands.
//
// Why: block_linear.cpp's AVX512 kernel is row-invariant but slow past a few rows; torch's GEMM (block_gemm.cpp)
// is fast but reduces a row differently by the number of rows (oneDNN picks its blocking by M). Here every row
// goes through one fixed sequence of tile operations:
//
//   C [16 rows, 16 channels] float32 = 0;  for each block b of 32 (in order): C += A_b . B_b   (TDPBF16PS)
//   then the epilogue (block_common.h): + bias, + residual, one rounding to bfloat16.
//
// TDPBF16PS computes each row of C from that row of A alone, so rows sharing a tile (or a tile of zero
// padding, for M = 1 and a last partial tile) change nothing, and neither does how many row tiles a call has.
// The weights are those the GEMM path multiplies by (d * q + m rounded to bfloat16, dequantize_channels_bf16's
// bits), decoded per tile of 16 channels straight into AMX's pair layout (B row r, dword n = channel n's weights
// 2r and 2r + 1), once per call, and read by every row tile.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "block_common.h"

#if defined(RADIXSERVE_BLOCK_AVX512BF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define RADIXSERVE_BLOCK_AMX 1
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

#ifdef RADIXSERVE_BLOCK_AMX
using radixserve::BlockWeights;
using radixserve::kBlock;

constexpr int64_t kTile = 16;            // rows of an A or C tile; channels of a B or C tile
constexpr int64_t kTileDwords = 16 * 16;  // one B tile (a block of 16 channels): 16 rows of 16 bf16 pairs

// The CPU has AMX-BF16 and the kernel lets this process use the tiles' state (Linux asks each process to
// request it once: arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); torch may have done so already).
bool request_amx() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  const bool tile = edx & (1u << 24), bf16 = edx & (1u << 22);
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return tile && bf16 && syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

// Tiles 0-3: C (2 x 2 of 16 rows x 16 float32), 4-5: A (16 rows x 32 bf16), 6-7: B (16 pairs x 16 channels).
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};

  TileConfig() {
    for (int t = 0; t < 8; ++t) colsb[t] = 64, rows[t] = kTile;
  }
};

// 16 rows of 16 dwords transposed in place: r[i] lane j <- r[j] lane i.
inline void transpose16(__m512i (&r)[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // r[4i + c], 128-bit lane l: rows 4i..4i+3 at column 4l + c
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i u = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x88), v = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xdd);
    const __m512i w = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x88);
    const __m512i x = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xdd);
    t[c] = _mm512_shuffle_i32x4(u, w, 0x88);
    t[4 + c] = _mm512_shuffle_i32x4(v, x, 0x88);
    t[8 + c] = _mm512_shuffle_i32x4(u, w, 0xdd);
    t[12 + c] = _mm512_shuffle_i32x4(v, x, 0xdd);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// The scales (and mins) of channels n0 .. n0 + count, blocks g .. min(g + 16, b1), as float32 [block][channel]: channel
// rows converted from float16, then transposed. Zeros past count channels and past the last block.
template <bool Q4>
void tile_scales(const BlockWeights& w, int64_t n0, int64_t count, int64_t g, int64_t b1, float (*d)[16],
                 float (*m)[16]) {
  const __mmask16 valid = static_cast<__mmask16>((1u << std::min<int64_t>(16, b1 - g)) - 1);
  __m512i ds[16], ms[16];
  for (int n = 0; n < 16; ++n) {
    const auto half16 = [&](const at::Half* h) {
      return n < count ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(valid, h + (n0 + n) * w.blocks + g))
                       : _mm512_setzero_ps();
    };
    const __m512 dn = half16(w.d);
    ds[n] = _mm512_castps_si512(dn);
    if constexpr (Q4)
      ms[n] = _mm512_castps_si512(w.m != nullptr ? half16(w.m) : _mm512_mul_ps(dn, _mm512_set1_ps(-8.f)));
  }
  transpose16(ds);
  for (int b = 0; b < 16; ++b) _mm512_store_si512(d[b], ds[b]);
  if constexpr (Q4) {
    transpose16(ms);
    for (int b = 0; b < 16; ++b) _mm512_store_si512(m[b], ms[b]);
  }
}

// Float32 weights (lane n: channel n) rounded to bfloat16 and interleaved into B's pairs:
// dword n = even_n | odd_n << 16.
inline __m512i pairs_bf16(__m512 even, __m512 odd) {
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                              22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(odd, even));
}

// One block's B tile from its codes transposed to dwords (code[i] lane n: dword i of channel n's block), scale d and
// min m per channel. Q4: weights 2r, 2r + 1 are the low nibbles (r < 8) or high nibbles (r >= 8) of bytes 2r % 16,
// 2r % 16 + 1; Q8: bytes 2r, 2r + 1. d * q + m is exact in float32 (dequantize_channels_bf16), then rounded.
template <bool Q4>
inline void block_tile(const __m512i* code, const float* d, const float* m, uint32_t* out) {
  const __m512 scale = _mm512_load_ps(d);
#pragma GCC unroll 16
  for (int r = 0; r < 16; ++r) {
    __m512 even, odd;
    if constexpr (Q4) {
      // A code as float32 in one permute: vpermps reads only an index's low 4 bits (no mask, no conversion).
      const __m512 codes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
      const __m512i word = code[(r % 8) / 2];
      const int shift = 16 * (r % 2) + (r >= 8 ? 4 : 0);
      const __m512 min = _mm512_load_ps(m);
      const __m512i low = shift == 0 ? word : _mm512_srli_epi32(word, shift);
      even = _mm512_fmadd_ps(scale, _mm512_permutexvar_ps(low, codes), min);
      odd = _mm512_fmadd_ps(scale, _mm512_permutexvar_ps(_mm512_srli_epi32(word, shift + 8), codes), min);
    } else {
      const __m512i word = code[r / 2];
      const int shift = 16 * (r % 2);
      even = _mm512_mul_ps(scale, _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(word, 24 - shift), 24)));
      odd = _mm512_mul_ps(scale, _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(word, 16 - shift), 24)));
    }
    _mm512_storeu_si512(out + r * 16, pairs_bf16(even, odd));
  }
}

// Blocks b0 .. b1 (b0 a multiple of 16) of channels n0 .. n0 + count (<= 16; the rest weigh 0) as B tiles, block b's
// at out + (b - b0) * kTileDwords. The codes are read 64 bytes of a channel at a time (4 Q4 blocks or 2 Q8 blocks)
// and transposed 16 channels at once.
template <bool Q4>
void decode_tile(const BlockWeights& w, int64_t n0, int64_t count, int64_t b0, int64_t b1, uint32_t* out) {
  constexpr int64_t per_load = Q4 ? 4 : 2, dwords = kBlock / (Q4 ? 8 : 4);  // blocks per 64 bytes; dwords a block
  alignas(64) float d[16][16], m[16][16];
  for (int64_t g = b0; g < b1; g += 16) {
    tile_scales<Q4>(w, n0, count, g, b1, d, m);
    for (int64_t l = g; l < std::min(g + 16, b1); l += per_load) {
      const int64_t blocks = std::min(per_load, b1 - l);
      const __mmask16 valid = static_cast<__mmask16>((1u << (blocks * dwords)) - 1);
      __m512i code[16];
      for (int n = 0; n < 16; ++n)
        code[n] = n < count ? _mm512_maskz_loadu_epi32(valid, w.qs + (n0 + n) * w.qs_row_bytes + l * dwords * 4)
                            : _mm512_setzero_si512();
      transpose16(code);
      for (int64_t b = l; b < l + blocks; ++b)
        block_tile<Q4>(code + (b - l) * dwords, d[b - g], m[b - g], out + (b - b0) * kTileDwords);
    }
  }
}

// A span of blocks [b0, b1) of a tile product: C tiles for R row tiles (x rows at a[0], a[1], each row ldx bytes apart)
// and C channel tiles (the span's B tiles at wt[0], wt[1]). The first span zeroes C, the last stores it into
// sums[row][channel] (32 floats a row); between spans C stays in its tiles: blocks are added in order either way.
struct Span {
  int64_t b0, b1;
  bool first, last;
};

template <int R, int C>
void tile_product(const uint16_t* const* a, int64_t ldx, const uint32_t* const* wt, Span span, float* sums) {
  if (span.first) {
    _tile_zero(0);
    if constexpr (C > 1) _tile_zero(1);
    if constexpr (R > 1) _tile_zero(2);
    if constexpr (R > 1 && C > 1) _tile_zero(3);
  }
  for (int64_t b = span.b0; b < span.b1; ++b) {
    _tile_loadd(4, a[0] + b * kBlock, ldx);
    _tile_loadd(6, wt[0] + (b - span.b0) * kTileDwords, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (C > 1) {
      _tile_loadd(7, wt[1] + (b - span.b0) * kTileDwords, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if constexpr (R > 1) {
      _tile_loadd(5, a[1] + b * kBlock, ldx);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (C > 1) _tile_dpbf16ps(3, 5, 7);
    }
  }
  if (!span.last) return;
  constexpr int64_t ld = 2 * kTile * sizeof(float);
  _tile_stored(0, sums, ld);
  if constexpr (C > 1) _tile_stored(1, sums + kTile, ld);
  if constexpr (R > 1) _tile_stored(2, sums + kTile * 2 * kTile, ld);
  if constexpr (R > 1 && C > 1) _tile_stored(3, sums + kTile * 2 * kTile + kTile, ld);
}

// The rows of x, 16 to an A tile: the last partial tile read from tail (zeros past the real rows).
struct Rows {
  const uint16_t* x;
  const uint16_t* tail;
  int64_t count, ld, first;  // rows; elements from one row to the next; the output row of x's first
  int64_t tiles() const { return (count + kTile - 1) / kTile; }
  const uint16_t* tile(int64_t t) const { return (t + 1) * kTile <= count ? x + t * kTile * ld : tail; }
};

// Row tiles t, t + 1 (if any) against the channels c0 .. c1 (one or two B tiles at wt) over one span.
void row_pair(const Rows& x, int64_t t, const uint32_t* const* wt, int64_t c0, int64_t c1, Span span, float* sums) {
  const uint16_t* a[2] = {x.tile(t), x.tile(t + 1)};
  const bool two_rows = t + 1 < x.tiles(), two_channels = c1 - c0 > kTile;
  const int64_t ldx = x.ld * 2;
  if (two_rows && two_channels) tile_product<2, 2>(a, ldx, wt, span, sums);
  else if (two_rows) tile_product<2, 1>(a, ldx, wt, span, sums);
  else if (two_channels) tile_product<1, 2>(a, ldx, wt, span, sums);
  else tile_product<1, 1>(a, ldx, wt, span, sums);
}

// Blocks span.b0 .. span.b1 of channels c0 .. c1 (<= 32: one or two B tiles) as B tiles into wbuf (two tiles of
// `chunk` blocks).
void decode_group(const BlockWeights& w, int64_t c0, int64_t c1, Span span, int64_t chunk, uint32_t* wbuf) {
  for (int64_t c = c0; c < c1; c += kTile) {
    uint32_t* at = wbuf + (c - c0) / kTile * chunk * kTileDwords;
    if (w.q4()) decode_tile<true>(w, c, std::min(kTile, c1 - c), span.b0, span.b1, at);
    else decode_tile<false>(w, c, std::min(kTile, c1 - c), span.b0, span.b1, at);
  }
}

// Every row of x against channels c0 .. c1 over one span (wbuf: decode_group's), stored when the span is the last.
void product_group(const Rows& x, int64_t c0, int64_t c1, Span span, int64_t chunk, const uint32_t* wbuf,
                   const radixserve::Epilogue& out) {
  alignas(64) float sums[2 * kTile][2 * kTile];
  const uint32_t* wt[2] = {wbuf, wbuf + chunk * kTileDwords};
  for (int64_t t = 0; t < x.tiles(); t += 2) {
    row_pair(x, t, wt, c0, c1, span, sums[0]);
    if (!span.last) continue;
    for (int64_t r = t * kTile; r < std::min(x.count, (t + 2) * kTile); ++r)
      out.store_row(x.first + r, c0, c1 - c0, sums[r - t * kTile]);
  }
}

// Channel groups of 32 (the work items), each in its own tile config.
template <typename Group>
void for_groups(int64_t g0, int64_t g1, const Group& group) {
  at::parallel_for(g0, g1, 1, [&](int64_t a, int64_t b) {
    const TileConfig config;
    _tile_loadconfig(&config);
    for (int64_t g = a; g < b; ++g) group(g);
    _tile_release();
  });
}

// Up to two row tiles (32 rows): per channel group the C tiles stay in place while the weights are decoded 16 blocks
// at a time into an L1-sized buffer.
void linear_few(const Rows& x, const BlockWeights& w, const radixserve::Epilogue& out) {
  constexpr int64_t chunk = 16;
  const int64_t groups = (out.out_features + 2 * kTile - 1) / (2 * kTile);
  for_groups(0, groups, [&](int64_t g) {
    alignas(64) static thread_local uint32_t wbuf[2 * chunk * kTileDwords];
    const int64_t c0 = g * 2 * kTile, c1 = std::min(out.out_features, c0 + 2 * kTile);
    for (int64_t b0 = 0; b0 < w.blocks; b0 += chunk) {
      const Span span{b0, std::min(w.blocks, b0 + chunk), b0 == 0, b0 + chunk >= w.blocks};
      decode_group(w, c0, c1, span, chunk, wbuf);
      product_group(x, c0, c1, span, chunk, wbuf, out);
    }
  });
}

// More rows: channel groups are decoded whole, up to kDecodedBytes of them at once (read from L3 by every row block),
// then rows go in blocks of about kRowBlockBytes of x (kept in L2 while every decoded group reads them). Measured
// on SmolLM2 at 2,048 rows: one pass over all of x per group ran at 0.5x the tiled GEMM's speed; x blocks with each
// group decoded anew per block 0.62x.
constexpr int64_t kDecodedBytes = 4 << 20, kRowBlockBytes = 1 << 20;

void linear_many(const Rows& x, const BlockWeights& w, const radixserve::Epilogue& out) {
  const int64_t groups = (out.out_features + 2 * kTile - 1) / (2 * kTile), group_dwords = 2 * w.blocks * kTileDwords;
  const int64_t per_pass = std::max<int64_t>(1, kDecodedBytes / (group_dwords * 4));
  const int64_t block = std::max<int64_t>(2 * kTile, kRowBlockBytes / (x.ld * 2) / (2 * kTile) * (2 * kTile));
  const Span all{0, w.blocks, true, true};
  std::unique_ptr<uint32_t[]> decoded(new uint32_t[std::min(groups, per_pass) * group_dwords]);
  for (int64_t p0 = 0; p0 < groups; p0 += per_pass) {
    const int64_t p1 = std::min(groups, p0 + per_pass);
    const auto channels = [&](int64_t g) { return std::min(out.out_features, (g + 1) * 2 * kTile); };
    at::parallel_for(p0, p1, 1, [&](int64_t a, int64_t b) {
      for (int64_t g = a; g < b; ++g)
        decode_group(w, g * 2 * kTile, channels(g), all, w.blocks, &decoded[(g - p0) * group_dwords]);
    });
    for (int64_t r0 = 0; r0 < x.count; r0 += block) {
      const Rows rows{x.x + r0 * x.ld, x.tail, std::min(block, x.count - r0), x.ld, r0};
      for_groups(p0, p1, [&](int64_t g) {
        product_group(rows, g * 2 * kTile, channels(g), all, w.blocks, &decoded[(g - p0) * group_dwords], out);
      });
    }
  }
}

// x [rows, K] bfloat16, contiguous.
void linear(const at::Tensor& x, const BlockWeights& w, const radixserve::Epilogue& out) {
  const int64_t rows = x.size(0), ldx = x.size(1);
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  std::vector<uint16_t> tail(kTile * ldx, 0);  // the last partial row tile, padded with zero rows
  const int64_t full = rows / kTile * kTile;
  std::copy(xp + full * ldx, xp + rows * ldx, tail.begin());
  const Rows r{xp, tail.data(), rows, ldx, 0};
  if (r.tiles() <= 2) linear_few(r, w, out);
  else linear_many(r, w, out);
}
#endif

bool amx_available() {
#ifdef RADIXSERVE_BLOCK_AMX
  static const bool available = request_amx();
  return available;
#else
  return false;
#endif
}

// x [M, K] bfloat16 @ W.T for the blocks W [N, K] (+ bias [N]) (+ residual [M, N], added before the one rounding).
at::Tensor block_linear_amx_op(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                               const std::optional<at::Tensor>& m, const std::optional<at::Tensor>& bias,
                               const std::optional<at::Tensor>& residual) {
  TORCH_CHECK(amx_available(), "block_linear_amx: this CPU, kernel or build has no AMX-BF16 (see amx_available())");
#ifdef RADIXSERVE_BLOCK_AMX
  const bool q4 = radixserve::check_blocks(qs, d, m);
  const int64_t out_features = qs.size(0), blocks = d.size(1);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "block_linear_amx: x must be bfloat16");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == blocks * 32 && x.device().is_cpu(),
              "x [M, K] on CPU against weights [N, K]");
  at::Tensor out;
  const radixserve::Epilogue epilogue =
      radixserve::make_epilogue(x, out_features, out, std::nullopt, bias, residual, false);
  const BlockWeights w{static_cast<const uint8_t*>(qs.data_ptr()), d.data_ptr<at::Half>(),
                       q4 && m.has_value() ? m->data_ptr<at::Half>() : nullptr, blocks, qs.size(1)};
  if (x.size(0) > 0) linear(x.contiguous(), w, epilogue);
  return out;
#else
  return {};  // not reached: amx_available() is false
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixserve, m) {
  m.def("amx_available() -> bool", &amx_available);
  m.def(
      "block_linear_amx(Tensor x, Tensor qs, Tensor d, Tensor? m, Tensor? bias=None, Tensor? residual=None) -> "
      "Tensor");
}

TORCH_LIBRARY_IMPL(radixserve, CPU, m) {
  m.impl("block_linear_amx", &block_linear_amx_op);
}
