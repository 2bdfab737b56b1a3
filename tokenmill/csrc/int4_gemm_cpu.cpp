// Weight-only int4 linear layer for steps of up to a hundred-odd rows (decode, short prompt chunks),
// and the matching dequantization: a row kernel for a few rows, and where the CPU and the OS allow
// AMX a tile kernel for more (its section below says how).
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
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define TOKENMILL_INT4_AMX 1
#include "amx_tiles.h"
#include <sys/syscall.h>
#include <unistd.h>

#include <mutex>
#include <vector>
#endif
#endif

#include "cpu_ops.h"
#include "group_gemm.h"

namespace tokenmill {
namespace {

using namespace group_gemm;  // kGroup, kMaxGroups, kPrefetchBytes, widen_row, the row kernel

constexpr int64_t kGroupBytes = kGroup / 2;

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

// The int4 format for the row kernel (group_gemm.h): per row the float32 scales and minimums, per group
// one table lookup (dequantize_group), a 64-byte line of packed weights prefetched every 4 groups.
struct Int4Groups {
  const uint8_t* packed;
  const c10::Half* scales;
  const c10::Half* mins;
  int64_t groups;
  struct Row {
    alignas(64) float d[kMaxGroups];
    alignas(64) float m[kMaxGroups];
  };
  void start_row(int64_t o, Row& row) const {
    _mm_prefetch(reinterpret_cast<const char*>(scales + o * groups + kPrefetchBytes / kGroupBytes), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(mins + o * groups + kPrefetchBytes / kGroupBytes), _MM_HINT_T0);
    widen_row(scales + o * groups, row.d, groups);
    widen_row(mins + o * groups, row.m, groups);
  }
  __m512bh group(int64_t o, int64_t g, const Row& row) const {
    const uint8_t* w = packed + (o * groups + g) * kGroupBytes;
    if ((g & 3) == 0) _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetchBytes), _MM_HINT_T0);
    return dequantize_group(w, _mm512_set1_ps(row.d[g]), _mm512_set1_ps(row.m[g]));
  }
};

void dequantize_rows(const uint8_t* packed, const c10::Half* scales, const c10::Half* mins, c10::BFloat16* out,
                     int64_t begin, int64_t end, int64_t in) {
  const Int4Groups format{packed, scales, mins, in / kGroup};
  Int4Groups::Row row;
  for (int64_t o = begin; o < end; ++o) {
    format.start_row(o, row);
    for (int64_t g = 0; g < format.groups; ++g) {
      _mm512_storeu_si512(out + o * in + g * kGroup, (__m512i)format.group(o, g, row));
    }
  }
}

#ifdef TOKENMILL_INT4_AMX

// ---------------------------------------------------------------------------------------------------
// The tile path (AMX), for steps of several rows.
//
// The row kernel above spends one dot-product instruction per input row and group, so its time grows
// with the rows. A tile product (TDPBF16PS: a 16 x 32 bfloat16 tile times a 32 x 16 one, accumulated
// into 16 x 16 float32) does 16 rows' worth of a group for all 16 outputs of a block in one
// instruction. So per block of 16 outputs the kernel dequantizes each group once, exactly as the row
// kernel does (dequantize_group), into a scratch tile, and multiplies it with every 16-row block of
// the input: the weight bytes are read and decoded once per call whatever the number of rows, and
// the products cost little next to the decoding up to ~64 rows.
//
// It computes the transposed product out^T = W x^T: the weight tile is the "A" operand (16 outputs x
// 32 inputs, row-major: each output's group is one 64-byte tile row, as dequantize_group writes it),
// and the input is the "B" operand in the pair-interleaved layout tile products read (tile row r holds
// inputs 2r and 2r+1 of each of 16 input rows), laid out once per call in a scratch shared by all
// threads. The accumulator tile holds 16 outputs x 16 input rows and is transposed on the way out.
// Blocks are decoded and multiplied two at a time (multiply_pair: accumulators for two blocks x two
// row blocks), so each input tile loaded, which for a large step comes from L2, feeds two products;
// a lone last block takes multiply_block's passes of four row blocks.

constexpr int kTile = 16;                 // outputs per block, input rows per row block, rows of a tile
constexpr int kMaxRowBlocksPerPass = 4;   // multiply_block: accumulators 0..3, weights 4, inputs 5..6
constexpr int64_t kAmxMaxGroups = 256;    // inputs up to 8192: a block's decoded weights fit in L2
using amx::configure_tiles;
using amx::kTileBytes;
using amx::transpose16x16;

