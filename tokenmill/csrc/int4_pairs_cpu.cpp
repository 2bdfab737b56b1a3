// The int4 linear layer for steps of a few bfloat16 rows (decode) on CPUs with AVX512-BF16 but no
// AMX-sized batches: the "level sums" kernel, int4_linear's pick from 1 to kPairsMaxRows rows.
//
// Format: layers/int4.py's (groups of 32, float16 scale d and minimum m, 4-bit levels q, value d*q + m).
//
// What it computes: per output o and row x, sum over groups g of d_g * sum_j(x_j * q_j) + m_g * sum_j(x_j):
// the exact weight values d*q + m (real arithmetic), with float32 accumulation. The row kernel of
// int4_gemm_cpu.cpp instead rounds each weight to bfloat16 before its products (its bits are those of
// the bfloat16 GEMM on the dequantized weight, which the deterministic mode needs); this kernel's
// results differ from those in the last bits of the float32 sums and by the weights' bfloat16 rounding.
//
// Why: at one row the row kernel is bound by its instructions, not by memory (SmolLM2's layers: 10-19
// GB/s of packed weights on a 2-core Zen 4 whose memory gives 34): each group builds a 16-entry table
// with a multiply-add and a conversion before its lookup. Here the levels themselves are the bfloat16
// operands (0..15 are exact), looked up in one constant table, and two groups share every vector: the
// 32 packed bytes of groups g and g+1 widen to 32 words, whose low nibbles are elements 0..15 of both
// groups and whose high nibbles are elements 16..31. The activations are laid out once per call to
// match ([x_g[0:16], x_g+1[0:16]] and [x_g[16:32], x_g+1[16:32]] per pair) together with their group
// sums, so per pair and row the work is two dot-product instructions and one multiply-add by the two
// groups' scales; the minimums meet the group sums in one multiply-add per 16 groups.
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
#include "vec16.h"

namespace tokenmill {
namespace {

using namespace group_gemm;  // kGroup, kOutputsPerTask, kPrefetchBytes, TOKENMILL_GROUP_AVX512

constexpr int64_t kGroupBytes = kGroup / 2;
constexpr int64_t kPairElements = 2 * kGroup;
constexpr int64_t kMaxPairRows = 8;  // the kernel's largest step (template instances 1..8)

#ifdef TOKENMILL_GROUP_AVX512

// One step's activations in the kernel's layout: per row, `pairs` blocks of 64 bfloat16 (see the file
// comment; a missing last group's half is zeros), and per row the float32 sum of each group's 32
// activations, zero-padded to a multiple of 16 groups.
struct PairedRows {
  const c10::BFloat16* values;  // [rows, pairs * 64]
  const float* sums;            // [rows, sum_stride]
  int64_t pairs, sum_stride;
};

void lay_out_rows(const c10::BFloat16* x, int64_t x_stride, int64_t rows, int64_t groups, c10::BFloat16* values,
                  float* sums, int64_t pairs, int64_t sum_stride) {
  for (int64_t r = 0; r < rows; ++r) {
    c10::BFloat16* row_values = values + r * pairs * kPairElements;
    float* row_sums = sums + r * sum_stride;
    for (int64_t g = 0; g < groups; ++g) {
      const c10::BFloat16* src = x + r * x_stride + g * kGroup;
      c10::BFloat16* pair = row_values + (g / 2) * kPairElements + (g % 2) * 16;
      std::memcpy(pair, src, 16 * sizeof(c10::BFloat16));                // elements 0..15
      std::memcpy(pair + kGroup, src + 16, 16 * sizeof(c10::BFloat16));  // elements 16..31
      row_sums[g] = vec::reduce_add(vec::add(vec::load(src, 16), vec::load(src + 16, 16)));
    }
    if (groups % 2) {  // a missing last group's halves
      c10::BFloat16* pair = row_values + (groups / 2) * kPairElements + 16;
      std::memset(pair, 0, 16 * sizeof(c10::BFloat16));
      std::memset(pair + kGroup, 0, 16 * sizeof(c10::BFloat16));
    }
    std::fill(row_sums + groups, row_sums + sum_stride, 0.0f);
  }
}

// 16 groups' scales (or minimums) from `count` = popcount(lanes) stored values, float32 (zeros past them).
inline __m512 load_scales(const c10::Half* p, __mmask16 lanes) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes, p));
}
inline __m512 load_scales(const float* p, __mmask16 lanes) { return _mm512_maskz_loadu_ps(lanes, p); }

