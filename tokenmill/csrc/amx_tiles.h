// AMX tile helpers shared by the CPU kernels that multiply on tiles (int4_gemm_cpu.cpp,
// paged_attention_cpu.cpp, prefill_attention_cpu.cpp): the tile configuration every one of them
// uses (each of the 8 tiles 16 rows of 64 bytes) and the value side of attention's P V (the products
// of four tiles); the operand layouts come from tile_layout.h.
// Include only where __AMX_TILE__ and __AMX_BF16__ are defined.
#pragma once

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cstdint>

#include "tile_layout.h"

namespace tokenmill::amx {

using tiles::interleave_value_rows;
using tiles::kTileBytes;
using tiles::kTileRows;
using tiles::transpose16x16;

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
