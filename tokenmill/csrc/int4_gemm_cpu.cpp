// Weight-only int4 linear layer for small batches (decode), and the matching dequantization.
//
// Format (layers/int4.py writes it): a weight [out, in] in groups of 32 consecutive input features;
// per group a float16 scale d and minimum m (tensors [out, in/32]) and 4-bit q in 0..15 with value
// d*q + m. A group's 16 packed bytes hold element j in the low nibble of byte j and element j+16 in
// its high nibble, so the two nibble halves unpack to elements 0..15 and 16..31.
//
// Why: decoding one sequence streams every weight once per token, so its speed is bytes per second.
// 4.5 bits per weight instead of bfloat16's 16 is 3.6x fewer bytes. Each weight value is
// round_bf16(fma(q, d, m)) in float32 (q*d is exact: 4 x 11 mantissa bits), in the kernel and in
// int4_dequantize alike, so the large-batch path (a bfloat16 GEMM on the dequantized weight) computes
// with the very same values. The product then uses the bfloat16 dot-product instruction (float32
// accumulation) against the activations of the group, for every input row while the group's weights
// are in registers: the weights are read once per call whatever the number of rows.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__) && !defined(TOKENMILL_NO_AVX512)
#define TOKENMILL_INT4_AVX512 1
#include <immintrin.h>
#endif

namespace tokenmill {
namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kGroupBytes = kGroup / 2;
// Input rows handled per pass over a weight row: one float32 accumulator register each.
constexpr int kMaxRowsPerPass = 16;
// Largest input width: the float32 copies of one weight row's scales and minimums live on the stack.
constexpr int64_t kMaxGroups = 1024;
// How far ahead the row kernel prefetches packed weights (one 64-byte line every 4 groups). Measured on
// a 2-core Xeon: no prefetch 5.5 GB/s at one row, 1 KiB 10 GB/s, 4-16 KiB 12-14 GB/s.
constexpr int64_t kPrefetchBytes = 4096;

void check_format(const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& mins) {
  TORCH_CHECK(packed.device().is_cpu() && scales.device().is_cpu() && mins.device().is_cpu(),
              "int4 tensors must be on the CPU");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 2 && packed.is_contiguous(),
              "packed must be contiguous uint8 [out, in / 2]");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && mins.scalar_type() == at::kHalf && scales.is_contiguous() &&
                  mins.is_contiguous(),
              "scales and mins must be contiguous float16 [out, in / 32]");
  const int64_t out = packed.size(0), in = packed.size(1) * 2;
  TORCH_CHECK(in % kGroup == 0, "in_features must be a multiple of ", kGroup, ", got ", in);
  TORCH_CHECK(in / kGroup <= kMaxGroups, "in_features must be at most ", kMaxGroups * kGroup, ", got ", in);
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == out && scales.size(1) == in / kGroup &&
                  mins.sizes() == scales.sizes(),
              "scales and mins must be [", out, ", ", in / kGroup, "]");
}

#ifdef TOKENMILL_INT4_AVX512

// The 32 weights of one group as bfloat16, elements 0..31 in order: a 16-entry table of the group's
// values round_bf16(fma(q, d, m)) for q = 0..15 (one fma, one rounding), then one word permute looks
// up each element's nibble. The table fills both halves of the 32-word permute source, so a low
// element may index it with its whole byte: bit 4 (the high nibble's lowest bit) picks an identical
// half. Fewer vector instructions per group than widening all 32 nibbles to float32 and back, which
// at one input row bounds the kernel (the weights stream from memory faster than that).
inline __m512bh dequantize_group(const uint8_t* bytes, __m512 d, __m512 m) {
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 values = _mm512_fmadd_ps(iota, d, m);
  // cvtne2ps(a, b) puts b's 16 values in lanes 0..15 and a's in lanes 16..31 (round to nearest even).
  const __m512i table = (__m512i)_mm512_cvtne2ps_pbh(values, values);
  // Words 0..15 and 16..31 both hold bytes 0..15; the upper 16 words shift down to the high nibble.
  const __m512i words = _mm512_cvtepu8_epi16(_mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes))));
  const __m512i shifts = _mm512_set_epi64(0x0004000400040004, 0x0004000400040004, 0x0004000400040004,
                                          0x0004000400040004, 0, 0, 0, 0);
  return (__m512bh)_mm512_permutexvar_epi16(_mm512_srlv_epi16(words, shifts), table);
}

