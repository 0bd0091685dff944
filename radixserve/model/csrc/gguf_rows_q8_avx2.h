// The int8-activation linear over the GGUF row types with codes (gguf_rows_q8.h) on AVX2 without AVX512-VNNI (the
// panels, block_q8_panels.h, run there): block_q8_linear.cpp's AVX2 kernel for these rows. Per block of 32, the
// channel's 32 unsigned codes decoded into one register (block_codes) once for a tile of up to 8 rows, then per
// row vpmaddubsw + vpmaddwd (8 int32 lanes, each an exact partial dot: codes <= 63 and |x| <= 127), converted to
// float and scaled by d * s in one FMA; Q6_K's vpmaddwd multiplies by the two sub-block scales (sc_a on weights
// 0..15, sc_b on 16..31) instead of ones. Per row, 8 blocks at a time, the terms without codes: a min's m * s sum
// (Q4_K / Q5_K / Q5_1) or the integer start (Q5_0: -16 sum; Q6_K: -32 (sc_a sum_a + sc_b sum_b)) times d * s.
// Even and odd blocks go to two accumulators per row (against the FMA's latency); their lanes are summed last.
//
// A row's operations are the same at every tile size and thread split (threads split channels), so its bits
// never depend on its batch; they differ from the panels' and the portable loop's (other builds, other sums).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "block_common.h"
#include "block_q8_rows.h"
#include "gguf_rows_q8.h"

#if defined(RADIXSERVE_BLOCK_AVX2) && !defined(RADIXSERVE_Q8_PANELS)
#define RADIXSERVE_ROWS_Q8_AVX2 1

namespace radixserve::gguf_rows::q8avx2 {

// Rows sharing one decode of a channel's block (block_q8_linear.cpp's tile). 8 rows' two accumulators spill, but
// smaller tiles decode more often and were no faster on a Zen 3 (`bench block-linears --formats Q4_K,Q6_K,Q5_0
// --paths kernel-q8`, ms a forward at 8 / 16 rows: tiles of 8 Q5_0 29.1 / 60.5, Q6_K 10.6 / 17.1; of 6 35.8 / 61.3,
// 9.2 / 15.9; of 4 35.0 / 64.1, 8.8 / 16.2).
constexpr int kRowTile = 8;

RADIXSERVE_ROWS_INLINE __m256i load256(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// Byte l of the result 16 where bit l of qh is set, else 0 (Q5_0 / Q5_1's fifth bits): qh's byte l / 8 spread to
// bytes l, tested against bit l % 8.
RADIXSERVE_ROWS_INLINE __m256i fifth_bits(const uint8_t* qh) {
  const __m256i spread =
      _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(u32_at(qh))),
                          _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(16));
}

// Bits 2k, 2k + 1 of each byte of v moved to bits 4, 5 (others: any); epi16 shifts by <= 4 keep them in their byte.
template <int K>
RADIXSERVE_ROWS_INLINE __m256i bits_to_4(__m256i v) {
  if constexpr (K < 2) return _mm256_slli_epi16(v, 4 - 2 * K);
  else if constexpr (K == 3) return _mm256_srli_epi16(v, 2);
  else return v;
}

// Block J of the unit at u (K-quants: sub-block J of 8; Q5_0 / Q5_1: the block) as 32 unsigned codes, weight
// order: gguf_rows_q8.h's code<T>.
template <typename T, int J>
RADIXSERVE_ROWS_INLINE __m256i block_codes(const uint8_t* u) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  if constexpr (T::kWeights == 32) {
    // The 16 bytes in both lanes, the high lane's shifted down a nibble (no lane insert: one shuffle-port op less)
    const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(u + T::kHigh + 4)));
    const __m256i low = _mm256_and_si256(_mm256_srlv_epi32(v, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)), nibble);
    return _mm256_or_si256(low, fifth_bits(u + T::kHigh));
  } else if constexpr (T::kType == Q6_K) {  // low nibbles: bytes 64 h + 32 (k % 2), nibble k / 2; highs: bits 2k
    constexpr int h = J / 4, k = J % 4;
    __m256i low = load256(u + 64 * h + 32 * (k % 2));
    if constexpr (k >= 2) low = _mm256_srli_epi16(low, 4);
    const __m256i high = bits_to_4<k>(load256(u + 128 + 32 * h));
    return _mm256_or_si256(_mm256_and_si256(low, nibble), _mm256_and_si256(high, _mm256_set1_epi8(0x30)));
  } else {  // sub-blocks 2p, 2p + 1: the low and high nibbles of bytes 32p ..; Q5_K: bit J of the 32 high bytes
    __m256i q = load256(u + T::kCodeBytes + 32 * (J / 2));
    if constexpr (J % 2 == 1) q = _mm256_srli_epi16(q, 4);
    q = _mm256_and_si256(q, nibble);
    if constexpr (T::kType == Q5_K) {
      const __m256i h = load256(u + 16);
      const __m256i moved = J < 4 ? _mm256_slli_epi16(h, 4 - J) : J > 4 ? _mm256_srli_epi16(h, J - 4) : h;
      q = _mm256_or_si256(q, _mm256_and_si256(moved, _mm256_set1_epi8(0x10)));
    }
    return q;
  }
}

