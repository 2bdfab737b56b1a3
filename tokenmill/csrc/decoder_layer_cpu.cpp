// The Llama-family decoder stack for a step of decodes (and prompt chunks) on CPU, in one call. Each
// layer:
//
//   residual, x = x, rms_norm(x)              (first layer: no residual yet)
//   or x, residual = add_rms_norm(x, residual)
//   q, k, v = linear(x, qkv)                  (views of one [S, (H + 2 KVH) * D] output)
//   q, k = q_norm(q), k_norm(k)               (per head, when the layer has them: Qwen3)
//   rotary(q, k) in place; write_kv(k, v)
//   x = linear(attention(q), o)               (decode rows: paged_attention_decode; chunks:
//                                              paged_prefill_attention)
//   x, residual = add_rms_norm(x, residual)
//   return linear(silu_and_mul(linear(x, gate_up)), down)   (a gate_up in the blocked int4 layout: one call,
//                                              int4_linear_blocked_silu_and_mul, bitwise the same)
// and after the last layer: x, residual = add_rms_norm(x, residual) with the final norm's weight.
// `linear` is int4_linear for int4 weights (bfloat16 activations, or float32 ones: the weights' float32
// values), f32_panel_linear for float32 panels (float32 activations, on CPUs without AVX-512), and
// oneDNN's packed GEMM (mkldnn::_linear_pointwise, as cpu_gemm.packed_linear calls it) for bfloat16
// activations with oneDNN-packed bfloat16 weights: the "wide" stack of layers/fused_decode_stack.py,
// for steps with more rows than the int4 kernels take, where the layer modules multiply the same way.
//
// Why: with int4 weights a single-sequence decode step of a small model spends about as long in
// Python and the dispatcher (about 12 operator calls and a dozen module calls per layer) as in the
// kernels' memory traffic; one call per layer still cost ~20 us of Python and argument boxing each
// (SmolLM2: 30 layers, ~0.6 ms of a 10 ms step). This op chains the same kernels (cpu_ops.h) in the
// same order on the same tensors, so its results are bitwise those of the layer modules in
// models/llama.py followed by the model's final norm.
//
// Contract (tokenmill::llama_decode_stack), L layers:
//   hidden       [S, hidden] bfloat16 or float32, contiguous: the embeddings (overwritten)
//   weights      per layer, in order: [input_norm, post_attention_norm, then the weights of qkv, o,
//                gate_up, down] in hidden's dtype; for bfloat16 the projections' (packed, scales,
//                mins), int4 in layers/int4.py's format or, for bfloat16 steps of up to 16 rows, its
//                blocked copy (Int4Weight.blocked; not with row_independent) (14 tensors; float32 hidden too), or their
//                oneDNN-packed weights (torch.ops.mkldnn._reorder_linear_weight; 6 tensors), or for
//                float32 their panels [ceil(out / 16), in, 16] (f32_gemm_cpu.cpp; 6 tensors); then, for layers with
//                per-head q/k RMSNorms, their two weights [head_dim] (16 or 8 tensors): every layer the
//                same count, 14, 16, 6 or 8
//   biases       per layer [qkv, o, gate_up, down]: each projection's bias (added to its output) or
//                None: 4 L entries
//   kv_caches    per layer [2, num_blocks, block_size, kv_heads, head_dim]: row s's key and value are
//                stored at slot_mapping[s] before attention
//   positions    [S] int64; cos_cache / sin_cache [max_position, rotary_dim / 2] float32
//   block_tables [S, max_blocks] and seq_lens [S] int64: each row is one sequence's decode; or, with
//                chunks, [D, max_blocks] and [D] for the rows listed in decode_rows
//   chunk_spans  None, or [C, 3] int64: prompt chunks (first row, start position, tokens) whose rows
//                attend through paged_prefill_attention with block table chunk_tables[c] ([C,
//                max_blocks] int64), as the layer modules' CpuPagedAttention attends them
//   decode_rows  with chunk_spans: [D] int64, the step's other rows, each a decode attending through
//                paged_attention_decode with block_tables[d] and seq_lens[d]
//   final_norm   [hidden] in hidden's dtype
//   interrupt    None or [1] uint8 in memory another process may write (step_control.py): read
//                before each layer (but the first of a resumed call); once nonzero the call stops there
//   start_layer  with residual, a resumed call: the layer to go on from, hidden and residual being what a
//   residual     stopped call returned (the input of that layer and the residual stream, [0] before the
//                first layer); without, 0 and hidden is the embeddings
//   row_independent  (the deterministic mode) int4 products on the row kernel and decode attention on
//                the vector path for any number of rows (no AMX tiles chosen by the row count), every row
//                a decode (no chunk_spans): a row's bits then do not depend on the other rows
//   returns      (out, residual, next_layer): when every layer ran, next_layer = L and out [S, hidden] is
//                the final norm's output (the LM head's input); when the interrupt stopped the call
//                before layer l, next_layer = l, out is that layer's input and residual the residual
//                stream ([0] before the first layer): pass them back with start_layer = l to go on
#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/add.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/rsqrt.h>
#include <torch/library.h>

