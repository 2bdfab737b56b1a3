// Gemma's fused elementwise CPU kernels: its RMSNorm (with and without the residual add) and the
// gelu-tanh-and-multiply of its MLP, bfloat16 and float32.
//
// Why: a Gemma 3 layer normalises six times (before and after attention and MLP, each head's queries
// and keys); as torch ops each norm is ~9 calls (widen, square, mean, add, rsqrt, two multiplies,
// round), ~60 calls a layer with the activation, which on Gemma 3 270M's 18 layers was about a third
// of a single-stream decode step. These do it in one call each, following transformers' rounding
// steps: GemmaRMSNorm multiplies the float32 normalised value by the float32 1 + w and rounds once
// (layers/norm.py), the gated activation rounds gelu(gate) to the activation dtype before the
// multiply by up. Results differ from the torch ops only by float32 summation order in the RMS and
// by the few-ulp float32 differences of our exp against torch's tanh in the activation, both below
// bfloat16's rounding.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
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

// out = (x / rms(x) * scale).to(T) for one row of `features` values (scale = 1 + w, float32).
template <typename T>
void gemma_norm_row(const T* x, const float* scale, T* out, int64_t features, float eps) {
  vec::Vec squares = vec::zero();
  for (int64_t i = 0; i < features; i += vec::kLanes) {
    const int n = static_cast<int>(std::min<int64_t>(vec::kLanes, features - i));
    const vec::Vec v = vec::load(x + i, n);
    squares = vec::fmadd(v, v, squares);
  }
  const float inv_rms = 1.0f / std::sqrt(vec::reduce_add(squares) / static_cast<float>(features) + eps);
  for (int64_t i = 0; i < features; i += vec::kLanes) {
    const int n = static_cast<int>(std::min<int64_t>(vec::kLanes, features - i));
    const vec::Vec normed = vec::mul(vec::load(x + i, n), vec::splat(inv_rms));  // float32, as torch's
    vec::store(out + i, vec::mul(normed, vec::load(scale + i, n)), n);         // one rounding to T
  }
}

// Calls fn with a null pointer of x's element type (bfloat16 or float32, which the caller checked).
template <typename Fn>
void on_dtype(const at::Tensor& x, Fn&& fn) {
  if (x.scalar_type() == at::kBFloat16)
    fn(static_cast<c10::BFloat16*>(nullptr));
  else
    fn(static_cast<float*>(nullptr));
}

void check_scale(const at::Tensor& x, const at::Tensor& scale) {
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "x must be a bfloat16 or float32 CPU tensor");
  TORCH_CHECK(x.stride(-1) == 1, "x must have contiguous features");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.dim() == 1 && scale.is_contiguous() &&
                  scale.size(0) == x.size(-1),
              "scale (1 + weight) must be contiguous float32 [", x.size(-1), "]");
}

// x [rows, features] or [tokens, heads, features] (any strides, contiguous features): a new
// contiguous tensor of x's shape and dtype.
at::Tensor gemma_rms_norm(const at::Tensor& x, const at::Tensor& scale, double eps) {
  TORCH_CHECK(x.dim() == 2 || x.dim() == 3, "x must be [rows, features] or [tokens, heads, features]");
  check_scale(x, scale);
  at::Tensor out = at::empty(x.sizes(), x.options());
  const int64_t features = x.size(-1), heads = x.dim() == 3 ? x.size(1) : 1;
  const int64_t head_stride = x.dim() == 3 ? x.stride(1) : 0, rows = x.size(0) * heads;
  const float* sp = scale.data_ptr<float>();
  on_dtype(x, [&](auto* type) {
    using scalar_t = std::remove_pointer_t<decltype(type)>;
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, rows_grain(features), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* row = xp + (r / heads) * x.stride(0) + (r % heads) * head_stride;
        gemma_norm_row(row, sp, op + r * features, features, static_cast<float>(eps));
      }
    });
  });
  return out;
}

// In place, for x and residual [rows, features] with contiguous rows: residual <- (residual + x).to(T),
// then x <- gemma_rms_norm(residual).
void add_gemma_rms_norm(at::Tensor x, at::Tensor residual, const at::Tensor& scale, double eps) {
  TORCH_CHECK(x.dim() == 2 && residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type() &&
                  residual.stride(-1) == 1,
              "x and residual must be [rows, features] of one dtype with contiguous features");
  check_scale(x, scale);
  const int64_t rows = x.size(0), features = x.size(1);
  const float* sp = scale.data_ptr<float>();
  on_dtype(x, [&](auto* type) {
    using scalar_t = std::remove_pointer_t<decltype(type)>;
    scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* rp = residual.data_ptr<scalar_t>();
    const int64_t xs = x.stride(0), rs = residual.stride(0);
    at::parallel_for(0, rows, rows_grain(features), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        scalar_t* xr = xp + r * xs;
        scalar_t* rr = rp + r * rs;
        for (int64_t i = 0; i < features; i += vec::kLanes) {
          const int n = static_cast<int>(std::min<int64_t>(vec::kLanes, features - i));
          vec::store(rr + i, vec::add(vec::load(rr + i, n), vec::load(xr + i, n)), n);  // rounded to T
        }
        gemma_norm_row(rr, sp, xr, features, static_cast<float>(eps));
      }
    });
  });
}

