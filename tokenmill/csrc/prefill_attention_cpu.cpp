// Prompt-chunk attention over the paged cache, on AMX tiles or AVX512-BF16 vectors: one sequence's
// chunk of new tokens attending to everything before it and causally within itself, reading keys and
// values straight from the cache blocks (no gather, no mask tensor).
//
// Contract (tokenmill::paged_prefill_attention):
//   query        [T, num_heads, head_dim] bfloat16, head_dim 64 or 128, head_dim contiguous: the
//                chunk's tokens in order
//   key_cache    [num_blocks, 16, kv_heads, head_dim] bfloat16, contiguous, this step's keys stored
//   value_cache  as key_cache
//   block_table  [max_blocks] int64: the sequence's blocks; every block below ceil((start + T) / 16)
//                must be a valid id
//   start        the position of the chunk's first token: token t attends to positions [0, start + t]
//   returns      [T, num_heads, head_dim] bfloat16: softmax(q . K^T * scale) . V per query head, query
//                head h reading KV head h / (num_heads / kv_heads)
//   tiles        use AMX tile products where the CPU and the OS allow them; False (or no AMX): the
//                same products on AVX512-BF16 vectors (tests compare both)
//   Needs a build with AVX512-BF16 (prefill_attention_available()); raises otherwise.
//
// Why: a chunk over a cached prefix (the next turn of a conversation, a question after a shared
// system prompt) went through a gather of its keys and values into contiguous tensors and SDPA under
// an additive mask: ~0.8 ms a layer for 66 tokens over 1,090 positions with SmolLM2's heads.
//
// How: per KV head, the keys are laid out once per call as the "B" operands of S = Q K^T (per block
// of 16 positions and 32 dimensions, a 16 x 16 transpose of 32-bit dimension pairs) and the values as
// those of O = P V (per 32 positions and 16 dimensions, pairs of value rows interleaved). A task is a
// KV head and 16 query rows (the chunk's rows for that head's query heads, token-major), whose queries
// are the "A" operand. Per 64 positions: four score tiles, an online softmax per row (float32; the
// probabilities rounded to bfloat16 as the "A" operand of P V, as flash attention kernels do; see
// attend_rows for its lazy rescaling), and the P V tiles accumulated onto the rows' float32 outputs.
// Positions past a tile's last row's limit are never computed; the causal limits inside are masked
// per row, in the steps that reach them. Without AMX the vector path multiplies the same operands
// with VDPBF16PS: a key tile's row (one dimension pair of 16 positions) against each row's query pair
// broadcast, and a value tile's row (two positions of 16 dimensions) against each row's probability
// pair broadcast; sums in float32 as the tile products do, in another order.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu_ops.h"
#include "vec16.h"

#if defined(TOKENMILL_AVX512) && defined(__AVX512BF16__)
#define TOKENMILL_PREFILL_KERNEL 1
#include "tile_layout.h"
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define TOKENMILL_PREFILL_AMX 1
#include "amx_tiles.h"
#endif
#endif

