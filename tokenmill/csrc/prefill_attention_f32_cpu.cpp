// Prompt-chunk attention over the paged cache in float32 on AVX2 vectors, for CPUs without AVX-512
// (such as Zen 3, where `--dtype auto` is float32): one sequence's chunk of new tokens attending to
// everything before it and causally within itself, reading the cache blocks in place (no gather, no
// mask tensor). prefill_attention_cpu.cpp does the same for bfloat16 with AVX512-BF16 or AMX.
//
// Contract (tokenmill::paged_prefill_attention with float32 tensors; ops::paged_prefill_attention_f32):
//   query        [T, num_heads, head_dim] float32, head_dim a multiple of 8 up to 256, head_dim
//                contiguous: the chunk's tokens in order
//   key_cache    [num_blocks, block_size, kv_heads, head_dim] float32, bfloat16 or float16 (a 16-bit
//                cache: its elements widened to float32 as they are read), contiguous, this step's keys
//                stored
//   value_cache  as key_cache
//   block_table  [max_blocks] int64: the sequence's blocks; every block below
//                ceil((start + T) / block_size) must be a valid id
//   start        the position of the chunk's first token: token t attends to positions [0, start + t]
//   returns      [T, num_heads, head_dim] float32: softmax(q . K^T * scale) . V per query head, query
//                head h reading KV head h / (num_heads / kv_heads)
//   Needs a build for AVX2 and FMA without AVX-512 (prefill_attention_f32_available()); raises otherwise.
//
// Why: such a chunk went through a gather of its keys and values and SDPA under an additive mask, at
// about 75 GFLOP/s on a 2-core Zen 3 (66 tokens over 1,090 positions with SmolLM2's heads: 2.2 ms a
// layer).
//
// How: the rows of the work are query heads of one token: per KV head, the chunk's tokens times that
// head's query heads, token-major. The keys are transposed once per call into float32 [step][dim][64
// positions], so that per 64 positions the scores of a tile of six rows come from one pass over them
// with positions in the vector lanes (S = Q K^T, twelve accumulators); the values are read in place
// from the cache rows (O += P V, tiles of four rows and sixteen dimensions). A task is a KV head and 48
// rows; it stops at the last position its last row attends, and positions past a row's own limit get
// probability 0. The online softmax runs per row in float32 with the vector exp of vec16.h. Each score
// is one in-order sum over the head's dimensions and each output one in-order sum over the positions,
// so a row's result does not depend on the chunk around it or on the threads.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "cpu_ops.h"
#include "online_softmax.h"
#include "vec16.h"

#ifdef TOKENMILL_AVX2
#define TOKENMILL_PREFILL_F32 1
#endif