// out[r, o] for the step's ROWS rows and outputs [begin, end); Scale is c10::Half (layers/int4.py) or
// float (layers/level_sums.py: a GGUF K-quant's sub-block scales times its super-block's, exact in float32).
//
// With FIVE, levels have a fifth bit: high[o * groups + g] holds group g's 32 of them (bit j: element j's,
// worth 16), added to the words before the products (levels 0..31 are exact bfloat16 too, 128 + q).
template <int ROWS, typename Scale, bool FIVE>
void pair_rows(const PairedRows& x, const uint8_t* packed, const Scale* scales, const Scale* mins,
               const uint32_t* high, int64_t groups, c10::BFloat16* out, int64_t out_stride, int64_t begin,
               int64_t end) {
  // A level q in 0..15 becomes the bfloat16 128 + q by setting the exponent bits of 128 above it
  // (bfloat16 0x4300 is 128, whose last mantissa bit is worth 1): no table lookup. The sums then hold
  // 128 * sum(x) besides sum(x * q), which the minimums' term takes back (m - 128 d).
  const __m512i low_nibble = _mm512_set1_epi16(0x0F);
  const __m512i bias_128 = _mm512_set1_epi16(0x4300);
  const __m512 minus_128 = _mm512_set1_ps(-128.0f);
  // Lanes 0..7 take a pair's first group's scale, lanes 8..15 its second's (indices into 16 groups).
  const __m512i first_pair = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  const __m512i fifth_bit = _mm512_set1_epi16(16);
  const int64_t pairs = x.pairs;
  for (int64_t o = begin; o < end; ++o) {
    const uint8_t* w = packed + o * groups * kGroupBytes;
    const Scale* d_row = scales + o * groups;
    const Scale* m_row = mins + o * groups;
    __m512 acc[ROWS];
    for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t block = 0; block < groups; block += 16) {
      const int64_t count = std::min<int64_t>(16, groups - block);
      const __mmask16 lanes = count == 16 ? __mmask16(0xFFFF) : __mmask16((1u << count) - 1u);
      const __m512 d = load_scales(d_row + block, lanes);  // [16 groups]
      const __m512 m = _mm512_fmadd_ps(minus_128, d, load_scales(m_row + block, lanes));
      for (int r = 0; r < ROWS; ++r) {
        acc[r] = _mm512_fmadd_ps(m, _mm512_loadu_ps(x.sums + r * x.sum_stride + block), acc[r]);
      }
      __m512i pair_index = first_pair;
      for (int64_t g = block; g < block + count; g += 2) {
        const uint8_t* bytes = w + g * kGroupBytes;
        if ((g & 3) == 0) _mm_prefetch(reinterpret_cast<const char*>(bytes + kPrefetchBytes), _MM_HINT_T0);
        // A last lone group reads its 16 bytes only (the second group's words are zeros).
        const __m256i packed_pair = g + 1 < groups ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes))
                                                   : _mm256_maskz_loadu_epi8(0xFFFF, bytes);
        const __m512i words = _mm512_cvtepu8_epi16(packed_pair);
        // (words & 0x0F) | 0x4300, and (words >> 4) | 0x4300.
        __m512i low_words = _mm512_ternarylogic_epi32(words, low_nibble, bias_128, 0xEA);
        __m512i high_words = _mm512_or_si512(_mm512_srli_epi16(words, 4), bias_128);
        if constexpr (FIVE) {
          // Lanes 0..15 are group g's elements 0..15 (low) or 16..31 (high), lanes 16..31 group g+1's.
          const uint32_t* bits = high + o * groups + g;
          const uint32_t first = bits[0], second = g + 1 < groups ? bits[1] : 0u;
          const __mmask32 low_bits = (first & 0xFFFFu) | (second << 16);
          const __mmask32 high_bits = (first >> 16) | (second & 0xFFFF0000u);
          low_words = _mm512_mask_add_epi16(low_words, low_bits, low_words, fifth_bit);
          high_words = _mm512_mask_add_epi16(high_words, high_bits, high_words, fifth_bit);
        }
        const __m512bh low = (__m512bh)low_words;
        const __m512bh high = (__m512bh)high_words;
        const __m512 pair_scales = _mm512_permutexvar_ps(pair_index, d);
        pair_index = _mm512_add_epi32(pair_index, _mm512_set1_epi32(2));
        const int64_t p = g / 2;
        for (int r = 0; r < ROWS; ++r) {
          const c10::BFloat16* xp = x.values + r * pairs * kPairElements + p * kPairElements;
          __m512 sum = _mm512_dpbf16_ps(_mm512_setzero_ps(), low, (__m512bh)_mm512_loadu_si512(xp));
          sum = _mm512_dpbf16_ps(sum, high, (__m512bh)_mm512_loadu_si512(xp + kGroup));
          acc[r] = _mm512_fmadd_ps(sum, pair_scales, acc[r]);
        }
      }
    }
    for (int r = 0; r < ROWS; ++r) {
      out[r * out_stride + o] = static_cast<c10::BFloat16>(_mm512_reduce_add_ps(acc[r]));
    }
  }
}

