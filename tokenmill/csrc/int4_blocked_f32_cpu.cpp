// The int4 linear layer for steps of a few float32 rows (a float32 model: the avx2 and avx512 paths,
// --dtype float32 anywhere) over the blocked copy of the weight (int4_blocked_layout.h describes the
// layout; layers/int4.py block_int4_layout makes it). AVX-512F (16 outputs a vector) or AVX2 + FMA +
// F16C (8 outputs a vector, each block of 16 in two halves).
//
// What it computes: per output o and row x, sum over groups g of d_g * sum_j(x_j * q_j) + m_g * sum_j(x_j)
// in float32: the exact weight values d*q + m (real arithmetic), as the bfloat16 blocked kernel, with
// the activations unrounded. Each product x_j * q_j is exact before its one rounding (see below). Each
// row's bits do not depend on the other rows of the step or their number, so a speculative step
// verifying drafts computes the bits of decoding one token at a time.
//
// How: a step's 32 bytes hold, per output of the block, one 16-bit word whose four nibbles are the
// levels of features 4t, 4t + 2, 4t + 1 and 4t + 3 (nibble k at bits 4k). The word widened to 32 bits
// and masked to nibble k converts exactly to q * 16^k, so each feature costs a mask, a conversion and a
// multiply-add against the activation divided by 16^k (a power of two: exact for activations above
// 2^-114 in magnitude, far below any that matter). No shifts, no horizontal sums, the scales once per
// group. The row kernel it replaces (group_gemm_f32_cpu.cpp) widened and scaled every weight (fma(q, d,
// m)) before its product, about twice the instructions a weight, and summed each output horizontally.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "cpu_ops.h"
#include "f32_lanes.h"


namespace tokenmill {
namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kStepBytes = 32;
constexpr int64_t kStepsPerGroup = kGroup / 4;
constexpr int64_t kBlockGroupBytes = kStepsPerGroup * kStepBytes;  // 256
constexpr int64_t kPrefetchBytes = 4096;

#ifdef TOKENMILL_BLOCKED_F32
using namespace f32_lanes;


// Per row: `scaled`, the activations in nibble order, each divided by its nibble's 16^k; `sums`, the
// float32 sum of each group's 32 activations (one fixed order: the row's bits stand alone).
void prepare_rows(const float* x, int64_t x_stride, int64_t rows, int64_t in, float* scaled, float* sums) {
  alignas(64) float factors[kLanes];
  for (int64_t i = 0; i < kLanes; ++i) factors[i] = 1.0f / static_cast<float>(1 << (4 * (i % 4)));
  const Floats factor = load(factors);
  for (int64_t r = 0; r < rows; ++r) {
    const float* src = x + r * x_stride;
    float* dst = scaled + r * in;
    for (int64_t j = 0; j < in; j += kLanes) store(dst + j, mul(nibble_order(load(src + j)), factor));
    for (int64_t g = 0; g < in / kGroup; ++g) {
      Floats total = load(src + g * kGroup);
      for (int64_t j = kLanes; j < kGroup; j += kLanes) total = add(total, load(src + g * kGroup + j));
      sums[r * (in / kGroup) + g] = reduce(total);
    }
  }
}

// out[r, o0 .. o0 + kLanes) for ROWS rows (scaled, sums and out start at the first of them): part `part`
// of block `block`. Per row two chains of group sums (the even and odd nibbles) and one accumulator.
template <int ROWS, typename Scale>
void part_rows(const float* scaled, int64_t in, const float* sums, int64_t groups, const uint8_t* packed,
               const Scale* scales, const Scale* mins, float* out, int64_t out_stride, int64_t block, int64_t part) {
  const uint8_t* part_bytes = packed + block * groups * kBlockGroupBytes + part * kLanes * 2;
  Floats acc[ROWS];
  for (int r = 0; r < ROWS; ++r) acc[r] = zero();
  for (int64_t g = 0; g < groups; ++g) {
    Floats even[ROWS], odd[ROWS];
    for (int r = 0; r < ROWS; ++r) even[r] = odd[r] = zero();
    for (int64_t t = 0; t < kStepsPerGroup; ++t) {
      const uint8_t* bytes = part_bytes + g * kBlockGroupBytes + t * kStepBytes;
      if ((t & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(bytes + kPrefetchBytes), _MM_HINT_T0);
      const Ints words = load_words(bytes);
      const Floats q0 = level(words, 0x000F), q1 = level(words, 0x00F0);
      const Floats q2 = level(words, 0x0F00), q3 = level(words, 0xF000);
      const int64_t feature = g * kGroup + 4 * t;
      for (int r = 0; r < ROWS; ++r) {
        const float* xs = scaled + r * in + feature;
        even[r] = fma(q0, splat(xs[0]), even[r]);
        odd[r] = fma(q1, splat(xs[1]), odd[r]);
        even[r] = fma(q2, splat(xs[2]), even[r]);
        odd[r] = fma(q3, splat(xs[3]), odd[r]);
      }
    }
    const int64_t at = (block * groups + g) * kBlockOutputs + part * kLanes;
    const Floats d = load_constants(scales + at);
    const Floats m = load_constants(mins + at);
    for (int r = 0; r < ROWS; ++r) {
      acc[r] = fma(add(even[r], odd[r]), d, acc[r]);
      acc[r] = fma(m, splat(sums[r * groups + g]), acc[r]);
    }
  }
  for (int r = 0; r < ROWS; ++r) store(out + r * out_stride + block * kBlockOutputs + part * kLanes, acc[r]);
}

template <int ROWS, typename Scale>
void part_dispatch(int64_t rows, const float* scaled, int64_t in, const float* sums, int64_t groups,
                   const uint8_t* packed, const Scale* scales, const Scale* mins, float* out, int64_t out_stride,
                   int64_t block, int64_t part) {
  if constexpr (ROWS > 1) {
    if (rows < ROWS) {
      part_dispatch<ROWS - 1, Scale>(rows, scaled, in, sums, groups, packed, scales, mins, out, out_stride, block,
                                     part);
      return;
    }
  }
  part_rows<ROWS, Scale>(scaled, in, sums, groups, packed, scales, mins, out, out_stride, block, part);
}

#endif  // TOKENMILL_BLOCKED_F32

}  // namespace
}  // namespace tokenmill

