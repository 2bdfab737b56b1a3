// Fused elementwise CPU kernels for the decoder layer: RMSNorm (with and without the residual add),
// rotary embedding in place, and SiLU-and-multiply.
//
// Why: a decode step of a small model is dominated by per-operator overhead, not arithmetic. One
// Llama layer spends about 40 ATen calls on norms, rotary and the MLP activation; these kernels do
// the same work in 4 calls. Each kernel reproduces the rounding steps of the transformers code it
// replaces (round to the activation dtype where transformers does), so bfloat16 results agree with
// the unfused path up to float32 summation order in the RMS.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cpu_ops.h"
#include "rows_grain.h"
#include "vec16.h"

namespace tokenmill {
namespace {

// Rounds a float to the storage type and back, as an ATen op that returns T would.
template <typename T>
inline float round_to(float x) {
  return static_cast<float>(static_cast<T>(x));
}

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(x.dim() == 2, name, " must be 2-D [rows, features], got ", x.dim(), " dims");
  TORCH_CHECK(x.stride(1) == 1, name, " must have contiguous rows");
}

// 1 / rms(x) of one row of `hidden` features, in float32.
inline float inverse_rms(float sum_of_squares, int64_t hidden, float eps) {
  return 1.0f / std::sqrt(sum_of_squares / static_cast<float>(hidden) + eps);
}

// out = weight * (x * inv_rms).to(T) for one row.
template <typename T>
void normalize_row(const T* xr, const T* weight, T* outr, int64_t hidden, float inv_rms) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    for (int64_t i = 0; i < hidden; i += vec::kLanes) {
      const int n = static_cast<int>(std::min<int64_t>(vec::kLanes, hidden - i));
      const vec::Vec normed = vec::round_bf16(vec::mul(vec::load(xr + i, n), vec::splat(inv_rms)));
      vec::store(outr + i, vec::mul(vec::load(weight + i, n), normed), n);
    }
    return;
  }
  for (int64_t i = 0; i < hidden; ++i) {
    const float normed = round_to<T>(static_cast<float>(xr[i]) * inv_rms);
    outr[i] = static_cast<T>(static_cast<float>(weight[i]) * normed);
  }
}

// out[r] = weight * (x[r] / rms(x[r])).to(T), the rms in float32 (transformers' LlamaRMSNorm).
template <typename T>
void rms_norm_rows(const T* x, int64_t x_stride, const T* weight, T* out, int64_t out_stride, int64_t rows,
                   int64_t hidden, float eps) {
  at::parallel_for(0, rows, rows_grain(hidden), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * x_stride;
      float sum = 0.0f;
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        vec::Vec squares = vec::zero();
        for (int64_t i = 0; i < hidden; i += vec::kLanes) {
          const vec::Vec v = vec::load(xr + i, static_cast<int>(std::min<int64_t>(vec::kLanes, hidden - i)));
          squares = vec::fmadd(v, v, squares);
        }
        sum = vec::reduce_add(squares);
      } else {
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < hidden; ++i) {
          float v = static_cast<float>(xr[i]);
          sum += v * v;
        }
      }
      normalize_row(xr, weight, out + r * out_stride, hidden, inverse_rms(sum, hidden, eps));
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous(),
              "weight must be contiguous [features]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "weight and x must have the same dtype");
  at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), x.stride(0), weight.data_ptr<scalar_t>(),
                            out.data_ptr<scalar_t>(), out.stride(0), x.size(0), x.size(1),
                            static_cast<float>(eps));
  });
  return out;
}

