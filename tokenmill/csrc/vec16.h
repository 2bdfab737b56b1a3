// A 16-lane float32 vector type for the CPU kernels: an AVX-512 implementation, an AVX2 one (two
// 8-lane halves, for x86 CPUs without AVX-512 such as Zen 3, or built with -DTOKENMILL_NO_AVX512),
// and a portable one of plain loops (other CPUs, or -DTOKENMILL_NO_AVX2 as well) that the compiler
// vectorizes as it can. Kernels are written once against these functions.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && !defined(TOKENMILL_NO_AVX512)
#define TOKENMILL_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(TOKENMILL_NO_AVX2)
#define TOKENMILL_AVX2 1
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#endif

namespace tokenmill {
namespace vec {

// A read prefetch of the cache line at p into L2. Written as an instruction: GCC 12 at -O2/-O3 may
// drop __builtin_prefetch calls in hot loops (its tree dead-code elimination removed every one of the
// decode attention's, seen in the disassembly), and an asm statement is never dropped.
inline void prefetch_l2(const void* p) {
#if defined(__x86_64__)
  asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p)));
#else
  __builtin_prefetch(p, 0, 2);
#endif
}

constexpr int kLanes = 16;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

#if defined(TOKENMILL_AVX512) || defined(TOKENMILL_AVX2)
// The vector exp and exp2 of the AVX-512 and AVX2 implementations, which differ only in intrinsics.
namespace poly {
constexpr float kLog2e = 1.44269504088896341f;
// ln 2 split in a part exact in float32 and a remainder, so that x - k ln 2 loses no bits.
constexpr float kLn2High = 0.693145751953125f;
constexpr float kLn2Low = 1.428606765330187e-06f;
// exp(r) for |r| <= ln(2) / 2: the degree-7 Taylor polynomial (about one float32 ulp), highest first.
constexpr float kExp[] = {1.0f / 5040.0f, 1.0f / 720.0f, 1.0f / 120.0f, 1.0f / 24.0f,
                          1.0f / 6.0f,    0.5f,           1.0f,           1.0f};
// 2^f for |f| <= 1/2: a degree-6 polynomial of exp(f ln 2) (about 1e-7 relative), highest first.
constexpr float kExp2[] = {1.5403530393381608e-04f, 1.3333558146428443e-03f, 9.6181291076284772e-03f,
                           5.5504108664821580e-02f, 2.4022650695910071e-01f, 6.9314718055994531e-01f,
                           1.0f};
// Horner's rule over `coefficients` (highest degree first) at r, with the vector type's
// fmadd(a, b, c) = a * b + c and splat(c).
template <typename V, size_t N, typename Fmadd, typename Splat>
inline V horner(const float (&coefficients)[N], V r, Fmadd fmadd, Splat splat) {
  V p = splat(coefficients[0]);
  for (size_t i = 1; i < N; ++i) p = fmadd(p, r, splat(coefficients[i]));
  return p;
}
}  // namespace poly
#endif

#ifdef TOKENMILL_AVX512

struct Vec {
  __m512 v;
};

inline __mmask16 lane_mask(int n) { return n >= kLanes ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1u); }

