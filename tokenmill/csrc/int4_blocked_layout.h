// The blocked layout of an int4 weight (layers/int4.py block_int4_layout), which the bfloat16 blocked kernel
// (int4_blocked_cpu.cpp) and the wide kernel (int4_wide_cpu.cpp) read: outputs in blocks of 16 (out_features
// a multiple of 16); per block and group of 32 input features, 8 steps of 32 bytes, step t covering features
// 4t..4t+3 of the group: byte j holds output 16b + j/2's level of feature 4t + j%2 in its low nibble and of
// feature 4t + 2 + j%2 in its high nibble. packed [blocks, groups, 256] uint8; scales and mins [blocks,
// groups, 16] float16 (the same values as the row layout's, output o of the block in lane o), or float32
// for layers/level_sums.py's groups, whose 5-bit levels add `high` [blocks, groups, 16] int32: per step two
// masks (bit j: the fifth bit of the level byte j's low, then high, nibble holds).
#pragma once

#include <c10/util/Half.h>

#include <cstdint>

#include "group_gemm.h"

namespace tokenmill::int4_blocked {

constexpr int64_t kBlockOutputs = 16;
constexpr int64_t kStepBytes = 32;  // 4 features x 16 outputs, two levels a byte
constexpr int64_t kStepsPerGroup = group_gemm::kGroup / 4;         // 8
constexpr int64_t kBlockGroupBytes = kStepsPerGroup * kStepBytes;  // 256

#ifdef TOKENMILL_GROUP_AVX512

// A block's 16 scales or minimums of one group, float32.
inline __m512 load_block_constants(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load_block_constants(const float* p) { return _mm512_loadu_ps(p); }

#endif  // TOKENMILL_GROUP_AVX512

}  // namespace tokenmill::int4_blocked