#include <array>
#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

#include "cpu_ops.h"

namespace tokenmill {
namespace {

constexpr int64_t kAutoKernel = 0;  // int4_linear picks the row or tile kernel by row count
constexpr int64_t kRowKernel = 1;   // int4_linear's row kernel for any row count (row_independent)
constexpr size_t kNumProjections = 4;
constexpr size_t kNumWeights = 2 + 3 * kNumProjections;  // int4: two norms, (packed, scales, mins) each
constexpr size_t kNumPanelWeights = 2 + kNumProjections;  // float32: two norms, the panels of each
constexpr size_t kNumHeadNorms = 2;

// How a layer's weights list is laid out (see the contract).
struct WeightLayout {
  size_t per_projection;  // tensors per projection: 3 (int4) or 1 (float32 panels)
  bool head_norms;        // the q and k norms' weights follow the projections'

  static std::optional<WeightLayout> of(size_t per_layer) {
    if (per_layer == kNumWeights || per_layer == kNumWeights + kNumHeadNorms)
      return WeightLayout{3, per_layer != kNumWeights};
    if (per_layer == kNumPanelWeights || per_layer == kNumPanelWeights + kNumHeadNorms)
      return WeightLayout{1, per_layer != kNumPanelWeights};
    return std::nullopt;
  }
  size_t first_head_norm() const { return 2 + per_projection * kNumProjections; }
};

// Per-head RMSNorm of q or k [S, heads, D], as layers/norm.py's RMSNorm computes it for a 3-D input
// (the unfused torch ops, so the same kernels and bits): weight * (x / rms(x)).to(x.dtype).
at::Tensor head_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const at::Tensor values = x.to(at::kFloat);                                 // [S, heads, D]
  const at::Tensor variance = values.pow(2).mean(-1, /*keepdim=*/true);      // [S, heads, 1]
  const at::Tensor normalized = at::mul(values, at::rsqrt(at::add(variance, eps)));
  return at::mul(weight, normalized.to(x.scalar_type()));                    // [S, heads, D]
}

// The tensors of one step shared by every layer.
struct StepInputs {
  const at::Tensor& positions;
  const at::Tensor& cos_cache;
  const at::Tensor& sin_cache;
  const at::Tensor& slot_mapping;
  const at::Tensor& block_tables;
  const at::Tensor& seq_lens;
  int64_t num_heads, num_kv_heads, head_dim;
  double eps, scale;
  int64_t window;
  // Prompt chunks attending through the prefill kernel (none: every row is a decode).
  std::vector<std::array<int64_t, 3>> chunks;  // first row, start position, tokens
  at::Tensor chunk_tables;                     // [C, max_blocks]
  at::Tensor decode_rows;                      // [D]: the rows block_tables and seq_lens describe
  bool decodes_lead = false;                   // decode_rows is 0 .. D - 1
  // The deterministic mode: int4 products on the row kernel and decode attention on the vector path
  // whatever the number of rows, so each row's bits do not depend on the other rows.
  bool row_independent = false;
};

// The step's attention for q [S, H, D] (this layer's keys and values already stored).
at::Tensor attend(const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
                  const StepInputs& step) {
  if (step.chunks.empty())
    return ops::paged_attention_decode(q, key_cache, value_cache, step.block_tables, step.seq_lens, step.scale,
                                       step.window, std::nullopt, !step.row_independent);  // [S, H, D]
  at::Tensor out = at::empty(q.sizes(), q.options());  // [S, H, D]
  const int64_t decodes = step.decode_rows.size(0);
  if (decodes > 0) {
    const at::Tensor rows = step.decodes_lead ? q.narrow(0, 0, decodes) : q.index_select(0, step.decode_rows);
    const at::Tensor attended = ops::paged_attention_decode(rows, key_cache, value_cache, step.block_tables,
                                                            step.seq_lens, step.scale, step.window, std::nullopt,
                                                            !step.row_independent);  // [D, H, D]
    if (step.decodes_lead)
      out.narrow(0, 0, decodes).copy_(attended);
    else
      out.index_copy_(0, step.decode_rows, attended);
  }
  for (size_t c = 0; c < step.chunks.size(); ++c) {
    const auto& [first, start, tokens] = step.chunks[c];
    out.narrow(0, first, tokens)
        .copy_(ops::paged_prefill_attention(q.narrow(0, first, tokens), key_cache, value_cache,
                                            step.chunk_tables.select(0, static_cast<int64_t>(c)), start,
                                            step.scale));  // [tokens, H, D]
  }
  return out;
}

// One layer: `weights` are this layer's (laid out as `layout` says), its biases biases[first_bias + p]
// for projection p. `hidden` is overwritten; `skip` is the residual stream, undefined before the first
// layer (then `hidden` becomes it) and updated in place. Returns the layer's output.
at::Tensor decode_layer(at::Tensor hidden, at::Tensor& skip, c10::ArrayRef<at::Tensor> weights, WeightLayout layout,
                        const c10::List<std::optional<at::Tensor>>& biases, size_t first_bias,
                        const at::Tensor& kv_cache, const StepInputs& step) {
  const int64_t rows = hidden.size(0);
  const int64_t num_heads = step.num_heads, num_kv_heads = step.num_kv_heads, head_dim = step.head_dim;
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  const double eps = step.eps;
  const at::Tensor &input_norm = weights[0], &post_norm = weights[1];
  // The projections' output widths, which panels (padded to 16) do not carry: the down projection's
  // panels [.., intermediate, 16] give the intermediate size.
  const int64_t intermediate = layout.per_projection == 1 && hidden.scalar_type() == at::kFloat ? weights[2 + 3].size(1) : 0;
  const int64_t out_features[kNumProjections] = {q_size + 2 * kv_size, hidden.size(1), 2 * intermediate,
                                                 hidden.size(1)};
  // Projection p (0 qkv, 1 o, 2 gate_up, 3 down) of x, its bias added as the layer module adds it:
  // after the int4 kernel, inside the panel kernel.
  const auto linear = [&](const at::Tensor& x, size_t p) {
    const size_t first = 2 + layout.per_projection * p;
    const std::optional<at::Tensor> bias = biases.get(first_bias + p);
    if (layout.per_projection == 1 && x.scalar_type() == at::kFloat)
      return ops::f32_panel_linear(x, weights[first], bias, out_features[p]);
    if (layout.per_projection == 1) return ops::onednn_packed_linear(x, weights[first], bias);
    at::Tensor out = ops::int4_linear(x, weights[first], weights[first + 1], weights[first + 2],
                                      step.row_independent ? kRowKernel : kAutoKernel);
    return bias.has_value() ? at::add(out, *bias) : out;
  };

  // silu_and_mul(linear(x, 2)) [S, intermediate]; a gate_up weight in the blocked layout whose halves are whole
  // blocks computes it in one call (the wide kernel's epilogue on steps of many rows), bit for bit.
  const auto activated_gate_up = [&](const at::Tensor& x) {
    const size_t first = 2 + layout.per_projection * 2;
    if (layout.per_projection == 3 && weights[first].dim() == 3 && weights[first].size(0) % 2 == 0 &&
        !biases.get(first_bias + 2).has_value())
      return ops::int4_linear_blocked_silu_and_mul(x, weights[first], weights[first + 1], weights[first + 2],
                                                   std::nullopt);
    return ops::silu_and_mul(linear(x, 2));
  };

  at::Tensor normed;
  if (skip.defined()) {
    ops::add_rms_norm(hidden, skip, input_norm, eps);
    normed = hidden;
  } else {
    skip = hidden;
    normed = ops::rms_norm(hidden, input_norm, eps);
  }

  const at::Tensor qkv = linear(normed, 0);  // [S, (H + 2 * KVH) * D]
  TORCH_CHECK(qkv.size(1) == q_size + 2 * kv_size, "the qkv weight has ", qkv.size(1), " outputs, expected ",
              q_size + 2 * kv_size);
  at::Tensor q = qkv.narrow(1, 0, q_size);            // [S, H * D], rows strided
  at::Tensor k = qkv.narrow(1, q_size, kv_size);      // [S, KVH * D]
  at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size);
  if (layout.head_norms) {
    const size_t q_norm = layout.first_head_norm();
    q = head_rms_norm(q.view({rows, num_heads, head_dim}), weights[q_norm], eps).view({rows, q_size});
    k = head_rms_norm(k.view({rows, num_kv_heads, head_dim}), weights[q_norm + 1], eps).view({rows, kv_size});
  }
  ops::rotary_embedding(step.positions, q, k, step.cos_cache, step.sin_cache, head_dim);
  const at::Tensor key_cache = kv_cache.select(0, 0), value_cache = kv_cache.select(0, 1);
  ops::write_kv(k.view({rows, num_kv_heads, head_dim}), v.view({rows, num_kv_heads, head_dim}), key_cache,
                value_cache, step.slot_mapping);
  const at::Tensor attended = attend(q.view({rows, num_heads, head_dim}), key_cache, value_cache, step);  // [S, H, D]

