// AMX tile helpers shared by the CPU kernels that multiply on tiles (int4_gemm_cpu.cpp,
// paged_attention_cpu.cpp, prefill_attention_cpu.cpp): the tile configuration every one of them
// uses (each of the 8 tiles 16 rows of 64 bytes), a 16 x 16 transpose of 32-bit elements, and the
// value side of attention's P V (value rows laid out as tile operands, the products of four tiles).
// Include only where __AMX_TILE__ and __AMX_BF16__ are defined.
#pragma once

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cstdint>

namespace tokenmill::amx {

constexpr int kTileRows = 16;
constexpr int64_t kTileBytes = 1024;  // one 16 x 64-byte tile

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Every tile 16 rows of 64 bytes. Per thread; pair with _tile_release() when done.
inline void configure_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = kTileRows;
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
}

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

// Adds P_s V_{s, j} for s < steps into tiles 0-3 (one per 16-dimension tile j): P_s (the "A"
// operand: 16 rows x 32 positions in bfloat16) at probs + s * kTileBytes, V_{s, j} (laid out by
// interleave_value_rows) at values + s * value_step_bytes + j * kTileBytes. Uses tiles 4 and 5.
inline void add_value_products(const char* probs, const char* values, int64_t value_step_bytes, int steps) {
  for (int s = 0; s < steps; ++s) {
    const char* v = values + s * value_step_bytes;
    _tile_loadd(4, probs + s * kTileBytes, 64);
    _tile_loadd(5, v, 64);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(5, v + kTileBytes, 64);
    _tile_dpbf16ps(1, 4, 5);
    _tile_loadd(5, v + 2 * kTileBytes, 64);
    _tile_dpbf16ps(2, 4, 5);
    _tile_loadd(5, v + 3 * kTileBytes, 64);
    _tile_dpbf16ps(3, 4, 5);
  }
}

// partial[j] = sum over s < steps of P_s V_{s, j} (see add_value_products). Uses tiles 0-5.
inline void multiply_values(const char* probs, const char* values, int64_t value_step_bytes, int steps,
                            float (*partial)[kTileRows][kTileRows]) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  add_value_products(probs, values, value_step_bytes, steps);
  _tile_stored(0, partial[0], 64);
  _tile_stored(1, partial[1], 64);
  _tile_stored(2, partial[2], 64);
  _tile_stored(3, partial[3], 64);
}

// out[:, 16 j .. 16 j + 16) += sum over s < steps of P_s V_{s, j} for j < 4: the four 16 x 16 float
// tiles at out + 16 j (rows out_stride_bytes apart) are loaded, accumulated and stored back.
inline void accumulate_values(const char* probs, const char* values, int64_t value_step_bytes, int steps, float* out,
                              int64_t out_stride_bytes) {
  _tile_loadd(0, out, out_stride_bytes);
  _tile_loadd(1, out + 16, out_stride_bytes);
  _tile_loadd(2, out + 32, out_stride_bytes);
  _tile_loadd(3, out + 48, out_stride_bytes);
  add_value_products(probs, values, value_step_bytes, steps);
  _tile_stored(0, out, out_stride_bytes);
  _tile_stored(1, out + 16, out_stride_bytes);
  _tile_stored(2, out + 32, out_stride_bytes);
  _tile_stored(3, out + 48, out_stride_bytes);
}

}  // namespace tokenmill::amx
