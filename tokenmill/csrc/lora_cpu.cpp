// Segmented LoRA shrink/expand for CPU steps (layers/lora.py, layers/lora_kernel.py): one call adds
// every row's adapter delta to the base projection's output, whatever mix of adapter slots the rows
// use. For row i of slot s (rank r; -1 or rank 0: nothing):
//   t = A[s][0 .. P*r) . x_i                 (shrink: P*r dot products over the input features)
//   out_i[o] += sum_j t[p*r + j] * Bt[s][j][o] for o in piece p's columns   (expand)
// accumulated in float32 and added to out_i once (one rounding in bfloat16). A and Bt are float32,
// or, for bfloat16 activations on CPUs with AVX512-BF16 (TOKENMILL_LORA_BF16), bfloat16: the shrink
// is then vdpbf16ps dot products of x and A (32 exact products per instruction, float32 sums), and
// the expand widens Bt's rows as it reads them and keeps t in float32 (rounding t to bfloat16 for
// vdpbf16ps there cost a measurable share of the delta's accuracy, for few instructions saved).
// Half the bytes of float32 slots: the adapters' weights are what a step reads.
//
// Rows are grouped by slot and taken in chunks of up to kChunkRows (the work items threads share).
// Inside a chunk both products are register-tiled over the 16-lane vectors of vec16.h (AVX-512, or
// AVX2 halves, or plain loops: the same code for every CPU): the shrink computes a tile of TM rows x
// kTileRanks dot products at once, so each loaded vector of A serves TM rows and each vector of x
// serves kTileRanks ranks; the expand keeps TM rows x kExpandVecs output vectors in registers while
// it walks the rank, so each vector of Bt serves TM rows. x is read in place (float32 or bfloat16).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "vec16.h"

// The op library's name; a test builds the AVX2 variant under another name beside the native one.
#ifndef TOKENMILL_LORA_LIBRARY
#define TOKENMILL_LORA_LIBRARY tokenmill_lora
#endif

#if defined(TOKENMILL_AVX512) && defined(__AVX512BF16__)
#define TOKENMILL_LORA_BF16 1
#endif