// Loads the first n (<= 16) elements as float32; the other lanes read nothing and are zero.
inline Vec load(const float* p, int n) { return {_mm512_maskz_loadu_ps(lane_mask(n), p)}; }
inline Vec load(const c10::BFloat16* p, int n) {
  // bfloat16 is the high half of a float32: widen to 32 bits and shift into place.
  __m256i raw = _mm256_maskz_loadu_epi16(lane_mask(n), p);
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16))};
}
inline Vec load(const c10::Half* p, int n) {
  return {_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lane_mask(n), p))};
}
// Loads n floats; the other lanes are `fill` (e.g. -inf for a max).
inline Vec load_or(const float* p, int n, float fill) {
  return {_mm512_mask_loadu_ps(_mm512_set1_ps(fill), lane_mask(n), p)};
}
inline void store(float* p, Vec x, int n) { _mm512_mask_storeu_ps(p, lane_mask(n), x.v); }
// x rounded to bfloat16 (nearest, ties to even; NaN to 0x7FC0) exactly as c10::BFloat16(float), as
// the bit patterns of the rounded floats (low 16 bits zero).
inline __m512i bf16_rounded_bits(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  rounded = _mm512_and_si512(rounded, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  return _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC00000));
}
// static_cast<float>(static_cast<c10::BFloat16>(x)) lane by lane.
inline Vec round_bf16(Vec x) { return {_mm512_castsi512_ps(bf16_rounded_bits(x.v))}; }
// Stores the first n lanes as bfloat16, rounded as c10::BFloat16(float).
inline void store(c10::BFloat16* p, Vec x, int n) {
  const __m256i halves = _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_rounded_bits(x.v), 16));
  _mm256_mask_storeu_epi16(p, lane_mask(n), halves);
}
inline Vec splat(float x) { return {_mm512_set1_ps(x)}; }
inline Vec zero() { return {_mm512_setzero_ps()}; }
inline Vec fmadd(Vec a, Vec b, Vec c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline Vec add(Vec a, Vec b) { return {_mm512_add_ps(a.v, b.v)}; }
inline Vec sub(Vec a, Vec b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline Vec mul(Vec a, Vec b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline Vec div(Vec a, Vec b) { return {_mm512_div_ps(a.v, b.v)}; }
inline Vec max(Vec a, Vec b) { return {_mm512_max_ps(a.v, b.v)}; }
// |magnitude| with the sign bit of `sign`, lane by lane.
inline Vec copy_sign(Vec magnitude, Vec sign) {
  const __m512i bit = _mm512_set1_epi32(INT32_MIN);  // 0xCA: bit ? sign : magnitude, bitwise
  return {_mm512_castsi512_ps(_mm512_ternarylogic_epi32(bit, _mm512_castps_si512(sign.v), _mm512_castps_si512(magnitude.v), 0xCA))};
}
// Zeroes the lanes from n on.
inline Vec keep(Vec a, int n) { return {_mm512_maskz_mov_ps(lane_mask(n), a.v)}; }
inline float reduce_add(Vec a) { return _mm512_reduce_add_ps(a.v); }
// The first lane equal to x, or -1.
inline int first_equal(Vec a, float x) {
  const __mmask16 hits = _mm512_cmp_ps_mask(a.v, _mm512_set1_ps(x), _CMP_EQ_OQ);
  return hits == 0 ? -1 : __builtin_ctz(hits);
}
inline float reduce_max(Vec a) { return _mm512_reduce_max_ps(a.v); }

// The levels of reduce_rows' transpose-and-add tree, each adding two units of the level below (rows,
// pairs, quads, octets) into one: reduce_rows and callers that build the tree in registers as rows
// arrive (paged decode attention's scores) add in the same order, so they get the same bits.
// Level 0: lanes hold partial sums of rows (a, b), interleaved.
inline __m512 rows_tree_level0(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
}
// Level 1: each 128-bit block holds the sums of four rows over that block's columns.
inline __m512 rows_tree_level1(__m512 a, __m512 b) {
  const __m512d x = _mm512_castps_pd(a), y = _mm512_castps_pd(b);
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
}
// Levels 2 and 3: 128-bit blocks of the two halves.
inline __m512 rows_tree_level23(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
}
template <int kLevel>
inline __m512 rows_tree_level(__m512 a, __m512 b) {
  if constexpr (kLevel == 0) return rows_tree_level0(a, b);
  else if constexpr (kLevel == 1) return rows_tree_level1(a, b);
  else return rows_tree_level23(a, b);
}

// Lane i of the result is the sum of the 16 floats of row i (rows: 16 rows of 16 floats). A
// transpose-and-add tree: 15 shuffle pairs for 16 sums, against about 8 instructions per
// horizontal sum done one row at a time.
inline Vec reduce_rows(const float* rows) {
  __m512 pairs[8];
  for (int i = 0; i < 8; ++i)
    pairs[i] = rows_tree_level0(_mm512_loadu_ps(rows + 2 * i * kLanes), _mm512_loadu_ps(rows + (2 * i + 1) * kLanes));
  __m512 quads[4];
  for (int i = 0; i < 4; ++i) quads[i] = rows_tree_level1(pairs[2 * i], pairs[2 * i + 1]);
  __m512 octs[2];
  for (int i = 0; i < 2; ++i) octs[i] = rows_tree_level23(quads[2 * i], quads[2 * i + 1]);
  return {rows_tree_level23(octs[0], octs[1])};
}

// exp(x) = 2^k * exp(r) with k = round(x / ln 2) and |r| <= ln(2) / 2; a degree-7 Taylor polynomial
// is accurate to about one float32 ulp there. Inputs below -100 (and -inf) give 0.
inline __m512 fmadd512(__m512 a, __m512 b, __m512 c) { return _mm512_fmadd_ps(a, b, c); }
inline __m512 splat512(float c) { return _mm512_set1_ps(c); }

inline Vec exp(Vec x) {
  __m512 xv = _mm512_max_ps(x.v, _mm512_set1_ps(-100.0f));
  __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(xv, _mm512_set1_ps(poly::kLog2e)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(poly::kLn2High), xv);
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(poly::kLn2Low), r);
  return {_mm512_scalef_ps(poly::horner(poly::kExp, r, fmadd512, splat512), k)};
}

// 2^x = 2^k * 2^f with k = round(x) and |f| <= 1/2; a degree-6 Taylor polynomial of exp(f ln 2) is
// accurate to about 1e-7 relative there. Inputs below -127 (and -inf) give at most 2^-127, a
// denormal that bfloat16 conversion flushes to zero. For callers that fold a scale and log2(e) into
// one multiply-subtract ahead of it (softmax).
inline Vec exp2(Vec x) {
  const __m512 xv = _mm512_max_ps(x.v, _mm512_set1_ps(-127.0f));
  const __m512 k = _mm512_roundscale_ps(xv, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(xv, k);
  return {_mm512_scalef_ps(poly::horner(poly::kExp2, f, fmadd512, splat512), k)};
}

#elif defined(TOKENMILL_AVX2)

struct Vec {
  __m256 lo, hi;  // lanes 0-7, lanes 8-15
};

namespace avx2 {
// All-ones in the first n lanes of an 8-lane vector (none for n <= 0, all for n >= 8).
inline __m256i first_lanes(int n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
// Eight bfloat16 bit patterns widened to float32 (a bfloat16 is the high half of a float32).
inline __m256 widen_bf16(__m128i raw) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
// The first n (< 16) 16-bit elements of p, the rest zero, without reading past them.
inline void copy_tail16(const void* p, int n, uint16_t (&out)[kLanes]) {
  std::memset(out, 0, sizeof(out));
  if (n > 0) std::memcpy(out, p, static_cast<size_t>(n) * sizeof(uint16_t));
}
// x rounded to bfloat16 as c10::BFloat16(float) does (nearest, ties to even; NaN to 0x7FC0), as
// the bit patterns of the rounded floats (low 16 bits zero).
inline __m256i bf16_rounded_bits(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  rounded = _mm256_and_si256(rounded, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u)));
  const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  return _mm256_castps_si256(
      _mm256_blendv_ps(_mm256_castsi256_ps(rounded), _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)), nan));
}
// p * 2^k for integral k in [-254, 254], as AVX-512's scalef: two exact power-of-two factors, so
// that results below the normal range become denormals or 0 and results above it infinity.
inline __m256 scale_by_pow2(__m256 p, __m256 k) {
  const __m256i ki = _mm256_cvtps_epi32(k);
  const __m256i half = _mm256_srai_epi32(ki, 1);
  const __m256i rest = _mm256_sub_epi32(ki, half);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 f1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, bias), 23));
  const __m256 f2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(rest, bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(p, f1), f2);
}
inline __m256 fmadd8(__m256 a, __m256 b, __m256 c) { return _mm256_fmadd_ps(a, b, c); }
inline __m256 splat8(float c) { return _mm256_set1_ps(c); }
inline __m256 exp8(__m256 x) {  // the AVX-512 exp's polynomial and reduction, on 8 lanes
  const __m256 xv = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-100.0f)), _mm256_set1_ps(170.0f));
  const __m256 k = _mm256_round_ps(_mm256_mul_ps(xv, _mm256_set1_ps(poly::kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(poly::kLn2High), xv);
  r = _mm256_fnmadd_ps(k, _mm256_set1_ps(poly::kLn2Low), r);
  return scale_by_pow2(poly::horner(poly::kExp, r, fmadd8, splat8), k);
}
inline __m256 exp2_8(__m256 x) {  // the AVX-512 exp2's polynomial, on 8 lanes
  const __m256 xv = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-127.0f)), _mm256_set1_ps(250.0f));
  const __m256 k = _mm256_round_ps(xv, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(xv, k);
  return scale_by_pow2(poly::horner(poly::kExp2, f, fmadd8, splat8), k);
}
inline float sum8(__m256 x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float max8(__m256 x) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
// Lane i: the sum of the 8 lanes of rows[i], for 8 rows.
inline __m256 transpose_sums8(const __m256* rows) {
  const __m256 h01 = _mm256_hadd_ps(rows[0], rows[1]), h23 = _mm256_hadd_ps(rows[2], rows[3]);
  const __m256 h45 = _mm256_hadd_ps(rows[4], rows[5]), h67 = _mm256_hadd_ps(rows[6], rows[7]);
  const __m256 h0123 = _mm256_hadd_ps(h01, h23), h4567 = _mm256_hadd_ps(h45, h67);  // per 128-bit half
  return _mm256_add_ps(_mm256_permute2f128_ps(h0123, h4567, 0x20), _mm256_permute2f128_ps(h0123, h4567, 0x31));
}
}  // namespace avx2

