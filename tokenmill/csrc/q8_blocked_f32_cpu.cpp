// Exact 8-bit groups (q8_gemm_cpu.cpp's format: per 32 weights a float16 scale d, int8 q) times steps of a
// few float32 rows, over a blocked copy of the weight (layers/q8.py block_q8_layout): the LM head of a
// float32 model (the avx2 and avx512 paths) decoding, or verifying drafts.
//
// Blocked layout: outputs in blocks of 16 (out_features a multiple of 16); per block and group of 32 input
// features, 32 rows of 16 bytes, row j holding the 16 outputs' q of feature j. q [blocks, groups, 512] int8;
// scales [blocks, groups, 16] float16 (output o of the block in lane o).
//
// What it computes: per output o and row x, sum over groups g of d_g * sum_j(x_j * q_j) in float32, the
// exact weight values d * q (real arithmetic). Per feature a vector of 16 (AVX-512F) or 8 (AVX2) outputs'
// levels is widened and converted once and meets each row's activation in one multiply-add; the scales
// meet the sums once per group; no horizontal sums. Each row's bits do not depend on the other rows of
// the step or their number (the row kernel's do: one row takes four chains, more rows one each), so a
// step verifying drafts computes the head of decoding one token at a time.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "cpu_ops.h"
#include "f32_lanes.h"

namespace tokenmill {
namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kBlockGroupBytes = kGroup * 16;  // 512
constexpr int64_t kPrefetchBytes = 4096;

#ifdef TOKENMILL_BLOCKED_F32
using namespace f32_lanes;

// out[r, o0 .. o0 + kLanes) for ROWS rows (x and out start at the first of them): part `part` of block
// `block`. Per row two chains of group sums (even and odd features) and one accumulator.
template <int ROWS>
void part_rows(const float* x, int64_t x_stride, int64_t groups, const int8_t* q, const c10::Half* scales,
               float* out, int64_t out_stride, int64_t block, int64_t part) {
  const int8_t* part_bytes = q + block * groups * kBlockGroupBytes + part * kLanes;
  Floats acc[ROWS];
  for (int r = 0; r < ROWS; ++r) acc[r] = zero();
  for (int64_t g = 0; g < groups; ++g) {
    Floats even[ROWS], odd[ROWS];
    for (int r = 0; r < ROWS; ++r) even[r] = odd[r] = zero();
    for (int64_t j = 0; j < kGroup; j += 2) {
      const int8_t* bytes = part_bytes + g * kBlockGroupBytes + j * 16;
      if ((j & 3) == 0) _mm_prefetch(reinterpret_cast<const char*>(bytes + kPrefetchBytes), _MM_HINT_T0);
      const Floats q0 = load_int8(bytes), q1 = load_int8(bytes + 16);
      for (int r = 0; r < ROWS; ++r) {
        const float* xs = x + r * x_stride + g * kGroup + j;
        even[r] = fma(q0, splat(xs[0]), even[r]);
        odd[r] = fma(q1, splat(xs[1]), odd[r]);
      }
    }
    const Floats d = load_constants(scales + (block * groups + g) * kBlockOutputs + part * kLanes);
    for (int r = 0; r < ROWS; ++r) acc[r] = fma(add(even[r], odd[r]), d, acc[r]);
  }
  for (int r = 0; r < ROWS; ++r) store(out + r * out_stride + block * kBlockOutputs + part * kLanes, acc[r]);
}

template <int ROWS>
void part_dispatch(int64_t rows, const float* x, int64_t x_stride, int64_t groups, const int8_t* q,
                   const c10::Half* scales, float* out, int64_t out_stride, int64_t block, int64_t part) {
  if constexpr (ROWS > 1) {
    if (rows < ROWS) {
      part_dispatch<ROWS - 1>(rows, x, x_stride, groups, q, scales, out, out_stride, block, part);
      return;
    }
  }
  part_rows<ROWS>(x, x_stride, groups, q, scales, out, out_stride, block, part);
}

#endif  // TOKENMILL_BLOCKED_F32

}  // namespace
}  // namespace tokenmill

namespace tokenmill::ops {

// x [rows, in] float32 (1 or more rows, contiguous features) times the weight in the blocked layout;
// [rows, blocks * 16] float32.
at::Tensor q8_linear_blocked_f32(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales) {
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == at::kChar && q.dim() == 3 && q.size(2) == kBlockGroupBytes &&
                  q.is_contiguous(),
              "q8 blocked layout: q must be contiguous int8 [blocks, groups, ", kBlockGroupBytes, "]");
  TORCH_CHECK(scales.device().is_cpu() && scales.scalar_type() == at::kHalf && scales.is_contiguous() &&
                  scales.dim() == 3 && scales.size(0) == q.size(0) && scales.size(1) == q.size(1) && scales.size(2) == 16,
              "q8 blocked layout: scales must be contiguous float16 [", q.size(0), ", ", q.size(1), ", 16]");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1,
              "the q8 blocked kernel takes a float32 CPU tensor x [rows, in] with contiguous features");
  const int64_t rows = x.size(0), blocks = q.size(0), groups = q.size(1);
  TORCH_CHECK(rows >= 1, "the q8 blocked kernel takes at least one row, got ", rows);
  TORCH_CHECK(x.size(1) == groups * kGroup, "x has ", x.size(1), " features, the weight ", groups * kGroup);
  TORCH_CHECK(int4_blocked_f32_available(), "the q8 blocked kernel for float32 rows needs AVX2, FMA and F16C");
  at::Tensor out = at::empty({rows, blocks * 16}, x.options());
#ifdef TOKENMILL_BLOCKED_F32
  const float* xp = x.data_ptr<float>();
  const auto* qp = q.data_ptr<int8_t>();
  const auto* dp = scales.data_ptr<c10::Half>();
  float* op = out.data_ptr<float>();
  const int64_t x_stride = x.stride(0), out_stride = blocks * kBlockOutputs;
  at::parallel_for(0, blocks * kPartsPerBlock, 1, [&](int64_t begin, int64_t end) {
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t block = unit / kPartsPerBlock, part = unit % kPartsPerBlock;
      for (int64_t first = 0; first < rows; first += kPassRows)
        part_dispatch<kPassRows>(std::min<int64_t>(kPassRows, rows - first), xp + first * x_stride, x_stride, groups,
                                 qp, dp, op + first * out_stride, out_stride, block, part);
    }
  });
#endif
  return out;
}

}  // namespace tokenmill::ops
