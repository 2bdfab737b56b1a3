// The row split of the elementwise CPU kernels (fused_ops_cpu.cpp, gemma_ops_cpu.cpp).
#pragma once

#include <algorithm>
#include <cstdint>

namespace tokenmill {

// Rows per thread below which a kernel runs on the calling thread alone: about 256k elements. A
// decode step's norms, rotary and activation (tens to a few hundred rows) take tens of microseconds;
// splitting them across threads gains a few microseconds when the cores are idle, but when another
// process holds a core (the API server streaming tokens, a client) the other thread waits at the
// barrier for a whole scheduler time slice: about 1 ms instead of 40 us per call, measured.
// `cost` weighs an element by its work next to a norm's (a load, a multiply-add, a store).
inline int64_t rows_grain(int64_t elements_per_row, int64_t cost = 1) {
  constexpr int64_t kMinElementsPerThread = int64_t{1} << 18;
  return std::max<int64_t>(1, kMinElementsPerThread / std::max<int64_t>(1, elements_per_row * cost));
}

}  // namespace tokenmill