// In place: residual[r] <- (residual[r] + x[r]).to(T); x[r] <- rms_norm(residual[r]).
template <typename T>
void add_rms_norm_rows(T* xp, int64_t xs, T* rp, int64_t rs, const T* weight, int64_t rows, int64_t hidden,
                       float eps) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    // One pass for the add and the squares (of the sums as rounded to bfloat16), one to normalize.
    at::parallel_for(0, rows, rows_grain(hidden), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        T* xr = xp + r * xs;
        T* rr = rp + r * rs;
        vec::Vec squares = vec::zero();
        for (int64_t i = 0; i < hidden; i += vec::kLanes) {
          const int n = static_cast<int>(std::min<int64_t>(vec::kLanes, hidden - i));
          const vec::Vec sum = vec::round_bf16(vec::add(vec::load(rr + i, n), vec::load(xr + i, n)));
          vec::store(rr + i, sum, n);
          squares = vec::fmadd(sum, sum, squares);
        }
        normalize_row(rr, weight, xr, hidden, inverse_rms(vec::reduce_add(squares), hidden, eps));
      }
    });
    return;
  }
  at::parallel_for(0, rows, rows_grain(hidden), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* xr = xp + r * xs;
      T* rr = rp + r * rs;
      for (int64_t i = 0; i < hidden; ++i) {
        rr[i] = static_cast<T>(static_cast<float>(rr[i]) + static_cast<float>(xr[i]));
      }
    }
  });
  rms_norm_rows<T>(rp, rs, weight, xp, xs, rows, hidden, eps);
}

// In place: residual <- (residual + x).to(T); x <- rms_norm(residual). The decoder layer's skip
// connection and the next norm in one pass.
void add_rms_norm(at::Tensor x, at::Tensor residual, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  TORCH_CHECK(x.sizes() == residual.sizes(), "x and residual must have the same shape");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous(),
              "weight must be contiguous [features]");
  TORCH_CHECK(x.scalar_type() == residual.scalar_type() && x.scalar_type() == weight.scalar_type(),
              "x, residual and weight must have the same dtype");
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "add_rms_norm", [&] {
    add_rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), x.stride(0), residual.data_ptr<scalar_t>(),
                                residual.stride(0), weight.data_ptr<scalar_t>(), x.size(0), x.size(1),
                                static_cast<float>(eps));
  });
}

// Rotates the first rotary_dim dims of every head of x in place, "rotate half" style:
// (x1, x2) <- (x1 cos - x2 sin, x2 cos + x1 sin), with cos/sin rounded to T and every product and
// sum rounded to T, exactly as transformers' apply_rotary_pos_emb computes in the activation dtype.
template <typename T>
void rotate_rows(T* x, int64_t row_stride, int64_t rows, int64_t heads, int64_t head_dim, const int64_t* positions,
                 const float* cos_cache, const float* sin_cache, int64_t half) {
  at::parallel_for(0, rows, rows_grain(heads * head_dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* cos_row = cos_cache + positions[r] * half;
      const float* sin_row = sin_cache + positions[r] * half;
      for (int64_t h = 0; h < heads; ++h) {
        T* head = x + r * row_stride + h * head_dim;
        if constexpr (std::is_same_v<T, c10::BFloat16>) {
          // The same roundings as the loop below, 16 lanes at a time.
          for (int64_t i = 0; i < half; i += vec::kLanes) {
            const int n = static_cast<int>(std::min<int64_t>(vec::kLanes, half - i));
            const vec::Vec c = vec::round_bf16(vec::load(cos_row + i, n));
            const vec::Vec s = vec::round_bf16(vec::load(sin_row + i, n));
            const vec::Vec x1 = vec::load(head + i, n), x2 = vec::load(head + i + half, n);
            vec::store(head + i, vec::sub(vec::round_bf16(vec::mul(x1, c)), vec::round_bf16(vec::mul(x2, s))), n);
            vec::store(head + i + half, vec::add(vec::round_bf16(vec::mul(x2, c)), vec::round_bf16(vec::mul(x1, s))),
                       n);
          }
          continue;
        }
        for (int64_t i = 0; i < half; ++i) {
          const float c = round_to<T>(cos_row[i]), s = round_to<T>(sin_row[i]);
          const float x1 = static_cast<float>(head[i]), x2 = static_cast<float>(head[i + half]);
          head[i] = static_cast<T>(round_to<T>(x1 * c) - round_to<T>(x2 * s));
          head[i + half] = static_cast<T>(round_to<T>(x2 * c) + round_to<T>(x1 * s));
        }
      }
    }
  });
}