template <int ROWS, typename Scale, bool FIVE>
void pair_pass(const PairedRows& x, const uint8_t* packed, const Scale* scales, const Scale* mins,
               const uint32_t* high, int64_t groups, c10::BFloat16* out, int64_t out_stride, int64_t rows,
               int64_t begin, int64_t end) {
  if constexpr (ROWS > 1) {
    if (rows < ROWS) {
      pair_pass<ROWS - 1, Scale, FIVE>(x, packed, scales, mins, high, groups, out, out_stride, rows, begin, end);
      return;
    }
  }
  pair_rows<ROWS, Scale, FIVE>(x, packed, scales, mins, high, groups, out, out_stride, begin, end);
}

#endif  // TOKENMILL_GROUP_AVX512

}  // namespace
}  // namespace tokenmill

namespace tokenmill::ops {

bool int4_pairs_available() {
#ifdef TOKENMILL_GROUP_AVX512
  return true;
#else
  return false;
#endif
}

int64_t int4_pairs_max_rows() { return kMaxPairRows; }

// x [rows, in] bfloat16 (rows 1..kMaxPairRows, unit stride in features) times the int4 weight, whose
// format the caller has checked (scales and mins float16 or float32, of one dtype; `high`, when given,
// the levels' fifth bits [out, in / 32] int32); [rows, out] bfloat16. Callers check int4_pairs_available().
at::Tensor int4_linear_pairs(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                             const at::Tensor& mins, const std::optional<at::Tensor>& high) {
  const int64_t rows = x.size(0), out_features = packed.size(0), in = packed.size(1) * 2;
  TORCH_CHECK(rows >= 1 && rows <= kMaxPairRows, "the int4 level-sums kernel takes 1 to ", kMaxPairRows,
              " rows, got ", rows);
  at::Tensor out = at::empty({rows, out_features}, x.options());
#ifdef TOKENMILL_GROUP_AVX512
  const int64_t groups = in / kGroup, pairs = (groups + 1) / 2, sum_stride = (groups + 15) / 16 * 16;
  at::Tensor values = at::empty({rows, pairs * kPairElements}, x.options());
  at::Tensor sums = at::empty({rows, sum_stride}, x.options().dtype(at::kFloat));
  lay_out_rows(x.data_ptr<c10::BFloat16>(), x.stride(0), rows, groups, values.data_ptr<c10::BFloat16>(),
               sums.data_ptr<float>(), pairs, sum_stride);
  const PairedRows paired{values.data_ptr<c10::BFloat16>(), sums.data_ptr<float>(), pairs, sum_stride};
  const auto* wp = packed.data_ptr<uint8_t>();
  auto* op = out.data_ptr<c10::BFloat16>();
  const auto* hp = high.has_value() ? reinterpret_cast<const uint32_t*>(high->data_ptr<int32_t>()) : nullptr;
  const auto run = [&](const auto* dp, const auto* mp) {
    at::parallel_for(0, out_features, kOutputsPerTask, [&](int64_t begin, int64_t end) {
      if (hp != nullptr)
        pair_pass<kMaxPairRows, std::remove_const_t<std::remove_pointer_t<decltype(dp)>>, true>(
            paired, wp, dp, mp, hp, groups, op, out_features, rows, begin, end);
      else
        pair_pass<kMaxPairRows, std::remove_const_t<std::remove_pointer_t<decltype(dp)>>, false>(
            paired, wp, dp, mp, nullptr, groups, op, out_features, rows, begin, end);
    });
  };
  if (scales.scalar_type() == at::kFloat)
    run(scales.data_ptr<float>(), mins.data_ptr<float>());
  else
    run(scales.data_ptr<c10::Half>(), mins.data_ptr<c10::Half>());
#else
  (void)in;
  TORCH_CHECK(false, "the int4 level-sums kernel needs AVX512-BF16");
#endif
  return out;
}

}  // namespace tokenmill::ops

