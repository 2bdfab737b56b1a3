// Segmented LoRA shrink/expand for CPU steps (layers/lora.py, layers/lora_kernel.py): one call adds
// every row's adapter delta to the base projection's output, whatever mix of adapter slots the rows
// use. For row i of slot s (rank r; -1 or rank 0: nothing):
//   t = A[s][0 .. P*r) . x_i                 (shrink: P*r dot products over the input features)
//   out_i[o] += sum_j t[p*r + j] * Bt[s][j][o] for o in piece p's columns   (expand)
// accumulated in float32 and added to out_i once (one rounding in bfloat16). Rows are split across
// threads; each thread keeps its float32 row buffers. The A and Bt of a slot stay in cache across
// the rows that use it (a rank-16 SmolLM2 projection's are tens of kilobytes).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

namespace tokenmill_lora {
namespace {

inline float to_float(float v) { return v; }
inline float to_float(c10::BFloat16 v) { return static_cast<float>(v); }

template <typename T>
void lora_rows(T* out, const T* x, const T* a, const T* bt, const int64_t* ranks, const int64_t* row_slots,
               const int64_t* offsets, int64_t num_pieces, int64_t rows, int64_t in_features, int64_t out_features,
               int64_t a_slot_rows, int64_t max_rank) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> xf(in_features), shrunk(num_pieces * max_rank), acc(out_features);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t slot = row_slots[i];
      if (slot < 0) continue;
      const int64_t rank = ranks[slot];
      if (rank == 0) continue;
      const T* xi = x + i * in_features;
      for (int64_t k = 0; k < in_features; ++k) xf[k] = to_float(xi[k]);
      const T* a_slot = a + slot * a_slot_rows * in_features;
      for (int64_t k = 0; k < num_pieces * rank; ++k) {
        const T* a_row = a_slot + k * in_features;
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t d = 0; d < in_features; ++d) sum += to_float(a_row[d]) * xf[d];
        shrunk[k] = sum;
      }
      const T* bt_slot = bt + slot * max_rank * out_features;
      for (int64_t p = 0; p < num_pieces; ++p) {
        const int64_t lo = offsets[p], hi = offsets[p + 1];
        float* acc_p = acc.data();
#pragma omp simd
        for (int64_t o = lo; o < hi; ++o) acc_p[o] = 0.f;
        for (int64_t j = 0; j < rank; ++j) {
          const float t = shrunk[p * rank + j];
          const T* b_row = bt_slot + j * out_features;
#pragma omp simd
          for (int64_t o = lo; o < hi; ++o) acc_p[o] += t * to_float(b_row[o]);
        }
      }
      T* oi = out + i * out_features;
      for (int64_t o = 0; o < out_features; ++o) oi[o] = static_cast<T>(to_float(oi[o]) + acc[o]);
    }
  });
}

void lora_shrink_expand(at::Tensor& out, const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& lora_bt,
                        const at::Tensor& ranks, const at::Tensor& row_slots, const at::Tensor& piece_offsets) {
  TORCH_CHECK(out.is_contiguous() && x.is_contiguous() && lora_a.is_contiguous() && lora_bt.is_contiguous(),
              "lora_shrink_expand: tensors must be contiguous");
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.size(0) == out.size(0), "lora_shrink_expand: x [rows, in], out [rows, out]");
  TORCH_CHECK(x.scalar_type() == out.scalar_type() && x.scalar_type() == lora_a.scalar_type() &&
                  x.scalar_type() == lora_bt.scalar_type(),
              "lora_shrink_expand: x, out and the LoRA tensors must share a dtype");
  TORCH_CHECK(ranks.scalar_type() == at::kLong && row_slots.scalar_type() == at::kLong &&
                  piece_offsets.scalar_type() == at::kLong,
              "lora_shrink_expand: ranks, row_slots and piece_offsets are int64");
  const int64_t rows = x.size(0), in_features = x.size(1), out_features = out.size(1);
  const int64_t num_pieces = piece_offsets.size(0) - 1, max_rank = lora_bt.size(1);
  TORCH_CHECK(lora_a.size(2) == in_features && lora_bt.size(2) == out_features && row_slots.size(0) == rows,
              "lora_shrink_expand: shapes do not match");
  if (x.scalar_type() == at::kFloat) {
    lora_rows<float>(out.data_ptr<float>(), x.data_ptr<float>(), lora_a.data_ptr<float>(), lora_bt.data_ptr<float>(),
                     ranks.data_ptr<int64_t>(), row_slots.data_ptr<int64_t>(), piece_offsets.data_ptr<int64_t>(),
                     num_pieces, rows, in_features, out_features, lora_a.size(1), max_rank);
  } else if (x.scalar_type() == at::kBFloat16) {
    lora_rows<c10::BFloat16>(out.data_ptr<c10::BFloat16>(), x.data_ptr<c10::BFloat16>(),
                             lora_a.data_ptr<c10::BFloat16>(), lora_bt.data_ptr<c10::BFloat16>(),
                             ranks.data_ptr<int64_t>(), row_slots.data_ptr<int64_t>(), piece_offsets.data_ptr<int64_t>(),
                             num_pieces, rows, in_features, out_features, lora_a.size(1), max_rank);
  } else {
    TORCH_CHECK(false, "lora_shrink_expand: float32 or bfloat16 only");
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
