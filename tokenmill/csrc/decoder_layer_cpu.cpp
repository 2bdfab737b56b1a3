// One Llama-family decoder layer for a step of decodes on CPU, in one call:
//
//   residual, x = x, rms_norm(x)              (first layer: no residual yet)
//   or x, residual = add_rms_norm(x, residual)
//   q, k, v = int4_linear(x, qkv)             (views of one [S, (H + 2 KVH) * D] output)
//   q, k = q_norm(q), k_norm(k)               (per head, when the layer has them: Qwen3)
//   rotary(q, k) in place; write_kv(k, v)
//   x = int4_linear(paged_attention_decode(q), o)
//   x, residual = add_rms_norm(x, residual)
//   return int4_linear(silu_and_mul(int4_linear(x, gate_up)), down)
//
// Why: with int4 weights a single-sequence decode step of a small model spends about as long in
// Python and the dispatcher (about 12 operator calls and a dozen module calls per layer) as in the
// kernels' memory traffic. This op chains the same kernels (cpu_ops.h) in the same order on the same
// tensors, so its results are bitwise those of the unfused layer in models/llama.py.
//
// Contract (tokenmill::llama_decode_layer):
//   hidden       [S, hidden] bfloat16, contiguous: the previous layer's output (overwritten)
//   residual     [S, hidden] bfloat16 or None (first layer: `hidden` becomes the residual); updated
//                in place to the residual after the attention block
//   weights      [input_norm, post_attention_norm, then (packed, scales, mins) of qkv, o, gate_up,
//                down]: 14 tensors, int4 in layers/int4.py's format; then, for a layer with per-head
//                q/k RMSNorms, their two weights [head_dim] (16 tensors)
//   biases       [qkv, o, gate_up, down]: each projection's bias (added to its output) or None
//   positions    [S] int64; cos_cache / sin_cache [max_position, rotary_dim / 2] float32
//   key_cache, value_cache [num_blocks, block_size, kv_heads, head_dim]: row s's key and value are
//                stored at slot_mapping[s] before attention
//   block_tables [S, max_blocks] and seq_lens [S] int64: each row is one sequence's decode
//   returns      [S, hidden] bfloat16: the layer's output before the next residual add
#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/add.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/rsqrt.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "cpu_ops.h"

namespace tokenmill {
namespace {

constexpr int64_t kAutoKernel = 0;  // int4_linear picks the row or tile kernel by row count
constexpr size_t kNumWeights = 14;
constexpr size_t kNumWeightsWithHeadNorms = 16;
constexpr size_t kNumProjections = 4;

// Per-head RMSNorm of q or k [S, heads, D], as layers/norm.py's RMSNorm computes it for a 3-D input
// (the unfused torch ops, so the same kernels and bits): weight * (x / rms(x)).to(x.dtype).
at::Tensor head_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const at::Tensor values = x.to(at::kFloat);                                 // [S, heads, D]
  const at::Tensor variance = values.pow(2).mean(-1, /*keepdim=*/true);      // [S, heads, 1]
  const at::Tensor normalized = at::mul(values, at::rsqrt(at::add(variance, eps)));
  return at::mul(weight, normalized.to(x.scalar_type()));                    // [S, heads, D]
}

at::Tensor llama_decode_layer(at::Tensor hidden, const std::optional<at::Tensor>& residual,
                              const std::vector<at::Tensor>& weights,
                              const c10::List<std::optional<at::Tensor>>& biases, const at::Tensor& positions,
                              const at::Tensor& cos_cache, const at::Tensor& sin_cache, at::Tensor key_cache,
                              at::Tensor value_cache, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                              const at::Tensor& seq_lens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                              double eps, double scale, int64_t window) {
  TORCH_CHECK(weights.size() == kNumWeights || weights.size() == kNumWeightsWithHeadNorms, "weights must hold ",
              kNumWeights, " or ", kNumWeightsWithHeadNorms, " tensors, got ", weights.size());
  TORCH_CHECK(biases.size() == kNumProjections, "biases must hold ", kNumProjections, " entries, got ", biases.size());
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous(), "hidden must be contiguous [S, hidden]");
  const int64_t rows = hidden.size(0);
  const at::Tensor &input_norm = weights[0], &post_norm = weights[1];
  // Projection p (0 qkv, 1 o, 2 gate_up, 3 down) of x, its bias added as the layer module adds it.
  const auto linear = [&](const at::Tensor& x, size_t p) {
    const size_t first = 2 + 3 * p;
    at::Tensor out = ops::int4_linear(x, weights[first], weights[first + 1], weights[first + 2], kAutoKernel);
    const std::optional<at::Tensor> bias = biases.get(p);
    return bias.has_value() ? at::add(out, *bias) : out;
  };

  at::Tensor normed, skip;
  if (residual.has_value()) {
    skip = *residual;
    ops::add_rms_norm(hidden, skip, input_norm, eps);
    normed = hidden;
  } else {
    skip = hidden;
    normed = ops::rms_norm(hidden, input_norm, eps);
  }

  const at::Tensor qkv = linear(normed, 0);  // [S, (H + 2 * KVH) * D]
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  TORCH_CHECK(qkv.size(1) == q_size + 2 * kv_size, "the qkv weight has ", qkv.size(1), " outputs, expected ",
              q_size + 2 * kv_size);
  at::Tensor q = qkv.narrow(1, 0, q_size);            // [S, H * D], rows strided
  at::Tensor k = qkv.narrow(1, q_size, kv_size);      // [S, KVH * D]
  at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size);
  if (weights.size() == kNumWeightsWithHeadNorms) {
    q = head_rms_norm(q.view({rows, num_heads, head_dim}), weights[14], eps).view({rows, q_size});
    k = head_rms_norm(k.view({rows, num_kv_heads, head_dim}), weights[15], eps).view({rows, kv_size});
  }
  ops::rotary_embedding(positions, q, k, cos_cache, sin_cache, head_dim);
  ops::write_kv(k.view({rows, num_kv_heads, head_dim}), v.view({rows, num_kv_heads, head_dim}), key_cache,
                value_cache, slot_mapping);
  const at::Tensor attended = ops::paged_attention_decode(q.view({rows, num_heads, head_dim}), key_cache,
                                                          value_cache, block_tables, seq_lens, scale,
                                                          window);  // [S, H, D]

  at::Tensor x = linear(attended.view({rows, q_size}), 1);  // [S, hidden]
  ops::add_rms_norm(x, skip, post_norm, eps);
  const at::Tensor gate_up = linear(x, 2);                    // [S, 2 * intermediate]
  return linear(ops::silu_and_mul(gate_up), 3);              // [S, hidden]
}

}  // namespace
}  // namespace tokenmill

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def(
      "llama_decode_layer(Tensor(a!) hidden, Tensor(b!)? residual, Tensor[] weights, Tensor?[] biases, "
      "Tensor positions, "
      "Tensor cos_cache, Tensor sin_cache, Tensor(c!) key_cache, Tensor(d!) value_cache, Tensor slot_mapping, "
      "Tensor block_tables, Tensor seq_lens, int num_heads, int num_kv_heads, int head_dim, float eps, "
      "float scale, int window) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) { m.impl("llama_decode_layer", &tokenmill::llama_decode_layer); }