namespace tokenmill_lora {
namespace {

namespace vec = tokenmill::vec;
using vec::Vec;

constexpr int64_t kChunkRows = 32;  // rows of one slot in a work item
constexpr int kTileRanks = 4;       // shrink: ranks per tile (4 x TM accumulators)
#if defined(TOKENMILL_AVX512)
constexpr int kExpandVecs = 4;  // expand: output vectors per row in registers (32 zmm registers)
#else
constexpr int kExpandVecs = 2;  // AVX2 (16 ymm registers, two per Vec) and the portable loops
#endif

// shrunk[m][k] = A[k] . x_m for TM rows (row pointers, any T) and all `width` ranks of the slot.
template <int TM, typename T>
void shrink_tile(const T* const* rows, const float* a_slot, int64_t width, int64_t in_features, float* shrunk,
                 int64_t shrunk_stride) {
  alignas(64) float sums[vec::kLanes * vec::kLanes] = {};
  for (int64_t k0 = 0; k0 < width; k0 += kTileRanks) {
    const float* a_rows[kTileRanks];
    for (int kk = 0; kk < kTileRanks; ++kk)  // past the last rank: repeat rank k0, result dropped
      a_rows[kk] = a_slot + (k0 + kk < width ? k0 + kk : k0) * in_features;
    Vec acc[TM][kTileRanks];
    for (int mm = 0; mm < TM; ++mm)
      for (int kk = 0; kk < kTileRanks; ++kk) acc[mm][kk] = vec::zero();
    for (int64_t d = 0; d < in_features; d += vec::kLanes) {
      const int lanes = static_cast<int>(std::min<int64_t>(vec::kLanes, in_features - d));
      Vec av[kTileRanks];
      for (int kk = 0; kk < kTileRanks; ++kk) av[kk] = vec::load(a_rows[kk] + d, lanes);
      for (int mm = 0; mm < TM; ++mm) {
        const Vec xv = vec::load(rows[mm] + d, lanes);
        for (int kk = 0; kk < kTileRanks; ++kk) acc[mm][kk] = vec::fmadd(av[kk], xv, acc[mm][kk]);
      }
    }
    // Sum each accumulator's lanes, 16 at a time (rows of `sums` past TM * kTileRanks are unused).
    for (int mm = 0; mm < TM; ++mm)
      for (int kk = 0; kk < kTileRanks; ++kk) vec::store(sums + (mm * kTileRanks + kk) * vec::kLanes, acc[mm][kk], vec::kLanes);
    alignas(64) float totals[vec::kLanes];
    vec::store(totals, vec::reduce_rows(sums), vec::kLanes);
    for (int mm = 0; mm < TM; ++mm)
      for (int kk = 0; kk < kTileRanks && k0 + kk < width; ++kk) shrunk[mm * shrunk_stride + k0 + kk] = totals[mm * kTileRanks + kk];
  }
}

// out_m[o .. o + kBlock) += sum_j t_m[j] * Bt[j][o ..] for TM rows (lanes[v]: the valid lanes of
// output vector v; 0 past the piece's end).
template <int TM, typename T, typename W>
void expand_block(T* const* outs, const float* t, int64_t t_stride, const W* bt_block, int64_t rank,
                  int64_t out_features, const int* lanes) {
  Vec acc[TM][kExpandVecs];
  for (int mm = 0; mm < TM; ++mm)
    for (int v = 0; v < kExpandVecs; ++v) acc[mm][v] = vec::zero();
  for (int64_t j = 0; j < rank; ++j) {
    const W* b_row = bt_block + j * out_features;  // bfloat16 rows are widened as they are read
    Vec bv[kExpandVecs];
    for (int v = 0; v < kExpandVecs; ++v) bv[v] = vec::load(b_row + v * vec::kLanes, lanes[v]);
    for (int mm = 0; mm < TM; ++mm) {
      const Vec tj = vec::splat(t[mm * t_stride + j]);
      for (int v = 0; v < kExpandVecs; ++v) acc[mm][v] = vec::fmadd(tj, bv[v], acc[mm][v]);
    }
  }
  for (int mm = 0; mm < TM; ++mm) {
    for (int v = 0; v < kExpandVecs && lanes[v] > 0; ++v) {
      T* dst = outs[mm] + v * vec::kLanes;
      vec::store(dst, vec::add(vec::load(dst, lanes[v]), acc[mm][v]), lanes[v]);
    }
  }
}

#ifdef TOKENMILL_LORA_BF16
using BF16 = c10::BFloat16;
constexpr int64_t kBf16Lanes = 2 * vec::kLanes;  // bfloat16 values in one vdpbf16ps operand (32)

inline __mmask32 bf16_mask(int64_t n) { return n >= kBf16Lanes ? __mmask32(0xFFFFFFFFu) : __mmask32((1u << n) - 1u); }
inline __m512bh load_bf16x32(const BF16* p, int64_t n) { return (__m512bh)_mm512_maskz_loadu_epi16(bf16_mask(n), p); }

// The shrink of shrink_tile with bfloat16 x and A: 32 products per vdpbf16ps, float32 sums.
template <int TM>
void shrink_tile(const BF16* const* rows, const BF16* a_slot, int64_t width, int64_t in_features, float* shrunk,
                 int64_t shrunk_stride) {
  alignas(64) float sums[vec::kLanes * vec::kLanes] = {};
  for (int64_t k0 = 0; k0 < width; k0 += kTileRanks) {
    const BF16* a_rows[kTileRanks];
    for (int kk = 0; kk < kTileRanks; ++kk) a_rows[kk] = a_slot + (k0 + kk < width ? k0 + kk : k0) * in_features;
    __m512 acc[TM][kTileRanks];
    for (int mm = 0; mm < TM; ++mm)
      for (int kk = 0; kk < kTileRanks; ++kk) acc[mm][kk] = _mm512_setzero_ps();
    for (int64_t d = 0; d < in_features; d += kBf16Lanes) {
      const int64_t n = std::min<int64_t>(kBf16Lanes, in_features - d);
      __m512bh av[kTileRanks];
      for (int kk = 0; kk < kTileRanks; ++kk) av[kk] = load_bf16x32(a_rows[kk] + d, n);
      for (int mm = 0; mm < TM; ++mm) {
        const __m512bh xv = load_bf16x32(rows[mm] + d, n);
        for (int kk = 0; kk < kTileRanks; ++kk) acc[mm][kk] = _mm512_dpbf16_ps(acc[mm][kk], av[kk], xv);
      }
    }
    for (int mm = 0; mm < TM; ++mm)
      for (int kk = 0; kk < kTileRanks; ++kk) _mm512_store_ps(sums + (mm * kTileRanks + kk) * vec::kLanes, acc[mm][kk]);
    alignas(64) float totals[vec::kLanes];
    vec::store(totals, vec::reduce_rows(sums), vec::kLanes);
    for (int mm = 0; mm < TM; ++mm)
      for (int kk = 0; kk < kTileRanks && k0 + kk < width; ++kk) shrunk[mm * shrunk_stride + k0 + kk] = totals[mm * kTileRanks + kk];
  }
}

#endif  // TOKENMILL_LORA_BF16

template <int N>
using Rows = std::integral_constant<int, N>;

// Calls fn(Rows<TM>{}, m) over rows [0, n) in tiles of TM = 4, then 2, then 1.
template <typename Fn>
void for_row_tiles(int64_t n, Fn&& fn) {
  int64_t m = 0;
  for (; m + 4 <= n; m += 4) fn(Rows<4>{}, m);
  if (m + 2 <= n) {
    fn(Rows<2>{}, m);
    m += 2;
  }
  if (m < n) fn(Rows<1>{}, m);
}

// One work item: rows `members[0 .. n)` (n <= kChunkRows) of one slot. The shrink fills `shrunk`
// [n, P * rank] a tile of rows at a time; the expand walks the output a block of columns at a time
// and applies it to every row of the item, so the block of Bt stays in L1 across the rows.
template <typename T, typename W>
void slot_rows(T* out, const T* x, const int64_t* members, int64_t n, const W* a_slot, const W* bt_slot,
               int64_t rank, int64_t num_pieces, const int64_t* offsets, int64_t in_features, int64_t out_features,
               float* shrunk) {
  constexpr int64_t kBlock = kExpandVecs * vec::kLanes;
  const int64_t width = num_pieces * rank;
  const T* rows[kChunkRows];
  T* outs[kChunkRows];
  for (int64_t m = 0; m < n; ++m) {
    rows[m] = x + members[m] * in_features;
    outs[m] = out + members[m] * out_features;
  }
  for_row_tiles(n, [&](auto tile, int64_t m) { shrink_tile<decltype(tile)::value>(rows + m, a_slot, width, in_features, shrunk + m * width, width); });
  T* block_outs[kChunkRows];
  for (int64_t p = 0; p < num_pieces; ++p) {
    const int64_t hi = offsets[p + 1];
    for (int64_t o = offsets[p]; o < hi; o += kBlock) {
      int lanes[kExpandVecs];
      for (int v = 0; v < kExpandVecs; ++v)
        lanes[v] = static_cast<int>(std::clamp<int64_t>(hi - o - v * vec::kLanes, 0, vec::kLanes));
      for (int64_t m = 0; m < n; ++m) block_outs[m] = outs[m] + o;
      for_row_tiles(n, [&](auto tile, int64_t m) {
        expand_block<decltype(tile)::value>(block_outs + m, shrunk + m * width + p * rank, width, bt_slot + o, rank, out_features, lanes);
      });
    }
  }
}

template <typename T, typename W>
void lora_rows(T* out, const T* x, const W* a, const W* bt, const int64_t* ranks, const int64_t* row_slots,
               const int64_t* offsets, int64_t num_pieces, int64_t rows, int64_t num_slots, int64_t in_features,
               int64_t out_features, int64_t a_slot_rows, int64_t max_rank) {
  std::vector<std::vector<int64_t>> rows_of(num_slots);
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t slot = row_slots[i];
    if (slot >= 0 && slot < num_slots && ranks[slot] > 0) rows_of[slot].push_back(i);
  }
  struct Item {
    int64_t slot, begin, end;
  };
  std::vector<Item> items;
  int64_t total = 0;  // multiply-adds
  for (int64_t slot = 0; slot < num_slots; ++slot) {
    const int64_t n = static_cast<int64_t>(rows_of[slot].size());
    for (int64_t begin = 0; begin < n; begin += kChunkRows) items.push_back({slot, begin, std::min(n, begin + kChunkRows)});
    total += n * ranks[slot] * (num_pieces * in_features + out_features);
  }
  // Threads only for calls of at least ~4M multiply-adds (a quarter millisecond): a parallel region of
  // less waits a whole time slice whenever another process holds a core.
  const int64_t num_items = static_cast<int64_t>(items.size());
  const int64_t grain = total >= (int64_t{1} << 22) ? 1 : std::max<int64_t>(num_items, 1);
  at::parallel_for(0, num_items, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> shrunk(kChunkRows * num_pieces * max_rank);
    for (int64_t item = begin; item < end; ++item) {
      const Item& work = items[item];
      slot_rows(out, x, rows_of[work.slot].data() + work.begin, work.end - work.begin,
                a + work.slot * a_slot_rows * in_features, bt + work.slot * max_rank * out_features, ranks[work.slot],
                num_pieces, offsets, in_features, out_features, shrunk.data());
    }
  });
}

