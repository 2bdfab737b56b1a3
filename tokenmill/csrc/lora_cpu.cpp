// Segmented LoRA shrink/expand for CPU steps (layers/lora.py, layers/lora_kernel.py): one call adds
// every row's adapter delta to the base projection's output, whatever mix of adapter slots the rows
// use. For row i of slot s (rank r; -1 or rank 0: nothing):
//   t = A[s][0 .. P*r) . x_i                 (shrink: P*r dot products over the input features)
//   out_i[o] += sum_j t[p*r + j] * Bt[s][j][o] for o in piece p's columns   (expand)
// accumulated in float32 and added to out_i once (one rounding in bfloat16). A and Bt are float32.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace tokenmill_lora {
namespace {

constexpr int64_t kBlock = 64;  // outputs a thread sums at once in the expand (four 16-lane registers)

// bfloat16 <-> float by bits (round to nearest even), simple enough for the compiler to vectorize.
inline float load_float(float v) { return v; }
inline float load_float(c10::BFloat16 v) {
  const uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline void store_float(float* dst, float v) { *dst = v; }
inline void store_float(c10::BFloat16* dst, float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  dst->x = static_cast<uint16_t>(bits >> 16);
}

// The adapters' A and Bt are float32 (layers/lora.py keeps them so): every inner loop is a float32
// dot product or axpy over contiguous memory, which -O3 -march=native turns into vector FMAs. Rows
// are taken slot by slot (the segments), so each row of A and of Bt is read from memory once per
// call and reused for all of the slot's rows from L1, instead of once per row.
template <typename T>
void lora_rows(T* out, const T* x, const float* a, const float* bt, const int64_t* ranks, const int64_t* row_slots,
               const int64_t* offsets, int64_t num_pieces, int64_t rows, int64_t num_slots, int64_t in_features,
               int64_t out_features, int64_t a_slot_rows, int64_t max_rank) {
  std::vector<std::vector<int64_t>> rows_of(num_slots);
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t slot = row_slots[i];
    if (slot >= 0 && slot < num_slots && ranks[slot] > 0) rows_of[slot].push_back(i);
  }
  // Threads only for calls of at least ~4M multiply-adds (a quarter millisecond): a parallel region of
  // less waits a whole time slice whenever another process holds a core.
  int64_t total = 0;
  for (int64_t slot = 0; slot < num_slots; ++slot)
    total += static_cast<int64_t>(rows_of[slot].size()) * ranks[slot] * (num_pieces * in_features + out_features);
  const int64_t grain = total >= (int64_t{1} << 22) ? 1 : num_slots;
  at::parallel_for(0, num_slots, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> xs, shrunk;
    for (int64_t slot = begin; slot < end; ++slot) {
      const std::vector<int64_t>& members = rows_of[slot];
      const int64_t n = static_cast<int64_t>(members.size());
      if (n == 0) continue;
      const int64_t rank = ranks[slot], width = num_pieces * rank;
      xs.resize(n * in_features);
      shrunk.resize(n * width);
      for (int64_t m = 0; m < n; ++m) {
        const T* xi = x + members[m] * in_features;
        float* xv = xs.data() + m * in_features;
        for (int64_t d = 0; d < in_features; ++d) xv[d] = load_float(xi[d]);
      }
      const float* a_slot = a + slot * a_slot_rows * in_features;
      for (int64_t k = 0; k < width; ++k) {  // shrink: t[m][k] = A[k] . x_m
        const float* a_row = a_slot + k * in_features;
        for (int64_t m = 0; m < n; ++m) {
          const float* xv = xs.data() + m * in_features;
          float sum = 0.f;
#pragma omp simd reduction(+ : sum)
          for (int64_t d = 0; d < in_features; ++d) sum += a_row[d] * xv[d];
          shrunk[m * width + k] = sum;
        }
      }
      const float* bt_slot = bt + slot * max_rank * out_features;
      for (int64_t m = 0; m < n; ++m) {  // expand, a block of kBlock outputs at a time in registers
        T* oi = out + members[m] * out_features;
        for (int64_t p = 0; p < num_pieces; ++p) {
          const float* t = shrunk.data() + m * width + p * rank;
          const int64_t lo = offsets[p], hi = offsets[p + 1];
          int64_t o = lo;
          for (; o + kBlock <= hi; o += kBlock) {
            float block[kBlock] = {};
            for (int64_t j = 0; j < rank; ++j) {
              const float tj = t[j];
              const float* b_row = bt_slot + j * out_features + o;
#pragma omp simd
              for (int64_t q = 0; q < kBlock; ++q) block[q] += tj * b_row[q];
            }
            for (int64_t q = 0; q < kBlock; ++q) store_float(oi + o + q, load_float(oi[o + q]) + block[q]);
          }
          for (; o < hi; ++o) {
            float sum = 0.f;
            for (int64_t j = 0; j < rank; ++j) sum += t[j] * bt_slot[j * out_features + o];
            store_float(oi + o, load_float(oi[o]) + sum);
          }
        }
      }
    }
  });
}