namespace tokenmill {
namespace {

// The op for weights in groups of 32 of 4-bit levels (5-bit with `high`: a Q5_0 tensor's) with float32
// scales and minimums (layers/level_sums.py: a GGUF K-quant's 4-bit layers, whose per-group scale
// d_super * sc and minimum -dmin * m are exact in float32, not in float16) or float16 ones: x [rows, in]
// bfloat16, 1 to kMaxPairRows rows with contiguous features.
at::Tensor level_sums_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                             const at::Tensor& mins, const std::optional<at::Tensor>& high) {
  // The blocked layout (layers/level_sums.py LevelWeight.kernel_tensors): the blocked kernel.
  if (packed.dim() == 3) return ops::int4_linear_blocked(x, packed, scales, mins, high);
  TORCH_CHECK(ops::int4_pairs_available(), "level_sums_linear needs a CPU with AVX512-BF16");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.stride(1) == 1,
              "level_sums_linear: x must be a bfloat16 CPU tensor [rows, in] with contiguous features");
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kByte && packed.dim() == 2 &&
                  packed.is_contiguous(),
              "level_sums_linear: packed must be contiguous uint8 [out, in / 2]");
  const int64_t out_features = packed.size(0), in = packed.size(1) * 2;
  TORCH_CHECK(in % kGroup == 0 && x.size(1) == in, "level_sums_linear: x has ", x.size(1),
              " features, the weight ", in, " (a multiple of ", kGroup, ")");
  for (const at::Tensor* t : {&scales, &mins}) {
    TORCH_CHECK(t->device().is_cpu() && (t->scalar_type() == at::kFloat || t->scalar_type() == at::kHalf) &&
                    t->scalar_type() == scales.scalar_type() && t->is_contiguous() && t->dim() == 2 &&
                    t->size(0) == out_features && t->size(1) == in / kGroup,
                "level_sums_linear: scales and mins must be contiguous float32 (or both float16) [", out_features,
                ", ", in / kGroup, "]");
  }
  TORCH_CHECK(!high.has_value() || (high->device().is_cpu() && high->scalar_type() == at::kInt &&
                                     high->is_contiguous() && high->dim() == 2 && high->size(0) == out_features &&
                                     high->size(1) == in / kGroup),
              "level_sums_linear: high must be contiguous int32 [", out_features, ", ", in / kGroup, "]");
  return ops::int4_linear_pairs(x, packed, scales, mins, high);
}

}  // namespace
}  // namespace tokenmill

namespace tokenmill::ops {
at::Tensor level_sums_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                             const at::Tensor& mins, const std::optional<at::Tensor>& high) {
  return ::tokenmill::level_sums_linear(x, packed, scales, mins, high);
}
}  // namespace tokenmill::ops

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("int4_pairs_available() -> bool", &tokenmill::ops::int4_pairs_available);
  m.def("int4_pairs_max_rows() -> int", &tokenmill::ops::int4_pairs_max_rows);
  m.def("level_sums_linear(Tensor x, Tensor packed, Tensor scales, Tensor mins, Tensor? high=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) { m.impl("level_sums_linear", &tokenmill::level_sums_linear); }
