// The Gemma 3 decoder stack for a step of decodes on CPU, in one call. Each layer (models/gemma3.py):
//
//   x = gemma_rms_norm(hidden, input)
//   q, k, v = linear(x, qkv)                      (views of one [S, (H + 2 KVH) * D] output)
//   q, k = gemma_rms_norm(q, q_norm), gemma_rms_norm(k, k_norm)   (per head, new tensors)
//   rotary(q, k) in place (the layer's rope); write_kv(k, v) at the layer's slots
//   a = gemma_rms_norm(linear(decode_attention(q), o), post_attention)   (the layer's window)
//   a, hidden = add_gemma_rms_norm(a, hidden, pre_feedforward)  (hidden += a in place, a the norm)
//   hidden = hidden + gemma_rms_norm(linear(gelu_tanh_and_mul(linear(a, gate_up)), down), post_feedforward)
// and after the last layer the final norm: gemma_rms_norm(hidden, final).
//
// `linear` is, per projection, the kernel the layer module takes for the step's rows
// (layers/linear.py LinearBase._matmul): int4_linear (its automatic choice), q8_linear (exact 8-bit
// groups), level_sums_linear (a GGUF's exact Q4_K or Q5_0 groups), batch_invariant_linear (a bfloat16
// weight's row kernel, cpu_gemm.bf16_row_linear) or f32_panel_linear (float32 panels), each bias added as the module adds it. The caller
// (layers/gemma_decode_stack.py) picks the kinds and sends only steps every projection takes.
//
// Why: Gemma 3 270M's single-stream decode step spent ~4 ms of ~15 in Python and the dispatcher
// around 18 layers of ~25 calls each. This op chains the same kernels (cpu_ops.h) in the same order
// on the same tensors, so its results are bitwise those of the layer modules and the model's norm.
//
// Contract (tokenmill::gemma_decode_stack), L layers, A attention kinds (Gemma 3: sliding and global):
//   hidden        [S, hidden] bfloat16 or float32, contiguous: the scaled embeddings (updated in place)
//   weights       per layer: the six float32 norm scales (1 + w) [input, post_attention, pre_feedforward,
//                 post_feedforward] [hidden] and [q_norm, k_norm] [head_dim], then each of its
//                 projections qkv, o, gate_up, down as its kind says
//   kinds         [4 L]: per projection 0 int4 (packed, scales, mins: layers/int4.py, or its blocked copy), 1 exact 8-bit
//                 groups (q, scales: layers/q8.py), 2 a bfloat16 weight [out, in] on the row kernel,
//                 3 float32 panels [ceil(out / 16), in, 16] (f32_gemm_cpu.cpp), 4 level sums (packed, scales,
//                 mins, fifth bits or an empty tensor: layers/level_sums.py, level_sums_linear), 5 a oneDNN-packed
//                 bfloat16 weight (the wide stack's, for steps above every small-step kernel's rows)
//   out_features  [4 L]: each projection's outputs
//   biases        [4 L]: each projection's bias or None
//   kv_caches     per layer [2, num_blocks, block_size, kv_heads, head_dim]
//   positions     [S] int64
//   layer_kinds   [L]: the attention kind a of each layer, indexing the per-kind lists below
//   cos_caches, sin_caches  per kind [max_position, rotary_dim / 2] float32: the kind's rope tables
//   slot_mappings, block_tables, seq_lens, windows  per kind: [S] int64 slots, [S, max_blocks] and [S]
//                 int64 (each row one sequence's decode), the attention window (0: none)
//   final_norm    [hidden] float32 (1 + w)
//   interrupt     None or [1] uint8 another process may write (step_control.py): read before each layer
//                 but the first of a resumed call; once nonzero the call stops there
//   start_layer, resumed: a resumed call goes on at start_layer with hidden that layer's input
//   returns       (out, next_layer): next_layer = L and out the final norm's output [S, hidden], or, when
//                 the interrupt stopped the call before layer l, l and that layer's input
#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/add.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

#include "cpu_ops.h"