void lora_shrink_expand(at::Tensor& out, const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& lora_bt,
                        const at::Tensor& ranks, const at::Tensor& row_slots, const at::Tensor& piece_offsets) {
  TORCH_CHECK(out.is_contiguous() && x.is_contiguous() && lora_a.is_contiguous() && lora_bt.is_contiguous(),
              "lora_shrink_expand: tensors must be contiguous");
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.size(0) == out.size(0), "lora_shrink_expand: x [rows, in], out [rows, out]");
  TORCH_CHECK(x.scalar_type() == out.scalar_type(), "lora_shrink_expand: x and out must share a dtype");
  TORCH_CHECK(lora_a.scalar_type() == at::kFloat && lora_bt.scalar_type() == at::kFloat,
              "lora_shrink_expand: lora_a and lora_bt are float32");
  TORCH_CHECK(ranks.scalar_type() == at::kLong && row_slots.scalar_type() == at::kLong &&
                  piece_offsets.scalar_type() == at::kLong,
              "lora_shrink_expand: ranks, row_slots and piece_offsets are int64");
  const int64_t rows = x.size(0), in_features = x.size(1), out_features = out.size(1);
  const int64_t num_pieces = piece_offsets.size(0) - 1, max_rank = lora_bt.size(1);
  TORCH_CHECK(lora_a.size(2) == in_features && lora_bt.size(2) == out_features && row_slots.size(0) == rows,
              "lora_shrink_expand: shapes do not match");
  const float* a = lora_a.data_ptr<float>();
  const float* bt = lora_bt.data_ptr<float>();
  if (x.scalar_type() == at::kFloat) {
    lora_rows<float>(out.data_ptr<float>(), x.data_ptr<float>(), a, bt, ranks.data_ptr<int64_t>(),
                     row_slots.data_ptr<int64_t>(), piece_offsets.data_ptr<int64_t>(), num_pieces, rows,
                     lora_a.size(0), in_features, out_features, lora_a.size(1), max_rank);
  } else if (x.scalar_type() == at::kBFloat16) {
    lora_rows<c10::BFloat16>(out.data_ptr<c10::BFloat16>(), x.data_ptr<c10::BFloat16>(), a, bt,
                             ranks.data_ptr<int64_t>(), row_slots.data_ptr<int64_t>(), piece_offsets.data_ptr<int64_t>(),
                             num_pieces, rows, lora_a.size(0), in_features, out_features, lora_a.size(1), max_rank);
  } else {
    TORCH_CHECK(false, "lora_shrink_expand: float32 or bfloat16 activations only");
  }
}

}  // namespace
}  // namespace tokenmill_lora

TORCH_LIBRARY(tokenmill_lora, m) {
  m.def(
      "lora_shrink_expand(Tensor(a!) out, Tensor x, Tensor lora_a, Tensor lora_bt, Tensor ranks, Tensor row_slots, "
      "Tensor piece_offsets) -> ()");
}

TORCH_LIBRARY_IMPL(tokenmill_lora, CPU, m) { m.impl("lora_shrink_expand", &tokenmill_lora::lora_shrink_expand); }
