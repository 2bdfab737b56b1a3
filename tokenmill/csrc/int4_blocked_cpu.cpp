// The int4 linear layer for steps of a few bfloat16 rows on CPUs with AVX512-BF16 (no AMX tiles): the
// "blocked" kernel, over a copy of layers/int4.py's weight laid out for it (layers/int4.py
// block_int4_layout).
//
// The blocked layout: int4_blocked_layout.h. The same kernel serves layers/level_sums.py's groups
// (level_sums_linear): float32 scales and minimums, and 5-bit levels with their fifth bits.
//
// What it computes: per output o and row x, sum over groups g of d_g * sum_j(x_j * q_j) + m_g * sum_j(x_j),
// the exact weight values d*q + m (real arithmetic) with float32 accumulation, as the level-sums kernel
// (int4_pairs_cpu.cpp) does, with another summation order. Each row's bits do not depend on the other
// rows of the step or their number (one kernel for every row count), so a speculative step verifying drafts
// computes the bits of decoding one token at a time.
//
// Why: the level-sums kernel keeps an output's sums across the lanes of a vector. Per pair of groups and
// row it spends a multiply-add on the groups' scales besides its two dot products, reloads the row's
// activations for every output, and ends every output with a horizontal sum per row: its time grows
// about as fast as the rows (SmolLM2's gate_up, 2-core Zen 4: 43 us at one row, 91 at five, 134 at
// eight). Here a vector holds 16 outputs: per step and row, two bfloat16 dot products whose activation
// operand is one broadcast pair of features, nothing per output; the scales meet the sums once per group
// (gate_up at one / five / eight rows: 33 / 62 / 97 us against the level sums' 46 / 97 / 148).
// The levels become bfloat16 operands as in the level-sums kernel (q | 0x4300 is 128 + q, exact), and
// the minimums' term takes the 128 * sum(x) back.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>

#include "cpu_ops.h"
#include "group_gemm.h"
#include "int4_blocked_layout.h"
#include "vec16.h"

namespace tokenmill {
namespace {

using namespace group_gemm;  // kGroup, kPrefetchBytes, TOKENMILL_GROUP_AVX512

using namespace int4_blocked;  // kBlockOutputs, kStepBytes, kStepsPerGroup, kBlockGroupBytes, load_block_constants

constexpr int kChunkRows = 12;  // most rows a pass over a block keeps in registers (two vectors each)

#ifdef TOKENMILL_GROUP_AVX512

// The float32 sum of each group's 32 activations, per row: sums[r * groups + g].
void group_sums(const c10::BFloat16* x, int64_t x_stride, int64_t rows, int64_t groups, float* sums) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const c10::BFloat16* src = x + r * x_stride + g * kGroup;
      sums[r * groups + g] = vec::reduce_add(vec::add(vec::load(src, 16), vec::load(src + 16, 16)));
    }
  }
}