void rotary_embedding(const at::Tensor& positions, at::Tensor query, at::Tensor key, const at::Tensor& cos_cache,
                      const at::Tensor& sin_cache, int64_t head_dim) {
  check_rows(query, "query");
  check_rows(key, "key");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.dim() == 1,
              "positions must be contiguous int64 [tokens]");
  TORCH_CHECK(query.size(0) == positions.size(0) && key.size(0) == positions.size(0),
              "query, key and positions must have the same number of tokens");
  TORCH_CHECK(cos_cache.scalar_type() == at::kFloat && sin_cache.scalar_type() == at::kFloat &&
                  cos_cache.is_contiguous() && sin_cache.is_contiguous() && cos_cache.sizes() == sin_cache.sizes(),
              "cos/sin caches must be contiguous float32 [max_position, rotary_dim / 2]");
  TORCH_CHECK(query.scalar_type() == key.scalar_type(), "query and key must have the same dtype");
  TORCH_CHECK(head_dim > 0 && query.size(1) % head_dim == 0 && key.size(1) % head_dim == 0,
              "query/key feature sizes must be multiples of head_dim");
  const int64_t half = cos_cache.size(1);
  TORCH_CHECK(2 * half <= head_dim, "rotary_dim must not exceed head_dim");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < positions.size(0); ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos_cache.size(0), "position ", pos[t], " outside the rotary cache");
  }
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, query.scalar_type(), "rotary_embedding", [&] {
    rotate_rows<scalar_t>(query.data_ptr<scalar_t>(), query.stride(0), query.size(0), query.size(1) / head_dim,
                          head_dim, pos, cos_cache.data_ptr<float>(), sin_cache.data_ptr<float>(), half);
    rotate_rows<scalar_t>(key.data_ptr<scalar_t>(), key.stride(0), key.size(0), key.size(1) / head_dim, head_dim,
                          pos, cos_cache.data_ptr<float>(), sin_cache.data_ptr<float>(), half);
  });
}

// What an element of silu_and_mul costs next to a norm's (rows_grain).
constexpr int64_t kSiluCost = 4;

// out = silu(gate).to(T) * up for x = [gate | up] along the last dim (transformers' LlamaMLP).
template <typename T>
void silu_and_mul_rows(const T* xp, int64_t x_stride, T* op, int64_t rows, int64_t size) {
  // An exp and a division per output: a prompt chunk's activation (66 rows of SmolLM2's 1,536
  // features: ~75 us alone) is split, a decode step's (16 rows) is not.
  at::parallel_for(0, rows, rows_grain(2 * size, kSiluCost), [&](int64_t begin, int64_t end) {
    float exp_neg[vec::kLanes];
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = xp + r * x_stride;
      const T* up = gate + size;
      T* o = op + r * size;
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        for (int64_t i = 0; i < size; i += vec::kLanes) {
          const int n = static_cast<int>(std::min<int64_t>(vec::kLanes, size - i));
          vec::store(o + i, vec::silu_and_mul_bf16(vec::load(gate + i, n), vec::load(up + i, n)), n);
        }
        continue;
      }
      for (int64_t i = 0; i < size; i += vec::kLanes) {
        const int n = static_cast<int>(std::min<int64_t>(vec::kLanes, size - i));
        vec::store(exp_neg, vec::exp(vec::mul(vec::load(gate + i, n), vec::splat(-1.0f))), n);
        for (int j = 0; j < n; ++j) {
          const float g = static_cast<float>(gate[i + j]);
          const float act = round_to<T>(g / (1.0f + exp_neg[j]));
          o[i + j] = static_cast<T>(act * static_cast<float>(up[i + j]));
        }
      }
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  check_rows(x, "x");
  TORCH_CHECK(x.size(1) % 2 == 0, "x must hold gate and up halves");
  const int64_t rows = x.size(0), size = x.size(1) / 2;
  at::Tensor out = at::empty({rows, size}, x.options());
  if (x.scalar_type() == at::kBFloat16) {
    silu_and_mul_rows(x.data_ptr<c10::BFloat16>(), x.stride(0), out.data_ptr<c10::BFloat16>(), rows, size);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "silu_and_mul supports bfloat16 and float32, got ", x.scalar_type());
    silu_and_mul_rows(x.data_ptr<float>(), x.stride(0), out.data_ptr<float>(), rows, size);
  }
  return out;
}