namespace tokenmill {
namespace {

bool prefill_available() {
#ifdef TOKENMILL_PREFILL_KERNEL
  return true;
#else
  return false;
#endif
}

#ifdef TOKENMILL_PREFILL_KERNEL
using namespace vec;
using tiles::kTileRows;

constexpr int kStep = 64;      // positions per online-softmax step: four score tiles
constexpr int64_t kTileWords = tiles::kTileBytes / 4;  // one tile in 32-bit words

struct Problem {
  const c10::BFloat16* query;
  const c10::BFloat16* key_cache;
  const c10::BFloat16* value_cache;
  const int64_t* table;
  c10::BFloat16* out;
  int64_t q_stride_token, q_stride_head;
  int64_t stride_block, stride_slot, stride_head;  // of both caches (contiguous, same shape)
  int64_t num_tokens, num_heads, kv_heads, group, head_dim, start, total;
  float scale;
  int64_t halves;        // head_dim / 32
  int64_t blocks;        // ceil(total / 16)
  int64_t value_steps;   // ceil(total / 32)
  uint32_t* keys;        // [kv_heads][blocks][halves] tiles
  uint32_t* values;      // [kv_heads][value_steps][head_dim / 16] tiles
};

uint32_t* key_tile(const Problem& p, int64_t kv, int64_t block, int64_t half) {
  return p.keys + ((kv * p.blocks + block) * p.halves + half) * kTileWords;
}
uint32_t* value_tile(const Problem& p, int64_t kv, int64_t step, int64_t chunk) {
  return p.values + ((kv * p.value_steps + step) * (p.head_dim / 16) + chunk) * kTileWords;
}

// Block `block` of KV head `kv` as "B" tiles of Q K^T: word [pair][position] = dimensions 2 pair and
// 2 pair + 1 of that position's key (32 dimensions a tile).
void lay_out_keys(const Problem& p, int64_t kv, int64_t block) {
  const c10::BFloat16* rows = p.key_cache + p.table[block] * p.stride_block + kv * p.stride_head;
  for (int64_t half = 0; half < p.halves; ++half) {
    __m512i r[kTileRows];
    for (int i = 0; i < kTileRows; ++i) r[i] = _mm512_loadu_si512(rows + i * p.stride_slot + half * 32);
    tiles::transpose16x16(r);
    uint32_t* tile = key_tile(p, kv, block, half);
    for (int i = 0; i < kTileRows; ++i) _mm512_store_si512(tile + i * kTileRows, r[i]);
  }
}

// Positions [32 step, 32 step + 32) of KV head `kv`'s values as "B" tiles of P V: row r of the tile
// of dimensions [16 c, 16 c + 16) holds positions 2r and 2r + 1 interleaved. Positions past the
// sequence are zeros (their probabilities are zero, and 0 * a stale NaN would not be).
void lay_out_values(const Problem& p, int64_t kv, int64_t step) {
  for (int r = 0; r < kTileRows; ++r) {
    const int64_t p0 = step * 32 + 2 * r, p1 = p0 + 1;
    const auto row = [&](int64_t pos) -> const c10::BFloat16* {
      if (pos >= p.total) return nullptr;
      return p.value_cache + p.table[pos / kTileRows] * p.stride_block + (pos % kTileRows) * p.stride_slot +
             kv * p.stride_head;
    };
    tiles::interleave_value_rows(row(p0), row(p1), p.halves, r, reinterpret_cast<char*>(value_tile(p, kv, step, 0)));
  }
}

// The vector path's products (AVX512-BF16 on the tile path's operands), for kRows query rows.
inline __m512bh pair_of(const c10::BFloat16* row, int64_t pair) {
  uint32_t word;
  std::memcpy(&word, row + 2 * pair, sizeof(word));
  return (__m512bh)_mm512_set1_epi32(static_cast<int>(word));
}

// scores[i][j] = q[i] . key of position j, for the 16 positions of one block: `keys` is the block's
// first key tile (the `halves` tiles follow one another, so dimension pair k's 16 words sit at
// keys + 16 k).
template <int kRows>
void score_block(const c10::BFloat16 (*q)[128], const uint32_t* keys, int64_t halves, float (*scores)[kTileRows]) {
  __m512 acc[kRows];
  for (int i = 0; i < kRows; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t pair = 0; pair < halves * 16; ++pair) {
    const __m512bh k = (__m512bh)_mm512_load_si512(keys + pair * kTileRows);
    for (int i = 0; i < kRows; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], pair_of(q[i], pair), k);
  }
  for (int i = 0; i < kRows; ++i) _mm512_store_ps(scores[i], acc[i]);
}

// acc[i][16 c .. 16 c + 16) += sum over the `steps` steps of 32 positions of probs[s][i] . V, for every
// 16-dimension chunk c: `values` is the first step's first value tile, a step's tiles `step_words`
// after the previous step's, chunk c's kTileWords after chunk c - 1's; row r of a tile pairs positions
// 2 r and 2 r + 1.
template <int kRows>
void accumulate_values(const c10::BFloat16 (*probs)[kTileRows][32], const uint32_t* values, int64_t step_words,
                       int steps, int64_t chunks, float (*acc)[128]) {
  for (int64_t c = 0; c < chunks; ++c) {
    __m512 o[kRows];
    for (int i = 0; i < kRows; ++i) o[i] = _mm512_load_ps(acc[i] + c * kLanes);
    for (int s = 0; s < steps; ++s) {
      const uint32_t* tile = values + s * step_words + c * kTileWords;
      for (int r = 0; r < kTileRows; ++r) {
        const __m512bh v = (__m512bh)_mm512_load_si512(tile + r * kTileRows);
        for (int i = 0; i < kRows; ++i) o[i] = _mm512_dpbf16_ps(o[i], pair_of(probs[s][i], r), v);
      }
    }
    for (int i = 0; i < kRows; ++i) _mm512_store_ps(acc[i] + c * kLanes, o[i]);
  }
}

// The 16 query rows [row0, row0 + 16) of KV head `kv`: row r is token r / group, query head
// kv * group + r % group. kAmx: tile products (tiles configured by the caller); else vectors, for the
// first kRows rows (the valid ones; the rest are padding).
//
// The softmax keeps, per row, its running maximum `ref` (in raw score units) and weighs position j
// by 2^((s_j - ref) * scale * log2 e) in float32 (one multiply-subtract and exp2), rounded to
// bfloat16 for P V. Whether a step raises a row's maximum is one comparison per vector; only then
// are the maximum found, and the row's sums and outputs rescaled (after the first steps, rarely).
// The maximum weight is exactly 1: letting the reference lag (rescaling only on large jumps) made
// the dominant weight a rounded bfloat16 and doubled the largest errors. The running sums stay
// vectors (one horizontal add per row at the end), and the outputs accumulate in the P V tiles
// themselves, loaded from and stored to the rows' float32 outputs.
constexpr float kLog2E = 1.44269504088896341f;

template <bool kAmx, int kRows>
void attend_rows(const Problem& p, int64_t kv, int64_t row0) {
  const int64_t rows_total = p.num_tokens * p.group;
  const int valid = static_cast<int>(std::min<int64_t>(kTileRows, rows_total - row0));
  alignas(64) c10::BFloat16 q[kTileRows][128];           // "A" operands of Q K^T, per 32 dimensions
  alignas(64) float scores[4][kTileRows][kTileRows];     // S per 16 positions: [row][position]
  alignas(64) c10::BFloat16 probs[2][kTileRows][32];     // "A" operands of P V, per 32 positions
  alignas(64) float acc[kTileRows][128];                 // unnormalised outputs
  alignas(64) float sums[kTileRows][kTileRows];          // per row: the weights summed, lane-wise
  float ref[kTileRows];
  int64_t limit[kTileRows];  // last position each row attends to
  for (int i = 0; i < kTileRows; ++i) {
    if (i < valid) {
      const int64_t row = row0 + i, token = row / p.group, head = kv * p.group + row % p.group;
      std::memcpy(q[i], p.query + token * p.q_stride_token + head * p.q_stride_head,
                  p.head_dim * sizeof(c10::BFloat16));
      limit[i] = p.start + token;
    } else {
      std::memset(q[i], 0, p.head_dim * sizeof(c10::BFloat16));
      limit[i] = -1;
      // Padding rows weigh nothing, ever.
      for (int j = 0; j < 2; ++j) _mm512_store_si512(probs[j][i], _mm512_setzero_si512());
    }
    std::fill(acc[i], acc[i] + p.head_dim, 0.0f);
    _mm512_store_ps(sums[i], _mm512_setzero_ps());
    ref[i] = kNegInf;
  }
  const float log2_scale = p.scale * kLog2E;
  const int64_t end = limit[valid - 1] + 1;   // rows are token-major: the last valid row sees furthest
  const int64_t q_stride = 128 * static_cast<int64_t>(sizeof(c10::BFloat16));
  const int64_t acc_stride = 128 * static_cast<int64_t>(sizeof(float));
  const int64_t chunks = p.head_dim / 16;
#ifdef TOKENMILL_PREFILL_AMX
  if (kAmx && p.halves == 2) {
    _tile_loadd(6, &q[0][0], q_stride);
    _tile_loadd(7, &q[0][32], q_stride);
  }
#endif
  for (int64_t pos0 = 0; pos0 < end; pos0 += kStep) {
    const int tiles = static_cast<int>(std::min<int64_t>(4, (end - pos0 + kTileRows - 1) / kTileRows));
    const int64_t block0 = pos0 / kTileRows;
    if constexpr (!kAmx) {
      for (int t = 0; t < tiles; ++t) score_block<kRows>(q, key_tile(p, kv, block0 + t, 0), p.halves, scores[t]);
    }
#ifdef TOKENMILL_PREFILL_AMX
    if constexpr (kAmx) {
    // (The tile intrinsics take literal tile numbers, hence a macro.)
    // head_dim 64: the queries stay in tiles 6 and 7 for the whole task; 128: reloaded per tile.
#define TOKENMILL_SCORE_TILE(T)                                                    \
  {                                                                                \
    _tile_zero(T);                                                                 \
    if (p.halves == 2) {                                                           \
      _tile_loadd(5, key_tile(p, kv, block0 + (T), 0), 64);                        \
      _tile_dpbf16ps(T, 6, 5);                                                     \
      _tile_loadd(4, key_tile(p, kv, block0 + (T), 1), 64);                        \
      _tile_dpbf16ps(T, 7, 4);                                                     \
    } else {                                                                       \
      for (int64_t half = 0; half < p.halves; ++half) {                            \
        _tile_loadd(4, &q[0][half * 32], q_stride);                                \
        _tile_loadd(5, key_tile(p, kv, block0 + (T), half), 64);                   \
        _tile_dpbf16ps(T, 4, 5);                                                   \
      }                                                                            \
    }                                                                              \
    _tile_stored(T, scores[T], 64);                                                \
  }
    TOKENMILL_SCORE_TILE(0)
    if (tiles > 1) TOKENMILL_SCORE_TILE(1)
    if (tiles > 2) TOKENMILL_SCORE_TILE(2)
    if (tiles > 3) TOKENMILL_SCORE_TILE(3)
#undef TOKENMILL_SCORE_TILE
    }
#endif
    // Only steps reaching past the first row's limit (the smallest) need a causal mask.
    const bool masked = pos0 + tiles * kTileRows > limit[0] + 1;
    uint32_t rescaled = 0;  // rows whose reference moved this step
    alignas(64) float alpha[kTileRows];
    for (int i = 0; i < valid; ++i) {
      __m512 s[4];
      __mmask16 allowed[4];
      for (int j = 0; j < 4; ++j) {
        // Lanes past the row's limit (or past this step's tiles) are -inf: no weight.
        const int64_t n = j < tiles ? std::clamp<int64_t>(limit[i] - pos0 - j * kTileRows + 1, 0, kLanes) : 0;
        allowed[j] = masked ? lane_mask(static_cast<int>(n)) : (j < tiles ? __mmask16(0xFFFF) : __mmask16(0));
        s[j] = _mm512_mask_load_ps(_mm512_set1_ps(kNegInf), allowed[j], scores[j][i]);
      }
      const __m512 above = _mm512_set1_ps(ref[i]);
      const __mmask16 over = _mm512_cmp_ps_mask(s[0], above, _CMP_GT_OQ) | _mm512_cmp_ps_mask(s[1], above, _CMP_GT_OQ) |
                             _mm512_cmp_ps_mask(s[2], above, _CMP_GT_OQ) | _mm512_cmp_ps_mask(s[3], above, _CMP_GT_OQ);
      if (over != 0) {
        const float best = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(s[0], s[1]), _mm512_max_ps(s[2], s[3])));
        alpha[i] = ref[i] == kNegInf ? 0.0f : std::exp2((ref[i] - best) * log2_scale);
        ref[i] = best;
        rescaled |= 1u << i;
        _mm512_store_ps(sums[i], _mm512_mul_ps(_mm512_load_ps(sums[i]), _mm512_set1_ps(alpha[i])));
      }
      // Every valid row allows position 0, so ref is finite from the first step on.
      const __m512 shift = _mm512_set1_ps(ref[i] * log2_scale), factor = _mm512_set1_ps(log2_scale);
      __m512 w[4];
      for (int j = 0; j < 4; ++j)
        w[j] = _mm512_maskz_mov_ps(allowed[j], exp2(Vec{_mm512_fmsub_ps(s[j], factor, shift)}).v);
      _mm512_store_ps(sums[i], _mm512_add_ps(_mm512_load_ps(sums[i]),
                                             _mm512_add_ps(_mm512_add_ps(w[0], w[1]), _mm512_add_ps(w[2], w[3]))));
      for (int j = 0; j < 2; ++j)
        _mm512_store_si512(probs[j][i], (__m512i)_mm512_cvtne2ps_pbh(w[2 * j + 1], w[2 * j]));
    }
    for (uint32_t left = rescaled; left != 0; left &= left - 1) {
      const int i = __builtin_ctz(left);
      const __m512 a = _mm512_set1_ps(alpha[i]);
      for (int64_t d = 0; d < p.head_dim; d += kLanes) _mm512_store_ps(acc[i] + d, _mm512_mul_ps(_mm512_load_ps(acc[i] + d), a));
    }
    const int steps = (tiles + 1) / 2;  // of 32 positions
    const int64_t value_step0 = pos0 / 32;
    if constexpr (!kAmx) {
      accumulate_values<kRows>(probs, value_tile(p, kv, value_step0, 0), chunks * kTileWords, steps, chunks, acc);
    }
#ifdef TOKENMILL_PREFILL_AMX
    if constexpr (kAmx) {
      for (int64_t c0 = 0; c0 < chunks; c0 += 4)
        amx::accumulate_values(reinterpret_cast<const char*>(probs),
                               reinterpret_cast<const char*>(value_tile(p, kv, value_step0, c0)),
                               chunks * amx::kTileBytes, steps, &acc[0][c0 * kLanes], acc_stride);
    }
#endif
  }
  for (int i = 0; i < valid; ++i) {
    const int64_t row = row0 + i, token = row / p.group, head = kv * p.group + row % p.group;
    const float total = _mm512_reduce_add_ps(_mm512_load_ps(sums[i]));
    const float inv = total > 0.0f ? 1.0f / total : 0.0f;
    c10::BFloat16* o = p.out + (token * p.num_heads + head) * p.head_dim;
    for (int64_t d = 0; d < p.head_dim; ++d) o[d] = static_cast<c10::BFloat16>(acc[i][d] * inv);
  }
}

