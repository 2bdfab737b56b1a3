// float32 activations times the grouped weight formats: int4 groups (int4_gemm_cpu.cpp's format: per 32
// weights a float16 scale d and minimum m, 4-bit q) and exact 8-bit groups (q8_gemm_cpu.cpp's: a float16
// scale d, int8 q), for decode steps of a model run in float32 (--dtype auto on CPUs without AVX-512).
//
// Values: each weight is fma(q, d, m) (int4) or d * q (8-bit) in float32, not rounded to bfloat16: q * d
// is exact in float32, so these are exactly the float32 values a Q4_1 / Q8_0 GGUF tensor dequantizes to
// (one rounding of q * d + m), and a float32 layer whose weight holds such values streams 4.5 or 8.5
// bits per weight instead of 32 for the same products (up to summation order).
//
// Kernel (AVX2 + FMA; plain loops elsewhere): per output row its float16 constants are widened once
// (F16C), and per group the 32 weights are decoded into four 8-lane float32 vectors once and multiplied
// into four independent accumulators for a single input row (short FMA latency chains), or one
// accumulator per row for up to kRowsPerPass rows; the packed stream is prefetched kPrefetchBytes
// ahead, as in group_gemm.h.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define TOKENMILL_GROUP_F32_AVX2 1
#include <immintrin.h>
#endif

#include "cpu_ops.h"

namespace tokenmill {
namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kOutputsPerTask = 16;
constexpr int64_t kPrefetchBytes = 4096;
constexpr int kRowsPerPass = 8;  // 8 accumulators + 4 weight vectors fit the 16 AVX2 registers

constexpr int64_t kMaxGroups = 1024;  // int4_gemm_cpu.cpp / q8_gemm_cpu.cpp check in_features against it

#ifdef TOKENMILL_GROUP_F32_AVX2
// float32 copies of one row's float16 group constants (8 per F16C instruction; c10::Half's scalar
// conversion per group would cost more than the group's FMAs).
inline void widen(const c10::Half* src, float* dst, int64_t groups) {
  int64_t g = 0;
  for (; g + 8 <= groups; g += 8)
    _mm256_store_ps(dst + g, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + g))));
  for (; g < groups; ++g) dst[g] = static_cast<float>(src[g]);
}
#endif

// One output row's weights: per group the 32 float32 values as four 8-lane vectors (or 32 floats).
struct Int4Format {
  const uint8_t* packed;
  const c10::Half* scales;
  const c10::Half* mins;
  int64_t groups;
  static constexpr int64_t kGroupBytes = kGroup / 2;
#ifdef TOKENMILL_GROUP_F32_AVX2
  struct Row {
    alignas(32) float d[kMaxGroups];
    alignas(32) float m[kMaxGroups];
  };
  void start_row(int64_t o, Row& row) const {
    widen(scales + o * groups, row.d, groups);
    widen(mins + o * groups, row.m, groups);
  }
  void decode(int64_t o, int64_t g, const Row& row, __m256 w[4]) const {
    const uint8_t* bytes = packed + (o * groups + g) * kGroupBytes;
    if ((g & 3) == 0) _mm_prefetch(reinterpret_cast<const char*>(bytes + kPrefetchBytes), _MM_HINT_T0);
    const __m256 d = _mm256_broadcast_ss(row.d + g);
    const __m256 m = _mm256_broadcast_ss(row.m + g);
    const __m128i nibbles = _mm_set1_epi8(0x0F);
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes));
    const __m128i low = _mm_and_si128(raw, nibbles);                       // elements 0..15
    const __m128i high = _mm_and_si128(_mm_srli_epi16(raw, 4), nibbles);  // elements 16..31
    w[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(low)), d, m);
    w[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(low, 8))), d, m);
    w[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(high)), d, m);
    w[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(high, 8))), d, m);
  }
#endif
  float value(int64_t o, int64_t g, int j) const {
    const uint8_t* bytes = packed + (o * groups + g) * kGroupBytes;
    const int q = j < 16 ? (bytes[j] & 0x0F) : (bytes[j - 16] >> 4);
    return std::fma(static_cast<float>(q), static_cast<float>(scales[o * groups + g]),
                    static_cast<float>(mins[o * groups + g]));
  }
};

struct Q8Format {
  const int8_t* q;
  const c10::Half* scales;
  int64_t groups;
#ifdef TOKENMILL_GROUP_F32_AVX2
  struct Row {
    alignas(32) float d[kMaxGroups];
  };
  void start_row(int64_t o, Row& row) const { widen(scales + o * groups, row.d, groups); }
  void decode(int64_t o, int64_t g, const Row& row, __m256 w[4]) const {
    const int8_t* values = q + (o * groups + g) * kGroup;
    if ((g & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(values + kPrefetchBytes), _MM_HINT_T0);
    const __m256 d = _mm256_broadcast_ss(row.d + g);
    for (int c = 0; c < 4; ++c) {
      const __m128i eight = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(values + 8 * c));
      w[c] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(eight)), d);
    }
  }
#endif
  float value(int64_t o, int64_t g, int j) const {
    return static_cast<float>(scales[o * groups + g]) * static_cast<float>(q[(o * groups + g) * kGroup + j]);
  }
};

