// The int4 linear layer for steps of many bfloat16 rows on CPUs with AVX512-BF16 (no AMX tiles): the
// "wide" kernel, over the blocked layout of int4_blocked_cpu.cpp (layers/int4.py block_int4_layout).
//
// What it computes: per output o and row x, the float32 sum over input features of x_f * w_f, where w_f is
// the weight's bfloat16 value round_bf16(d * q + m) (the bfloat16 weight int4_dequantize gives, which the
// tile kernel and oneDNN's bfloat16 GEMM multiply), summed over the features in order, one chain per row and
// output: each row's bits depend neither on the other rows of the step nor on their number.
//
// Why: from about 16 rows a step is bound by the products, not the weight stream. oneDNN's bfloat16 GEMM
// over the dequantized weight reaches ~90% of the bfloat16 peak while the weights are in cache, but a decode
// step streams every layer's bfloat16 weights (7 MB a layer for SmolLM2) from memory, and oneDNN does not
// overlap that stream with its products: 64 rows of SmolLM2's four projections take 525 us a layer warm and
// 675 us cold (2-core Zen 5). The blocked kernel streams 3.6x fewer bytes but spends a group's scales and
// minimums on every row (its 8-row passes keep 8 chains in flight, fewer than the two dot-product pipes
// need). Here each panel of 32 outputs is decoded once into bfloat16 pairs (36 KB for 576 inputs, in the
// first two levels of cache) and every tile of up to 12 rows multiplies it with 24 accumulators in
// registers: per pair of input features two weight loads, 12 broadcast activation pairs, 24 dot products.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <type_traits>

#include "cpu_ops.h"
#include "group_gemm.h"
#include "int4_blocked_layout.h"
#include "vec16.h"

namespace tokenmill {
namespace {

using group_gemm::kGroup;
using namespace int4_blocked;  // kBlockOutputs, kStepBytes, kStepsPerGroup, kBlockGroupBytes, load_block_constants

constexpr int kPanelBlocks = 2;  // outputs a panel: 2 x 16, decoded once per call
constexpr int kTileRows = 12;    // rows a tile keeps in registers: 12 x 2 accumulators
constexpr int64_t kPrefetchBytes = 2048;

#ifdef TOKENMILL_GROUP_AVX512

// The 16 outputs x 2 features of 32 levels (word j: output j / 2, feature j % 2) as bfloat16 weights
// round_bf16(d * q + m), in the same word order; d_lo / m_lo hold outputs 0..7 in lanes (2i, 2i + 1), d_hi /
// m_hi outputs 8..15.
inline __m512bh weights_of(__m512i levels, __m512 d_lo, __m512 m_lo, __m512 d_hi, __m512 m_hi) {
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(levels)));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(levels, 1)));
  // d * q is exact in float32 (d a float16, q < 32), so the multiply-add rounds once, as d * q + m does.
  return _mm512_cvtne2ps_pbh(_mm512_fmadd_ps(hi, d_hi, m_hi), _mm512_fmadd_ps(lo, d_lo, m_lo));
}

// Decodes blocks block + j * block_step (j < count) into panel[pair * count + j], pair = input feature pair
// (2 pair, 2 pair + 1).
template <typename Scale, bool FIVE>
void decode_panel(const uint8_t* packed, const Scale* scales, const Scale* mins, const uint32_t* high,
                  int64_t groups, int64_t block, int64_t block_step, int count, __m512bh* panel) {
  const __m512i low_nibble = _mm512_set1_epi16(0x0F);
  const __m512i fifth_bit = _mm512_set1_epi16(16);
  const __m512i pick_lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i pick_hi = _mm512_set_epi32(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8);
  for (int j = 0; j < count; ++j) {
    const int64_t b = block + j * block_step;
    const uint8_t* block_bytes = packed + b * groups * kBlockGroupBytes;
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t at = (b * groups + g) * kBlockOutputs;
      const __m512 d = load_block_constants(scales + at), m = load_block_constants(mins + at);
      const __m512 d_lo = _mm512_permutexvar_ps(pick_lo, d), d_hi = _mm512_permutexvar_ps(pick_hi, d);
      const __m512 m_lo = _mm512_permutexvar_ps(pick_lo, m), m_hi = _mm512_permutexvar_ps(pick_hi, m);
      const uint8_t* group_bytes = block_bytes + g * kBlockGroupBytes;
      for (int64_t line = 0; line < kBlockGroupBytes; line += 64)  // a later group's bytes, into L1
        _mm_prefetch(reinterpret_cast<const char*>(group_bytes + kPrefetchBytes + line), _MM_HINT_T0);
      for (int64_t t = 0; t < kStepsPerGroup; ++t) {
        const __m512i words =
            _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(group_bytes + t * kStepBytes)));
        __m512i first = _mm512_and_si512(words, low_nibble);  // features 4t, 4t + 1
        __m512i second = _mm512_srli_epi16(words, 4);         // features 4t + 2, 4t + 3
        if constexpr (FIVE) {  // levels 16..31
          const uint32_t* bits = high + at + 2 * t;
          first = _mm512_mask_add_epi16(first, __mmask32(bits[0]), first, fifth_bit);
          second = _mm512_mask_add_epi16(second, __mmask32(bits[1]), second, fifth_bit);
        }
        const int64_t pair = g * (kGroup / 2) + 2 * t;
        panel[pair * count + j] = weights_of(first, d_lo, m_lo, d_hi, m_hi);
        panel[(pair + 1) * count + j] = weights_of(second, d_lo, m_lo, d_hi, m_hi);
      }
    }
  }
}