// Every row tile of the chunk (tasks of a KV head and 16 query rows), on the threads.
void attend_all(const Problem& p, bool amx) {
  const int64_t rows_total = p.num_tokens * p.group;
  const int64_t row_tiles = (rows_total + kTileRows - 1) / kTileRows;
  // Dynamic: a causal chunk's later rows see more positions, so equal shares of tasks are not equal work.
  const int64_t num_tasks = p.kv_heads * row_tiles;
  const int threads = static_cast<int>(std::min<int64_t>(std::max(1, at::get_num_threads()), num_tasks));
#ifdef TOKENMILL_PREFILL_AMX
  if (amx) {
#pragma omp parallel num_threads(threads)
    {
      amx::configure_tiles();
#pragma omp for schedule(dynamic, 1)
      for (int64_t task = 0; task < num_tasks; ++task)
        attend_rows<true, kTileRows>(p, task % p.kv_heads, task / p.kv_heads * kTileRows);
      _tile_release();
    }
    return;
  }
#endif
  (void)amx;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
  for (int64_t task = 0; task < num_tasks; ++task) {
    const int64_t kv = task % p.kv_heads, row0 = task / p.kv_heads * kTileRows;
    // Vector work grows with the rows: a tile with few valid rows (a short chunk) computes only those.
    const int64_t valid = std::min<int64_t>(kTileRows, rows_total - row0);
    if (valid <= 4)
      attend_rows<false, 4>(p, kv, row0);
    else if (valid <= 8)
      attend_rows<false, 8>(p, kv, row0);
    else
      attend_rows<false, kTileRows>(p, kv, row0);
  }
}
#endif  // TOKENMILL_PREFILL_KERNEL