namespace tokenmill {
namespace {

constexpr int64_t kAutoKernel = 0;  // int4_linear picks its kernel by the row count
constexpr size_t kNumProjections = 4;
constexpr size_t kNumScales = 6;
enum Kind : int64_t { kInt4 = 0, kQ8 = 1, kBf16Rows = 2, kPanels = 3, kSums = 4, kOneDnn = 5 };

int64_t tensors_of(int64_t kind) {
  switch (kind) {
    case kInt4:
      return 3;
    case kSums:
      return 4;
    case kQ8:
      return 2;
    case kBf16Rows:
    case kPanels:
    case kOneDnn:
      return 1;
    default:
      TORCH_CHECK(false, "projection kind must be 0 (int4), 1 (8-bit groups), 2 (bfloat16 rows), 3 (float32 "
                         "panels), 4 (level sums) or 5 (oneDNN-packed), got ", kind);
  }
}

// One projection's weights and how to apply them.
struct Projection {
  int64_t kind;
  c10::ArrayRef<at::Tensor> tensors;
  std::optional<at::Tensor> bias;
  int64_t out_features;

  at::Tensor operator()(const at::Tensor& x) const {
    at::Tensor out;
    switch (kind) {
      case kInt4:
        out = ops::int4_linear(x, tensors[0], tensors[1], tensors[2], kAutoKernel);
        break;
      case kQ8:
        out = ops::q8_linear(x, tensors[0], tensors[1]);
        break;
      case kBf16Rows:
        out = ops::batch_invariant_linear(x, tensors[0]);
        break;
      case kSums:  // an empty fourth tensor: 4-bit levels
        out = ops::level_sums_linear(x, tensors[0], tensors[1], tensors[2],
                                     tensors[3].numel() > 0 ? std::optional<at::Tensor>(tensors[3]) : std::nullopt);
        break;
      case kOneDnn:
        return ops::onednn_packed_linear(x, tensors[0], bias);  // the bias inside, as the module
      default:
        return ops::f32_panel_linear(x, tensors[0], bias, out_features);  // the bias inside, as the module
    }
    return bias.has_value() ? at::add(out, *bias) : out;  // [S, out_features]
  }
};

// One layer's norm scales and projections, sliced from the op's flat lists.
struct GemmaLayer {
  c10::ArrayRef<at::Tensor> scales;  // input, post_attention, pre_feedforward, post_feedforward, q, k
  Projection qkv, o, gate_up, down;
};

// The tensors of one attention kind (a window and a rope) for this step.
struct AttentionKind {
  at::Tensor cos_cache, sin_cache, slot_mapping, block_tables, seq_lens;
  int64_t window;
};

struct StepShape {
  int64_t num_heads, num_kv_heads, head_dim;
  double eps, scale;
};

at::Tensor gemma_layer(at::Tensor hidden, const GemmaLayer& layer, const at::Tensor& kv_cache,
                       const at::Tensor& positions, const AttentionKind& attention, const StepShape& shape) {
  const int64_t rows = hidden.size(0), heads = shape.num_heads, kv_heads = shape.num_kv_heads, dim = shape.head_dim;
  const int64_t q_size = heads * dim, kv_size = kv_heads * dim;
  const double eps = shape.eps;
  const at::Tensor qkv = layer.qkv(ops::gemma_rms_norm(hidden, layer.scales[0], eps));  // [S, (H + 2 KVH) D]
  TORCH_CHECK(qkv.size(1) == q_size + 2 * kv_size, "the qkv projection has ", qkv.size(1), " outputs, expected ",
              q_size + 2 * kv_size);
  at::Tensor q = ops::gemma_rms_norm(qkv.narrow(1, 0, q_size).view({rows, heads, dim}), layer.scales[4], eps);
  at::Tensor k = ops::gemma_rms_norm(qkv.narrow(1, q_size, kv_size).view({rows, kv_heads, dim}), layer.scales[5], eps);
  const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({rows, kv_heads, dim});  // [S, KVH, D]
  ops::rotary_embedding(positions, q.view({rows, q_size}), k.view({rows, kv_size}), attention.cos_cache,
                        attention.sin_cache, dim);  // in place, on flat views as fused_cpu.rotary_embedding
  const at::Tensor key_cache = kv_cache.select(0, 0), value_cache = kv_cache.select(0, 1);
  ops::write_kv(k, v, key_cache, value_cache, attention.slot_mapping);
  const at::Tensor attended = ops::paged_attention_decode(q, key_cache, value_cache, attention.block_tables,
                                                          attention.seq_lens, shape.scale, attention.window);
  at::Tensor mixed = ops::gemma_rms_norm(layer.o(attended.view({rows, q_size})), layer.scales[1], eps);  // [S, hidden]
  ops::add_gemma_rms_norm(mixed, hidden, layer.scales[2], eps);  // hidden += mixed; mixed = its norm
  const at::Tensor fed = layer.down(ops::gelu_tanh_and_mul(layer.gate_up(mixed)));  // [S, hidden]
  return at::add(hidden, ops::gemma_rms_norm(fed, layer.scales[3], eps));           // [S, hidden]
}

std::tuple<at::Tensor, int64_t> gemma_decode_stack(
    at::Tensor hidden, const std::vector<at::Tensor>& weights, c10::IntArrayRef kinds, c10::IntArrayRef out_features,
    const c10::List<std::optional<at::Tensor>>& biases, const std::vector<at::Tensor>& kv_caches,
    const at::Tensor& positions, c10::IntArrayRef layer_kinds, const std::vector<at::Tensor>& cos_caches,
    const std::vector<at::Tensor>& sin_caches, const std::vector<at::Tensor>& slot_mappings,
    const std::vector<at::Tensor>& block_tables, const std::vector<at::Tensor>& seq_lens, c10::IntArrayRef windows,
    const at::Tensor& final_norm, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale,
    const std::optional<at::Tensor>& interrupt, int64_t start_layer, bool resumed) {
  const size_t layers = kv_caches.size();
  TORCH_CHECK(layers > 0, "kv_caches must hold one cache per layer, got none");
  TORCH_CHECK(kinds.size() == kNumProjections * layers && out_features.size() == kinds.size() &&
                  biases.size() == kinds.size(),
              "kinds, out_features and biases must hold ", kNumProjections, " entries per layer (", layers,
              " layers), got ", kinds.size(), ", ", out_features.size(), " and ", biases.size());
  TORCH_CHECK(layer_kinds.size() == layers, "layer_kinds must name one attention kind per layer (", layers,
              "), got ", layer_kinds.size());
  const size_t num_kinds = windows.size();
  TORCH_CHECK(num_kinds > 0 && cos_caches.size() == num_kinds && sin_caches.size() == num_kinds &&
                  slot_mappings.size() == num_kinds && block_tables.size() == num_kinds &&
                  seq_lens.size() == num_kinds,
              "cos_caches, sin_caches, slot_mappings, block_tables, seq_lens and windows must hold one entry per "
              "attention kind");
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous(), "hidden must be contiguous [S, hidden]");
  const int64_t rows = hidden.size(0);
  std::vector<AttentionKind> attention;
  for (size_t a = 0; a < num_kinds; ++a) {
    TORCH_CHECK(block_tables[a].dim() == 2 && block_tables[a].size(0) == rows && seq_lens[a].numel() == rows &&
                    slot_mappings[a].numel() == rows,
                "attention kind ", a, ": block_tables, seq_lens and slot_mapping must have one row per step row (",
                rows, "): every row is a decode");
    attention.push_back(
        {cos_caches[a], sin_caches[a], slot_mappings[a], block_tables[a], seq_lens[a], windows[a]});
  }
  // Slice each layer's tensors out of the flat list.
  std::vector<GemmaLayer> stack;
  const c10::ArrayRef<at::Tensor> all(weights);
  size_t next = 0;
  for (size_t l = 0; l < layers; ++l) {
    TORCH_CHECK(layer_kinds[l] >= 0 && static_cast<size_t>(layer_kinds[l]) < num_kinds, "layer ", l,
                " names attention kind ", layer_kinds[l], " of ", num_kinds);
    TORCH_CHECK(kv_caches[l].dim() == 5 && kv_caches[l].size(0) == 2,
                "each kv cache must be [2, blocks, block_size, heads, D]");
    TORCH_CHECK(next + kNumScales <= all.size(), "weights end inside layer ", l, "'s norm scales");
    GemmaLayer layer{all.slice(next, kNumScales), {}, {}, {}, {}};
    next += kNumScales;
    Projection* projections[kNumProjections] = {&layer.qkv, &layer.o, &layer.gate_up, &layer.down};
    for (size_t p = 0; p < kNumProjections; ++p) {
      const size_t index = kNumProjections * l + p;
      const int64_t kind = kinds[index];
      const auto count = static_cast<size_t>(tensors_of(kind));
      TORCH_CHECK(next + count <= all.size(), "weights end inside layer ", l, "'s projection ", p);
      TORCH_CHECK(kind != kPanels || hidden.scalar_type() == at::kFloat,
                  "float32 panels go with float32 hidden states");
      TORCH_CHECK(kind != kBf16Rows || hidden.scalar_type() == at::kBFloat16,
                  "the bfloat16 row kernel goes with bfloat16 hidden states");
      TORCH_CHECK((kind == kOneDnn) == all[next].is_mkldnn(),
                  "oneDNN-packed weights (mkldnn tensors) are kind 5, and kind 5 takes them only");
      TORCH_CHECK(kind != kOneDnn || hidden.scalar_type() == at::kBFloat16,
                  "oneDNN-packed weights go with bfloat16 hidden states");
      *projections[p] = Projection{kind, all.slice(next, count), biases.get(index), out_features[index]};
      next += count;
    }
    stack.push_back(layer);
  }
  TORCH_CHECK(next == all.size(), "weights hold ", all.size() - next, " tensors past the last layer's");
  const volatile uint8_t* flag = nullptr;
  if (interrupt.has_value()) {
    TORCH_CHECK(interrupt->scalar_type() == at::kByte && interrupt->numel() >= 1 && interrupt->device().is_cpu(),
                "interrupt must be a uint8 CPU tensor of at least one element");
    flag = interrupt->data_ptr<uint8_t>();
  }
  TORCH_CHECK(start_layer >= 0 && static_cast<size_t>(start_layer) < layers, "start_layer must be in [0, ",
              layers, "), got ", start_layer);
  TORCH_CHECK(start_layer == 0 || resumed, "only a resumed call starts past the first layer");
  const StepShape shape{num_heads, num_kv_heads, head_dim, eps, scale};
  for (size_t l = static_cast<size_t>(start_layer); l < layers; ++l) {
    // A resumed call runs at least one layer, so every call makes progress.
    if (flag != nullptr && *flag != 0 && (l > static_cast<size_t>(start_layer) || !resumed))
      return {hidden, static_cast<int64_t>(l)};
    hidden = gemma_layer(hidden, stack[l], kv_caches[l], positions, attention[layer_kinds[l]], shape);
  }
  return {ops::gemma_rms_norm(hidden, final_norm, eps), static_cast<int64_t>(layers)};
}

}  // namespace
}  // namespace tokenmill

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def(
      "gemma_decode_stack(Tensor(a!) hidden, Tensor[] weights, int[] kinds, int[] out_features, Tensor?[] biases, "
      "Tensor(b!)[] kv_caches, Tensor positions, int[] layer_kinds, Tensor[] cos_caches, Tensor[] sin_caches, "
      "Tensor[] slot_mappings, Tensor[] block_tables, Tensor[] seq_lens, int[] windows, Tensor final_norm, "
      "int num_heads, int num_kv_heads, int head_dim, float eps, float scale, Tensor? interrupt=None, "
      "int start_layer=0, bool resumed=False) -> (Tensor, int)");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) { m.impl("gemma_decode_stack", &tokenmill::gemma_decode_stack); }
// The wide stack's weights are oneDNN-packed (mkldnn) tensors, which make the dispatcher pick this key.
TORCH_LIBRARY_IMPL(tokenmill, MkldnnCPU, m) { m.impl("gemma_decode_stack", &tokenmill::gemma_decode_stack); }