// The bfloat16 value of each lane of a float32 sum, as float32: what a bfloat16 store and a load give.
inline vec::Vec bf16_value(__m512 sum) {
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(sum)), 16))};
}

// out[r, 16 b ..) for ROWS rows (x and out start at the first) and the panel's COUNT blocks: per feature pair,
// COUNT weight vectors times each row's broadcast pair, one accumulator per row and block. SILU (COUNT 2, a
// gate block then its up block): out[r, 0..16) = silu_and_mul of the two blocks' bfloat16 outputs instead.
template <int ROWS, int COUNT, bool SILU>
void panel_tile(const c10::BFloat16* x, int64_t x_stride, int64_t pairs, const __m512bh* panel, c10::BFloat16* out,
                int64_t out_stride) {
  __m512 acc[ROWS][COUNT];
  for (int r = 0; r < ROWS; ++r)
    for (int j = 0; j < COUNT; ++j) acc[r][j] = _mm512_setzero_ps();
  const auto* x_pairs = reinterpret_cast<const int32_t*>(x);
  const int64_t pair_stride = x_stride / 2;
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh w[COUNT];
    for (int j = 0; j < COUNT; ++j) w[j] = panel[p * COUNT + j];
    for (int r = 0; r < ROWS; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(x_pairs[r * pair_stride + p]);
      for (int j = 0; j < COUNT; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], w[j], a);
    }
  }
  if constexpr (SILU) {
    static_assert(COUNT == 2, "silu_and_mul pairs a gate block with its up block");
    for (int r = 0; r < ROWS; ++r)
      vec::store(out + r * out_stride, vec::silu_and_mul_bf16(bf16_value(acc[r][0]), bf16_value(acc[r][1])),
                 vec::kLanes);
    return;
  }
  for (int r = 0; r < ROWS; ++r)
    for (int j = 0; j < COUNT; ++j)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * out_stride + j * kBlockOutputs),
                          (__m256i)_mm512_cvtneps_pbh(acc[r][j]));
}

template <int ROWS, int COUNT, bool SILU>
void tile_dispatch(int rows, const c10::BFloat16* x, int64_t x_stride, int64_t pairs, const __m512bh* panel,
                   c10::BFloat16* out, int64_t out_stride) {
  if constexpr (ROWS > 1) {
    if (rows < ROWS) {
      tile_dispatch<ROWS - 1, COUNT, SILU>(rows, x, x_stride, pairs, panel, out, out_stride);
      return;
    }
  }
  panel_tile<ROWS, COUNT, SILU>(x, x_stride, pairs, panel, out, out_stride);
}

// Panels [begin, end) of kPanelBlocks blocks (the last may hold one): decode, then every tile of rows. SILU:
// panel p is gate block p and up block p + blocks / 2 (blocks even), and writes silu_and_mul's 16 outputs
// out[:, 16 p ..).
template <typename Scale, bool FIVE, bool SILU>
void wide_panels(int64_t rows, const c10::BFloat16* x, int64_t x_stride, int64_t groups, int64_t blocks,
                 const uint8_t* packed, const Scale* scales, const Scale* mins, const uint32_t* high,
                 c10::BFloat16* out, int64_t out_stride, int64_t begin, int64_t end) {
  const int64_t pairs = groups * (kGroup / 2);
  // The decoded panel, 64 bytes a feature pair and block (36 KB for 576 inputs), kept by the thread.
  thread_local std::unique_ptr<__m512bh[]> scratch;
  thread_local int64_t capacity = 0;
  if (capacity < pairs * kPanelBlocks) {
    scratch.reset(new __m512bh[pairs * kPanelBlocks]);
    capacity = pairs * kPanelBlocks;
  }
  __m512bh* panel = scratch.get();
  for (int64_t p = begin; p < end; ++p) {
    const int64_t block = SILU ? p : p * kPanelBlocks;
    const int count = SILU ? kPanelBlocks : static_cast<int>(std::min<int64_t>(kPanelBlocks, blocks - block));
    decode_panel<Scale, FIVE>(packed, scales, mins, high, groups, block, SILU ? blocks / 2 : 1, count, panel);
    c10::BFloat16* panel_out = out + block * kBlockOutputs;
    // Tiles of equal size, within a row (13 rows: 6 and 7, not 12 and 1): a small tile keeps too few
    // accumulator chains in flight for the two dot-product pipes.
    const int64_t tiles = (rows + kTileRows - 1) / kTileRows;
    for (int64_t t = 0, first = 0; t < tiles; ++t) {
      const int tile = static_cast<int>((rows - first) / (tiles - t));
      if (count == kPanelBlocks)
        tile_dispatch<kTileRows, kPanelBlocks, SILU>(tile, x + first * x_stride, x_stride, pairs, panel,
                                                     panel_out + first * out_stride, out_stride);
      else if constexpr (!SILU)
        tile_dispatch<kTileRows, 1, false>(tile, x + first * x_stride, x_stride, pairs, panel,
                                           panel_out + first * out_stride, out_stride);
      first += tile;
    }
  }
}