at::Tensor paged_prefill_attention(const at::Tensor& query, const at::Tensor& key_cache,
                                   const at::Tensor& value_cache, const at::Tensor& block_table, int64_t start,
                                   double scale, bool tiles) {
  if (query.scalar_type() == at::kFloat)  // prefill_attention_f32_cpu.cpp (AVX2 builds)
    return ops::paged_prefill_attention_f32(query, key_cache, value_cache, block_table, start, scale);
  TORCH_CHECK(prefill_available(), "paged_prefill_attention needs a CPU with AVX512-BF16 (or AMX)");
  TORCH_CHECK(query.dim() == 3 && query.scalar_type() == at::kBFloat16 && query.stride(2) == 1,
              "query must be bfloat16 [T, num_heads, head_dim] with head_dim contiguous");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes() && key_cache.is_contiguous() &&
                  value_cache.is_contiguous() && key_cache.scalar_type() == at::kBFloat16 &&
                  value_cache.scalar_type() == at::kBFloat16,
              "key_cache/value_cache must be contiguous bfloat16 [num_blocks, 16, kv_heads, head_dim]");
  const int64_t num_tokens = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t kv_heads = key_cache.size(2);
  TORCH_CHECK(key_cache.size(1) == 16, "the caches' blocks must hold 16 slots, got ", key_cache.size(1));
  TORCH_CHECK(head_dim == 64 || head_dim == 128, "head_dim must be 64 or 128, got ", head_dim);
  TORCH_CHECK(key_cache.size(3) == head_dim, "cache head_dim ", key_cache.size(3), " != query head_dim ", head_dim);
  TORCH_CHECK(kv_heads > 0 && num_heads % kv_heads == 0, "num_heads must be a multiple of kv_heads");
  TORCH_CHECK(block_table.dim() == 1 && block_table.scalar_type() == at::kLong, "block_table must be int64 [max_blocks]");
  TORCH_CHECK(start >= 0, "start must be >= 0, got ", start);
  const int64_t total = start + num_tokens;
  TORCH_CHECK(total <= block_table.size(0) * 16, "start + T = ", total, " exceeds the block table");
  at::Tensor out = at::empty({num_tokens, num_heads, head_dim}, query.options().memory_format(at::MemoryFormat::Contiguous));
  if (num_tokens == 0) return out;