// The index of each row's largest value, the first one on ties, as torch.argmax: a NaN counts as
// larger than everything (the first NaN wins). Two vectorized passes: the maximum, then the first
// index holding it (the row is in cache by then). A row with a NaN or an infinity (then 0 * x is not
// 0) takes an exact scalar pass instead.
template <typename T>
int64_t argmax_row(const T* row, int64_t size) {
  const int64_t full = size / vec::kLanes * vec::kLanes;
  vec::Vec best = vec::splat(vec::kNegInf), probe = vec::zero();
  for (int64_t i = 0; i < full; i += vec::kLanes) {
    const vec::Vec x = vec::load(row + i, vec::kLanes);
    best = vec::max(best, x);
    probe = vec::add(probe, vec::mul(x, vec::zero()));
  }
  float top = vec::reduce_max(best);
  bool finite = vec::reduce_add(probe) == 0.0f;
  for (int64_t i = full; i < size; ++i) {
    const float x = static_cast<float>(row[i]);
    finite = finite && std::isfinite(x);
    top = std::max(top, x);
  }
  if (!finite) {
    int64_t index = 0;
    float value = static_cast<float>(row[0]);
    for (int64_t i = 0; i < size; ++i) {
      const float x = static_cast<float>(row[i]);
      if (std::isnan(x)) return i;
      if (x > value) value = x, index = i;
    }
    return index;
  }
  for (int64_t i = 0; i < full; i += vec::kLanes) {
    const int lane = vec::first_equal(vec::load(row + i, vec::kLanes), top);
    if (lane >= 0) return i + lane;
  }
  for (int64_t i = full; i < size; ++i)
    if (static_cast<float>(row[i]) == top) return i;
  return 0;  // unreachable: top is one of the row's values
}

at::Tensor argmax_rows(const at::Tensor& x) {
  check_rows(x, "x");
  const int64_t rows = x.size(0), size = x.size(1);
  TORCH_CHECK(size > 0, "argmax_rows needs at least one column");
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  const int64_t stride = x.stride(0);
  const auto run = [&](const auto* data) {
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) o[r] = argmax_row(data + r * stride, size);
    });
  };
  if (x.scalar_type() == at::kBFloat16) {
    run(x.data_ptr<c10::BFloat16>());
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "argmax_rows supports bfloat16 and float32, got ", x.scalar_type());
    run(x.data_ptr<float>());
  }
  return out;
}

}  // namespace
}  // namespace tokenmill

namespace tokenmill::ops {
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return ::tokenmill::rms_norm(x, weight, eps);
}
void add_rms_norm(at::Tensor x, at::Tensor residual, const at::Tensor& weight, double eps) {
  ::tokenmill::add_rms_norm(x, residual, weight, eps);
}
void rotary_embedding(const at::Tensor& positions, at::Tensor query, at::Tensor key, const at::Tensor& cos_cache,
                      const at::Tensor& sin_cache, int64_t head_dim) {
  ::tokenmill::rotary_embedding(positions, query, key, cos_cache, sin_cache, head_dim);
}
at::Tensor silu_and_mul(const at::Tensor& x) { return ::tokenmill::silu_and_mul(x); }
}  // namespace tokenmill::ops

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def(
      "rotary_embedding(Tensor positions, Tensor(a!) query, Tensor(b!) key, Tensor cos_cache, Tensor sin_cache, "
      "int head_dim) -> ()");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("argmax_rows(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("rms_norm", &tokenmill::rms_norm);
  m.impl("add_rms_norm", &tokenmill::add_rms_norm);
  m.impl("rotary_embedding", &tokenmill::rotary_embedding);
  m.impl("silu_and_mul", &tokenmill::silu_and_mul);
  m.impl("argmax_rows", &tokenmill::argmax_rows);
}