// What an element of the activation costs next to a norm's (rows_grain).
constexpr int64_t kGeluCost = 5;
// gelu_tanh(g) = g / 2 * (1 + tanh(y)), y = sqrt(2 / pi) * (g + 0.044715 g^3), in this order as torch
// computes it (so 1 + tanh(y) loses the same bits where tanh(y) is near -1); tanh(y) = sign(y) *
// (1 - 2 / (exp(2 |y|) + 1)), within a float32 ulp or two of torch's.
constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kGeluCubic = 0.044715f;

// out = gelu_tanh(gate).to(T) * up for x = [gate | up] along the last dim (transformers' Gemma MLP).
template <typename T>
void gelu_tanh_and_mul_rows(const T* xp, int64_t x_stride, T* op, int64_t rows, int64_t size) {
  at::parallel_for(0, rows, rows_grain(2 * size, kGeluCost), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = xp + r * x_stride;
      const T* up = gate + size;
      T* o = op + r * size;
      for (int64_t i = 0; i < size; i += vec::kLanes) {
        const int n = static_cast<int>(std::min<int64_t>(vec::kLanes, size - i));
        const vec::Vec g = vec::load(gate + i, n);
        const vec::Vec cubic = vec::mul(vec::mul(g, g), vec::mul(g, vec::splat(kGeluCubic)));
        const vec::Vec y = vec::mul(vec::add(g, cubic), vec::splat(kSqrt2OverPi));
        const vec::Vec magnitude = vec::max(y, vec::mul(y, vec::splat(-1.0f)));  // |y|
        const vec::Vec tail = vec::div(vec::splat(2.0f),
                                       vec::add(vec::exp(vec::mul(magnitude, vec::splat(2.0f))), vec::splat(1.0f)));
        const vec::Vec tanh_magnitude = vec::sub(vec::splat(1.0f), tail);
        const vec::Vec tanh = vec::copy_sign(tanh_magnitude, y);
        vec::Vec act = vec::mul(vec::mul(g, vec::splat(0.5f)), vec::add(vec::splat(1.0f), tanh));
        if constexpr (std::is_same_v<T, c10::BFloat16>) act = vec::round_bf16(act);
        vec::store(o + i, vec::mul(act, vec::load(up + i, n)), n);
      }
    }
  });
}

at::Tensor gelu_tanh_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1, "x must be a CPU tensor [rows, 2 * size]");
  TORCH_CHECK(x.size(1) % 2 == 0, "x must hold gate and up halves");
  const int64_t rows = x.size(0), size = x.size(1) / 2;
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "gelu_tanh_and_mul supports bfloat16 and float32, got ", x.scalar_type());
  at::Tensor out = at::empty({rows, size}, x.options());
  on_dtype(x, [&](auto* type) {
    using scalar_t = std::remove_pointer_t<decltype(type)>;
    gelu_tanh_and_mul_rows(x.data_ptr<scalar_t>(), x.stride(0), out.data_ptr<scalar_t>(), rows, size);
  });
  return out;
}

}  // namespace
}  // namespace tokenmill

namespace tokenmill::ops {
at::Tensor gemma_rms_norm(const at::Tensor& x, const at::Tensor& scale, double eps) {
  return ::tokenmill::gemma_rms_norm(x, scale, eps);
}
void add_gemma_rms_norm(at::Tensor x, at::Tensor residual, const at::Tensor& scale, double eps) {
  ::tokenmill::add_gemma_rms_norm(x, residual, scale, eps);
}
at::Tensor gelu_tanh_and_mul(const at::Tensor& x) { return ::tokenmill::gelu_tanh_and_mul(x); }
}  // namespace tokenmill::ops

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("gemma_rms_norm(Tensor x, Tensor scale, float eps) -> Tensor");
  m.def("add_gemma_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor scale, float eps) -> ()");
  m.def("gelu_tanh_and_mul(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("gemma_rms_norm", &tokenmill::gemma_rms_norm);
  m.impl("add_gemma_rms_norm", &tokenmill::add_gemma_rms_norm);
  m.impl("gelu_tanh_and_mul", &tokenmill::gelu_tanh_and_mul);
}