#ifdef TOKENMILL_PREFILL_KERNEL
  const at::Tensor table = block_table.contiguous();
  Problem p{};
  p.query = query.data_ptr<c10::BFloat16>();
  p.key_cache = key_cache.data_ptr<c10::BFloat16>();
  p.value_cache = value_cache.data_ptr<c10::BFloat16>();
  p.table = table.data_ptr<int64_t>();
  p.out = out.data_ptr<c10::BFloat16>();
  p.q_stride_token = query.stride(0);
  p.q_stride_head = query.stride(1);
  p.stride_block = key_cache.stride(0);
  p.stride_slot = key_cache.stride(1);
  p.stride_head = key_cache.stride(2);
  p.num_tokens = num_tokens;
  p.num_heads = num_heads;
  p.kv_heads = kv_heads;
  p.group = num_heads / kv_heads;
  p.head_dim = head_dim;
  p.start = start;
  p.total = total;
  p.scale = static_cast<float>(scale);
  p.halves = head_dim / 32;
  p.blocks = (total + 15) / 16;
  p.value_steps = (total + 31) / 32;
  const int64_t num_blocks = key_cache.size(0);
  for (int64_t b = 0; b < p.blocks; ++b)
    TORCH_CHECK(p.table[b] >= 0 && p.table[b] < num_blocks, "block id ", p.table[b], " outside the cache");
  at::Tensor keys = at::empty({kv_heads * p.blocks * p.halves * kTileWords + 16}, query.options().dtype(at::kInt));
  at::Tensor values =
      at::empty({kv_heads * p.value_steps * (head_dim / 16) * kTileWords + 16}, query.options().dtype(at::kInt));
  const auto aligned = [](at::Tensor& t) {
    return reinterpret_cast<uint32_t*>((reinterpret_cast<uintptr_t>(t.data_ptr<int32_t>()) + 63) & ~uintptr_t(63));
  };
  p.keys = aligned(keys);
  p.values = aligned(values);
  const int64_t layouts = kv_heads * (p.blocks + p.value_steps);
  at::parallel_for(0, layouts, 8, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t kv = i / (p.blocks + p.value_steps), k = i % (p.blocks + p.value_steps);
      if (k < p.blocks)
        lay_out_keys(p, kv, k);
      else
        lay_out_values(p, kv, k - p.blocks);
    }
  });
  attend_all(p, tiles && ops::attention_tiles_available());
#else
  (void)tiles;
#endif
  return out;
}

}  // namespace
}  // namespace tokenmill

namespace tokenmill::ops {
bool prefill_attention_available() { return ::tokenmill::prefill_available(); }
at::Tensor paged_prefill_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                                   const at::Tensor& block_table, int64_t start, double scale) {
  return ::tokenmill::paged_prefill_attention(query, key_cache, value_cache, block_table, start, scale,
                                              /*tiles=*/true);
}
}  // namespace tokenmill::ops

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def(
      "paged_prefill_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_table, int start, "
      "float scale, bool tiles=True) -> Tensor");
  m.def("prefill_attention_available() -> bool", &tokenmill::ops::prefill_attention_available);
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) { m.impl("paged_prefill_attention", &tokenmill::paged_prefill_attention); }