namespace tokenmill {
namespace {

#ifdef TOKENMILL_PREFILL_F32
using namespace vec;

constexpr int64_t kStep = 64;      // positions per online-softmax step
constexpr int kScoreRows = 6;      // rows per score tile: 12 accumulators, 2 key vectors, a broadcast
constexpr int kValueRows = 4;      // rows per value tile: 8 accumulators (GCC spills some of 12 there)
constexpr int64_t kTaskRows = 48;  // rows per task: eight score tiles, twelve value tiles
constexpr int64_t kMaxDim = 256;

// The cache's 8 elements at p as float32.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  return avx2::widen_bf16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load8(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

template <typename cache_t>
struct Problem {
  const float* query;
  const cache_t* key_cache;
  const cache_t* value_cache;
  const int64_t* table;
  float* out;
  float* keys;  // [kv_heads][steps][head_dim][kStep]: the keys transposed, zero past the last position
  int64_t q_stride_token, q_stride_head;
  int64_t stride_block, stride_slot, stride_head;
  int64_t block_size, num_tokens, num_heads, kv_heads, group, head_dim, start, total, steps;
  float scale;
};

// KV head kv's key (or value) row of position pos.
template <typename cache_t>
inline const cache_t* cache_row(const Problem<cache_t>& p, const cache_t* cache, int64_t pos, int64_t kv) {
  return cache + p.table[pos / p.block_size] * p.stride_block + (pos % p.block_size) * p.stride_slot +
         kv * p.stride_head;
}

template <typename cache_t>
inline float* keys_of(const Problem<cache_t>& p, int64_t kv, int64_t step) {
  return p.keys + (kv * p.steps + step) * p.head_dim * kStep;
}

// rows[0..8) transposed in place: rows[j][i] becomes rows[i][j].
inline void transpose8(__m256 (&r)[8]) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  r[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
  r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
  r[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
  r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
  r[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
  r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
  r[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
  r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

// The keys of KV head kv at positions [step * kStep, + kStep) as [head_dim][kStep], zero past p.total.
template <typename cache_t>
void lay_out_keys(const Problem<cache_t>& p, int64_t kv, int64_t step) {
  float* kt = keys_of(p, kv, step);
  const int64_t p0 = step * kStep;
  for (int64_t i0 = 0; i0 < kStep; i0 += 8) {
    const cache_t* rows[8];
    for (int j = 0; j < 8; ++j)
      rows[j] = p0 + i0 + j < p.total ? cache_row(p, p.key_cache, p0 + i0 + j, kv) : nullptr;
    for (int64_t d0 = 0; d0 < p.head_dim; d0 += 8) {
      __m256 r[8];
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) r[j] = rows[j] != nullptr ? load8(rows[j] + d0) : _mm256_setzero_ps();
      transpose8(r);
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) _mm256_storeu_ps(kt + (d0 + j) * kStep + i0, r[j]);
    }
  }
}

// One task's rows, each at a fixed stride in the task's scratch: its query copied (kMaxDim floats),
// its scores, then probabilities, of the current step (kStep), its output accumulator (kMaxDim), and
// its softmax state.
struct Rows {
  int64_t count = 0;
  float* q;      // [kTaskRows][kMaxDim]
  float* probs;  // [kTaskRows][kStep]
  float* acc;    // [kTaskRows][kMaxDim]
  int64_t limit[kTaskRows];  // the row attends to positions [0, limit)
  float max[kTaskRows], sum[kTaskRows], alpha[kTaskRows];
};

// scores[r][i0 + i] = scale * sum over d in order of q[r][d] * kt[d][i0 + i], for R rows (q and
// scores pointing at the tile's first row) and 8 * W positions.
template <int R, int W>
inline void score_tile(const float* q, const float* kt, int64_t head_dim, int64_t i0, float scale, float* scores) {
  __m256 acc[R][W];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int w = 0; w < W; ++w) acc[r][w] = _mm256_setzero_ps();
  for (int64_t d = 0; d < head_dim; ++d) {
    __m256 k[W];
#pragma GCC unroll 8
    for (int w = 0; w < W; ++w) k[w] = _mm256_loadu_ps(kt + d * kStep + i0 + 8 * w);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 qd = _mm256_broadcast_ss(q + r * kMaxDim + d);
#pragma GCC unroll 8
      for (int w = 0; w < W; ++w) acc[r][w] = _mm256_fmadd_ps(qd, k[w], acc[r][w]);
    }
  }
  const __m256 s = _mm256_set1_ps(scale);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int w = 0; w < W; ++w) _mm256_storeu_ps(scores + r * kStep + i0 + 8 * w, _mm256_mul_ps(acc[r][w], s));
}

// Scores of R rows over positions [0, n) of the step (written up to the next multiple of 8).
template <int R>
void score_rows(const float* q, const float* kt, int64_t head_dim, int64_t n, float scale, float* scores) {
  int64_t i0 = 0;
  for (; i0 + 8 < n; i0 += 16) score_tile<R, 2>(q, kt, head_dim, i0, scale, scores);
  if (i0 < n) score_tile<R, 1>(q, kt, head_dim, i0, scale, scores);
}

// acc[r][d0 + j] = acc[r][d0 + j] * alpha[r] + sum over t < n in order of probs[r][t] * v_t[d0 + j],
// for R rows (probs, alpha and acc pointing at the tile's first row) and 8 * W dimensions from d0.
template <int R, int W, typename cache_t>
inline void value_tile(const float* probs, const float* alpha, const cache_t* const* v_rows, int64_t n, int64_t d0,
                       float* acc) {
  __m256 a[R][W];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int w = 0; w < W; ++w)
      a[r][w] = _mm256_mul_ps(_mm256_loadu_ps(acc + r * kMaxDim + d0 + 8 * w), _mm256_set1_ps(alpha[r]));
  for (int64_t t = 0; t < n; ++t) {
    __m256 v[W];
#pragma GCC unroll 8
    for (int w = 0; w < W; ++w) v[w] = load8(v_rows[t] + d0 + 8 * w);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 pr = _mm256_broadcast_ss(probs + r * kStep + t);
#pragma GCC unroll 8
      for (int w = 0; w < W; ++w) a[r][w] = _mm256_fmadd_ps(pr, v[w], a[r][w]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int w = 0; w < W; ++w) _mm256_storeu_ps(acc + r * kMaxDim + d0 + 8 * w, a[r][w]);
}

template <int R, typename cache_t>
void value_rows(const float* probs, const float* alpha, const cache_t* const* v_rows, int64_t n, int64_t head_dim,
                float* acc) {
  int64_t d0 = 0;
  for (; d0 + 16 <= head_dim; d0 += 16) value_tile<R, 2>(probs, alpha, v_rows, n, d0, acc);
  if (d0 < head_dim) value_tile<R, 1>(probs, alpha, v_rows, n, d0, acc);  // head_dim is a multiple of 8
}

// Runs tile(R, first row) over `count` rows in tiles of kRows (at most 6), the last with the rows left.
template <int kRows, typename Tile>
void for_each_tile(int64_t count, Tile tile) {
  int64_t r = 0;
  for (; r + kRows <= count; r += kRows) tile(std::integral_constant<int, kRows>{}, r);
  switch (count - r) {
    case 1: return tile(std::integral_constant<int, 1>{}, r);
    case 2: return tile(std::integral_constant<int, 2>{}, r);
    case 3: return tile(std::integral_constant<int, 3>{}, r);
    case 4: return tile(std::integral_constant<int, 4>{}, r);
    case 5: return tile(std::integral_constant<int, 5>{}, r);
    default: return;
  }
}

// The online-softmax step of row r over the step's first n positions, of which it attends the first
// `valid` (none: probabilities 0 and the accumulation kept as it is).
void softmax_row(Rows& rows, int64_t r, int64_t n, int64_t valid) {
  float* row = rows.probs + r * kStep;
  if (valid <= 0) {
    std::fill(row, row + n, 0.0f);
    rows.alpha[r] = 1.0f;
    return;
  }
  rows.alpha[r] = online_softmax_step(row, n, valid, rows.max[r], rows.sum[r]);
}

// Rows [row0, row0 + rows.count) of KV head kv (row R: token R / group, query head kv * group + R % group).
template <typename cache_t>
void attend_task(const Problem<cache_t>& p, int64_t kv, int64_t row0, Rows& rows) {
  int64_t last_limit = 0;
  for (int64_t r = 0; r < rows.count; ++r) {
    const int64_t token = (row0 + r) / p.group, head = kv * p.group + (row0 + r) % p.group;
    const float* q = p.query + token * p.q_stride_token + head * p.q_stride_head;
    std::copy(q, q + p.head_dim, rows.q + r * kMaxDim);
    std::fill(rows.acc + r * kMaxDim, rows.acc + r * kMaxDim + p.head_dim, 0.0f);
    rows.limit[r] = p.start + token + 1;
    rows.max[r] = kNegInf;
    rows.sum[r] = 0.0f;
    last_limit = std::max(last_limit, rows.limit[r]);
  }
  const cache_t* v_rows[kStep];
  for (int64_t p0 = 0; p0 < last_limit; p0 += kStep) {
    const int64_t n = std::min(kStep, last_limit - p0);
    const float* kt = keys_of(p, kv, p0 / kStep);
    for_each_tile<kScoreRows>(rows.count, [&](auto tile_rows, int64_t r) {
      score_rows<decltype(tile_rows)::value>(rows.q + r * kMaxDim, kt, p.head_dim, n, p.scale, rows.probs + r * kStep);
    });
    for (int64_t r = 0; r < rows.count; ++r) softmax_row(rows, r, n, std::min(n, rows.limit[r] - p0));
    for (int64_t t = 0; t < n; ++t) v_rows[t] = cache_row(p, p.value_cache, p0 + t, kv);
    for_each_tile<kValueRows>(rows.count, [&](auto tile_rows, int64_t r) {
      value_rows<decltype(tile_rows)::value>(rows.probs + r * kStep, rows.alpha + r, v_rows, n, p.head_dim,
                                             rows.acc + r * kMaxDim);
    });
  }
  for (int64_t r = 0; r < rows.count; ++r) {
    const int64_t token = (row0 + r) / p.group, head = kv * p.group + (row0 + r) % p.group;
    float* o = p.out + (token * p.num_heads + head) * p.head_dim;
    const float inv = 1.0f / rows.sum[r];  // every row attends at least position 0
    const float* acc = rows.acc + r * kMaxDim;
    for (int64_t d = 0; d < p.head_dim; ++d) o[d] = acc[d] * inv;
  }
}

template <typename cache_t>
void attend_all(const Problem<cache_t>& p) {
  const int64_t rows_per_kv = p.num_tokens * p.group;
  const int64_t blocks = (rows_per_kv + kTaskRows - 1) / kTaskRows;
  const int64_t num_tasks = p.kv_heads * blocks;
  const int threads = static_cast<int>(std::min<int64_t>(std::max(1, at::get_num_threads()), num_tasks));
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> scratch(kTaskRows * (2 * kMaxDim + kStep));
    Rows rows;
    rows.q = scratch.data();
    rows.acc = rows.q + kTaskRows * kMaxDim;
    rows.probs = rows.acc + kTaskRows * kMaxDim;
    // Later rows attend to more positions: their tasks go first, so the short ones fill in at the end.
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < num_tasks; ++task) {
      const int64_t block = blocks - 1 - task / p.kv_heads, kv = task % p.kv_heads;
      const int64_t row0 = block * kTaskRows;
      rows.count = std::min(kTaskRows, rows_per_kv - row0);
      attend_task(p, kv, row0, rows);
    }
  }
}
#endif  // TOKENMILL_PREFILL_F32