// out[r, 0 .. 16) = the outputs 16 b .. 16 b + 16 for ROWS rows (x, sums and out start at the first of them) and
// block b. Per row and group two chains of 8 dot products in registers, one over each step's features 4t, 4t + 1
// and one over 4t + 2, 4t + 3, added at the group's end (one chain of 16 waited on the dot product's latency: 9
// rows 20%, 5 rows 9% slower on a Zen 5); the accumulators across groups stay in the first level of cache, so
// that 12 rows fit a pass. (Two or four blocks a pass, for more independent chains, measured slower at every row
// count: 37-43 vs 35 us on SmolLM2's gate_up at one and two rows; one stream each thread prefetches well.)
template <int ROWS, typename Scale, bool FIVE>
void blocked_rows(const c10::BFloat16* x, int64_t x_stride, const float* sums, int64_t groups, const uint8_t* packed,
                  const Scale* scales, const Scale* mins, const uint32_t* high, c10::BFloat16* out,
                  int64_t out_stride, int64_t block) {
  const __m512i fifth_bit = _mm512_set1_epi16(16);
  const __m512i low_nibble = _mm512_set1_epi16(0x0F);
  const __m512i bias_128 = _mm512_set1_epi16(0x4300);
  const __m512 minus_128 = _mm512_set1_ps(-128.0f);
  const uint8_t* block_bytes = packed + block * groups * kBlockGroupBytes;
  alignas(64) float acc[ROWS][kBlockOutputs];
  for (int r = 0; r < ROWS; ++r) _mm512_store_ps(acc[r], _mm512_setzero_ps());
  for (int64_t g = 0; g < groups; ++g) {
    __m512 sum_low[ROWS], sum_high[ROWS];
    for (int r = 0; r < ROWS; ++r) sum_low[r] = sum_high[r] = _mm512_setzero_ps();
    for (int64_t t = 0; t < kStepsPerGroup; ++t) {
      const uint8_t* bytes = block_bytes + g * kBlockGroupBytes + t * kStepBytes;
      if ((t & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(bytes + kPrefetchBytes), _MM_HINT_T0);
      const __m512i words = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes)));
      __m512i low_words = _mm512_ternarylogic_epi32(words, low_nibble, bias_128, 0xEA);  // (w & 0x0F) | 0x4300
      __m512i high_words = _mm512_or_si512(_mm512_srli_epi16(words, 4), bias_128);
      if constexpr (FIVE) {  // levels 16..31: 128 + q stays exact
        const uint32_t* bits = high + (block * groups + g) * kBlockOutputs + 2 * t;
        low_words = _mm512_mask_add_epi16(low_words, __mmask32(bits[0]), low_words, fifth_bit);
        high_words = _mm512_mask_add_epi16(high_words, __mmask32(bits[1]), high_words, fifth_bit);
      }
      const __m512bh low = (__m512bh)low_words;
      const __m512bh high = (__m512bh)high_words;
      const int64_t feature = g * kGroup + 4 * t;
      for (int r = 0; r < ROWS; ++r) {
        int32_t pair_low, pair_high;  // features (4t, 4t + 1) and (4t + 2, 4t + 3) of row r
        std::memcpy(&pair_low, x + r * x_stride + feature, sizeof(pair_low));
        std::memcpy(&pair_high, x + r * x_stride + feature + 2, sizeof(pair_high));
        sum_low[r] = _mm512_dpbf16_ps(sum_low[r], low, (__m512bh)_mm512_set1_epi32(pair_low));
        sum_high[r] = _mm512_dpbf16_ps(sum_high[r], high, (__m512bh)_mm512_set1_epi32(pair_high));
      }
    }
    const int64_t at = (block * groups + g) * kBlockOutputs;
    const __m512 d = load_block_constants(scales + at);
    const __m512 m = _mm512_fmadd_ps(minus_128, d, load_block_constants(mins + at));
    for (int r = 0; r < ROWS; ++r) {
      __m512 a = _mm512_fmadd_ps(_mm512_add_ps(sum_low[r], sum_high[r]), d, _mm512_load_ps(acc[r]));
      a = _mm512_fmadd_ps(m, _mm512_set1_ps(sums[r * groups + g]), a);
      _mm512_store_ps(acc[r], a);
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * out_stride),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(acc[r])));
  }
}

template <int ROWS, typename Scale, bool FIVE>
void blocked_dispatch(int64_t rows, const c10::BFloat16* x, int64_t x_stride, const float* sums, int64_t groups,
                      const uint8_t* packed, const Scale* scales, const Scale* mins, const uint32_t* high,
                      c10::BFloat16* out, int64_t out_stride, int64_t block) {
  if constexpr (ROWS > 1) {
    if (rows < ROWS) {
      blocked_dispatch<ROWS - 1, Scale, FIVE>(rows, x, x_stride, sums, groups, packed, scales, mins, high, out,
                                              out_stride, block);
      return;
    }
  }
  blocked_rows<ROWS, Scale, FIVE>(x, x_stride, sums, groups, packed, scales, mins, high, out, out_stride, block);
}

// Block `block` for all `rows` rows into out[r, 0 .. 16): the rows in passes of at most kChunkRows, of equal size
// within a row (16 rows: 8 and 8, not 12 and 4, whose 4-row pass keeps too few chains in flight); the block's
// weights, a few KB, are decoded again per pass from the first level of cache.
template <typename Scale, bool FIVE>
void blocked_block(int64_t rows, const c10::BFloat16* x, int64_t x_stride, const float* sums, int64_t groups,
                   const uint8_t* packed, const Scale* scales, const Scale* mins, const uint32_t* high,
                   c10::BFloat16* out, int64_t out_stride, int64_t block) {
  const int64_t passes = (rows + kChunkRows - 1) / kChunkRows;
  for (int64_t pass = 0, first = 0; pass < passes; ++pass) {
    const int64_t pass_rows = (rows - first) / (passes - pass);
    blocked_dispatch<kChunkRows, Scale, FIVE>(pass_rows, x + first * x_stride, x_stride, sums + first * groups,
                                              groups, packed, scales, mins, high, out + first * out_stride,
                                              out_stride, block);
    first += pass_rows;
  }
}

