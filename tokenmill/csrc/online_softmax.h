// The online-softmax step shared by the CPU attention kernels (paged_attention_cpu.cpp's decode
// path, prefill_attention_f32_cpu.cpp): one query head's scores over a chunk of positions folded into
// its running maximum and denominator.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "vec16.h"

namespace tokenmill::vec {

// row[0, n) holds a head's scores over the chunk's positions, of which it attends the first `valid`
// (1 <= valid <= n). Turns them into exp(score - new max), 0 from `valid` on, folds them into the
// running max and denominator, and returns the factor that rescales what the head accumulated before
// the chunk (0 for the first chunk).
inline float online_softmax_step(float* row, int64_t n, int64_t valid, float& row_max, float& row_sum) {
  Vec best = splat(kNegInf);
  for (int64_t i = 0; i < valid; i += kLanes) best = max(best, load_or(row + i, static_cast<int>(valid - i), kNegInf));
  const float old_max = row_max;
  const float new_max = std::max(old_max, reduce_max(best));
  const float alpha = old_max == kNegInf ? 0.0f : std::exp(old_max - new_max);
  Vec sum = zero();
  for (int64_t i = 0; i < n; i += kLanes) {
    const int lanes = static_cast<int>(std::min<int64_t>(kLanes, n - i));
    // Lanes past `valid` (or past n, loaded as 0) became exp(-max) or worse: keep them out.
    const int kept = static_cast<int>(std::clamp<int64_t>(valid - i, 0, kLanes));
    const Vec prob = keep(exp(sub(load(row + i, lanes), splat(new_max))), kept);
    store(row + i, prob, lanes);
    sum = add(sum, prob);
  }
  row_max = new_max;
  row_sum = row_sum * alpha + reduce_add(sum);
  return alpha;
}

}  // namespace tokenmill::vec