#ifdef TOKENMILL_PREFILL_F32
// The checked call of paged_prefill_attention_f32 over a cache of cache_t.
template <typename cache_t>
void prefill(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
             const at::Tensor& table, int64_t start, double scale, at::Tensor& out) {
  const int64_t num_tokens = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t kv_heads = key_cache.size(2), block_size = key_cache.size(1);
  Problem<cache_t> p{};
  p.query = query.data_ptr<float>();
  p.key_cache = key_cache.data_ptr<cache_t>();
  p.value_cache = value_cache.data_ptr<cache_t>();
  p.table = table.data_ptr<int64_t>();
  p.out = out.data_ptr<float>();
  p.q_stride_token = query.stride(0);
  p.q_stride_head = query.stride(1);
  p.stride_block = key_cache.stride(0);
  p.stride_slot = key_cache.stride(1);
  p.stride_head = key_cache.stride(2);
  p.block_size = block_size;
  p.num_tokens = num_tokens;
  p.num_heads = num_heads;
  p.kv_heads = kv_heads;
  p.group = num_heads / kv_heads;
  p.head_dim = head_dim;
  p.start = start;
  p.total = start + num_tokens;
  p.steps = (p.total + kStep - 1) / kStep;
  p.scale = static_cast<float>(scale);
  at::Tensor keys = at::empty({kv_heads * p.steps * head_dim * kStep}, query.options());
  p.keys = keys.data_ptr<float>();
  at::parallel_for(0, kv_heads * p.steps, 4, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) lay_out_keys(p, i / p.steps, i % p.steps);
  });
  attend_all(p);
}
#endif  // TOKENMILL_PREFILL_F32