// LlamaMLP's gate_up and activation for blocks of 16 activated outputs [begin, end) (`half` of them, the
// weight's 2 * half blocks its gate then its up halves): per p, gate block p and up block p + half into a
// scratch of bfloat16 outputs (the store's rounding), then vec::silu_and_mul_bf16 into out[r, 16 p .. 16 p +
// 16): silu_and_mul(int4_linear_blocked(...)) bit for bit, without the [rows, 2 * half * 16] product or its
// pass over the rows on one thread.
template <typename Scale, bool FIVE>
void blocked_silu_blocks(int64_t rows, const c10::BFloat16* x, int64_t x_stride, const float* sums, int64_t groups,
                         const uint8_t* packed, const Scale* scales, const Scale* mins, const uint32_t* high,
                         c10::BFloat16* out, int64_t out_stride, int64_t half, int64_t begin, int64_t end) {
  alignas(64) c10::BFloat16 gate[ops::kInt4BlockedMaxRows][kBlockOutputs];
  alignas(64) c10::BFloat16 up[ops::kInt4BlockedMaxRows][kBlockOutputs];
  for (int64_t p = begin; p < end; ++p) {
    blocked_block<Scale, FIVE>(rows, x, x_stride, sums, groups, packed, scales, mins, high, &gate[0][0],
                               kBlockOutputs, p);
    blocked_block<Scale, FIVE>(rows, x, x_stride, sums, groups, packed, scales, mins, high, &up[0][0],
                               kBlockOutputs, p + half);
    for (int64_t r = 0; r < rows; ++r)
      vec::store(out + r * out_stride + p * kBlockOutputs,
                 vec::silu_and_mul_bf16(vec::load(gate[r], kBlockOutputs), vec::load(up[r], kBlockOutputs)),
                 kBlockOutputs);
  }
}

#endif  // TOKENMILL_GROUP_AVX512

void check_blocked_format(const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& mins,
                          const std::optional<at::Tensor>& high) {
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kByte && packed.dim() == 3 &&
                  packed.size(2) == kBlockGroupBytes && packed.is_contiguous(),
              "int4 blocked layout: packed must be contiguous uint8 [blocks, groups, ", kBlockGroupBytes, "]");
  for (const at::Tensor* t : {&scales, &mins}) {
    TORCH_CHECK(t->device().is_cpu() && (t->scalar_type() == at::kHalf || t->scalar_type() == at::kFloat) &&
                    t->scalar_type() == scales.scalar_type() && t->is_contiguous() && t->dim() == 3 &&
                    t->size(0) == packed.size(0) && t->size(1) == packed.size(1) && t->size(2) == kBlockOutputs,
                "int4 blocked layout: scales and mins must be contiguous float16 (or both float32) [", packed.size(0),
                ", ", packed.size(1), ", ", kBlockOutputs, "]");
  }
  TORCH_CHECK(!high.has_value() || (high->device().is_cpu() && high->scalar_type() == at::kInt &&
                                     high->is_contiguous() && high->dim() == 3 && high->size(0) == packed.size(0) &&
                                     high->size(1) == packed.size(1) && high->size(2) == kBlockOutputs),
              "int4 blocked layout: high must be contiguous int32 [", packed.size(0), ", ", packed.size(1), ", ",
              kBlockOutputs, "]");
}

}  // namespace
}  // namespace tokenmill