void lora_shrink_expand(at::Tensor& out, const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& lora_bt,
                        const at::Tensor& ranks, const at::Tensor& row_slots, const at::Tensor& piece_offsets) {
  TORCH_CHECK(out.is_contiguous() && x.is_contiguous() && lora_a.is_contiguous() && lora_bt.is_contiguous(),
              "lora_shrink_expand: tensors must be contiguous");
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.size(0) == out.size(0), "lora_shrink_expand: x [rows, in], out [rows, out]");
  TORCH_CHECK(x.scalar_type() == out.scalar_type(), "lora_shrink_expand: x and out must share a dtype");
  TORCH_CHECK(lora_a.scalar_type() == lora_bt.scalar_type() &&
                  (lora_a.scalar_type() == at::kFloat || lora_a.scalar_type() == at::kBFloat16),
              "lora_shrink_expand: lora_a and lora_bt are both float32 or both bfloat16");
  TORCH_CHECK(ranks.scalar_type() == at::kLong && row_slots.scalar_type() == at::kLong &&
                  piece_offsets.scalar_type() == at::kLong,
              "lora_shrink_expand: ranks, row_slots and piece_offsets are int64");
  const int64_t rows = x.size(0), in_features = x.size(1), out_features = out.size(1);
  const int64_t num_pieces = piece_offsets.size(0) - 1, max_rank = lora_bt.size(1);
  TORCH_CHECK(lora_a.size(2) == in_features && lora_bt.size(2) == out_features && row_slots.size(0) == rows,
              "lora_shrink_expand: shapes do not match");
  TORCH_CHECK(lora_a.size(1) >= num_pieces * max_rank && ranks.size(0) == lora_a.size(0),
              "lora_shrink_expand: lora_a must hold P * max_rank rows per slot");
  const int64_t* rank_ptr = ranks.data_ptr<int64_t>();
  const int64_t* slot_ptr = row_slots.data_ptr<int64_t>();
  const int64_t* offset_ptr = piece_offsets.data_ptr<int64_t>();
  const int64_t num_slots = lora_a.size(0), a_slot_rows = lora_a.size(1);
  if (lora_a.scalar_type() == at::kBFloat16) {
#ifdef TOKENMILL_LORA_BF16
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "lora_shrink_expand: bfloat16 slots need bfloat16 activations");
    lora_rows<c10::BFloat16, c10::BFloat16>(out.data_ptr<c10::BFloat16>(), x.data_ptr<c10::BFloat16>(),
                                            lora_a.data_ptr<c10::BFloat16>(), lora_bt.data_ptr<c10::BFloat16>(),
                                            rank_ptr, slot_ptr, offset_ptr, num_pieces, rows, num_slots, in_features,
                                            out_features, a_slot_rows, max_rank);
    return;