// Loads the first n (<= 16) elements as float32; the other lanes read nothing and are zero.
inline Vec load(const float* p, int n) {
  if (n >= kLanes) return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)};
  return {_mm256_maskload_ps(p, avx2::first_lanes(n)), _mm256_maskload_ps(p + 8, avx2::first_lanes(n - 8))};
}
inline Vec load(const c10::BFloat16* p, int n) {
  if (n >= kLanes) {
    return {avx2::widen_bf16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
            avx2::widen_bf16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
  }
  uint16_t tail[kLanes];
  avx2::copy_tail16(p, n, tail);
  return load(reinterpret_cast<const c10::BFloat16*>(tail), kLanes);
}
inline Vec load(const c10::Half* p, int n) {
  if (n >= kLanes) {
    return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
  }
  uint16_t tail[kLanes];
  avx2::copy_tail16(p, n, tail);
  return load(reinterpret_cast<const c10::Half*>(tail), kLanes);
}
// Loads n floats; the other lanes are `fill` (e.g. -inf for a max).
inline Vec load_or(const float* p, int n, float fill) {
  if (n >= kLanes) return load(p, n);
  const Vec loaded = load(p, n);
  const __m256 f = _mm256_set1_ps(fill);
  return {_mm256_blendv_ps(f, loaded.lo, _mm256_castsi256_ps(avx2::first_lanes(n))),
          _mm256_blendv_ps(f, loaded.hi, _mm256_castsi256_ps(avx2::first_lanes(n - 8)))};
}
inline void store(float* p, Vec x, int n) {
  if (n >= kLanes) {
    _mm256_storeu_ps(p, x.lo);
    _mm256_storeu_ps(p + 8, x.hi);
    return;
  }
  _mm256_maskstore_ps(p, avx2::first_lanes(n), x.lo);
  _mm256_maskstore_ps(p + 8, avx2::first_lanes(n - 8), x.hi);
}
// static_cast<float>(static_cast<c10::BFloat16>(x)) lane by lane.
inline Vec round_bf16(Vec x) {
  return {_mm256_castsi256_ps(avx2::bf16_rounded_bits(x.lo)), _mm256_castsi256_ps(avx2::bf16_rounded_bits(x.hi))};
}
// Stores the first n lanes as bfloat16, rounded as c10::BFloat16(float).
inline void store(c10::BFloat16* p, Vec x, int n) {
  const __m256i lo = _mm256_srli_epi32(avx2::bf16_rounded_bits(x.lo), 16);
  const __m256i hi = _mm256_srli_epi32(avx2::bf16_rounded_bits(x.hi), 16);
  // packus interleaves the 128-bit halves (lo0-3 hi0-3 lo4-7 hi4-7); the permute puts them in order.
  const __m256i halves = _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xD8);
  if (n >= kLanes) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), halves);
    return;
  }
  uint16_t out[kLanes];
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), halves);
  if (n > 0) std::memcpy(p, out, static_cast<size_t>(n) * sizeof(uint16_t));
}
inline Vec splat(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline Vec zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline Vec fmadd(Vec a, Vec b, Vec c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline Vec add(Vec a, Vec b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline Vec sub(Vec a, Vec b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline Vec mul(Vec a, Vec b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline Vec div(Vec a, Vec b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline Vec max(Vec a, Vec b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline Vec copy_sign(Vec magnitude, Vec sign) {
  const __m256 bit = _mm256_set1_ps(-0.0f);
  return {_mm256_or_ps(_mm256_andnot_ps(bit, magnitude.lo), _mm256_and_ps(bit, sign.lo)),
          _mm256_or_ps(_mm256_andnot_ps(bit, magnitude.hi), _mm256_and_ps(bit, sign.hi))};
}
// Zeroes the lanes from n on.
inline Vec keep(Vec a, int n) {
  return {_mm256_and_ps(a.lo, _mm256_castsi256_ps(avx2::first_lanes(n))),
          _mm256_and_ps(a.hi, _mm256_castsi256_ps(avx2::first_lanes(n - 8)))};
}
inline float reduce_add(Vec a) { return avx2::sum8(_mm256_add_ps(a.lo, a.hi)); }
// The first lane equal to x, or -1.
inline int first_equal(Vec a, float x) {
  const __m256 target = _mm256_set1_ps(x);
  const int hits = _mm256_movemask_ps(_mm256_cmp_ps(a.lo, target, _CMP_EQ_OQ)) |
                   (_mm256_movemask_ps(_mm256_cmp_ps(a.hi, target, _CMP_EQ_OQ)) << 8);
  return hits == 0 ? -1 : __builtin_ctz(static_cast<unsigned>(hits));
}
inline float reduce_max(Vec a) { return avx2::max8(_mm256_max_ps(a.lo, a.hi)); }
// Lane i of the result is the sum of the 16 floats of row i (rows: 16 rows of 16 floats).
inline Vec reduce_rows(const float* rows) {
  __m256 halves[kLanes];  // row i's two halves added
  for (int i = 0; i < kLanes; ++i)
    halves[i] = _mm256_add_ps(_mm256_loadu_ps(rows + i * kLanes), _mm256_loadu_ps(rows + i * kLanes + 8));
  return {avx2::transpose_sums8(halves), avx2::transpose_sums8(halves + 8)};
}
// exp and exp2: the AVX-512 versions' polynomials (about one float32 ulp, 1e-7 relative).
inline Vec exp(Vec x) { return {avx2::exp8(x.lo), avx2::exp8(x.hi)}; }
inline Vec exp2(Vec x) { return {avx2::exp2_8(x.lo), avx2::exp2_8(x.hi)}; }

#else  // portable fallback: plain loops over 16 lanes

struct Vec {
  float v[kLanes];
};

template <typename T>
inline Vec load(const T* p, int n) {
  Vec out;
  for (int i = 0; i < kLanes; ++i) out.v[i] = i < n ? static_cast<float>(p[i]) : 0.0f;
  return out;
}
inline Vec load_or(const float* p, int n, float fill) {
  Vec out;
  for (int i = 0; i < kLanes; ++i) out.v[i] = i < n ? p[i] : fill;
  return out;
}
inline void store(float* p, Vec x, int n) {
  for (int i = 0; i < n && i < kLanes; ++i) p[i] = x.v[i];
}
inline Vec round_bf16(Vec x) {
  for (float& lane : x.v) lane = static_cast<float>(static_cast<c10::BFloat16>(lane));
  return x;
}
inline void store(c10::BFloat16* p, Vec x, int n) {
  for (int i = 0; i < n && i < kLanes; ++i) p[i] = static_cast<c10::BFloat16>(x.v[i]);
}
inline Vec splat(float x) {
  Vec out;
  for (float& lane : out.v) lane = x;
  return out;
}
inline Vec zero() { return splat(0.0f); }
inline Vec fmadd(Vec a, Vec b, Vec c) {
  for (int i = 0; i < kLanes; ++i) c.v[i] += a.v[i] * b.v[i];
  return c;
}
inline Vec add(Vec a, Vec b) {
  for (int i = 0; i < kLanes; ++i) a.v[i] += b.v[i];
  return a;
}
inline Vec sub(Vec a, Vec b) {
  for (int i = 0; i < kLanes; ++i) a.v[i] -= b.v[i];
  return a;
}
inline Vec mul(Vec a, Vec b) {
  for (int i = 0; i < kLanes; ++i) a.v[i] *= b.v[i];
  return a;
}
inline Vec div(Vec a, Vec b) {
  for (int i = 0; i < kLanes; ++i) a.v[i] /= b.v[i];
  return a;
}
inline Vec keep(Vec a, int n) {
  for (int i = n; i < kLanes; ++i) a.v[i] = 0.0f;
  return a;
}
inline Vec max(Vec a, Vec b) {
  for (int i = 0; i < kLanes; ++i) a.v[i] = std::max(a.v[i], b.v[i]);
  return a;
}
inline Vec copy_sign(Vec magnitude, Vec sign) {
  for (int i = 0; i < kLanes; ++i) magnitude.v[i] = std::copysign(magnitude.v[i], sign.v[i]);
  return magnitude;
}
inline float reduce_add(Vec a) {
  float sum = 0.0f;
  for (float lane : a.v) sum += lane;
  return sum;
}
inline int first_equal(Vec a, float x) {
  for (int i = 0; i < kLanes; ++i)
    if (a.v[i] == x) return i;
  return -1;
}
inline float reduce_max(Vec a) {
  float best = kNegInf;
  for (float lane : a.v) best = std::max(best, lane);
  return best;
}
inline Vec exp(Vec x) {
  for (float& lane : x.v) lane = std::exp(lane);
  return x;
}
inline Vec exp2(Vec x) {
  for (float& lane : x.v) lane = std::exp2(lane);
  return x;
}
inline Vec reduce_rows(const float* rows) {
  Vec out;
  for (int i = 0; i < kLanes; ++i) out.v[i] = reduce_add(load(rows + i * kLanes, kLanes));
  return out;
}

#endif

// One vector of silu_and_mul over bfloat16 halves: silu(gate) rounded to bfloat16, times up (gate and up
// hold bfloat16 values; the caller's bfloat16 store rounds the product). Every kernel that computes
// LlamaMLP's activation in bfloat16 calls this, so they agree bit for bit.
inline Vec silu_and_mul_bf16(Vec gate, Vec up) {
  const Vec e = exp(mul(gate, splat(-1.0f)));
  return mul(round_bf16(div(gate, add(splat(1.0f), e))), up);
}

}  // namespace vec
}  // namespace tokenmill
