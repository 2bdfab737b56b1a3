// Linear layer over exact 8-bit groups (layers/q8.py), for steps of a few rows: the LM head of a model
// whose weight is a Q8_0 GGUF tensor, such as the bundled SmolLM2's tied embedding.
//
// Format: a weight [out, in] in groups of 32 consecutive input features; per group a float16 scale d
// (tensor [out, in/32]) and int8 q (tensor [out, in]), element value round_bf16(float(d) * q): the
// product is exact in float32 (11 x 8 mantissa bits), and a Q8_0 tensor loaded in bfloat16 holds
// exactly these values, so this computes with the weight the bfloat16 GEMM would use, from half the
// bytes. The row kernel is group_gemm.h's; a group decodes in two sign extensions, two conversions,
// two multiplies and one rounding to bfloat16.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <tuple>

#include "cpu_ops.h"
#include "group_gemm.h"

namespace tokenmill {
namespace {

using namespace group_gemm;

#ifdef TOKENMILL_GROUP_AVX512

// The 32 weights of one group as bfloat16, in element order.
inline __m512bh dequantize_q8_group(const int8_t* q, __m512 d) {
  const __m512 low = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
  const __m512 high =
      _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16))));
  // cvtne2ps(a, b) puts b's 16 values in lanes 0..15 and a's in lanes 16..31 (round to nearest even).
  return _mm512_cvtne2ps_pbh(_mm512_mul_ps(high, d), _mm512_mul_ps(low, d));
}

// The 8-bit format for the row kernel: per row the float32 scales, a 64-byte line of weights
// prefetched every 2 groups.
struct Q8Groups {
  const int8_t* q;
  const c10::Half* scales;
  int64_t groups;
  struct Row {
    alignas(64) float d[kMaxGroups];
  };
  void start_row(int64_t o, Row& row) const {
    _mm_prefetch(reinterpret_cast<const char*>(scales + o * groups + kPrefetchBytes / kGroup), _MM_HINT_T0);
    widen_row(scales + o * groups, row.d, groups);
  }
  __m512bh group(int64_t o, int64_t g, const Row& row) const {
    const int8_t* w = q + (o * groups + g) * kGroup;
    if ((g & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetchBytes), _MM_HINT_T0);
    return dequantize_q8_group(w, _mm512_set1_ps(row.d[g]));
  }
};

#else  // portable loops: the same values and float32 accumulation, without the vector instructions

void q8_portable(const c10::BFloat16* x, int64_t x_stride, const int8_t* q, const c10::Half* scales,
                 c10::BFloat16* out, int64_t out_stride, int64_t rows, int64_t begin, int64_t end, int64_t in) {
  const int64_t groups = in / kGroup;
  for (int64_t o = begin; o < end; ++o) {
    for (int64_t r = 0; r < rows; ++r) {
      float acc = 0.0f;
      for (int64_t g = 0; g < groups; ++g) {
        const float d = static_cast<float>(scales[o * groups + g]);
        for (int64_t j = 0; j < kGroup; ++j) {
          const float w = static_cast<float>(static_cast<c10::BFloat16>(d * static_cast<float>(q[o * in + g * kGroup + j])));
          acc += w * static_cast<float>(x[r * x_stride + g * kGroup + j]);
        }
      }
      out[r * out_stride + o] = static_cast<c10::BFloat16>(acc);
    }
  }
}

#endif

at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales) {
  if (q.dim() == 3) return ops::q8_linear_blocked_f32(x, q, scales);  // the blocked layout: float32 rows
  TORCH_CHECK(q.device().is_cpu() && scales.device().is_cpu() && x.device().is_cpu(), "q8 tensors must be on the CPU");
  TORCH_CHECK(q.scalar_type() == at::kChar && q.dim() == 2 && q.is_contiguous(), "q must be contiguous int8 [out, in]");
  const int64_t out_features = q.size(0), in = q.size(1);
  TORCH_CHECK(in % kGroup == 0 && in / kGroup <= kMaxGroups, "in_features must be a multiple of ", kGroup,
              " and at most ", kMaxGroups * kGroup, ", got ", in);
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.dim() == 2 &&
                  scales.size(0) == out_features && scales.size(1) == in / kGroup,
              "scales must be contiguous float16 [", out_features, ", ", in / kGroup, "]");
  if (x.scalar_type() == at::kFloat) return ops::q8_linear_f32(x, q, scales);  // values d * q, unrounded
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.stride(1) == 1,
              "x must be a bfloat16 or float32 CPU tensor [rows, in] with contiguous rows");
  TORCH_CHECK(x.size(1) == in, "x has ", x.size(1), " features, the weight ", in);
  const int64_t rows = x.size(0);
  at::Tensor out = at::empty({rows, out_features}, x.options());
  if (rows == 0 || out_features == 0) return out;
  const auto* xp = x.data_ptr<c10::BFloat16>();
  const auto* qp = q.data_ptr<int8_t>();
  const auto* dp = scales.data_ptr<c10::Half>();
  auto* op = out.data_ptr<c10::BFloat16>();
  const int64_t x_stride = x.stride(0);
  at::parallel_for(0, out_features, kOutputsPerTask, [&](int64_t begin, int64_t end) {
#ifdef TOKENMILL_GROUP_AVX512
    multiply_rows(xp, x_stride, Q8Groups{qp, dp, in / kGroup}, op, out_features, rows, begin, end);
#else
    q8_portable(xp, x_stride, qp, dp, op, out_features, rows, begin, end, in);
#endif
  });
  return out;
}

