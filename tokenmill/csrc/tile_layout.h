// The operand layouts of bfloat16 pair products, shared by the AMX tile path and the AVX512-BF16
// vector path of the attention kernels (amx_tiles.h, prefill_attention_cpu.cpp): a 16 x 16 transpose
// of 32-bit elements (keys as "B" operands of Q K^T) and value rows pair-interleaved (values as "B"
// operands of P V). A "tile" is 16 rows of 64 bytes, whichever path reads it. Needs AVX-512 F/BW only.
#pragma once

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cstdint>

namespace tokenmill::tiles {

constexpr int kTileRows = 16;
constexpr int64_t kTileBytes = 1024;  // one 16 x 64-byte tile

// r[a][c] -> r[c][a]: a 16 x 16 transpose of 32-bit elements in registers (pairs, then quadruples
// within 128-bit lanes, then a 4 x 4 transpose of the lanes).
inline void transpose16x16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  __m512i u[4][4];  // u[q][k]: rows 4k..4k+3 of column 4L + q in lane L
  for (int k = 0; k < 4; ++k) {
    u[0][k] = _mm512_unpacklo_epi64(t[4 * k], t[4 * k + 2]);
    u[1][k] = _mm512_unpackhi_epi64(t[4 * k], t[4 * k + 2]);
    u[2][k] = _mm512_unpacklo_epi64(t[4 * k + 1], t[4 * k + 3]);
    u[3][k] = _mm512_unpackhi_epi64(t[4 * k + 1], t[4 * k + 3]);
  }
  for (int q = 0; q < 4; ++q) {
    const __m512i s0 = _mm512_shuffle_i32x4(u[q][0], u[q][1], 0x44), s1 = _mm512_shuffle_i32x4(u[q][0], u[q][1], 0xEE);
    const __m512i s2 = _mm512_shuffle_i32x4(u[q][2], u[q][3], 0x44), s3 = _mm512_shuffle_i32x4(u[q][2], u[q][3], 0xEE);
    r[q] = _mm512_shuffle_i32x4(s0, s2, 0x88);
    r[4 + q] = _mm512_shuffle_i32x4(s0, s2, 0xDD);
    r[8 + q] = _mm512_shuffle_i32x4(s1, s3, 0x88);
    r[12 + q] = _mm512_shuffle_i32x4(s1, s3, 0xDD);
  }
}

// Value rows a and b (32 bfloat16 dimensions each) pair-interleaved as tile products' "B" operand
// reads them: *low gets dimensions 0-15 as (a[d], b[d]) pairs, *high dimensions 16-31.
inline void interleave_pairs(__m512i a, __m512i b, __m512i* low, __m512i* high) {
  alignas(64) static const uint16_t kIndex[2][32] = {
      {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39, 8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15,
       47},
      {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55, 24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61,
       30, 62, 31, 63}};
  *low = _mm512_permutex2var_epi16(a, _mm512_load_si512(kIndex[0]), b);
  *high = _mm512_permutex2var_epi16(a, _mm512_load_si512(kIndex[1]), b);
}

// Value rows a and b (32 * halves bfloat16 each; nullptr: zeros, for positions past the end, whose
// probabilities are zero where 0 * a stale NaN would not be) as row r of the pair-interleaved "B"
// tiles of P V: the tile of dimensions [16 c, 16 c + 16) starts at tiles + c * kTileBytes.
inline void interleave_value_rows(const c10::BFloat16* a, const c10::BFloat16* b, int64_t halves, int r,
                                  char* tiles) {
  for (int64_t half = 0; half < halves; ++half) {
    const __m512i ra = a != nullptr ? _mm512_loadu_si512(a + half * 32) : _mm512_setzero_si512();
    const __m512i rb = b != nullptr ? _mm512_loadu_si512(b + half * 32) : _mm512_setzero_si512();
    __m512i low, high;
    interleave_pairs(ra, rb, &low, &high);
    _mm512_store_si512(tiles + 2 * half * kTileBytes + r * 64, low);
    _mm512_store_si512(tiles + (2 * half + 1) * kTileBytes + r * 64, high);
  }
}

}  // namespace tokenmill::tiles
