// Float32 vectors for the blocked kernels of float32 rows (int4_blocked_f32_cpu.cpp, q8_blocked_f32_cpu.cpp):
// one vector holds kLanes outputs of a block of 16, 16 with AVX-512F, 8 with AVX2 + FMA + F16C (a block
// in two parts). TOKENMILL_BLOCKED_F32 is 512 or 256 where the kernels are built, undefined elsewhere.
#pragma once

#include <c10/util/Half.h>

#include <cstdint>

#if defined(__AVX512F__) && !defined(TOKENMILL_NO_AVX512)
#define TOKENMILL_BLOCKED_F32 512
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define TOKENMILL_BLOCKED_F32 256
#include <immintrin.h>
#endif

#ifdef TOKENMILL_BLOCKED_F32
namespace tokenmill::f32_lanes {

#if TOKENMILL_BLOCKED_F32 == 512
using Floats = __m512;
using Ints = __m512i;
constexpr int64_t kLanes = 16;
// Rows a pass keeps in registers: 3 accumulators each, beside a step's 4 decoded vectors.
constexpr int kPassRows = 8;
inline Floats zero() { return _mm512_setzero_ps(); }
inline Floats splat(float v) { return _mm512_set1_ps(v); }
inline Floats fma(Floats a, Floats b, Floats c) { return _mm512_fmadd_ps(a, b, c); }
inline Floats add(Floats a, Floats b) { return _mm512_add_ps(a, b); }
inline Floats mul(Floats a, Floats b) { return _mm512_mul_ps(a, b); }
inline Floats load(const float* p) { return _mm512_loadu_ps(p); }
inline void store(float* p, Floats v) { _mm512_storeu_ps(p, v); }
// The lanes' 16-bit words, widened.
inline Ints load_words(const uint8_t* p) {
  return _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline Floats level(Ints words, int32_t mask) {
  return _mm512_cvtepi32_ps(_mm512_and_si512(words, _mm512_set1_epi32(mask)));
}
// The lanes' int8 values as float32.
inline Floats load_int8(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline Floats load_constants(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline Floats load_constants(const float* p) { return _mm512_loadu_ps(p); }
// Features (0, 1, 2, 3) of each 4 to (0, 2, 1, 3): the order of a word's nibbles.
inline Floats nibble_order(Floats v) { return _mm512_permute_ps(v, 0xD8); }
inline float reduce(Floats v) { return _mm512_reduce_add_ps(v); }
#else
using Floats = __m256;
using Ints = __m256i;
constexpr int64_t kLanes = 8;
constexpr int kPassRows = 4;
inline Floats zero() { return _mm256_setzero_ps(); }
inline Floats splat(float v) { return _mm256_set1_ps(v); }
inline Floats fma(Floats a, Floats b, Floats c) { return _mm256_fmadd_ps(a, b, c); }
inline Floats add(Floats a, Floats b) { return _mm256_add_ps(a, b); }
inline Floats mul(Floats a, Floats b) { return _mm256_mul_ps(a, b); }
inline Floats load(const float* p) { return _mm256_loadu_ps(p); }
inline void store(float* p, Floats v) { _mm256_storeu_ps(p, v); }
inline Ints load_words(const uint8_t* p) {
  return _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline Floats level(Ints words, int32_t mask) {
  return _mm256_cvtepi32_ps(_mm256_and_si256(words, _mm256_set1_epi32(mask)));
}
inline Floats load_int8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline Floats load_constants(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline Floats load_constants(const float* p) { return _mm256_loadu_ps(p); }
inline Floats nibble_order(Floats v) { return _mm256_permute_ps(v, 0xD8); }
inline float reduce(Floats v) {
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pair = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)));
}
#endif
constexpr int64_t kBlockOutputs = 16;
constexpr int64_t kPartsPerBlock = kBlockOutputs / kLanes;  // vectors a block's outputs fill

}  // namespace tokenmill::f32_lanes
#endif