namespace tokenmill::ops {

// Outputs per vector (16 with AVX-512F, 8 with AVX2), 0 where the kernel is not built.
int64_t int4_blocked_f32_lanes() {
#ifdef TOKENMILL_BLOCKED_F32
  return kLanes;
#else
  return 0;
#endif
}

bool int4_blocked_f32_available() { return int4_blocked_f32_lanes() > 0; }

// x [rows, in] float32 (1 or more rows, contiguous features) times the weight in the blocked layout
// (checked by the caller, int4_linear_blocked); [rows, blocks * 16] float32.
at::Tensor int4_linear_blocked_f32(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                                   const at::Tensor& mins) {
  TORCH_CHECK(int4_blocked_f32_available(), "the int4 blocked kernel for float32 rows needs AVX2, FMA and F16C");
  const int64_t rows = x.size(0), blocks = packed.size(0), groups = packed.size(1), in = groups * 32;
  at::Tensor out = at::empty({rows, blocks * 16}, x.options());
#ifdef TOKENMILL_BLOCKED_F32
  at::Tensor scaled = at::empty({rows, in}, x.options());
  at::Tensor sums = at::empty({rows, groups}, x.options());
  prepare_rows(x.data_ptr<float>(), x.stride(0), rows, in, scaled.data_ptr<float>(), sums.data_ptr<float>());
  const float* sp = scaled.data_ptr<float>();
  const float* gp = sums.data_ptr<float>();
  const auto* wp = packed.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int64_t out_stride = blocks * kBlockOutputs;
  const auto run = [&](const auto* dp, const auto* mp) {
    using Scale = std::remove_const_t<std::remove_pointer_t<decltype(dp)>>;
    at::parallel_for(0, blocks * kPartsPerBlock, 1, [&](int64_t begin, int64_t end) {
      for (int64_t unit = begin; unit < end; ++unit) {
        const int64_t block = unit / kPartsPerBlock, part = unit % kPartsPerBlock;
        for (int64_t first = 0; first < rows; first += kPassRows)
          part_dispatch<kPassRows, Scale>(std::min<int64_t>(kPassRows, rows - first), sp + first * in, in,
                                           gp + first * groups, groups, wp, dp, mp, op + first * out_stride,
                                           out_stride, block, part);
      }
    });
  };
  if (scales.scalar_type() == at::kFloat)
    run(scales.data_ptr<float>(), mins.data_ptr<float>());
  else
    run(scales.data_ptr<c10::Half>(), mins.data_ptr<c10::Half>());
#endif
  return out;
}

}  // namespace tokenmill::ops

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("int4_blocked_f32_lanes() -> int", &tokenmill::ops::int4_blocked_f32_lanes);
}