  at::Tensor x = linear(attended.view({rows, q_size}), 1);  // [S, hidden]
  ops::add_rms_norm(x, skip, post_norm, eps);
  return linear(activated_gate_up(x), 3);  // [S, hidden]
}

std::tuple<at::Tensor, at::Tensor, int64_t> llama_decode_stack(at::Tensor hidden, const std::vector<at::Tensor>& weights,
                              const c10::List<std::optional<at::Tensor>>& biases,
                              const std::vector<at::Tensor>& kv_caches, const at::Tensor& positions,
                              const at::Tensor& cos_cache, const at::Tensor& sin_cache, const at::Tensor& slot_mapping,
                              const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& final_norm,
                              int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale,
                              int64_t window, const std::optional<at::Tensor>& interrupt,
                              const std::optional<at::Tensor>& chunk_spans, const std::optional<at::Tensor>& chunk_tables,
                              const std::optional<at::Tensor>& decode_rows, int64_t start_layer,
                              const std::optional<at::Tensor>& residual, bool row_independent) {
  const size_t layers = kv_caches.size();
  TORCH_CHECK(layers > 0, "kv_caches must hold one cache per layer, got none");
  const size_t per_layer = weights.size() / layers;
  const std::optional<WeightLayout> layout = WeightLayout::of(per_layer);
  TORCH_CHECK(weights.size() % layers == 0 && layout.has_value(), "weights must hold ", kNumWeights, " or ",
              kNumWeights + kNumHeadNorms, " (int4), ", kNumPanelWeights, " or ", kNumPanelWeights + kNumHeadNorms,
              " (float32 panels or oneDNN-packed) tensors per layer (", layers, " layers), got ", weights.size());
  if (layout->per_projection == 1) {
    // One tensor a projection: float32 panels under float32 hidden states, oneDNN-packed weights
    // (opaque mkldnn tensors) under bfloat16 ones.
    const bool packed = hidden.scalar_type() == at::kBFloat16;
    TORCH_CHECK(packed || hidden.scalar_type() == at::kFloat,
                "one tensor a projection: float32 panels with float32 hidden states, or oneDNN-packed weights with "
                "bfloat16 ones");
    for (size_t layer = 0; layer < layers; ++layer)
      for (size_t p = 0; p < kNumProjections; ++p) {
        const at::Tensor& w = weights[per_layer * layer + 2 + p];
        TORCH_CHECK(w.is_mkldnn() == packed,
                    packed ? "bfloat16 hidden states with one tensor a projection take oneDNN-packed weights"
                           : "float32 hidden states with one tensor a projection take float32 panels");
      }
  }
  TORCH_CHECK(biases.size() == kNumProjections * layers, "biases must hold ", kNumProjections,
              " entries per layer (", layers, " layers), got ", biases.size());
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous(), "hidden must be contiguous [S, hidden]");
  for (const at::Tensor& cache : kv_caches) {
    TORCH_CHECK(cache.dim() == 5 && cache.size(0) == 2, "each kv cache must be [2, blocks, block_size, heads, D]");
  }
  StepInputs step{positions, cos_cache,    sin_cache, slot_mapping, block_tables, seq_lens, num_heads,
                  num_kv_heads, head_dim, eps,       scale,        window};
  step.row_independent = row_independent;
  TORCH_CHECK(!row_independent || !chunk_spans.has_value(),
              "row_independent attends every row as a decode: no prompt chunks through the prefill kernel");
  if (chunk_spans.has_value()) {
    TORCH_CHECK(chunk_tables.has_value() && decode_rows.has_value(), "chunk_spans needs chunk_tables and decode_rows");
    const at::Tensor spans = chunk_spans->to(at::kLong).contiguous();
    TORCH_CHECK(spans.dim() == 2 && spans.size(1) == 3, "chunk_spans must be [C, 3] (first row, start, tokens)");
    TORCH_CHECK(chunk_tables->dim() == 2 && chunk_tables->size(0) == spans.size(0),
                "chunk_tables must be [C, max_blocks], one row per chunk");
    TORCH_CHECK(decode_rows->dim() == 1 && decode_rows->size(0) == block_tables.size(0) &&
                    decode_rows->size(0) == seq_lens.size(0),
                "decode_rows, block_tables and seq_lens must describe the same decode rows");
    const int64_t* values = spans.data_ptr<int64_t>();
    int64_t covered = decode_rows->size(0);
    for (int64_t c = 0; c < spans.size(0); ++c) {
      const int64_t first = values[3 * c], start = values[3 * c + 1], tokens = values[3 * c + 2];
      TORCH_CHECK(first >= 0 && tokens > 0 && first + tokens <= hidden.size(0) && start >= 0,
                  "chunk ", c, " (rows ", first, " + ", tokens, ") is outside the step's ", hidden.size(0), " rows");
      step.chunks.push_back({first, start, tokens});
      covered += tokens;
    }
    TORCH_CHECK(covered == hidden.size(0), "decode rows and chunks cover ", covered, " rows, the step has ",
                hidden.size(0));
    step.chunk_tables = *chunk_tables;
    step.decode_rows = *decode_rows;
    const at::Tensor lead = at::arange(decode_rows->size(0), decode_rows->options());
    step.decodes_lead = decode_rows->size(0) == 0 || at::equal(*decode_rows, lead);
  }
  const c10::ArrayRef<at::Tensor> all_weights(weights);
  const volatile uint8_t* flag = nullptr;
  if (interrupt.has_value()) {
    TORCH_CHECK(interrupt->scalar_type() == at::kByte && interrupt->numel() >= 1 && interrupt->device().is_cpu(),
                "interrupt must be a uint8 CPU tensor of at least one element");
    flag = interrupt->data_ptr<uint8_t>();
  }
  TORCH_CHECK(start_layer >= 0 && static_cast<size_t>(start_layer) < layers, "start_layer must be in [0, ",
              layers, "), got ", start_layer);
  const bool resumed = residual.has_value();
  TORCH_CHECK((start_layer > 0) == (resumed && residual->numel() > 0),
              "a call resumed past the first layer takes the residual stream its stopped call returned");
  at::Tensor skip;  // the residual stream: undefined until the first layer makes `hidden` it
  if (start_layer > 0) {
    TORCH_CHECK(residual->sizes() == hidden.sizes() && residual->is_contiguous() &&
                    residual->scalar_type() == hidden.scalar_type(),
                "the residual stream must be contiguous and of hidden's shape and dtype");
    skip = *residual;
  }
  for (size_t layer = static_cast<size_t>(start_layer); layer < layers; ++layer) {
    // A resumed call runs at least one layer, so every call makes progress.
    if (flag != nullptr && *flag != 0 && (layer > static_cast<size_t>(start_layer) || !resumed))
      return {hidden, skip.defined() ? skip : at::empty({0}, hidden.options()), static_cast<int64_t>(layer)};
    hidden = decode_layer(hidden, skip, all_weights.slice(per_layer * layer, per_layer), *layout, biases,
                          kNumProjections * layer, kv_caches[layer], step);  // [S, hidden]
  }
  ops::add_rms_norm(hidden, skip, final_norm, eps);
  return {hidden, skip, static_cast<int64_t>(layers)};
}

}  // namespace
}  // namespace tokenmill