namespace tokenmill::ops {

bool int4_blocked_available() {
#ifdef TOKENMILL_GROUP_AVX512
  return true;
#else
  return false;
#endif
}

int64_t int4_blocked_max_rows() { return kInt4BlockedMaxRows; }

namespace {

// The bfloat16 run of both ops (their rows and format checked by the caller): silu false, [rows, blocks * 16]; true,
// [rows, blocks * 8] (an even number of blocks).
at::Tensor run_blocked(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& mins,
                       const std::optional<at::Tensor>& high, bool silu) {
  TORCH_CHECK(int4_blocked_available(), "the int4 blocked kernel needs AVX512-BF16 for bfloat16 rows");
  const int64_t rows = x.size(0), blocks = packed.size(0), groups = packed.size(1);
  const int64_t out_features = (silu ? blocks / 2 : blocks) * kBlockOutputs;
  at::Tensor out = at::empty({rows, out_features}, x.options());
#ifdef TOKENMILL_GROUP_AVX512
  at::Tensor sums = at::empty({rows, groups}, x.options().dtype(at::kFloat));
  const auto* xp = x.data_ptr<c10::BFloat16>();
  group_sums(xp, x.stride(0), rows, groups, sums.data_ptr<float>());
  const float* sp = sums.data_ptr<float>();
  const auto* wp = packed.data_ptr<uint8_t>();
  const auto* hp = high.has_value() ? reinterpret_cast<const uint32_t*>(high->data_ptr<int32_t>()) : nullptr;
  auto* op = out.data_ptr<c10::BFloat16>();
  const int64_t x_stride = x.stride(0);
  const auto run = [&](const auto* dp, const auto* mp, auto five) {
    using Scale = std::remove_const_t<std::remove_pointer_t<decltype(dp)>>;
    constexpr bool kFive = decltype(five)::value;
    if (silu) {
      at::parallel_for(0, blocks / 2, 1, [&](int64_t begin, int64_t end) {
        blocked_silu_blocks<Scale, kFive>(rows, xp, x_stride, sp, groups, wp, dp, mp, hp, op, out_features,
                                          blocks / 2, begin, end);
      });
      return;
    }
    at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t block = begin; block < end; ++block)
        blocked_block<Scale, kFive>(rows, xp, x_stride, sp, groups, wp, dp, mp, hp, op + block * kBlockOutputs,
                                    out_features, block);
    });
  };
  const auto run_scales = [&](auto five) {
    if (scales.scalar_type() == at::kFloat)
      run(scales.data_ptr<float>(), mins.data_ptr<float>(), five);
    else
      run(scales.data_ptr<c10::Half>(), mins.data_ptr<c10::Half>(), five);
  };
  if (hp != nullptr)
    run_scales(std::true_type{});
  else
    run_scales(std::false_type{});
#endif
  return out;
}

void check_blocked_rows(const at::Tensor& x, const at::Tensor& packed) {
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat) &&
                  x.dim() == 2 && x.stride(1) == 1,
              "the int4 blocked kernel takes a bfloat16 or float32 CPU tensor x [rows, in] with contiguous features");
  TORCH_CHECK(x.size(0) >= 1, "the int4 blocked kernel takes at least one row, got ", x.size(0));
  TORCH_CHECK(x.size(1) == packed.size(1) * kGroup, "x has ", x.size(1), " features, the weight ",
              packed.size(1) * kGroup);
}

}  // namespace

// x [rows, in] bfloat16 (1 or more rows, contiguous features) times the weight in the blocked layout; [rows,
// blocks * 16] bfloat16. Steps of more than kInt4BlockedMaxRows bfloat16 rows take the wide kernel.
at::Tensor int4_linear_blocked(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                               const at::Tensor& mins, const std::optional<at::Tensor>& high) {
  check_blocked_format(packed, scales, mins, high);
  if (x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.size(0) > kInt4BlockedMaxRows)
    return int4_linear_wide(x, packed, scales, mins, high);
  check_blocked_rows(x, packed);
  if (x.scalar_type() == at::kFloat) {
    TORCH_CHECK(!high.has_value(), "the int4 blocked kernel takes 5-bit levels with bfloat16 rows only");
    return int4_linear_blocked_f32(x, packed, scales, mins);
  }
  return run_blocked(x, packed, scales, mins, high, false);
}

// silu_and_mul(int4_linear_blocked(x, ...)) bit for bit; for bfloat16 steps the activation is applied per pair
// of gate and up blocks (blocked_silu_blocks, or the wide kernel's epilogue past kInt4BlockedMaxRows rows).
at::Tensor int4_linear_blocked_silu_and_mul(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                                            const at::Tensor& mins, const std::optional<at::Tensor>& high) {
  check_blocked_format(packed, scales, mins, high);
  TORCH_CHECK(packed.size(0) % 2 == 0, "silu_and_mul needs gate and up halves of whole blocks of ", kBlockOutputs,
              " outputs, got ", packed.size(0), " blocks");
  if (x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.size(0) > kInt4BlockedMaxRows)
    return int4_linear_wide_silu_and_mul(x, packed, scales, mins, high);
  if (x.scalar_type() != at::kBFloat16) return silu_and_mul(int4_linear_blocked(x, packed, scales, mins, high));
  check_blocked_rows(x, packed);
  return run_blocked(x, packed, scales, mins, high, true);
}

}  // namespace tokenmill::ops

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("int4_blocked_available() -> bool", &tokenmill::ops::int4_blocked_available);
  m.def("int4_blocked_max_rows() -> int", &tokenmill::ops::int4_blocked_max_rows);
  m.def("int4_linear_blocked_silu_and_mul(Tensor x, Tensor packed, Tensor scales, Tensor mins, Tensor? high=None) -> "
        "Tensor",
        &tokenmill::ops::int4_linear_blocked_silu_and_mul);
}