// Linux gives a process the AMX tile state only once it asks (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); a VM whose hypervisor does not pass AMX through refuses, and then the row
// kernel serves every batch size.
bool amx_permitted() {
  static std::once_flag once;
  static bool permitted = false;
  std::call_once(once, [] {
    constexpr long kArchReqXcompPerm = 0x1023;
    constexpr long kXfeatureXtiledata = 18;
    permitted = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  });
  return permitted;
}

// The input [rows, in] in tile products' "B" layout: for row block j and group g, a 1 KiB tile whose
// row r holds, for each of the block's 16 input rows, its inputs 32g + 2r and 32g + 2r + 1 (one
// 32-bit pair per row). Rows past the end are zeros. A 16 x 16 transpose of 32-bit pairs per tile.
void layout_inputs(const c10::BFloat16* x, int64_t x_stride, int64_t rows, int64_t groups, uint32_t* tiles) {
  const int64_t row_blocks = (rows + kTile - 1) / kTile;
  at::parallel_for(0, row_blocks * groups, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t j = t / groups, g = t % groups;
      uint32_t* tile = tiles + (j * groups + g) * (kTileBytes / 4);
      __m512i r[kTile];
      for (int m = 0; m < kTile; ++m) {
        const int64_t row = j * kTile + m;
        r[m] = row < rows ? _mm512_loadu_si512(x + row * x_stride + g * kGroup) : _mm512_setzero_si512();
      }
      transpose16x16(r);
      for (int p = 0; p < kTile; ++p) _mm512_storeu_si512(tile + p * kTile, r[p]);
    }
  });
}

// Writes one accumulator tile ([16 outputs][16 input rows], float32) of row block j as bfloat16 to
// outputs [o0, o0 + count) of the rows it holds.
inline void store_block(const float (*acc)[kTile], int64_t j, int64_t rows, c10::BFloat16* out, int64_t out_stride,
                        int64_t o0, int64_t count) {
  const __mmask16 lanes = count >= kTile ? __mmask16(0xFFFF) : __mmask16((1u << count) - 1u);
  __m512i r[kTile];
  for (int i = 0; i < kTile; ++i) r[i] = _mm512_load_si512(acc[i]);
  transpose16x16(r);  // r[m]: input row m's 16 outputs
  for (int m = 0; m < kTile; ++m) {
    const int64_t row = j * kTile + m;
    if (row >= rows) break;
    const __m256i values = (__m256i)_mm512_cvtneps_pbh(_mm512_castsi512_ps(r[m]));
    _mm256_mask_storeu_epi16(out + row * out_stride + o0, lanes, values);
  }
}

// A block of up to 16 outputs [o0, o0 + count) over ROW_BLOCKS row blocks from j0: the decoded weight
// tiles are in `weights` (one per group), the input tiles in `inputs`.
template <int ROW_BLOCKS>
void multiply_block(const c10::BFloat16* weights, const uint32_t* inputs, int64_t groups, int64_t j0, int64_t rows,
                    c10::BFloat16* out, int64_t out_stride, int64_t o0, int64_t count) {
  static_assert(ROW_BLOCKS >= 1 && ROW_BLOCKS <= kMaxRowBlocksPerPass, "accumulators are tiles 0..3");
  _tile_zero(0);
  if constexpr (ROW_BLOCKS > 1) _tile_zero(1);
  if constexpr (ROW_BLOCKS > 2) _tile_zero(2);
  if constexpr (ROW_BLOCKS > 3) _tile_zero(3);
  for (int64_t g = 0; g < groups; ++g) {
    _tile_loadd(4, weights + g * (kTileBytes / 2), 64);
    const uint32_t* b = inputs + (j0 * groups + g) * (kTileBytes / 4);
    const int64_t next = groups * (kTileBytes / 4);  // the same group of the next row block
    _tile_loadd(5, b, 64);
    _tile_dpbf16ps(0, 4, 5);
    if constexpr (ROW_BLOCKS > 1) {
      _tile_loadd(6, b + next, 64);
      _tile_dpbf16ps(1, 4, 6);
    }
    if constexpr (ROW_BLOCKS > 2) {
      _tile_loadd(5, b + 2 * next, 64);
      _tile_dpbf16ps(2, 4, 5);
    }
    if constexpr (ROW_BLOCKS > 3) {
      _tile_loadd(6, b + 3 * next, 64);
      _tile_dpbf16ps(3, 4, 6);
    }
  }
  alignas(64) float acc[kMaxRowBlocksPerPass][kTile][kTile];  // [row block][output][input row]
  _tile_stored(0, acc[0], 64);
  if constexpr (ROW_BLOCKS > 1) _tile_stored(1, acc[1], 64);
  if constexpr (ROW_BLOCKS > 2) _tile_stored(2, acc[2], 64);
  if constexpr (ROW_BLOCKS > 3) _tile_stored(3, acc[3], 64);
  for (int jb = 0; jb < ROW_BLOCKS; ++jb) store_block(acc[jb], j0 + jb, rows, out, out_stride, o0, count);
}