// Float32 copies of one weight row's group scales and minimums (16 converted per instruction).
inline void widen_row(const c10::Half* src, float* dst, int64_t groups) {
  for (int64_t g = 0; g < groups; g += 16) {
    const __mmask16 lanes = groups - g >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (groups - g)) - 1u);
    _mm512_mask_storeu_ps(dst + g, lanes, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes, src + g)));
  }
}

// out[r, o] for rows [row0, row0 + ROWS) and outputs [begin, end).
template <int ROWS>
void linear_rows(const c10::BFloat16* x, int64_t x_stride, const uint8_t* packed, const c10::Half* scales,
                 const c10::Half* mins, c10::BFloat16* out, int64_t out_stride, int64_t row0, int64_t begin,
                 int64_t end, int64_t in) {
  const int64_t groups = in / kGroup;
  alignas(64) float d_row[kMaxGroups], m_row[kMaxGroups];
  for (int64_t o = begin; o < end; ++o) {
    const uint8_t* w = packed + o * (in / 2);
    // Software prefetch of the three streams (packed bytes, scales, mins), kPrefetchBytes of packed
    // weights ahead: the hardware prefetcher alone leaves a core waiting on DRAM about half the time.
    _mm_prefetch(reinterpret_cast<const char*>(scales + o * groups + kPrefetchBytes / kGroupBytes), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(mins + o * groups + kPrefetchBytes / kGroupBytes), _MM_HINT_T0);
    widen_row(scales + o * groups, d_row, groups);
    widen_row(mins + o * groups, m_row, groups);
    __m512 acc[ROWS];
    for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      if ((g & 3) == 0) _mm_prefetch(reinterpret_cast<const char*>(w + g * kGroupBytes + kPrefetchBytes), _MM_HINT_T0);
      const __m512bh wg = dequantize_group(w + g * kGroupBytes, _mm512_set1_ps(d_row[g]), _mm512_set1_ps(m_row[g]));
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

template <int ROWS>
void linear_pass(const c10::BFloat16* x, int64_t x_stride, const uint8_t* packed, const c10::Half* scales,
                 const c10::Half* mins, c10::BFloat16* out, int64_t out_stride, int64_t row0, int64_t rows,
                 int64_t begin, int64_t end, int64_t in) {
  if constexpr (ROWS > 1) {
    if (rows < ROWS) {
      linear_pass<ROWS - 1>(x, x_stride, packed, scales, mins, out, out_stride, row0, rows, begin, end, in);
      return;
    }
  }
  linear_rows<ROWS>(x, x_stride, packed, scales, mins, out, out_stride, row0, begin, end, in);
}

void dequantize_rows(const uint8_t* packed, const c10::Half* scales, const c10::Half* mins, c10::BFloat16* out,
                     int64_t begin, int64_t end, int64_t in) {
  const int64_t groups = in / kGroup;
  alignas(64) float d_row[kMaxGroups], m_row[kMaxGroups];
  for (int64_t o = begin; o < end; ++o) {
    widen_row(scales + o * groups, d_row, groups);
    widen_row(mins + o * groups, m_row, groups);
    for (int64_t g = 0; g < groups; ++g) {
      const __m512bh wg = dequantize_group(packed + o * (in / 2) + g * kGroupBytes, _mm512_set1_ps(d_row[g]),
                                           _mm512_set1_ps(m_row[g]));
      _mm512_storeu_si512(out + o * in + g * kGroup, (__m512i)wg);
    }
  }
}

#else  // portable loops: the same values and float32 accumulation, without the vector instructions

inline float weight_at(const uint8_t* group, int j, float d, float m) {
  const int q = j < 16 ? (group[j] & 0x0F) : (group[j - 16] >> 4);
  return static_cast<float>(static_cast<c10::BFloat16>(static_cast<float>(q) * d + m));
}

void linear_portable(const c10::BFloat16* x, int64_t x_stride, const uint8_t* packed, const c10::Half* scales,
                     const c10::Half* mins, c10::BFloat16* out, int64_t out_stride, int64_t rows, int64_t begin,
                     int64_t end, int64_t in) {
  const int64_t groups = in / kGroup;
  for (int64_t o = begin; o < end; ++o) {
    for (int64_t r = 0; r < rows; ++r) {
      float acc = 0.0f;
      for (int64_t g = 0; g < groups; ++g) {
        const float d = static_cast<float>(scales[o * groups + g]), m = static_cast<float>(mins[o * groups + g]);
        const uint8_t* group = packed + o * (in / 2) + g * kGroupBytes;
        for (int j = 0; j < kGroup; ++j) acc += weight_at(group, j, d, m) * static_cast<float>(x[r * x_stride + g * kGroup + j]);
      }
      out[r * out_stride + o] = static_cast<c10::BFloat16>(acc);
    }
  }
}

void dequantize_rows(const uint8_t* packed, const c10::Half* scales, const c10::Half* mins, c10::BFloat16* out,
                     int64_t begin, int64_t end, int64_t in) {
  const int64_t groups = in / kGroup;
  for (int64_t o = begin; o < end; ++o) {
    for (int64_t g = 0; g < groups; ++g) {
      const float d = static_cast<float>(scales[o * groups + g]), m = static_cast<float>(mins[o * groups + g]);
      for (int j = 0; j < kGroup; ++j) {
        out[o * in + g * kGroup + j] = static_cast<c10::BFloat16>(weight_at(packed + o * (in / 2) + g * kGroupBytes, j, d, m));
      }
    }
  }
}

#endif

// Output rows per parallel task: a few KiB of packed weights, so two threads split even a small layer.
constexpr int64_t kOutputsPerTask = 16;

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& mins) {
  check_format(packed, scales, mins);
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.stride(1) == 1,
              "x must be a bfloat16 CPU tensor [rows, in] with contiguous rows");
  const int64_t rows = x.size(0), out_features = packed.size(0), in = packed.size(1) * 2;
  TORCH_CHECK(x.size(1) == in, "x has ", x.size(1), " features, the weight ", in);
  at::Tensor out = at::empty({rows, out_features}, x.options());
  if (rows == 0 || out_features == 0) return out;
  const auto* xp = x.data_ptr<c10::BFloat16>();
  const auto* wp = packed.data_ptr<uint8_t>();
  const auto* dp = scales.data_ptr<c10::Half>();
  const auto* mp = mins.data_ptr<c10::Half>();
  auto* op = out.data_ptr<c10::BFloat16>();
  const int64_t x_stride = x.stride(0);
  at::parallel_for(0, out_features, kOutputsPerTask, [&](int64_t begin, int64_t end) {
#ifdef TOKENMILL_INT4_AVX512
    for (int64_t row0 = 0; row0 < rows; row0 += kMaxRowsPerPass) {
      const int64_t n = std::min<int64_t>(kMaxRowsPerPass, rows - row0);
      linear_pass<kMaxRowsPerPass>(xp, x_stride, wp, dp, mp, op, out_features, row0, n, begin, end, in);
    }
#else
    linear_portable(xp, x_stride, wp, dp, mp, op, out_features, rows, begin, end, in);
#endif
  });
  return out;
}

at::Tensor int4_dequantize(const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& mins) {
  check_format(packed, scales, mins);
  const int64_t out_features = packed.size(0), in = packed.size(1) * 2;
  at::Tensor out = at::empty({out_features, in}, packed.options().dtype(at::kBFloat16));
  const auto* wp = packed.data_ptr<uint8_t>();
  const auto* dp = scales.data_ptr<c10::Half>();
  const auto* mp = mins.data_ptr<c10::Half>();
  auto* op = out.data_ptr<c10::BFloat16>();
  at::parallel_for(0, out_features, kOutputsPerTask, [&](int64_t begin, int64_t end) {
    dequantize_rows(wp, dp, mp, op, begin, end, in);
  });
  return out;
}

}  // namespace
}  // namespace tokenmill

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("int4_linear(Tensor x, Tensor packed, Tensor scales, Tensor mins) -> Tensor");
  m.def("int4_dequantize(Tensor packed, Tensor scales, Tensor mins) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("int4_linear", &tokenmill::int4_linear);
  m.impl("int4_dequantize", &tokenmill::int4_dequantize);
}
