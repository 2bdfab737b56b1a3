// The row kernel of the grouped weight formats: int4_gemm_cpu.cpp's 4-bit groups (scale and minimum)
// and q8_gemm_cpu.cpp's 8-bit groups (scale). For each output, each group of 32 weights is decoded
// once into 32 bfloat16 values and multiplied with the same 32 activations of every input row by the
// bfloat16 dot-product instruction (float32 accumulation): the weights are read once per call whatever
// the number of rows, and the time per row is one dot product per group.
//
// A format is a struct with `groups` (per output row), a `Row` of per-row constants, `start_row(o, row)`
// (fills them, prefetches its streams) and `group(o, g, row)` (the 32 weights of group g as bfloat16,
// element order, prefetching the packed stream ahead).
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__) && !defined(TOKENMILL_NO_AVX512)
#define TOKENMILL_GROUP_AVX512 1
#include <immintrin.h>
#endif

namespace tokenmill::group_gemm {

constexpr int64_t kGroup = 32;
// Input rows handled per pass over a weight row: one float32 accumulator register each.
constexpr int kMaxRowsPerPass = 16;
// Largest input width: the float32 copies of one weight row's per-group constants live on the stack.
constexpr int64_t kMaxGroups = 1024;
// How far ahead the kernel prefetches packed weights. Measured on a 2-core Xeon with int4: no prefetch
// 5.5 GB/s at one row, 1 KiB 10 GB/s, 4-16 KiB 12-14 GB/s.
constexpr int64_t kPrefetchBytes = 4096;
// Output rows per parallel task: a few KiB of packed weights, so two threads split even a small layer.
constexpr int64_t kOutputsPerTask = 16;

#ifdef TOKENMILL_GROUP_AVX512

// Float32 copies of one weight row's group constants (16 converted per instruction).
inline void widen_row(const c10::Half* src, float* dst, int64_t groups) {
  for (int64_t g = 0; g < groups; g += 16) {
    const __mmask16 lanes = groups - g >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (groups - g)) - 1u);
    _mm512_mask_storeu_ps(dst + g, lanes, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes, src + g)));
  }
}

// out[r, o] for rows [row0, row0 + ROWS) and outputs [begin, end).
template <int ROWS, typename Format>
void linear_rows(const c10::BFloat16* x, int64_t x_stride, const Format& format, c10::BFloat16* out,
                 int64_t out_stride, int64_t row0, int64_t begin, int64_t end) {
  typename Format::Row row;
  for (int64_t o = begin; o < end; ++o) {
    format.start_row(o, row);
    __m512 acc[ROWS];
    for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < format.groups; ++g) {
      const __m512bh wg = format.group(o, g, row);
      for (int r = 0; r < ROWS; ++r) {
        const __m512bh xg = (__m512bh)_mm512_loadu_si512(x + (row0 + r) * x_stride + g * kGroup);
        acc[r] = _mm512_dpbf16_ps(acc[r], wg, xg);
      }
    }
    for (int r = 0; r < ROWS; ++r) {
      out[(row0 + r) * out_stride + o] = static_cast<c10::BFloat16>(_mm512_reduce_add_ps(acc[r]));
    }
  }
}

template <int ROWS, typename Format>
void linear_pass(const c10::BFloat16* x, int64_t x_stride, const Format& format, c10::BFloat16* out,
                 int64_t out_stride, int64_t row0, int64_t rows, int64_t begin, int64_t end) {
  if constexpr (ROWS > 1) {
    if (rows < ROWS) {
      linear_pass<ROWS - 1>(x, x_stride, format, out, out_stride, row0, rows, begin, end);
      return;
    }
  }
  linear_rows<ROWS>(x, x_stride, format, out, out_stride, row0, begin, end);
}

// out[r, o] for every row r < rows and outputs [begin, end), kMaxRowsPerPass rows per pass.
template <typename Format>
void multiply_rows(const c10::BFloat16* x, int64_t x_stride, const Format& format, c10::BFloat16* out,
                   int64_t out_stride, int64_t rows, int64_t begin, int64_t end) {
  for (int64_t row0 = 0; row0 < rows; row0 += kMaxRowsPerPass) {
    const int64_t n = std::min<int64_t>(kMaxRowsPerPass, rows - row0);
    linear_pass<kMaxRowsPerPass>(x, x_stride, format, out, out_stride, row0, n, begin, end);
  }
}

#endif  // TOKENMILL_GROUP_AVX512

}  // namespace tokenmill::group_gemm