// Two blocks of outputs, [o0, o0 + count0) and [o0 + 16, o0 + 16 + count1), over ROW_BLOCKS (1 or 2)
// row blocks from j0, from their decoded weight tiles w0 and w1. Accumulators 0-3 hold [row block]
// [block], so each input tile loaded feeds two products: the input tiles of a large step stream
// from L2 once per block pair instead of once per block (the decoded weights stay in L1).
template <int ROW_BLOCKS>
void multiply_pair(const c10::BFloat16* w0, const c10::BFloat16* w1, const uint32_t* inputs, int64_t groups,
                   int64_t j0, int64_t rows, c10::BFloat16* out, int64_t out_stride, int64_t o0, int64_t count0,
                   int64_t count1) {
  static_assert(ROW_BLOCKS == 1 || ROW_BLOCKS == 2, "accumulators are tiles 0..3");
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (ROW_BLOCKS > 1) {
    _tile_zero(2);
    _tile_zero(3);
  }
  const int64_t next = groups * (kTileBytes / 4);  // the same group of the next row block
  for (int64_t g = 0; g < groups; ++g) {
    const uint32_t* b = inputs + (j0 * groups + g) * (kTileBytes / 4);
    _tile_loadd(4, w0 + g * (kTileBytes / 2), 64);
    _tile_loadd(5, w1 + g * (kTileBytes / 2), 64);
    _tile_loadd(6, b, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 5, 6);
    if constexpr (ROW_BLOCKS > 1) {
      _tile_loadd(7, b + next, 64);
      _tile_dpbf16ps(2, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  alignas(64) float acc[4][kTile][kTile];  // [row block * 2 + block][output][input row]
  _tile_stored(0, acc[0], 64);
  _tile_stored(1, acc[1], 64);
  if constexpr (ROW_BLOCKS > 1) {
    _tile_stored(2, acc[2], 64);
    _tile_stored(3, acc[3], 64);
  }
  for (int jb = 0; jb < ROW_BLOCKS; ++jb) {
    store_block(acc[2 * jb], j0 + jb, rows, out, out_stride, o0, count0);
    store_block(acc[2 * jb + 1], j0 + jb, rows, out, out_stride, o0 + kTile, count1);
  }
}

// Outputs [begin, end) (a multiple of 16 apart, but for the last block) for every row.
void linear_tiles(const uint32_t* inputs, int64_t rows, const uint8_t* packed, const c10::Half* scales,
                  const c10::Half* mins, c10::BFloat16* out, int64_t out_stride, int64_t begin, int64_t end,
                  int64_t in) {
  const int64_t groups = in / kGroup;
  const int64_t row_blocks = (rows + kTile - 1) / kTile;
  // One block's decoded weights: a tile per group, output i's group g at row i of tile g.
  // (Heap, grown once per thread: a large static thread_local array could exhaust the static TLS
  // space of a dlopen-ed library.)
  static thread_local std::vector<c10::BFloat16> scratch;
  const size_t block_elements = static_cast<size_t>(groups * kTileBytes / 2);
  if (scratch.size() < 2 * block_elements + 32) scratch.resize(2 * block_elements + 32);
  c10::BFloat16* weights = reinterpret_cast<c10::BFloat16*>((reinterpret_cast<uintptr_t>(scratch.data()) + 63) & ~uintptr_t(63));
  const Int4Groups format{packed, scales, mins, groups};
  Int4Groups::Row row;
  // Decodes outputs [o0, o0 + count) into the tiles at `tiles` (zeros past count).
  const auto decode_block = [&](c10::BFloat16* tiles, int64_t o0, int64_t count) {
    for (int64_t i = 0; i < kTile; ++i) {
      if (i >= count) {
        for (int64_t g = 0; g < groups; ++g) {
          _mm512_storeu_si512(tiles + g * (kTileBytes / 2) + i * kGroup, _mm512_setzero_si512());
        }
        continue;
      }
      const int64_t o = o0 + i;
      format.start_row(o, row);
      for (int64_t g = 0; g < groups; ++g) {
        _mm512_storeu_si512(tiles + g * (kTileBytes / 2) + i * kGroup, (__m512i)format.group(o, g, row));
      }
    }
  };
  configure_tiles();
  for (int64_t o0 = begin; o0 < end; o0 += 2 * kTile) {
    const int64_t count0 = std::min<int64_t>(kTile, end - o0);
    const int64_t count1 = std::max<int64_t>(0, std::min<int64_t>(kTile, end - o0 - kTile));
    decode_block(weights, o0, count0);
    if (count1 == 0) {  // a last lone block
      for (int64_t j0 = 0; j0 < row_blocks; j0 += kMaxRowBlocksPerPass) {
        switch (std::min<int64_t>(kMaxRowBlocksPerPass, row_blocks - j0)) {
          case 1: multiply_block<1>(weights, inputs, groups, j0, rows, out, out_stride, o0, count0); break;
          case 2: multiply_block<2>(weights, inputs, groups, j0, rows, out, out_stride, o0, count0); break;
          case 3: multiply_block<3>(weights, inputs, groups, j0, rows, out, out_stride, o0, count0); break;
          default: multiply_block<4>(weights, inputs, groups, j0, rows, out, out_stride, o0, count0); break;
        }
      }
      continue;
    }
    decode_block(weights + block_elements, o0 + kTile, count1);
    for (int64_t j0 = 0; j0 < row_blocks; j0 += 2) {
      if (row_blocks - j0 >= 2)
        multiply_pair<2>(weights, weights + block_elements, inputs, groups, j0, rows, out, out_stride, o0, count0, count1);
      else
        multiply_pair<1>(weights, weights + block_elements, inputs, groups, j0, rows, out, out_stride, o0, count0, count1);
    }
  }
  _tile_release();
}

#endif  // TOKENMILL_INT4_AMX

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

// Which kernel multiplies: kAuto picks the tile path from kTilesFromRows rows when the CPU and the OS
// allow AMX, else the level-sums kernel (int4_pairs_cpu.cpp) up to its rows where it is built, else
// the row kernel; kRows, kTiles and kPairs force one (tests compare each with the reference; kTiles
// and kPairs raise where they are unavailable). kRows is the deterministic mode's: its bits are the
// bfloat16 GEMM's on the dequantized weight.
enum Method : int64_t { kAuto = 0, kRows = 1, kTiles = 2, kPairs = 3 };
// From this many rows the tile path is faster (benchmarks/int4_gemv.py on SmolLM2's shapes: at one
// row the row kernel is 1.1-1.5x faster, at 4 they are even, at 8 the tiles are 1.3-2x faster).
constexpr int64_t kTilesFromRows = 6;
// Below kTilesFromRows (or without tiles) kAuto takes the level-sums kernel where it is built, for any
// row count it takes (benchmarks/int4_gemv.py on SmolLM2's shapes, 2-core Zen 4: 1.2-1.6x the row
// kernel's speed at one row, 1.0-1.2x at two, within 0.85-1.1x of it at four and eight rows, where
// each row costs it one multiply-add per pair of groups more). One kernel for every step of 1 to 8
// rows keeps a row's bits independent of the step's row count there: a speculative step verifying
// drafts computes the bits of decoding one token at a time.

bool tiles_available(int64_t in) {
#ifdef TOKENMILL_INT4_AMX
  return in / kGroup <= kAmxMaxGroups && amx_permitted();
#else
  (void)in;
  return false;
#endif
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& mins,
                       int64_t method) {
  if (packed.dim() == 3) {  // the blocked layout (int4_blocked_cpu.cpp): its kernel only, bfloat16 rows
    TORCH_CHECK(method == kAuto, "an int4 weight in the blocked layout runs on the blocked kernel only (method 0), got ",
                method);
    return ops::int4_linear_blocked(x, packed, scales, mins, std::nullopt);
  }
  check_format(packed, scales, mins);
  TORCH_CHECK(method >= kAuto && method <= kPairs, "method must be 0 (auto), 1 (rows), 2 (tiles) or 3 (level sums), got ",
              method);
  if (x.scalar_type() == at::kFloat) {  // float32 rows: the weights' float32 values, no bfloat16 rounding
    TORCH_CHECK(method != kTiles && method != kPairs, "the int4 tile and level-sums kernels take bfloat16 rows, not float32");
    return ops::int4_linear_f32(x, packed, scales, mins);
  }
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.stride(1) == 1,
              "x must be a bfloat16 or float32 CPU tensor [rows, in] with contiguous rows");
  const int64_t rows = x.size(0), out_features = packed.size(0), in = packed.size(1) * 2;
  TORCH_CHECK(x.size(1) == in, "x has ", x.size(1), " features, the weight ", in);
  const bool tiles = method == kTiles || (method == kAuto && rows >= kTilesFromRows && tiles_available(in));
  TORCH_CHECK(!(method == kTiles && !tiles_available(in)),
              "the int4 tile path needs AMX (CPU support and the OS's permission) and in_features <= 8192");
  const bool pairs_fit = rows >= 1 && rows <= ops::int4_pairs_max_rows() && ops::int4_pairs_available();
  TORCH_CHECK(method != kPairs || pairs_fit, "the int4 level-sums kernel needs AVX512-BF16 and 1 to ",
              ops::int4_pairs_max_rows(), " rows");
  if (method == kPairs || (method == kAuto && !tiles && pairs_fit && out_features > 0))
    return ops::int4_linear_pairs(x, packed, scales, mins, std::nullopt);
  at::Tensor out = at::empty({rows, out_features}, x.options());
  if (rows == 0 || out_features == 0) return out;
  const auto* xp = x.data_ptr<c10::BFloat16>();
  const auto* wp = packed.data_ptr<uint8_t>();
  const auto* dp = scales.data_ptr<c10::Half>();
  const auto* mp = mins.data_ptr<c10::Half>();
  auto* op = out.data_ptr<c10::BFloat16>();
  const int64_t x_stride = x.stride(0);
#ifdef TOKENMILL_INT4_AMX
  if (tiles) {
    const int64_t groups = in / kGroup, row_blocks = (rows + kTile - 1) / kTile;
    at::Tensor inputs = at::empty({row_blocks * groups * kTileBytes / 4}, x.options().dtype(at::kInt));
    auto* ip = reinterpret_cast<uint32_t*>(inputs.data_ptr<int32_t>());
    layout_inputs(xp, x_stride, rows, groups, ip);
    const int64_t blocks = (out_features + kTile - 1) / kTile;
    at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
      linear_tiles(ip, rows, wp, dp, mp, op, out_features, begin * kTile, std::min(end * kTile, out_features), in);
    });
    return out;
  }
#else
  (void)tiles;
#endif
  at::parallel_for(0, out_features, kOutputsPerTask, [&](int64_t begin, int64_t end) {
#ifdef TOKENMILL_INT4_AVX512
    multiply_rows(xp, x_stride, Int4Groups{wp, dp, mp, in / kGroup}, op, out_features, rows, begin, end);
#else
    linear_portable(xp, x_stride, wp, dp, mp, op, out_features, rows, begin, end, in);
#endif
  });
  return out;
}

bool int4_has_tiles() { return tiles_available(kGroup); }

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

namespace tokenmill::ops {
bool amx_permitted() {
#ifdef TOKENMILL_INT4_AMX
  return ::tokenmill::amx_permitted();
#else
  return false;
#endif
}
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                       const at::Tensor& mins, int64_t method) {
  return ::tokenmill::int4_linear(x, packed, scales, mins, method);
}
}  // namespace tokenmill::ops

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("int4_linear(Tensor x, Tensor packed, Tensor scales, Tensor mins, int method=0) -> Tensor");
  m.def("int4_has_tiles() -> bool", &tokenmill::int4_has_tiles);
  m.def("int4_dequantize(Tensor packed, Tensor scales, Tensor mins) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("int4_linear", &tokenmill::int4_linear);
  m.impl("int4_dequantize", &tokenmill::int4_dequantize);
}