at::Tensor paged_prefill_attention_f32(const at::Tensor& query, const at::Tensor& key_cache,
                                       const at::Tensor& value_cache, const at::Tensor& block_table, int64_t start,
                                       double scale) {
#ifndef TOKENMILL_PREFILL_F32
  TORCH_CHECK(false, "float32 paged_prefill_attention needs a build for AVX2 and FMA without AVX-512");
  (void)query, (void)key_cache, (void)value_cache, (void)block_table, (void)start, (void)scale;
  return at::Tensor();
#else
  TORCH_CHECK(query.dim() == 3 && query.scalar_type() == at::kFloat && query.stride(2) == 1,
              "query must be float32 [T, num_heads, head_dim] with head_dim contiguous");
  const at::ScalarType cache_type = key_cache.scalar_type();
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes() && key_cache.is_contiguous() &&
                  value_cache.is_contiguous() && value_cache.scalar_type() == cache_type &&
                  (cache_type == at::kFloat || cache_type == at::kBFloat16 || cache_type == at::kHalf),
              "key_cache/value_cache must be contiguous float32, bfloat16 or float16 [num_blocks, block_size, "
              "kv_heads, head_dim] of one dtype");
  TORCH_CHECK(query.device().is_cpu() && key_cache.device().is_cpu() && value_cache.device().is_cpu() &&
                  block_table.device().is_cpu(),
              "paged_prefill_attention runs on CPU tensors");
  const int64_t num_tokens = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t kv_heads = key_cache.size(2), block_size = key_cache.size(1);
  TORCH_CHECK(head_dim % 8 == 0 && head_dim > 0 && head_dim <= kMaxDim,
              "head_dim must be a multiple of 8 up to 256, got ", head_dim);
  TORCH_CHECK(key_cache.size(3) == head_dim, "cache head_dim ", key_cache.size(3), " != query head_dim ", head_dim);
  TORCH_CHECK(kv_heads > 0 && num_heads % kv_heads == 0, "num_heads must be a multiple of kv_heads");
  TORCH_CHECK(block_table.dim() == 1 && block_table.scalar_type() == at::kLong, "block_table must be int64 [max_blocks]");
  TORCH_CHECK(start >= 0, "start must be >= 0, got ", start);
  const int64_t total = start + num_tokens;
  TORCH_CHECK(total <= block_table.size(0) * block_size, "start + T = ", total, " exceeds the block table");
  at::Tensor out = at::empty({num_tokens, num_heads, head_dim}, query.options().memory_format(at::MemoryFormat::Contiguous));
  if (num_tokens == 0) return out;
  const at::Tensor table = block_table.contiguous();
  const int64_t* ids = table.data_ptr<int64_t>();
  const int64_t num_blocks = key_cache.size(0);
  for (int64_t b = 0; b < (total + block_size - 1) / block_size; ++b)
    TORCH_CHECK(ids[b] >= 0 && ids[b] < num_blocks, "block id ", ids[b], " outside the cache");
  if (cache_type == at::kBFloat16)
    prefill<c10::BFloat16>(query, key_cache, value_cache, table, start, scale, out);
  else if (cache_type == at::kHalf)
    prefill<c10::Half>(query, key_cache, value_cache, table, start, scale, out);
  else
    prefill<float>(query, key_cache, value_cache, table, start, scale, out);
  return out;
#endif
}

}  // namespace
}  // namespace tokenmill

namespace tokenmill::ops {
bool prefill_attention_f32_available() {
#ifdef TOKENMILL_PREFILL_F32
  return true;
#else
  return false;
#endif
}
at::Tensor paged_prefill_attention_f32(const at::Tensor& query, const at::Tensor& key_cache,
                                       const at::Tensor& value_cache, const at::Tensor& block_table, int64_t start,
                                       double scale) {
  return ::tokenmill::paged_prefill_attention_f32(query, key_cache, value_cache, block_table, start, scale);
}
}  // namespace tokenmill::ops

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("prefill_attention_f32_available() -> bool", &tokenmill::ops::prefill_attention_f32_available);
}