#ifdef TOKENMILL_GROUP_F32_AVX2

inline float horizontal_sum(__m256 v) {
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pair = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)));
}

// out[row0, o] for one row: four accumulators (independent FMA chains).
template <typename Format>
void one_row(const float* x, const Format& format, const typename Format::Row& row, float* out, int64_t o) {
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t g = 0; g < format.groups; ++g) {
    __m256 w[4];
    format.decode(o, g, row, w);
    for (int c = 0; c < 4; ++c) acc[c] = _mm256_fmadd_ps(w[c], _mm256_loadu_ps(x + g * kGroup + 8 * c), acc[c]);
  }
  *out = horizontal_sum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
}

// out[row0 + r, o] for r < ROWS: one accumulator a row (the rows' chains interleave), each group
// decoded once for all of them.
template <int ROWS, typename Format>
void several_rows(const float* x, int64_t x_stride, const Format& format, const typename Format::Row& row,
                  float* out, int64_t out_stride, int64_t row0, int64_t o) {
  __m256 acc[ROWS];
  for (int r = 0; r < ROWS; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < format.groups; ++g) {
    __m256 w[4];
    format.decode(o, g, row, w);
    for (int c = 0; c < 4; ++c)
      for (int r = 0; r < ROWS; ++r)
        acc[r] = _mm256_fmadd_ps(w[c], _mm256_loadu_ps(x + (row0 + r) * x_stride + g * kGroup + 8 * c), acc[r]);
  }
  for (int r = 0; r < ROWS; ++r) out[(row0 + r) * out_stride + o] = horizontal_sum(acc[r]);
}

template <int ROWS, typename Format>
void rows_pass(const float* x, int64_t x_stride, const Format& format, const typename Format::Row& row, float* out,
               int64_t out_stride, int64_t row0, int64_t rows, int64_t o) {
  if constexpr (ROWS > 2) {
    if (rows < ROWS) {
      rows_pass<ROWS - 1>(x, x_stride, format, row, out, out_stride, row0, rows, o);
      return;
    }
  }
  several_rows<ROWS>(x, x_stride, format, row, out, out_stride, row0, o);
}

#endif

// out[r, o] for every row and outputs [begin, end): one row alone with four FMA chains, more rows
// kRowsPerPass at a time, each group decoded once per pass.
template <typename Format>
void multiply(const float* x, int64_t x_stride, const Format& format, float* out, int64_t out_stride, int64_t rows,
              int64_t begin, int64_t end) {
#ifdef TOKENMILL_GROUP_F32_AVX2
  typename Format::Row row;
#endif
  for (int64_t o = begin; o < end; ++o) {
#ifdef TOKENMILL_GROUP_F32_AVX2
    format.start_row(o, row);
    if (rows == 1) {
      one_row(x, format, row, out + o, o);
      continue;
    }
    for (int64_t row0 = 0; row0 < rows; row0 += kRowsPerPass) {
      const int64_t n = std::min<int64_t>(kRowsPerPass, rows - row0);
      if (n == 1)
        one_row(x + row0 * x_stride, format, row, out + row0 * out_stride + o, o);
      else
        rows_pass<kRowsPerPass>(x, x_stride, format, row, out, out_stride, row0, n, o);
    }
#else
    for (int64_t r = 0; r < rows; ++r) {
      float acc = 0.0f;
      for (int64_t g = 0; g < format.groups; ++g)
        for (int j = 0; j < kGroup; ++j) acc += format.value(o, g, j) * x[r * x_stride + g * kGroup + j];
      out[r * out_stride + o] = acc;
    }
#endif
  }
}

template <typename Format>
at::Tensor linear_f32(const at::Tensor& x, const Format& format, int64_t out_features) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1,
              "x must be a float32 CPU tensor [rows, in] with contiguous rows");
  TORCH_CHECK(x.size(1) == format.groups * kGroup, "x has ", x.size(1), " features, the weight ",
              format.groups * kGroup);
  const int64_t rows = x.size(0);
  at::Tensor out = at::empty({rows, out_features}, x.options());
  if (rows == 0 || out_features == 0) return out;
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, out_features, kOutputsPerTask, [&](int64_t begin, int64_t end) {
    multiply(xp, x.stride(0), format, op, out_features, rows, begin, end);
  });
  return out;
}

}  // namespace
}  // namespace tokenmill

namespace tokenmill::ops {

at::Tensor int4_linear_f32(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                           const at::Tensor& mins) {
  const int64_t groups = packed.size(1) * 2 / kGroup;
  return linear_f32(x, Int4Format{packed.data_ptr<uint8_t>(), scales.data_ptr<c10::Half>(),
                                  mins.data_ptr<c10::Half>(), groups},
                    packed.size(0));
}

at::Tensor q8_linear_f32(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales) {
  return linear_f32(x, Q8Format{q.data_ptr<int8_t>(), scales.data_ptr<c10::Half>(), q.size(1) / kGroup},
                    q.size(0));
}

bool group_f32_vectorized() {
#ifdef TOKENMILL_GROUP_F32_AVX2
  return true;
#else
  return false;
#endif
}

}  // namespace tokenmill::ops

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("group_f32_vectorized() -> bool", &tokenmill::ops::group_f32_vectorized);
}
