// Batch-invariant bfloat16 linear layer for the deterministic mode (layers/batch_invariant.py): every
// output row is computed by the same instruction sequence whatever the number of rows or threads.
//
// It is group_gemm.h's row kernel over a plain bfloat16 weight [out, in]: for each output, each group
// of 32 input features is one bfloat16 dot-product instruction per input row into that row's own
// float32 accumulator, groups in input order, then one fixed horizontal sum and a rounding to
// bfloat16. The number of rows only changes how many accumulators run side by side (up to 16 per pass
// over a weight row), never a row's reduction: no blocking of the reduction chosen by the row count,
// no split of it across threads (threads split the outputs). So a row's bits are the same alone and
// among any other rows, which oneDNN's bfloat16 GEMM does not promise (its kernel and blocking
// follow the shape). The int4 and exact 8-bit formats have the same property through the same row
// kernel (int4_gemm_cpu.cpp method 1, q8_gemm_cpu.cpp).
//
// From kBlockedFromRows rows the same arithmetic runs register-blocked (blocked_rows: 4 outputs x 6
// rows of accumulators, each weight group loaded once per 6 rows and each input group once per 4
// outputs, instead of one input load per dot product): every accumulator still takes its groups'
// dot products in input order and one _mm512_reduce_add_ps, so the bits are those of the row kernel
// (and of the int4 and 8-bit row kernels over the same values), at about oneDNN's speed for prompt
// chunks (SmolLM2's projections, 128 rows, one thread: 1.29 vs 1.25 ms and 1.09 vs 1.06 ms; the
// plain row kernel 1.75 and 2.34).
//
// Built where the row kernel is (AVX512-BF16); elsewhere batch_invariant_linear_available() is false
// and the mode computes products in padded row tiles instead.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "cpu_ops.h"
#include "group_gemm.h"