// One channel's per-block values, its blocks padded to ld (zeros past them, written once): d, m (block_scales's; 0
// where the type has no min) and, Q6_K, its sub-block scales as int32 (sa, sb).
struct ChannelBlocks {
  std::vector<float> d, m;
  std::vector<int32_t> sa, sb;
  explicit ChannelBlocks(int64_t ld) : d(ld), m(ld), sa(ld), sb(ld) {}
};

// The float16 at u + i * stride for i = 0..7 as 8 floats (Q5_0 / Q5_1's d or m of 8 blocks: one conversion, not 8),
// gathered in two general registers rather than by 8 vpinsrw (shuffle-port work the codes' decode also needs).
RADIXSERVE_ROWS_INLINE __m256 halves8(const uint8_t* u, int64_t stride) {
  const auto four = [&](int i) {
    uint64_t v = 0;
    for (int k = 3; k >= 0; --k) {
      uint16_t h;
      std::memcpy(&h, u + (i + k) * stride, sizeof h);
      v = v << 16 | h;
    }
    return static_cast<long long>(v);
  };
  return _mm256_cvtph_ps(_mm_set_epi64x(four(4), four(0)));
}

// A Q6_K unit's 16 int8 sub-block scales (at p + 192; block j: sc_2j, sc_2j+1) as sa, sb [8].
RADIXSERVE_ROWS_INLINE void q6_sub_scales(const uint8_t* p, int32_t* sa, int32_t* sb) {
  const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 192));
  const __m128i split = _mm_shuffle_epi8(sc, _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(sa), _mm256_cvtepi8_epi32(split));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(sb), _mm256_cvtepi8_epi32(_mm_srli_si128(split, 8)));
}

// vpmaddwd's words for a Q6_K unit's block J (8 sc_2J, then 8 sc_2J+1), made in registers from the unit's scales
// widened once (a table of them in memory, 16 channels' worth, crowded the weights out of L1: 1.25x the time).
struct Q6Words {
  __m256i low, high;  // dwords (sc_i, sc_i): low = sc 0..3 | sc 8..11, high = sc 4..7 | sc 12..15
  RADIXSERVE_ROWS_INLINE explicit Q6Words(const uint8_t* u) {
    const __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(u + 192)));
    low = _mm256_unpacklo_epi16(w, w), high = _mm256_unpackhi_epi16(w, w);
  }
  template <int J>
  RADIXSERVE_ROWS_INLINE __m256i block() const {
    constexpr int at = 4 * (J / 4) + 2 * (J % 2);  // sc_2J's dword in low (J % 4 < 2) or high
    return _mm256_permutevar8x32_epi32(J % 4 < 2 ? low : high,
                                       _mm256_setr_epi32(at, at, at, at, at + 1, at + 1, at + 1, at + 1));
  }
};

template <typename T>
void channel_blocks(const uint8_t* row, int64_t blocks, ChannelBlocks& c) {
  if constexpr (T::kWeights == 32) {  // block_scales's d (and Q5_1's m), 8 blocks at a time
    int64_t b = 0;
    for (; b + 8 <= blocks; b += 8) {
      _mm256_storeu_ps(c.d.data() + b, halves8(row + b * T::kBytes, T::kBytes));
      if constexpr (T::kType == Q5_1) _mm256_storeu_ps(c.m.data() + b, halves8(row + b * T::kBytes + 2, T::kBytes));
    }
    for (; b < blocks; ++b) {
      c.d[b] = half_at(row + b * T::kBytes);
      if constexpr (T::kType == Q5_1) c.m[b] = half_at(row + b * T::kBytes + 2);
    }
    return;
  }
  for (int64_t u = 0; u < blocks / 8; ++u) {  // a K-quant unit's 8 blocks
    const uint8_t* p = row + u * T::kBytes;
    if constexpr (T::kType == Q6_K) {
      q6_sub_scales(p, c.sa.data() + 8 * u, c.sb.data() + 8 * u);
      _mm256_storeu_ps(c.d.data() + 8 * u, _mm256_set1_ps(half_at(p + 208)));
    } else {  // block_scales's d = D_j, m = -dm_j
      alignas(64) float sv[16];
      T::scales(p, sv);
      _mm256_storeu_ps(c.d.data() + 8 * u, _mm256_load_ps(sv));
      _mm256_storeu_ps(c.m.data() + 8 * u, _mm256_xor_ps(_mm256_load_ps(sv + 8), _mm256_set1_ps(-0.f)));
    }
  }
}