// fp16 neighbours of max|w| / 127 tried as a group's scale, in this order: a Q8_0 group's largest |q|
// is 127, but the bfloat16 value of d * 127 hides the last bits of d.
constexpr int kScaleSteps[] = {0, 1, -1, 2, -2, 3, -3, 4, -4, 5, -5, 6, -6, 7, -7, 8, -8};

// The q of group `w` (32 bfloat16 values) for scale d, if every round_bf16(d * q) equals its value.
bool fits_scale(const c10::BFloat16* w, float d, int8_t* q) {
  for (int64_t j = 0; j < kGroup; ++j) {
    const float value = static_cast<float>(w[j]);
    const float level = std::min(127.0f, std::max(-127.0f, std::nearbyint(value / d)));
    if (static_cast<float>(static_cast<c10::BFloat16>(d * level)) != value) return false;
    q[j] = static_cast<int8_t>(level);
  }
  return true;
}

// (q [out, in] int8, scales [out, in/32] float16, found): the exact 8-bit groups of a bfloat16 weight,
// as layers/q8.py's exact_q8_groups documents; `found` is false when some group has none (then q and
// scales are unspecified).
std::tuple<at::Tensor, at::Tensor, bool> q8_groups_of(const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kBFloat16 && weight.dim() == 2 &&
                  weight.is_contiguous() && weight.size(1) % kGroup == 0,
              "weight must be a contiguous bfloat16 CPU tensor [out, in] with in a multiple of ", kGroup);
  const int64_t out_features = weight.size(0), in = weight.size(1), groups = out_features * (in / kGroup);
  at::Tensor q = at::empty({out_features, in}, weight.options().dtype(at::kChar));
  at::Tensor scales = at::empty({out_features, in / kGroup}, weight.options().dtype(at::kHalf));
  const auto* wp = weight.data_ptr<c10::BFloat16>();
  auto* qp = q.data_ptr<int8_t>();
  auto* dp = scales.data_ptr<c10::Half>();
  std::atomic<bool> found{true};
  at::parallel_for(0, groups, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end && found.load(std::memory_order_relaxed); ++g) {
      const c10::BFloat16* w = wp + g * kGroup;
      float amax = 0.0f;
      for (int64_t j = 0; j < kGroup; ++j) amax = std::max(amax, std::abs(static_cast<float>(w[j])));
      if (amax == 0.0f) {  // all zeros (either sign): d = 0, q = 0
        dp[g] = c10::Half(0.0f);
        std::fill(qp + g * kGroup, qp + (g + 1) * kGroup, int8_t{0});
        continue;
      }
      const uint16_t guess = c10::Half(amax / 127.0f).x;
      bool fits = false;
      for (const int step : kScaleSteps) {
        c10::Half d;
        d.x = static_cast<uint16_t>(guess + step);
        const float d32 = static_cast<float>(d);
        if (d32 > 0.0f && std::isfinite(d32) && fits_scale(w, d32, qp + g * kGroup)) {
          dp[g] = d;
          fits = true;
          break;
        }
      }
      if (!fits) found.store(false, std::memory_order_relaxed);
    }
  });
  return {q, scales, found.load()};
}

}  // namespace
}  // namespace tokenmill

namespace tokenmill::ops {
at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales) {
  return ::tokenmill::q8_linear(x, q, scales);
}
}  // namespace tokenmill::ops

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("q8_linear(Tensor x, Tensor q, Tensor scales) -> Tensor");
  m.def("q8_groups_of(Tensor weight) -> (Tensor, Tensor, bool)");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("q8_linear", &tokenmill::q8_linear);
  m.impl("q8_groups_of", &tokenmill::q8_groups_of);
}