#else
    TORCH_CHECK(false, "lora_shrink_expand: bfloat16 slots need AVX512-BF16 (bf16_slots_available)");
#endif
  }
  const float* a = lora_a.data_ptr<float>();
  const float* bt = lora_bt.data_ptr<float>();
  if (x.scalar_type() == at::kFloat) {
    lora_rows<float, float>(out.data_ptr<float>(), x.data_ptr<float>(), a, bt, rank_ptr, slot_ptr, offset_ptr,
                            num_pieces, rows, num_slots, in_features, out_features, a_slot_rows, max_rank);
  } else if (x.scalar_type() == at::kBFloat16) {
    lora_rows<c10::BFloat16, float>(out.data_ptr<c10::BFloat16>(), x.data_ptr<c10::BFloat16>(), a, bt, rank_ptr,
                                    slot_ptr, offset_ptr, num_pieces, rows, num_slots, in_features, out_features,
                                    a_slot_rows, max_rank);
  } else {
    TORCH_CHECK(false, "lora_shrink_expand: float32 or bfloat16 activations only");
  }
}

// Whether this build has the bfloat16-slot path (AVX512-BF16; not under TOKENMILL_CPU_ISA=avx512/avx2).
bool bf16_slots_available() {
#ifdef TOKENMILL_LORA_BF16
  return true;
#else
  return false;
#endif
}

}  // namespace
}  // namespace tokenmill_lora

TORCH_LIBRARY(TOKENMILL_LORA_LIBRARY, m) {
  m.def(
      "lora_shrink_expand(Tensor(a!) out, Tensor x, Tensor lora_a, Tensor lora_bt, Tensor ranks, Tensor row_slots, "
      "Tensor piece_offsets) -> ()");
  m.def("bf16_slots_available() -> bool");
}

TORCH_LIBRARY_IMPL(TOKENMILL_LORA_LIBRARY, CPU, m) { 
  m.impl("lora_shrink_expand", &tokenmill_lora::lora_shrink_expand);
}
TORCH_LIBRARY_IMPL(TOKENMILL_LORA_LIBRARY, CompositeExplicitAutograd, m) {
  m.impl("bf16_slots_available", &tokenmill_lora::bf16_slots_available);
}
