// The CPU ops of tokenmill/csrc, callable from C++ without the dispatcher (decoder_layer_cpu.cpp and
// gemma_decoder_cpu.cpp chain them). Each has the contract of the torch.ops.tokenmill op of the same
// name, documented in its file: fused_ops_cpu.cpp (norms, rotary, SiLU-and-mul), gemma_ops_cpu.cpp (Gemma's
// norm and gelu-tanh-and-mul), q8_gemm_cpu.cpp (exact 8-bit groups), batch_invariant_gemm_cpu.cpp (the
// bfloat16 row kernel), int4_gemm_cpu.cpp (int4 linear; float32 rows in
// group_gemm_f32_cpu.cpp, a few bfloat16 rows in int4_pairs_cpu.cpp), f32_gemm_cpu.cpp
// (float32 panel linear), paged_attention_cpu.cpp (KV write, decode attention), prefill_attention_cpu.cpp
// and prefill_attention_f32_cpu.cpp (prompt chunks).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

namespace tokenmill::ops {

// Whether this process may use AMX tiles (Linux grants the tile state on request; a VM may refuse).
bool amx_permitted();
// Whether the attention kernels' tile paths run here: built with AMX and AVX512-BF16, and permitted.
bool attention_tiles_available();

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
void add_rms_norm(at::Tensor x, at::Tensor residual, const at::Tensor& weight, double eps);
void rotary_embedding(const at::Tensor& positions, at::Tensor query, at::Tensor key, const at::Tensor& cos_cache,
                      const at::Tensor& sin_cache, int64_t head_dim);
at::Tensor silu_and_mul(const at::Tensor& x);
at::Tensor gemma_rms_norm(const at::Tensor& x, const at::Tensor& scale, double eps);
void add_gemma_rms_norm(at::Tensor x, at::Tensor residual, const at::Tensor& scale, double eps);
at::Tensor gelu_tanh_and_mul(const at::Tensor& x);
at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales);
// Needs AVX512-BF16 (RuntimeError without).
at::Tensor batch_invariant_linear(const at::Tensor& x, const at::Tensor& weight);
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                       const at::Tensor& mins, int64_t method);
// int4_blocked_cpu.cpp: x [rows, in] bfloat16 (1 or more rows) times an int4 weight in the blocked layout
// (layers/int4.py block_int4_layout; float32 scales and `high`: level_sums.py's groups); [rows, blocks * 16]
// bfloat16. Callers check int4_blocked_available(). Steps of 1 to kInt4BlockedMaxRows bfloat16 rows run the
// blocked kernel (the exact values d * q + m), larger ones int4_linear_wide. Float32 rows (4-bit levels
// only) go to int4_linear_blocked_f32 and come back float32; callers check int4_blocked_f32_available().
constexpr int64_t kInt4BlockedMaxRows = 16;  // layers/int4.py INT4_BLOCKED_MAX_ROWS
bool int4_blocked_available();
int64_t int4_blocked_max_rows();
at::Tensor int4_linear_blocked(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                               const at::Tensor& mins, const std::optional<at::Tensor>& high);
// int4_wide_cpu.cpp: bfloat16 rows times the blocked layout with the weights' bfloat16 values
// round_bf16(d * q + m), for steps of many rows; needs int4_blocked_available().
at::Tensor int4_linear_wide(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                            const at::Tensor& mins, const std::optional<at::Tensor>& high);
// silu_and_mul(int4_linear_wide(x, ...)) bit for bit, LlamaMLP's activation in the wide kernel's epilogue: the
// weight's first half of blocks the gates, the second the ups (an even number of blocks, which the caller,
// int4_linear_blocked_silu_and_mul, checked); [rows, blocks * 8] bfloat16.
at::Tensor int4_linear_wide_silu_and_mul(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                                         const at::Tensor& mins, const std::optional<at::Tensor>& high);
// silu_and_mul(int4_linear_blocked(x, ...)) bit for bit, for gate_up weights in the blocked layout: bfloat16
// steps apply the activation per pair of gate and up blocks (of more than kInt4BlockedMaxRows rows, in
// int4_linear_wide_silu_and_mul's epilogue); float32 steps run the two calls.
at::Tensor int4_linear_blocked_silu_and_mul(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                                            const at::Tensor& mins, const std::optional<at::Tensor>& high);
// int4_blocked_f32_cpu.cpp: float32 rows times the blocked layout, the format checked by the caller.
bool int4_blocked_f32_available();
at::Tensor int4_linear_blocked_f32(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                                   const at::Tensor& mins);
// The int4 level-sums kernel (int4_pairs_cpu.cpp): built with AVX512-BF16; 1 to int4_pairs_max_rows() bfloat16
// rows whose format the caller checked.
bool int4_pairs_available();
int64_t int4_pairs_max_rows();
at::Tensor int4_linear_pairs(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                             const at::Tensor& mins, const std::optional<at::Tensor>& high);
// The same kernel for 4-bit levels (5-bit with `high`) with float32 scales and minimums (or float16),
// formats checked (int4_pairs_cpu.cpp; layers/level_sums.py).
at::Tensor level_sums_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                             const at::Tensor& mins, const std::optional<at::Tensor>& high);
// float32 rows times int4 / exact 8-bit groups (group_gemm_f32_cpu.cpp); the formats checked by the caller.
at::Tensor int4_linear_f32(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                           const at::Tensor& mins);
at::Tensor q8_linear_f32(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales);
// q8_blocked_f32_cpu.cpp: float32 rows times exact 8-bit groups in the blocked layout (layers/q8.py
// block_q8_layout), checked here; needs int4_blocked_f32_available() (the same vectors).
at::Tensor q8_linear_blocked_f32(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales);
// x [rows, in] bfloat16 times a oneDNN-packed bfloat16 weight (torch.ops.mkldnn._reorder_linear_weight), plus
// bias: the operator cpu_gemm.packed_linear calls (mkldnn::_linear_pointwise), through the dispatcher.
at::Tensor onednn_packed_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias);
at::Tensor f32_panel_linear(const at::Tensor& x, const at::Tensor& panels, const std::optional<at::Tensor>& bias,
                            int64_t out_features);
void write_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor key_cache, at::Tensor value_cache,
              const at::Tensor& slot_mapping);
at::Tensor paged_attention_decode(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                                  int64_t window, const std::optional<at::Tensor>& sinks = std::nullopt,
                                  bool tiles = true);
at::Tensor paged_prefill_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                                   const at::Tensor& block_table, int64_t start, double scale);
// Whether the float32 prompt-chunk attention (prefill_attention_f32_cpu.cpp) is built: AVX2 without AVX-512.
bool prefill_attention_f32_available();
at::Tensor paged_prefill_attention_f32(const at::Tensor& query, const at::Tensor& key_cache,
                                       const at::Tensor& value_cache, const at::Tensor& block_table, int64_t start,
                                       double scale);

}  // namespace tokenmill::ops