// The activation rows of one tile: codes (K a row), each block's d * s for this channel (ld a row), and x's own
// per-block values (ld a row): scales s, s * sum, the integer starts (Q5_0: -16 sum; Q6_K: -32 sum of each half).
struct TileRows {
  const int8_t* codes;
  int64_t k, ld;
  const float* scale;  // d_b * s_rb
  const float* sums;
  const int32_t* first;
  const int32_t* second;
};

// acc[r] += float(codes . x_rb) * (d_b s_rb) for the tile's R rows, block b = the unit's block J.
template <typename T, int R, int J>
RADIXSERVE_ROWS_INLINE void add_block(const TileRows& t, const uint8_t* u, int64_t b, __m256i w, __m256* acc) {
  const __m256i c = block_codes<T, J>(u);
  for (int r = 0; r < R; ++r) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t.codes + r * t.k + b * kBlock));
    const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(c, x), w);
    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_broadcast_ss(t.scale + r * t.ld + b), acc[r]);
  }
}

// The unit's blocks J..: even ones into even, odd ones into odd (K-quants 8, Q5_0 / Q5_1 2 blocks a unit; `count`
// of them: a row's last Q5 unit may hold one).
template <typename T, int R, size_t... J>
RADIXSERVE_ROWS_INLINE void add_unit(const TileRows& t, const uint8_t* row, int64_t b0, int count, __m256* even,
                                     __m256* odd, std::index_sequence<J...>) {
  const __m256i ones = _mm256_set1_epi16(1);
  const uint8_t* u = row + b0 / 8 * T::kBytes;  // K-quants: the unit
  const auto q6 = [&] {  // Q6_K: the unit's scales, widened once
    if constexpr (T::kType == Q6_K) return Q6Words(u);
    else return 0;
  }();
  const auto one = [&](auto j) {
    constexpr int kJ = decltype(j)::value;
    if constexpr (T::kWeights == 32) {
      if (kJ < count) add_block<T, R, 0>(t, row + (b0 + kJ) * T::kBytes, b0 + kJ, ones, kJ % 2 ? odd : even);
    } else if constexpr (T::kType == Q6_K) {
      add_block<T, R, kJ>(t, u, b0 + kJ, q6.template block<kJ>(), kJ % 2 ? odd : even);
    } else {
      add_block<T, R, kJ>(t, u, b0 + kJ, ones, kJ % 2 ? odd : even);
    }
  };
  (one(std::integral_constant<int, static_cast<int>(J)>{}), ...);
}

// The terms without codes, 8 blocks at a time, into odd: m * (s sum) (a min), or (d s) * float(start).
template <typename T, int R>
RADIXSERVE_ROWS_INLINE void add_starts(const TileRows& t, const ChannelBlocks& c, int64_t blocks, __m256* odd) {
  for (int64_t b = 0; b < (blocks + 7) / 8 * 8; b += 8) {
    if constexpr (T::kType == Q5_0 || T::kType == Q6_K) {
      __m256i sa, sb;
      if constexpr (T::kType == Q6_K) {
        sa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c.sa.data() + b));
        sb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c.sb.data() + b));
      }
      for (int r = 0; r < R; ++r) {
        __m256i start = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t.first + r * t.ld + b));
        if constexpr (T::kType == Q6_K) {
          const __m256i second = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t.second + r * t.ld + b));
          start = _mm256_add_epi32(_mm256_mullo_epi32(sa, start), _mm256_mullo_epi32(sb, second));
        }
        odd[r] = _mm256_fmadd_ps(_mm256_loadu_ps(t.scale + r * t.ld + b), _mm256_cvtepi32_ps(start), odd[r]);
      }
    } else {
      const __m256 m = _mm256_loadu_ps(c.m.data() + b);
      for (int r = 0; r < R; ++r) odd[r] = _mm256_fmadd_ps(m, _mm256_loadu_ps(t.sums + r * t.ld + b), odd[r]);
    }
  }
}

// R rows against one channel's row of units: sums[r].
template <typename T, int R>
RADIXSERVE_ROWS_INLINE void dot_rows(const TileRows& t, const uint8_t* row, const ChannelBlocks& c, int64_t blocks,
                                     float* sums) {
  constexpr int64_t kUnit = T::kWeights == 32 ? 2 : 8;
  __m256 even[R], odd[R];
  for (int r = 0; r < R; ++r) even[r] = odd[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; b += kUnit)
    add_unit<T, R>(t, row, b, static_cast<int>(std::min(kUnit, blocks - b)), even, odd,
                   std::make_index_sequence<kUnit>{});
  add_starts<T, R>(t, c, blocks, odd);
  for (int r = 0; r < R; ++r) sums[r] = hsum(_mm256_add_ps(even[r], odd[r]));
}