#endif  // TOKENMILL_GROUP_AVX512

}  // namespace
}  // namespace tokenmill

namespace tokenmill {
namespace {

// The checks and the run of both ops: silu false, [rows, blocks * 16]; true, [rows, blocks * 8] (an even number
// of blocks, which int4_linear_blocked_silu_and_mul checked).
at::Tensor run_wide(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& mins,
                    const std::optional<at::Tensor>& high, bool silu) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.stride(1) == 1 &&
                  x.stride(0) % 2 == 0 && x.size(0) >= 1,
              "the int4 wide kernel takes a bfloat16 CPU tensor x [rows, in] (at least one row) with contiguous "
              "features and an even row stride");
  TORCH_CHECK(x.size(1) == packed.size(1) * kGroup, "x has ", x.size(1), " features, the weight ",
              packed.size(1) * kGroup);
#ifdef TOKENMILL_GROUP_AVX512
  const int64_t rows = x.size(0), blocks = packed.size(0), groups = packed.size(1);
  const int64_t out_features = silu ? blocks / 2 * kBlockOutputs : blocks * kBlockOutputs;
  at::Tensor out = at::empty({rows, out_features}, x.options());
  const auto* xp = x.data_ptr<c10::BFloat16>();
  const auto* wp = packed.data_ptr<uint8_t>();
  const auto* hp = high.has_value() ? reinterpret_cast<const uint32_t*>(high->data_ptr<int32_t>()) : nullptr;
  auto* op = out.data_ptr<c10::BFloat16>();
  const int64_t x_stride = x.stride(0);
  const int64_t panels = silu ? blocks / 2 : (blocks + kPanelBlocks - 1) / kPanelBlocks;
  const auto run = [&](const auto* dp, const auto* mp, auto five, auto with_silu) {
    using Scale = std::remove_const_t<std::remove_pointer_t<decltype(dp)>>;
    at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
      wide_panels<Scale, decltype(five)::value, decltype(with_silu)::value>(rows, xp, x_stride, groups, blocks, wp,
                                                                            dp, mp, hp, op, out_features, begin, end);
    });
  };
  const auto run_scales = [&](auto five, auto with_silu) {
    if (scales.scalar_type() == at::kFloat)
      run(scales.data_ptr<float>(), mins.data_ptr<float>(), five, with_silu);
    else
      run(scales.data_ptr<c10::Half>(), mins.data_ptr<c10::Half>(), five, with_silu);
  };
  const auto run_silu = [&](auto five) {
    if (silu)
      run_scales(five, std::true_type{});
    else
      run_scales(five, std::false_type{});
  };
  if (hp != nullptr)
    run_silu(std::true_type{});
  else
    run_silu(std::false_type{});
  return out;
#else
  TORCH_CHECK(false, "the int4 wide kernel needs AVX512-BF16");
  return at::Tensor();
#endif
}

}  // namespace
}  // namespace tokenmill

namespace tokenmill::ops {

// x [rows, in] bfloat16 (contiguous features, an even row stride) times the weight in the blocked layout, whose
// format (and x's width) int4_linear_blocked checked: [rows, blocks * 16] bfloat16.
at::Tensor int4_linear_wide(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                            const at::Tensor& mins, const std::optional<at::Tensor>& high) {
  return run_wide(x, packed, scales, mins, high, false);
}

// silu_and_mul(int4_linear_wide(x, ...)) bit for bit, without the [rows, blocks * 16] product: the weight's
// first half of blocks are the gates, the second the ups (LlamaMLP's gate_up; their number even, as
// int4_linear_blocked_silu_and_mul checked). [rows, blocks * 8] bfloat16.
at::Tensor int4_linear_wide_silu_and_mul(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                                         const at::Tensor& mins, const std::optional<at::Tensor>& high) {
  return run_wide(x, packed, scales, mins, high, true);
}

}  // namespace tokenmill::ops