namespace tokenmill::ops {
at::Tensor onednn_packed_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, c10::string_view,
                            c10::List<std::optional<c10::Scalar>>, std::optional<c10::string_view>)>();
  return op.call(x, packed, bias, "none", c10::List<std::optional<c10::Scalar>>(), c10::string_view(""));  // [rows, out]
}
}  // namespace tokenmill::ops

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def(
      "llama_decode_stack(Tensor(a!) hidden, Tensor[] weights, Tensor?[] biases, Tensor(b!)[] kv_caches, "
      "Tensor positions, Tensor cos_cache, Tensor sin_cache, Tensor slot_mapping, Tensor block_tables, "
      "Tensor seq_lens, Tensor final_norm, int num_heads, int num_kv_heads, int head_dim, float eps, "
      "float scale, int window, Tensor? interrupt=None, Tensor? chunk_spans=None, Tensor? chunk_tables=None, "
      "Tensor? decode_rows=None, int start_layer=0, Tensor? residual=None, bool row_independent=False) -> "
      "(Tensor, Tensor, int)");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) { m.impl("llama_decode_stack", &tokenmill::llama_decode_stack); }
// The wide stack's weights are oneDNN-packed (mkldnn) tensors, which make the dispatcher pick this key.
TORCH_LIBRARY_IMPL(tokenmill, MkldnnCPU, m) { m.impl("llama_decode_stack", &tokenmill::llama_decode_stack); }