namespace tokenmill {
namespace {

using namespace group_gemm;

#ifdef TOKENMILL_GROUP_AVX512

// The bfloat16 "format" of the row kernel: a group is 32 consecutive weights loaded as they are, a
// 64-byte line prefetched kPrefetchBytes ahead on the weight row's stream.
struct Bf16Groups {
  const c10::BFloat16* weight;
  int64_t groups;
  struct Row {};
  void start_row(int64_t o, Row&) const {
    _mm_prefetch(reinterpret_cast<const char*>(weight + o * groups * kGroup), _MM_HINT_T0);
  }
  __m512bh group(int64_t o, int64_t g, const Row&) const {
    const c10::BFloat16* w = weight + (o * groups + g) * kGroup;
    _mm_prefetch(reinterpret_cast<const char*>(w) + kPrefetchBytes, _MM_HINT_T0);
    return (__m512bh)_mm512_loadu_si512(w);
  }
};

constexpr int kBlockOutputs = 4;     // outputs per register tile
constexpr int kBlockRows = 6;        // rows per register tile: 24 accumulators, 4 weights, 1 input
constexpr int64_t kBlockedFromRows = 3;

// out[r, o] for rows [r0, r0 + R) and outputs [o0, o0 + O) of the weight [out, groups * 32].
template <int R, int O>
inline void blocked_tile(const c10::BFloat16* x, int64_t x_stride, const c10::BFloat16* weight, int64_t groups,
                         c10::BFloat16* out, int64_t out_stride, int64_t r0, int64_t o0) {
  __m512 acc[R][O];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int o = 0; o < O; ++o) acc[r][o] = _mm512_setzero_ps();
  const int64_t in = groups * kGroup;
  for (int64_t g = 0; g < groups; ++g) {
    __m512bh wg[O];
#pragma GCC unroll 4
    for (int o = 0; o < O; ++o) {
      const c10::BFloat16* w = weight + (o0 + o) * in + g * kGroup;
      _mm_prefetch(reinterpret_cast<const char*>(w) + kPrefetchBytes, _MM_HINT_T0);
      wg[o] = (__m512bh)_mm512_loadu_si512(w);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512bh xg = (__m512bh)_mm512_loadu_si512(x + (r0 + r) * x_stride + g * kGroup);
#pragma GCC unroll 4
      for (int o = 0; o < O; ++o) acc[r][o] = _mm512_dpbf16_ps(acc[r][o], wg[o], xg);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int o = 0; o < O; ++o)
      out[(r0 + r) * out_stride + o0 + o] = static_cast<c10::BFloat16>(_mm512_reduce_add_ps(acc[r][o]));
}

// Every row for outputs [o0, o0 + O): tiles of kBlockRows rows, then one of the rest.
template <int O>
void blocked_outputs(const c10::BFloat16* x, int64_t x_stride, const c10::BFloat16* weight, int64_t groups,
                     c10::BFloat16* out, int64_t out_stride, int64_t rows, int64_t o0) {
  int64_t r0 = 0;
  for (; r0 + kBlockRows <= rows; r0 += kBlockRows)
    blocked_tile<kBlockRows, O>(x, x_stride, weight, groups, out, out_stride, r0, o0);
  switch (rows - r0) {
    case 1: blocked_tile<1, O>(x, x_stride, weight, groups, out, out_stride, r0, o0); break;
    case 2: blocked_tile<2, O>(x, x_stride, weight, groups, out, out_stride, r0, o0); break;
    case 3: blocked_tile<3, O>(x, x_stride, weight, groups, out, out_stride, r0, o0); break;
    case 4: blocked_tile<4, O>(x, x_stride, weight, groups, out, out_stride, r0, o0); break;
    case 5: blocked_tile<5, O>(x, x_stride, weight, groups, out, out_stride, r0, o0); break;
    default: break;
  }
}

// out[r, o] for every row and outputs [begin, end) (whole blocks of kBlockOutputs, then single ones).
void blocked_rows(const c10::BFloat16* x, int64_t x_stride, const c10::BFloat16* weight, int64_t groups,
                  c10::BFloat16* out, int64_t out_stride, int64_t rows, int64_t begin, int64_t end) {
  int64_t o = begin;
  for (; o + kBlockOutputs <= end; o += kBlockOutputs)
    blocked_outputs<kBlockOutputs>(x, x_stride, weight, groups, out, out_stride, rows, o);
  for (; o < end; ++o) blocked_outputs<1>(x, x_stride, weight, groups, out, out_stride, rows, o);
}

#endif  // TOKENMILL_GROUP_AVX512

bool batch_invariant_linear_available() {
#ifdef TOKENMILL_GROUP_AVX512
  return true;
#else
  return false;
#endif
}

at::Tensor batch_invariant_linear(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(batch_invariant_linear_available(), "batch_invariant_linear needs a CPU with AVX512-BF16");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.stride(1) == 1,
              "batch_invariant_linear: x must be a bfloat16 CPU tensor [rows, in] with contiguous rows");
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kBFloat16 && weight.dim() == 2 &&
                  weight.is_contiguous(),
              "batch_invariant_linear: weight must be a contiguous bfloat16 CPU tensor [out, in]");
  const int64_t rows = x.size(0), out_features = weight.size(0), in = weight.size(1);
  TORCH_CHECK(in % kGroup == 0, "batch_invariant_linear: in_features must be a multiple of ", kGroup, ", got ", in);
  TORCH_CHECK(x.size(1) == in, "batch_invariant_linear: x has ", x.size(1), " features, the weight ", in);
  at::Tensor out = at::empty({rows, out_features}, x.options());  // [rows, out_features]
#ifdef TOKENMILL_GROUP_AVX512
  if (rows == 0 || out_features == 0) return out;
  const auto* xp = x.data_ptr<c10::BFloat16>();
  const auto* wp = weight.data_ptr<c10::BFloat16>();
  auto* op = out.data_ptr<c10::BFloat16>();
  const int64_t x_stride = x.stride(0);
  if (rows < kBlockedFromRows) {
    at::parallel_for(0, out_features, kOutputsPerTask, [&](int64_t begin, int64_t end) {
      multiply_rows(xp, x_stride, Bf16Groups{wp, in / kGroup}, op, out_features, rows, begin, end);
    });
    return out;
  }
  // Threads split whole blocks of outputs (the arithmetic of an output does not depend on the split).
  const int64_t blocks = (out_features + kBlockOutputs - 1) / kBlockOutputs;
  at::parallel_for(0, blocks, kOutputsPerTask / kBlockOutputs, [&](int64_t begin, int64_t end) {
    blocked_rows(xp, x_stride, wp, in / kGroup, op, out_features, rows, begin * kBlockOutputs,
                 std::min(end * kBlockOutputs, out_features));
  });
#endif
  return out;
}

}  // namespace
}  // namespace tokenmill

namespace tokenmill::ops {
at::Tensor batch_invariant_linear(const at::Tensor& x, const at::Tensor& weight) {
  return ::tokenmill::batch_invariant_linear(x, weight);
}
}  // namespace tokenmill::ops

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("batch_invariant_linear_available() -> bool", &tokenmill::batch_invariant_linear_available);
  m.def("batch_invariant_linear(Tensor x, Tensor weight) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) { m.impl("batch_invariant_linear", &tokenmill::batch_invariant_linear); }