// Channels c0..c1 and their per-block values: a chunk's, made once and read by each tile of rows (c[n - c0]), or
// (one tile: c null) each channel's made into `fresh` just before its dot products, while its row is in L1 (a pass
// over 16 channels first left one row 1.1x slower with the weights streamed from memory).
constexpr int64_t kChunk = 16;
struct Chunk {
  const RowWeights& w;
  int64_t c0, c1, blocks;
  const ChannelBlocks* c;
  ChannelBlocks* fresh;
};

// Rows r0 .. r0 + R - 1 against the chunk's channels: each channel's d * s per row, then its dot products. One
// function per tile size, the channel loop inside (its constants loaded once, not once a channel).
template <typename T, int R>
void tile_channels(const Q8Rows& x, const int32_t* first, const int32_t* second, const Chunk& ch, int64_t r0,
                   float* scale, const Epilogue& out) {
  const int64_t k = ch.w.in_features, ld = x.ld, padded = (ch.blocks + 7) / 8 * 8;
  const float* xs = x.scales.data() + r0 * ld;
  const TileRows t{x.codes.data_ptr<int8_t>() + r0 * k, k, ld, scale, x.sums.data() + r0 * ld, first + r0 * ld,
                   second == nullptr ? nullptr : second + r0 * ld};
  float sums[R];
  for (int64_t n = ch.c0; n < ch.c1; ++n) {
    const uint8_t* row = ch.w.raw + n * ch.w.row_bytes;
    if (ch.c == nullptr) channel_blocks<T>(row, ch.blocks, *ch.fresh);
    const ChannelBlocks& c = ch.c == nullptr ? *ch.fresh : ch.c[n - ch.c0];
    for (int r = 0; r < R; ++r)
      for (int64_t b = 0; b < padded; b += 8)
        _mm256_storeu_ps(scale + r * ld + b, _mm256_mul_ps(_mm256_loadu_ps(c.d.data() + b),
                                                           _mm256_loadu_ps(xs + r * ld + b)));
    dot_rows<T, R>(t, row, c, ch.blocks, sums);
    for (int r = 0; r < R; ++r) out.store(r0 + r, n, sums[r]);
  }
}

template <typename T>
void tile_channels(int rows, const Q8Rows& x, const int32_t* first, const int32_t* second, const Chunk& ch,
                   int64_t r0, float* scale, const Epilogue& out) {
  switch (rows) {
#define RADIXSERVE_TILE(R) \
  case R: return tile_channels<T, R>(x, first, second, ch, r0, scale, out);
    RADIXSERVE_TILE(1) RADIXSERVE_TILE(2) RADIXSERVE_TILE(3) RADIXSERVE_TILE(4)
    RADIXSERVE_TILE(5) RADIXSERVE_TILE(6) RADIXSERVE_TILE(7)
#undef RADIXSERVE_TILE
    default: return tile_channels<T, kRowTile>(x, first, second, ch, r0, scale, out);
  }
}

// Output channels n0..n1 of every row: up to kRowTile rows in one tile, channel by channel; more, kChunk channels
// at a time, each tile of rows dispatched by its size.
template <typename T>
void linear_channels(const Q8Rows& x, const int32_t* first, const int32_t* second, const RowWeights& w, int64_t n0,
                     int64_t n1, const Epilogue& out) {
  const int64_t rows = x.codes.size(0), blocks = w.in_features / kBlock;
  std::vector<float> scale(kRowTile * x.ld);
  if (rows <= kRowTile) {
    ChannelBlocks fresh(x.ld);
    return tile_channels<T>(static_cast<int>(rows), x, first, second, {w, n0, n1, blocks, nullptr, &fresh}, 0,
                            scale.data(), out);
  }
  std::vector<ChannelBlocks> c(kChunk, ChannelBlocks(x.ld));
  for (int64_t c0 = n0; c0 < n1; c0 += kChunk) {
    const Chunk ch{w, c0, std::min(n1, c0 + kChunk), blocks, c.data(), nullptr};
    for (int64_t n = ch.c0; n < ch.c1; ++n) channel_blocks<T>(w.raw + n * w.row_bytes, blocks, c[n - c0]);
    for (int64_t r0 = 0; r0 < rows; r0 += kRowTile)
      tile_channels<T>(static_cast<int>(std::min<int64_t>(kRowTile, rows - r0)), x, first, second, ch, r0,
                       scale.data(), out);
  }
}

}  // namespace radixserve::gguf_rows::q8avx2

#endif
