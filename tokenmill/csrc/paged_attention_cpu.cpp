// Decode-time paged attention on CPU: one new query token per sequence, keys and values read straight
// from the paged KV cache through the block table (no gather copy).
//
// Contract (tokenmill::paged_attention_decode):
//   query        [S, num_heads, head_dim]                       float32 / bfloat16 / float16
//   key_cache    [num_blocks, block_size, kv_heads, head_dim]   query's dtype, or bfloat16 / float16
//                                                               for a float32 query (a 16-bit cache)
//   value_cache  [num_blocks, block_size, kv_heads, head_dim]   key_cache's dtype
//   block_tables [S, max_blocks] int32 or int64: the physical block of each logical block; every
//                entry a sequence reaches must be a valid block id
//   seq_lens     [S] int32 or int64: tokens in the cache for the sequence, the new one included
//   window       > 0: attend only to the last `window` positions; <= 0: no window
//   tiles        use the tile path (AMX) where it applies, see TileBuffers (tests compare both paths)
//   returns      [S, num_heads, head_dim] in the query dtype:
//                softmax(q . K^T * scale) . V over positions [max(0, seq_len - window), seq_len)
//   Query head h reads KV head h / (num_heads / kv_heads). A sequence with nothing to attend to gets
//   zeros. Accumulation is float32, with a streaming (online) softmax over chunks of 64 positions. A
//   float32 query over a 16-bit cache gets bitwise what it would over a float32 cache holding the same
//   values (cache elements are widened to float32 as they are loaded).
//
// All query heads of a KV head are computed together, so every K/V row is loaded from memory once.
// Sequences whose block tables start with the same blocks (a shared system prompt through the prefix
// cache, n > 1 siblings) are attended as a group over those blocks: each chunk of shared rows is read
// from memory once and used by every member while it is in cache (cascade attention), then each
// member attends to the rest of its own positions.
// OpenMP tasks are whole items (a sequence or a group) when there are enough of them, else (item, KV
// head) pairs.
// Each head's sums run in one fixed order, so results do not depend on the batch or the thread count.
// Common head sizes (64, 128) get code specialised at compile time (no tail masks, fully unrolled);
// the others run the same code with run-time sizes.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "vec16.h"
#include "cpu_ops.h"
#include "online_softmax.h"

#if defined(TOKENMILL_AVX512) && defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define TOKENMILL_ATTENTION_AMX 1
#include "amx_tiles.h"
#endif

namespace tokenmill {
namespace {

using namespace vec;

// Up to 1024: multi-head latent attention's absorbed decode attends over one latent "head" of
// kv_lora_rank + qk_rope_head_dim (576 for DeepSeek-V3). Only the tile path has fixed-size buffers,
// and it takes head_dim 64 or 128 only.
constexpr int64_t kMaxHeadDim = 1024;
// Query heads kept in registers at once; a KV head with more query heads is done in several tiles,
// which re-read the chunk's K/V rows from L1 rather than from memory.
constexpr int kHeadTile = 4;
// Head-dim chunks of 16 lanes whose accumulators stay in registers together (4 x 4 heads = 16 zmm).
constexpr int kSpan = 4;
// Positions per online-softmax step: the max/exp/rescale bookkeeping is paid once per this many.
constexpr int kChunkTokens = 64;
// Most sequences that read a shared prefix together (bounds each thread's scratch).
constexpr int64_t kMaxMembers = 16;

// Everything the tasks share, read once per call.
template <typename scalar_t>
struct Problem {
  const scalar_t* query;
  const scalar_t* key_cache;
  const scalar_t* value_cache;
  const int64_t* block_tables;
  const int64_t* seq_lens;
  scalar_t* out;
  // A float32 query with a 16-bit cache: the query is read from query_f32 and the output written to
  // out_f32 (query and out are null); otherwise both are null.
  const float* query_f32;
  float* out_f32;
  int64_t q_stride_seq, q_stride_head;
  int64_t k_stride_block, k_stride_slot, k_stride_head;
  int64_t v_stride_block, v_stride_slot, v_stride_head;
  int64_t table_stride;
  int64_t num_heads, kv_heads, head_dim, block_size, window;
  int64_t chunks;      // head_dim in 16-lane chunks, rounded up
  int64_t padded_dim;  // chunks * 16
  float scale;
  bool tiles;  // ranges starting on a block take the tile path (AMX; bfloat16, see TileBuffers)
  // Attention sinks (gpt-oss), one logit per query head, or null: each head's softmax starts from a
  // key of that logit and no value (running max = the sink, running sum = 1, accumulator 0).
  const float* sinks;
};

// Head-dim geometry: kChunks > 0 fixes head_dim = 16 * kChunks at compile time; 0 reads it at run time.
template <int kChunks, typename scalar_t>
inline int64_t num_chunks(const Problem<scalar_t>& p) {
  return kChunks > 0 ? kChunks : p.chunks;
}
template <int kChunks, typename scalar_t>
inline int lanes_of(const Problem<scalar_t>& p, int64_t chunk) {
  return kChunks > 0 ? kLanes : static_cast<int>(std::min<int64_t>(kLanes, p.head_dim - chunk * kLanes));
}

// Per-thread scratch. Row pointers are double-buffered: the next chunk's rows are prefetched while
// the current chunk is computed.
struct Scratch {
  std::vector<float> q;                   // [num_heads, padded_dim] queries as float32, zero padded
  std::vector<float> acc;                 // [num_heads, padded_dim] unnormalised outputs
  std::vector<float> row_max, row_sum;    // [num_heads] running softmax max and denominator
  float dots[kHeadTile][kLanes][kLanes];  // per head, per token of a 16-token group: partial dots
  float scores[kHeadTile][kChunkTokens];  // scores, then probabilities, of the current chunk
  const void* k_rows[2][kChunkTokens];    // KV head 0's K row of each position of a chunk
  const void* v_rows[2][kChunkTokens];
  const void* upcoming_k_rows[kChunkTokens];  // the first chunk of the task this thread does next
  const void* upcoming_v_rows[kChunkTokens];
  const c10::BFloat16* q_bf16 = nullptr;  // the sequence's queries, when they are bfloat16
  // Which sequence's state q/acc/row_max/row_sum hold: a shared-prefix group keeps one state per
  // member, member m's heads at [m * num_heads, (m + 1) * num_heads).
  int64_t base = 0;
  struct TileBuffers* tiles = nullptr;  // the tile path's operands (AMX), when the problem uses it
  bool tiles_now = false;               // the range being attended starts on a block: the tile path
};

// KV head 0's rows of positions [pos, pos + n) of the sequence with block table `table`.
template <typename scalar_t>
void find_rows(const Problem<scalar_t>& p, const int64_t* table, int64_t pos, int64_t n, const void** k_rows,
               const void** v_rows) {
  int64_t block = pos / p.block_size, slot = pos % p.block_size;  // one division per chunk, not per row
  const scalar_t* k = p.key_cache + table[block] * p.k_stride_block;
  const scalar_t* v = p.value_cache + table[block] * p.v_stride_block;
  for (int64_t i = 0; i < n; ++i, ++slot) {
    if (slot == p.block_size) {
      slot = 0;
      ++block;
      k = p.key_cache + table[block] * p.k_stride_block;
      v = p.value_cache + table[block] * p.v_stride_block;
    }
    k_rows[i] = k + slot * p.k_stride_slot;
    v_rows[i] = v + slot * p.v_stride_slot;
  }
}

// Rows to ask for ahead of their use: KV head 0's K and V row of each position, and the byte range
// of a row wanted (from the row's start).
struct Rows {
  const void* const* k_rows = nullptr;  // [n]
  const void* const* v_rows = nullptr;  // [n]
  int64_t n = 0;
  int64_t k_from = 0, v_from = 0, bytes = 0;
};

// The positions attended in one online-softmax step, and the rows to prefetch while it is computed:
// the next chunk's, or at a task's end the next task's first chunk.
struct Chunk {
  const void* const* k_rows;  // [n], KV head 0
  const void* const* v_rows;  // [n]
  int64_t n;
  Rows next;
  int64_t share = 0;  // ceil(2^16 / n), for share_of
};

inline void prefetch_rows(const void* const* rows, int64_t from, int64_t bytes, int64_t first, int64_t last) {
  for (int64_t r = first; r < last; ++r) {
    const char* row = static_cast<const char*>(rows[r]) + from;
    for (int64_t b = 0; b < bytes; b += 64) prefetch_l2(row + b);
  }
}

// Called at each position i of a chunk of n (1 <= n), from the loop over the chunk's keys (or its
// values): asks for the keys (values) of the next rows in proportion, so the requests are spread
// evenly over the compute of the chunk instead of issued in a burst. A burst fills the core's queue of
// outstanding misses, after which prefetches are dropped or stall it; blocks are scattered through
// the pool, so the hardware prefetcher cannot guess them. Keys are asked for while keys are scored
// and values while values are summed, so both streams stay in flight the whole time. Into L2, which
// tracks more outstanding misses than L1.
// Position i's share of the next rows, [i * next.n / n, (i + 1) * next.n / n) rounded down, by a multiply
// and a shift with `c.share` = ceil(2^16 / n) (n, next.n <= kChunkTokens): two integer divisions a position
// and KV head held the divider for most of a position's time.
inline int64_t share_of(const Chunk& c, int64_t i) { return (i * c.next.n * c.share) >> 16; }
inline void prefetch_next_keys(const Chunk& c, int64_t i) {
  if (c.next.n == 0) return;
  prefetch_rows(c.next.k_rows, c.next.k_from, c.next.bytes, share_of(c, i), share_of(c, i + 1));
}
inline void prefetch_next_values(const Chunk& c, int64_t i) {
  if (c.next.n == 0) return;
  prefetch_rows(c.next.v_rows, c.next.v_from, c.next.bytes, share_of(c, i), share_of(c, i + 1));
}
inline void prefetch_next(const Chunk& c, int64_t i) {
  prefetch_next_keys(c, i);
  prefetch_next_values(c, i);
}

// Scaled scores of a 16-token group from its partial dot products (one 16-lane row per token).
template <int NG, typename scalar_t>
inline void finish_scores(const Problem<scalar_t>& p, Scratch& s, int64_t offset, int m) {
  for (int g = 0; g < NG; ++g) {
    // Rows past m hold stale values; zero them so the reduction never meets NaNs or denormals.
    for (int i = m; i < kLanes; ++i) store(s.dots[g][i], zero(), kLanes);
    store(&s.scores[g][offset], mul(reduce_rows(&s.dots[g][0][0]), splat(p.scale)), m);
  }
}

template <int NG>
inline void keep_dots(Scratch& s, const Vec* dot, int i, bool first) {
  for (int g = 0; g < NG; ++g)
    store(s.dots[g][i], first ? dot[g] : add(load(s.dots[g][i], kLanes), dot[g]), kLanes);
}

// Scores of the chunk's positions for query heads [h0, h0 + NG), whose KV head's rows sit `k_off`
// elements into KV head 0's. The queries of a span of chunks stay in registers while the key rows
// stream past.
template <int NG, int kChunks, typename scalar_t>
void score_chunk(const Problem<scalar_t>& p, Scratch& s, const Chunk& c, int64_t k_off, int64_t h0,
                 bool prefetch) {
  const int64_t n = c.n, chunks = num_chunks<kChunks>(p);
  for (int64_t tg = 0; tg < n; tg += kLanes) {
    const int m = static_cast<int>(std::min<int64_t>(kLanes, n - tg));
    for (int64_t c0 = 0; c0 < chunks; c0 += kSpan) {
      Vec q[NG][kSpan];
      for (int g = 0; g < NG; ++g)
        for (int j = 0; j < kSpan; ++j)
          if (c0 + j < chunks) q[g][j] = load(&s.q[(s.base + h0 + g) * p.padded_dim + (c0 + j) * kLanes], kLanes);
      for (int i = 0; i < m; ++i) {
        if (prefetch && c0 == 0) prefetch_next_keys(c, tg + i);
        const scalar_t* k = static_cast<const scalar_t*>(c.k_rows[tg + i]) + k_off + c0 * kLanes;
        Vec dot[NG];
        for (int g = 0; g < NG; ++g) dot[g] = zero();
        for (int j = 0; j < kSpan; ++j) {
          if (c0 + j >= chunks) break;
          Vec kc = load(k + j * kLanes, lanes_of<kChunks>(p, c0 + j));
          for (int g = 0; g < NG; ++g) dot[g] = fmadd(q[g][j], kc, dot[g]);
        }
        keep_dots<NG>(s, dot, i, c0 == 0);
      }
    }
    finish_scores<NG>(p, s, tg, m);
  }
}

#if defined(TOKENMILL_AVX512) && defined(__AVX512BF16__)
// bfloat16 keys: VDPBF16PS multiplies 32 bfloat16 pairs straight from the cache rows, accumulating in
// float32 (a product of two bfloat16 is exact in float32), with no conversion of the keys. The queries
// are read in bfloat16 from the query tensor; float32 queries (over a bfloat16 cache) keep the float32
// path above, so they are never rounded.
inline __mmask32 mask32(int64_t n) { return n >= 32 ? ~__mmask32(0) : __mmask32((1u << n) - 1u); }

// Head dim 64 or 128 (one or two passes of two 32-pair steps), a whole group of 16 positions: each
// position's partial dot products (the passes' chains added in pass order, as keep_dots adds them) join
// the transpose-and-add tree of reduce_rows in registers as they are made (`held[L]`: the level-L unit
// waiting for its sibling), instead of going through the scratch and back; the same additions in the
// same order as finish_scores, so the same bits.
template <int L, int I, int NG>
inline void join_tree(__m512 (&held)[4][NG], __m512 (&v)[NG], __m512 (&out)[NG]) {
  if constexpr (L == 4) {
    for (int g = 0; g < NG; ++g) out[g] = v[g];
  } else if constexpr (((I >> L) & 1) != 0) {
    for (int g = 0; g < NG; ++g) v[g] = vec::rows_tree_level<L>(held[L][g], v[g]);
    join_tree<L + 1, I, NG>(held, v, out);
  } else {
    for (int g = 0; g < NG; ++g) held[L][g] = v[g];
  }
}

// P: the head's 32-pair steps (2 or 4).
template <int I, int NG, int P>
inline void score_position(const __m512i (&q)[NG][P], const Chunk& c, int64_t tg, int64_t k_off, bool prefetch,
                           __m512 (&held)[4][NG], __m512 (&out)[NG]) {
  if (prefetch) prefetch_next_keys(c, tg + I);
  const c10::BFloat16* k = static_cast<const c10::BFloat16*>(c.k_rows[tg + I]) + k_off;
  __m512i keys[P];
  for (int j = 0; j < P; ++j) keys[j] = _mm512_loadu_si512(k + 32 * j);
  __m512 v[NG];
  for (int g = 0; g < NG; ++g) {
    for (int j = 0; j < P; j += 2) {
      const __m512 pass = _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)q[g][j], (__m512bh)keys[j]),
                                           (__m512bh)q[g][j + 1], (__m512bh)keys[j + 1]);
      v[g] = j == 0 ? pass : _mm512_add_ps(v[g], pass);
    }
  }
  join_tree<0, I, NG>(held, v, out);
}

template <int NG, int P, size_t... I>
inline void score_group(const __m512i (&q)[NG][P], const Chunk& c, int64_t tg, int64_t k_off, bool prefetch,
                        __m512 (&out)[NG], std::index_sequence<I...>) {
  __m512 held[4][NG];
  (score_position<static_cast<int>(I), NG, P>(q, c, tg, k_off, prefetch, held, out), ...);
}

template <int NG, int kChunks>
void score_chunk(const Problem<c10::BFloat16>& p, Scratch& s, const Chunk& c, int64_t k_off, int64_t h0,
                 bool prefetch) {
  if (p.query_f32 != nullptr) return score_chunk<NG, kChunks, c10::BFloat16>(p, s, c, k_off, h0, prefetch);
  constexpr int kPairSpan = 2;  // 2 x 32 = 64 dimensions per pass
  const int64_t n = c.n, chunks = kChunks > 0 ? kChunks / 2 : (p.head_dim + 31) / 32;
  const auto lanes = [&](int64_t c) { return kChunks > 0 ? int64_t{32} : p.head_dim - c * 32; };
  const c10::BFloat16* q_heads = s.q_bf16 + h0 * p.q_stride_head;
  for (int64_t tg = 0; tg < n; tg += kLanes) {
    const int m = static_cast<int>(std::min<int64_t>(kLanes, n - tg));
    if constexpr (kChunks == 4 || kChunks == 8) {
      if (m == kLanes) {
        constexpr int P = kChunks / 2;
        __m512i q[NG][P];
        for (int g = 0; g < NG; ++g)
          for (int j = 0; j < P; ++j) q[g][j] = _mm512_loadu_si512(q_heads + g * p.q_stride_head + j * 32);
        __m512 sums[NG];
        score_group<NG, P>(q, c, tg, k_off, prefetch, sums, std::make_index_sequence<kLanes>{});
        for (int g = 0; g < NG; ++g) store(&s.scores[g][tg], mul(Vec{sums[g]}, splat(p.scale)), kLanes);
        continue;
      }
    }
    for (int64_t c0 = 0; c0 < chunks; c0 += kPairSpan) {
      __m512i q[NG][kPairSpan];
      for (int g = 0; g < NG; ++g)
        for (int j = 0; j < kPairSpan; ++j)
          if (c0 + j < chunks)
            q[g][j] = _mm512_maskz_loadu_epi16(mask32(lanes(c0 + j)),
                                               q_heads + g * p.q_stride_head + (c0 + j) * 32);
      for (int i = 0; i < m; ++i) {
        if (prefetch && c0 == 0) prefetch_next_keys(c, tg + i);
        const c10::BFloat16* k = static_cast<const c10::BFloat16*>(c.k_rows[tg + i]) + k_off + c0 * 32;
        Vec dot[NG];
        for (int g = 0; g < NG; ++g) dot[g] = zero();
        for (int j = 0; j < kPairSpan; ++j) {
          if (c0 + j >= chunks) break;
          __m512i kc = _mm512_maskz_loadu_epi16(mask32(lanes(c0 + j)), k + j * 32);
          for (int g = 0; g < NG; ++g) dot[g].v = _mm512_dpbf16_ps(dot[g].v, (__m512bh)q[g][j], (__m512bh)kc);
        }
        keep_dots<NG>(s, dot, i, c0 == 0);
      }
    }
    finish_scores<NG>(p, s, tg, m);
  }
}
#endif

#ifdef TOKENMILL_ATTENTION_AMX
// The tile path (AMX) for bfloat16 caches of 16-slot blocks and head_dim 64 or 128, where a range
// starts on a block boundary (so each 16 positions of a chunk are one block's rows, at one stride).
// Scores: S^T = K Q^T, K's 16 rows straight from the cache as the "A" operand (32 dimensions per
// tile), the chunk's queries transposed into pair-interleaved "B" tiles once per chunk; the 16 x 16
// float32 result is stored and each head's column gathered into its score row. Values: O += P V, the
// probabilities rounded to bfloat16 as the "A" operand (heads x 32 positions) and each pair of value
// rows interleaved into "B" tiles (32 positions x 16 dimensions). A tile product multiplies
// bfloat16 pairs and accumulates in float32, as VDPBF16PS does; the order of the sums differs from
// the vector path's, and P is rounded to bfloat16 (as flash attention kernels do), so results agree
// with it to bfloat16 precision, not bitwise. Which path a chunk takes depends only on the problem
// and the range's first position, so a sequence gets the same bits alone, batched or grouped.
using amx::configure_tiles;
using amx::kTileRows;
constexpr int kMaxTileHeadDim = 128;               // the tile path's widest head (64 or 128)
constexpr int kMaxHalves = kMaxTileHeadDim / 32;  // 32-dimension slices of a head

struct alignas(64) TileBuffers {
  uint32_t q[kMaxHalves][kTileRows][kTileRows];            // Q^T per 32 dimensions: [pair][head]
  float s[4][kTileRows][kTileRows];                        // S^T per 16 positions: [position][head]
  c10::BFloat16 p[2][kTileRows][32];                       // P per 32 positions: [head][position]
  c10::BFloat16 v[2][2 * kMaxHalves][kTileRows][32];       // V per 32 positions, per 16 dimensions
  float o[4][kTileRows][kTileRows];                        // P V per 16 dimensions: [head][dimension]
};

template <int NG, int kChunks>
void score_chunk_tiles(const Problem<c10::BFloat16>& p, Scratch& s, const Chunk& c, int64_t k_off, int64_t h0,
                       bool prefetch) {
  constexpr int kHalves = kChunks / 2;
  TileBuffers& t = *s.tiles;
  const c10::BFloat16* q_heads = s.q_bf16 + h0 * p.q_stride_head;
  for (int h = 0; h < kHalves; ++h) {
    for (int r = 0; r < kTileRows; ++r) _mm512_store_si512(t.q[h][r], _mm512_setzero_si512());
    for (int g = 0; g < NG; ++g) {
      const uint32_t* pairs = reinterpret_cast<const uint32_t*>(q_heads + g * p.q_stride_head + h * 32);
      for (int r = 0; r < kTileRows; ++r) t.q[h][r][g] = pairs[r];
    }
  }
  const int64_t n = c.n, k_stride = p.k_stride_slot * static_cast<int64_t>(sizeof(c10::BFloat16));
  // Up to four 16-position groups at once, one accumulator tile each, so the products overlap.
  // (The tile intrinsics take literal tile numbers, hence a macro.)
#define TOKENMILL_SCORE_GROUP(ACC, TG)                                                      \
  {                                                                                         \
    const c10::BFloat16* k = static_cast<const c10::BFloat16*>(c.k_rows[TG]) + k_off;     \
    _tile_zero(ACC);                                                                        \
    for (int h = 0; h < kHalves; ++h) {                                                     \
      _tile_loadd(4, k + h * 32, k_stride);                                                 \
      _tile_loadd(5, t.q[h], 64);                                                           \
      _tile_dpbf16ps(ACC, 4, 5);                                                            \
    }                                                                                       \
    _tile_stored(ACC, t.s[ACC], 64);                                                        \
  }
  const int groups = static_cast<int>((n + kTileRows - 1) / kTileRows);
  if (prefetch)
    for (int64_t i = 0; i < n; ++i) prefetch_next(c, i);
  TOKENMILL_SCORE_GROUP(0, 0)
  if (groups > 1) TOKENMILL_SCORE_GROUP(1, 16)
  if (groups > 2) TOKENMILL_SCORE_GROUP(2, 32)
  if (groups > 3) TOKENMILL_SCORE_GROUP(3, 48)
#undef TOKENMILL_SCORE_GROUP
  const __m512i column = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(kTileRows));
  for (int j = 0; j < groups; ++j) {
    const int m = static_cast<int>(std::min<int64_t>(kTileRows, n - j * kTileRows));
    for (int g = 0; g < NG; ++g) {
      const __m512 scores = _mm512_i32gather_ps(_mm512_add_epi32(column, _mm512_set1_epi32(g)), &t.s[j][0][0], 4);
      store(&s.scores[g][j * kTileRows], mul(Vec{scores}, splat(p.scale)), m);
    }
  }
}

// acc[g] = acc[g] * alpha[g] + sum over the chunk of scores[g][i] * V[i], for heads [h0, h0 + NG).
template <int NG, int kChunks>
void accumulate_values_tiles(const Problem<c10::BFloat16>& p, Scratch& s, const Chunk& c, int64_t v_off,
                             int64_t h0, const float* alpha) {
  constexpr int kHalves = kChunks / 2;
  TileBuffers& t = *s.tiles;
  const int64_t n = c.n;
  const int steps = static_cast<int>((n + 31) / 32);
  for (int st = 0; st < steps; ++st) {
    for (int r = 0; r < kTileRows; ++r) {
      const int64_t i0 = st * 32 + 2 * r, i1 = i0 + 1;
      const c10::BFloat16* a = i0 < n ? static_cast<const c10::BFloat16*>(c.v_rows[i0]) + v_off : nullptr;
      const c10::BFloat16* b = i1 < n ? static_cast<const c10::BFloat16*>(c.v_rows[i1]) + v_off : nullptr;
      amx::interleave_value_rows(a, b, kHalves, r, reinterpret_cast<char*>(t.v[st][0]));  // past the chunk: zeros
    }
    for (int g = 0; g < NG; ++g) {
      const float* row = s.scores[g] + st * 32;
      const int left = static_cast<int>(n - st * 32);
      const __m512 lo = _mm512_maskz_loadu_ps(lane_mask(std::max(0, left)), row);
      const __m512 hi = _mm512_maskz_loadu_ps(lane_mask(std::max(0, left - kLanes)), row + kLanes);
      _mm512_store_si512(t.p[st][g], (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
  }
  for (int d0 = 0; d0 < 2 * kHalves; d0 += 4) {
    amx::multiply_values(reinterpret_cast<const char*>(t.p), reinterpret_cast<const char*>(t.v[0][d0]),
                         sizeof(t.v[0]), steps, t.o);
    for (int g = 0; g < NG; ++g)
      for (int j = 0; j < 4; ++j) {
        float* acc = &s.acc[(s.base + h0 + g) * p.padded_dim + (d0 + j) * kLanes];
        store(acc, fmadd(load(acc, kLanes), splat(alpha[g]), load(t.o[j][g], kLanes)), kLanes);
      }
  }
}
#endif  // TOKENMILL_ATTENTION_AMX

// One chunk for query heads [h0, h0 + NG) of KV head `kv`: scores, the online-softmax rescale, then
// the probability-weighted sum of the value rows.
template <int NG, int kChunks, typename scalar_t>
void attend_chunk(const Problem<scalar_t>& p, Scratch& s, const Chunk& c, int64_t kv, int64_t h0,
                  bool prefetch) {
  const int64_t n = c.n;
#ifdef TOKENMILL_ATTENTION_AMX
  constexpr bool kTilesFit = std::is_same_v<scalar_t, c10::BFloat16> && (kChunks == 4 || kChunks == 8);
  if constexpr (kTilesFit) {
    if (s.tiles_now) score_chunk_tiles<NG, kChunks>(p, s, c, kv * p.k_stride_head, h0, prefetch);
  }
  if (!kTilesFit || !s.tiles_now)
#endif
    score_chunk<NG, kChunks>(p, s, c, kv * p.k_stride_head, h0, prefetch);

  float alpha[NG];
  for (int g = 0; g < NG; ++g)
    alpha[g] = online_softmax_step(s.scores[g], n, n, s.row_max[s.base + h0 + g], s.row_sum[s.base + h0 + g]);

#ifdef TOKENMILL_ATTENTION_AMX
  if constexpr (kTilesFit) {
    if (s.tiles_now) return accumulate_values_tiles<NG, kChunks>(p, s, c, kv * p.v_stride_head, h0, alpha);
  }
#endif
  // Positions outer, a span of chunks inner: NG * kSpan independent accumulators in registers, enough
  // to hide the FMA latency (one accumulator per chunk would wait on it at every position).
  const int64_t chunks = num_chunks<kChunks>(p), v_off = kv * p.v_stride_head;
  for (int64_t c0 = 0; c0 < chunks; c0 += kSpan) {
    Vec acc[NG][kSpan];
    for (int g = 0; g < NG; ++g)
      for (int j = 0; j < kSpan; ++j)
        if (c0 + j < chunks)
          acc[g][j] = mul(load(&s.acc[(s.base + h0 + g) * p.padded_dim + (c0 + j) * kLanes], kLanes),
                          splat(alpha[g]));
    for (int64_t t = 0; t < n; ++t) {
      if (prefetch && c0 == 0) prefetch_next_values(c, t);
      const scalar_t* v = static_cast<const scalar_t*>(c.v_rows[t]) + v_off + c0 * kLanes;
      Vec prob[NG];
      for (int g = 0; g < NG; ++g) prob[g] = splat(s.scores[g][t]);
      for (int j = 0; j < kSpan; ++j) {
        if (c0 + j >= chunks) break;
        Vec vc = load(v + j * kLanes, lanes_of<kChunks>(p, c0 + j));
        for (int g = 0; g < NG; ++g) acc[g][j] = fmadd(prob[g], vc, acc[g][j]);
      }
    }
    for (int g = 0; g < NG; ++g)
      for (int j = 0; j < kSpan; ++j)
        if (c0 + j < chunks) store(&s.acc[(s.base + h0 + g) * p.padded_dim + (c0 + j) * kLanes], acc[g][j], kLanes);
  }
}

template <int kChunks, typename scalar_t>
void attend_tile(const Problem<scalar_t>& p, Scratch& s, const Chunk& c, int64_t kv, int64_t h0,
                 int64_t num_g, bool prefetch) {
  switch (num_g) {
    case 1:
      return attend_chunk<1, kChunks>(p, s, c, kv, h0, prefetch);
    case 2:
      return attend_chunk<2, kChunks>(p, s, c, kv, h0, prefetch);
    case 3:
      return attend_chunk<3, kChunks>(p, s, c, kv, h0, prefetch);
    default:
      return attend_chunk<kHeadTile, kChunks>(p, s, c, kv, h0, prefetch);
  }
}

// One member of a work item: a sequence and the slot of its softmax state in the scratch.
struct Member {
  int64_t seq;
  int64_t base;  // state slot offset, a multiple of num_heads
};

// Loads the queries of heads [h_begin, h_end) of `m.seq` and clears their softmax state.
template <typename scalar_t>
void init_state(const Problem<scalar_t>& p, Scratch& s, const Member& m, int64_t h_begin, int64_t h_end) {
  for (int64_t h = h_begin; h < h_end; ++h) {
    float* q = &s.q[(m.base + h) * p.padded_dim];
    const int64_t offset = m.seq * p.q_stride_seq + h * p.q_stride_head;
    if (p.query_f32 != nullptr)
      std::copy(p.query_f32 + offset, p.query_f32 + offset + p.head_dim, q);
    else
      for (int64_t d = 0; d < p.head_dim; ++d) q[d] = static_cast<float>(p.query[offset + d]);
    std::fill(&s.acc[(m.base + h) * p.padded_dim], &s.acc[(m.base + h + 1) * p.padded_dim], 0.0f);
    s.row_max[m.base + h] = p.sinks != nullptr ? p.sinks[h] : kNegInf;
    s.row_sum[m.base + h] = p.sinks != nullptr ? 1.0f : 0.0f;
  }
}

// Positions [begin, end) of the block table `table`, attended by every member for KV heads [kv0, kv1)
// with all their query heads. Chunks of kChunkTokens positions start at `begin`; chunk by chunk, each
// member in turn reads the same rows, which the first member brought into cache. Every KV head of the
// range reads its part of the same cache rows, so a range handled whole streams through whole rows.
// `after`, when not null, is prefetched during the range's last chunk (the first rows of the thread's
// next task).
template <int kChunks, typename scalar_t>
void attend_range(const Problem<scalar_t>& p, Scratch& s, const int64_t* table, int64_t begin, int64_t end,
                  int64_t kv0, int64_t kv1, const Member* members, int64_t num_members,
                  const Rows* after = nullptr) {
  const int64_t group = p.num_heads / p.kv_heads;
  const int64_t elem = static_cast<int64_t>(sizeof(scalar_t));
  // The bytes of a row the range reads: KV heads [kv0, kv1) (the last one only head_dim long).
  const int64_t prefetch_bytes = ((kv1 - kv0 - 1) * p.k_stride_head + p.head_dim) * elem;
  s.tiles_now = s.tiles != nullptr && begin % p.block_size == 0;
  int cur = 0;
  if (begin < end) {
    const int64_t n = std::min<int64_t>(kChunkTokens, end - begin);
    find_rows(p, table, begin, n, s.k_rows[cur], s.v_rows[cur]);
    // Later chunks are prefetched while the one before them is computed; the first has nothing
    // before it, so ask for all of its rows at once: the misses then overlap instead of queueing
    // behind the dot products one row at a time.
    prefetch_rows(s.k_rows[cur], kv0 * p.k_stride_head * elem, prefetch_bytes, 0, n);
    prefetch_rows(s.v_rows[cur], kv0 * p.v_stride_head * elem, prefetch_bytes, 0, n);
  }
  for (int64_t pos = begin; pos < end; pos += kChunkTokens) {
    const int64_t next = pos + kChunkTokens;
    const int64_t next_n = std::max<int64_t>(0, std::min<int64_t>(kChunkTokens, end - next));
    if (next_n > 0) find_rows(p, table, next, next_n, s.k_rows[1 - cur], s.v_rows[1 - cur]);
    const int64_t n = std::min<int64_t>(kChunkTokens, end - pos);
    const Chunk chunk{s.k_rows[cur], s.v_rows[cur], n,
                      Rows{s.k_rows[1 - cur], s.v_rows[1 - cur], next_n, 0, 0, p.head_dim * elem},
                      ((int64_t{1} << 16) + n - 1) / n};
    const bool last = next_n == 0 && after != nullptr && after->n > 0;
    for (int64_t m = 0; m < num_members; ++m) {
      s.base = members[m].base;
      // Read by the bfloat16 score paths (tiles and AVX512-BF16 vectors); a float32 query (over a
      // 16-bit cache) has none and takes the float32 path.
      if (p.query != nullptr)
        s.q_bf16 = reinterpret_cast<const c10::BFloat16*>(p.query + members[m].seq * p.q_stride_seq);
      for (int64_t kv = kv0; kv < kv1; ++kv) {
        // Each KV head asks for its own part of the next chunk's rows while it reads its part of
        // these; the next task's rows (whatever KV heads it reads) are asked for by the first.
        Chunk head_chunk = chunk;
        head_chunk.next.k_from = kv * p.k_stride_head * elem;
        head_chunk.next.v_from = kv * p.v_stride_head * elem;
        if (last) head_chunk.next = kv == kv0 ? *after : Rows{};
        for (int64_t g0 = 0; g0 < group; g0 += kHeadTile)
          attend_tile<kChunks>(p, s, head_chunk, kv, kv * group + g0, std::min<int64_t>(kHeadTile, group - g0),
                               m == 0 && g0 == 0);
      }
    }
    cur = 1 - cur;
  }
}

// Normalises and writes the outputs of heads [h_begin, h_end) of `m.seq`.
template <typename scalar_t>
void finish_state(const Problem<scalar_t>& p, const Scratch& s, const Member& m, int64_t h_begin, int64_t h_end) {
  for (int64_t h = h_begin; h < h_end; ++h) {
    const float inv = s.row_sum[m.base + h] > 0.0f ? 1.0f / s.row_sum[m.base + h] : 0.0f;
    const int64_t offset = (m.seq * p.num_heads + h) * p.head_dim;
    const float* acc = &s.acc[(m.base + h) * p.padded_dim];
    if (p.out_f32 != nullptr)
      for (int64_t d = 0; d < p.head_dim; ++d) p.out_f32[offset + d] = acc[d] * inv;
    else
      for (int64_t d = 0; d < p.head_dim; ++d) p.out[offset + d] = static_cast<scalar_t>(acc[d] * inv);
  }
}

// A work item: sequences order[first, first + count), whose first `shared_len` positions (a multiple
// of kChunkTokens; 0 for a lone sequence) sit in the same cache blocks. The shared positions are read
// from memory once for all members; each member then attends to the rest of its own positions. The
// chunks start at the same positions as they would for the sequence alone, so every member's result
// is bitwise the same as without the group.
struct Item {
  int64_t first, count, shared_len;
};

// Where sequence `seq`'s attended positions start: 0, or where its window starts.
template <typename scalar_t>
int64_t window_start(const Problem<scalar_t>& p, int64_t seq) {
  return p.window > 0 ? std::max<int64_t>(0, p.seq_lens[seq] - p.window) : 0;
}

// The first range an item attends, [begin, end) of its first member's block table: a group's shared
// positions, else the sequence's own.
template <typename scalar_t>
std::pair<int64_t, int64_t> first_range(const Problem<scalar_t>& p, const std::vector<int64_t>& order,
                                        const Item& item) {
  const int64_t seq = order[item.first];
  if (item.shared_len > 0) return {0, item.shared_len};
  return {window_start(p, seq), p.seq_lens[seq]};
}

// `after` (may be null): rows to prefetch during the item's last chunk.
template <int kChunks, typename scalar_t>
void attend_item(const Problem<scalar_t>& p, Scratch& s, const std::vector<int64_t>& order, const Item& item,
                 int64_t kv0, int64_t kv1, const Rows* after) {
  const int64_t group = p.num_heads / p.kv_heads;
  const int64_t h_begin = kv0 * group, h_end = kv1 * group;
  Member members[kMaxMembers];
  for (int64_t m = 0; m < item.count; ++m) {
    members[m] = Member{order[item.first + m], m * p.num_heads};
    init_state(p, s, members[m], h_begin, h_end);
  }
  if (item.shared_len > 0) {
    const int64_t* leader_table = p.block_tables + members[0].seq * p.table_stride;
    attend_range<kChunks>(p, s, leader_table, 0, item.shared_len, kv0, kv1, members, item.count);
  }
  for (int64_t m = 0; m < item.count; ++m) {
    const int64_t seq = members[m].seq, seq_len = p.seq_lens[seq];
    const int64_t begin = item.shared_len > 0 ? item.shared_len : window_start(p, seq);
    attend_range<kChunks>(p, s, p.block_tables + seq * p.table_stride, begin, seq_len, kv0, kv1, &members[m], 1,
                          m + 1 == item.count ? after : nullptr);
    finish_state(p, s, members[m], h_begin, h_end);
  }
}

// Leading block ids two block tables have in common, among the first `limit`.
inline int64_t common_blocks(const int64_t* a, const int64_t* b, int64_t limit) {
  int64_t n = 0;
  while (n < limit && a[n] == b[n]) ++n;
  return n;
}

// The work items: sequences whose block tables start with the same cache blocks (a shared system
// prompt, n > 1 siblings, forks) form groups that read those blocks once; the others stand alone.
// Without a window only: a window's first position depends on the sequence's length.
template <typename scalar_t>
std::vector<Item> plan_items(const Problem<scalar_t>& p, int64_t num_seqs, std::vector<int64_t>& order) {
  order.resize(num_seqs);
  for (int64_t i = 0; i < num_seqs; ++i) order[i] = i;
  std::vector<Item> items;
  const auto table = [&](int64_t seq) { return p.block_tables + seq * p.table_stride; };
  // Blocks whose every position is below the sequence's length: their contents are settled.
  const auto full_blocks = [&](int64_t seq) { return p.seq_lens[seq] / p.block_size; };
  if (p.window > 0 || num_seqs < 2) {
    for (int64_t i = 0; i < num_seqs; ++i) items.push_back(Item{i, 1, 0});
    return items;
  }
  // Sorted by their full blocks' ids, lexicographically: sequences with long common prefixes end up
  // side by side.
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    const int64_t n = std::min(full_blocks(a), full_blocks(b));
    const int64_t common = common_blocks(table(a), table(b), n);
    return common < n ? table(a)[common] < table(b)[common] : full_blocks(a) < full_blocks(b);
  });
  const int64_t min_shared_blocks = (kChunkTokens + p.block_size - 1) / p.block_size;
  int64_t i = 0;
  while (i < num_seqs) {
    // Grow a group from order[i] while the next sequence shares at least one chunk of blocks with
    // it and joining does not halve what the group shares.
    const int64_t leader = order[i];
    int64_t shared_blocks = full_blocks(leader), j = i + 1;
    while (j < num_seqs && j - i < kMaxMembers) {
      const int64_t seq = order[j];
      const int64_t common =
          common_blocks(table(leader), table(seq), std::min(shared_blocks, full_blocks(seq)));
      if (common < min_shared_blocks || (j - i > 1 && 2 * common < shared_blocks)) break;
      shared_blocks = common;
      ++j;
    }
    const int64_t shared_len = j - i > 1 ? shared_blocks * p.block_size / kChunkTokens * kChunkTokens : 0;
    items.push_back(Item{i, j - i, shared_len});
    i = j;
  }
  return items;
}

// Splits the largest groups in halves while there are fewer than two tasks a thread (a task is an
// item and a KV head, or a whole item): one shared-prefix group of 16 sequences with 3 KV heads would
// otherwise give two threads 3 equal tasks, so that one thread works for two tasks' time while the
// other waits through the second. Each half reads the shared blocks again (from cache where they still
// are); every member's arithmetic, and so its result, is unchanged.
inline void split_groups(std::vector<Item>& items, int64_t kv_heads, int threads) {
  while (static_cast<int64_t>(items.size()) * kv_heads < 2 * threads) {
    const auto largest = std::max_element(items.begin(), items.end(),
                                          [](const Item& a, const Item& b) { return a.count < b.count; });
    if (largest == items.end() || largest->count < 2) return;
    const int64_t half = largest->count / 2;
    const Item second{largest->first + half, largest->count - half, largest->shared_len};
    largest->count = half;
    items.push_back(second);
  }
}

template <int kChunks, typename scalar_t>
void run(const Problem<scalar_t>& p, int64_t num_seqs) {
  const int threads = std::max(1, at::get_num_threads());  // torch.set_num_threads governs this kernel too
  // A small step (one short sequence: tens of microseconds of work) stays on the calling thread: a
  // second thread gains microseconds on idle cores, and costs a whole scheduler time slice at the
  // barrier when another process (the API server) holds a core.
  int64_t kv_elements = 0;
  for (int64_t seq = 0; seq < num_seqs; ++seq) {
    const int64_t len = p.window > 0 ? std::min(p.seq_lens[seq], p.window) : p.seq_lens[seq];
    kv_elements += 2 * len * p.kv_heads * p.head_dim;
  }
  constexpr int64_t kMinKvElementsToShare = int64_t{1} << 19;
  const bool shared = kv_elements >= kMinKvElementsToShare;
  std::vector<int64_t> order;
  std::vector<Item> items = plan_items(p, num_seqs, order);
  if (shared) split_groups(items, p.kv_heads, threads);  // one thread: nothing to balance
  int64_t max_members = 1;
  for (const Item& item : items) max_members = std::max(max_members, item.count);
  // Whole items when there are enough to share out (whole rows stream from memory); otherwise one task
  // per (item, KV head), so that a few long sequences still use every thread.
  const int64_t num_items_whole = static_cast<int64_t>(items.size());
  const int64_t kv_per_task = num_items_whole >= 4 * threads ? p.kv_heads : 1;
  const int64_t tasks_per_item = p.kv_heads / kv_per_task;
  const int64_t num_tasks = num_items_whole * tasks_per_item;
  const int num_threads = shared ? static_cast<int>(std::min<int64_t>(threads, num_tasks)) : 1;
  const int64_t elem = static_cast<int64_t>(sizeof(scalar_t));
  std::atomic<int64_t> claimed{0};
#pragma omp parallel num_threads(num_threads)
  {
    Scratch s;
#ifdef TOKENMILL_ATTENTION_AMX
    std::unique_ptr<TileBuffers> tiles;
    if (p.tiles) {
      tiles = std::make_unique_for_overwrite<TileBuffers>();  // every part read is written first
      s.tiles = tiles.get();
      configure_tiles();
    }
#endif
    s.q.resize(max_members * p.num_heads * p.padded_dim);
    s.acc.resize(max_members * p.num_heads * p.padded_dim);
    s.row_max.resize(max_members * p.num_heads);
    s.row_sum.resize(max_members * p.num_heads);
    // Tasks are taken in order from a shared counter (sequence lengths differ, so equal shares of
    // tasks are not equal shares of work), one ahead: a thread knows its next task while it works on
    // the current one, and asks for that task's first rows during the current one's last chunk.
    int64_t task = claimed.fetch_add(1);
    while (task < num_tasks) {
      const int64_t following = claimed.fetch_add(1);
      Rows after;
      if (following < num_tasks) {
        const Item& next_item = items[following / tasks_per_item];
        const int64_t next_kv0 = following % tasks_per_item * kv_per_task, seq = order[next_item.first];
        const auto [begin, end] = first_range(p, order, next_item);
        after.n = std::max<int64_t>(0, std::min<int64_t>(kChunkTokens, end - begin));
        if (after.n > 0)
          find_rows(p, p.block_tables + seq * p.table_stride, begin, after.n, s.upcoming_k_rows, s.upcoming_v_rows);
        after.k_rows = s.upcoming_k_rows;
        after.v_rows = s.upcoming_v_rows;
        after.k_from = next_kv0 * p.k_stride_head * elem;
        after.v_from = next_kv0 * p.v_stride_head * elem;
        after.bytes = ((kv_per_task - 1) * p.k_stride_head + p.head_dim) * elem;
      }
      const Item& item = items[task / tasks_per_item];
      const int64_t kv0 = task % tasks_per_item * kv_per_task;
      attend_item<kChunks>(p, s, order, item, kv0, kv0 + kv_per_task, &after);
      task = following;
    }
#ifdef TOKENMILL_ATTENTION_AMX
    if (p.tiles) _tile_release();
#endif
  }
}

#define TOKENMILL_FLOAT_CASES(...)          \
  AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) \
  AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__) AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__)

at::Tensor paged_attention_decode(const at::Tensor& query, const at::Tensor& key_cache,
                                  const at::Tensor& value_cache, const at::Tensor& block_tables,
                                  const at::Tensor& seq_lens, double scale, int64_t window, bool tiles,
                                  const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(query.dim() == 3, "query must be [S, num_heads, head_dim]");
  TORCH_CHECK(key_cache.dim() == 4 && value_cache.dim() == 4,
              "key_cache/value_cache must be [num_blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(key_cache.sizes() == value_cache.sizes(), "key_cache and value_cache shapes differ");
  TORCH_CHECK(query.device().is_cpu() && key_cache.device().is_cpu() && value_cache.device().is_cpu() &&
                  block_tables.device().is_cpu() && seq_lens.device().is_cpu(),
              "paged_attention_decode runs on CPU tensors");
  const bool float32_query = query.scalar_type() == at::kFloat && key_cache.scalar_type() != at::kFloat;
  TORCH_CHECK(key_cache.scalar_type() == value_cache.scalar_type() &&
                  (key_cache.scalar_type() == query.scalar_type() ||
                   (float32_query && (key_cache.scalar_type() == at::kBFloat16 || key_cache.scalar_type() == at::kHalf))),
              "query and caches must share a dtype, or a float32 query read a bfloat16 or float16 cache; got ",
              query.scalar_type(), " and ", key_cache.scalar_type());
  TORCH_CHECK(at::isIntegralType(block_tables.scalar_type(), false) &&
                  at::isIntegralType(seq_lens.scalar_type(), false),
              "block_tables and seq_lens must be integer tensors");
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t kv_heads = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == head_dim, "cache head_dim ", key_cache.size(3), " != query head_dim ",
              head_dim);
  TORCH_CHECK(head_dim > 0 && head_dim <= kMaxHeadDim, "head_dim ", head_dim, " not in [1, ", kMaxHeadDim,
              "]");
  TORCH_CHECK(kv_heads > 0 && num_heads % kv_heads == 0, "num_heads must be a multiple of kv_heads");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == num_seqs,
              "block_tables must be [S, max_blocks]");
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.size(0) == num_seqs, "seq_lens must be [S]");
  TORCH_CHECK(query.stride(2) == 1 && key_cache.stride(3) == 1 && value_cache.stride(3) == 1,
              "the head_dim axis must be contiguous");
  // Tiny tensors: one int64 layout keeps the number of kernel instantiations down.
  at::Tensor sink_values;  // [num_heads] float32, defined when the layer has attention sinks
  if (sinks.has_value() && sinks->defined()) {
    TORCH_CHECK(sinks->dim() == 1 && sinks->size(0) == num_heads && sinks->device().is_cpu(),
                "sinks must be a CPU tensor [num_heads]");
    sink_values = sinks->to(at::kFloat).contiguous();
  }
  const at::Tensor tables = block_tables.to(at::kLong).contiguous();
  const at::Tensor lens = seq_lens.to(at::kLong).contiguous();
  at::Tensor out =
      at::empty({num_seqs, num_heads, head_dim}, query.options().memory_format(at::MemoryFormat::Contiguous));
  if (num_seqs == 0) return out;
  const int64_t* len_values = lens.data_ptr<int64_t>();
  const int64_t longest = *std::max_element(len_values, len_values + num_seqs);  // no operator call
  TORCH_CHECK(longest <= tables.size(1) * key_cache.size(1), "a seq_len exceeds its block table");

  AT_DISPATCH_SWITCH(key_cache.scalar_type(), "paged_attention_decode", TOKENMILL_FLOAT_CASES([&] {
                       Problem<scalar_t> p{};
                       if (float32_query) {
                         p.query_f32 = query.data_ptr<float>();
                         p.out_f32 = out.data_ptr<float>();
                       } else {
                         p.query = query.data_ptr<scalar_t>();
                         p.out = out.data_ptr<scalar_t>();
                       }
                       p.key_cache = key_cache.data_ptr<scalar_t>();
                       p.value_cache = value_cache.data_ptr<scalar_t>();
                       p.block_tables = tables.data_ptr<int64_t>();
                       p.seq_lens = lens.data_ptr<int64_t>();
                       p.q_stride_seq = query.stride(0);
                       p.q_stride_head = query.stride(1);
                       p.k_stride_block = key_cache.stride(0);
                       p.k_stride_slot = key_cache.stride(1);
                       p.k_stride_head = key_cache.stride(2);
                       p.v_stride_block = value_cache.stride(0);
                       p.v_stride_slot = value_cache.stride(1);
                       p.v_stride_head = value_cache.stride(2);
                       p.table_stride = tables.stride(0);
                       p.num_heads = num_heads;
                       p.kv_heads = kv_heads;
                       p.head_dim = head_dim;
                       p.block_size = key_cache.size(1);
                       p.window = window;
                       p.chunks = (head_dim + kLanes - 1) / kLanes;
                       p.padded_dim = p.chunks * kLanes;
                       p.scale = static_cast<float>(scale);
                       p.sinks = sink_values.defined() ? sink_values.data_ptr<float>() : nullptr;
#ifdef TOKENMILL_ATTENTION_AMX
                       p.tiles = tiles && !float32_query && std::is_same_v<scalar_t, c10::BFloat16> &&
                                 (head_dim == 64 || head_dim == 128) &&
                                 p.block_size == kTileRows && p.num_heads / p.kv_heads <= kTileRows &&
                                 ops::attention_tiles_available();
#endif
                       if (head_dim == 64)
                         run<4>(p, num_seqs);
                       else if (head_dim == 128)
                         run<8>(p, num_seqs);
                       else
                         run<0>(p, num_seqs);
                     }));
  return out;
}

// Stores each token's key and value rows at its slot of the paged cache:
//   key, value   [T, kv_heads, head_dim], each row (kv_heads * head_dim elements) contiguous
//   key_cache, value_cache [num_blocks, block_size, kv_heads, head_dim] contiguous, key's dtype, or
//                bfloat16 / float16 for float32 rows (each element rounded to nearest, ties to even)
//   slot_mapping [T] int64, every slot in [0, num_blocks * block_size)
// Equivalent to index_copy_ of the rows in the cache's dtype into the caches viewed as
// [num_slots, kv_heads, head_dim]. The slots are
// scattered over the pool and usually not in cache: every destination line is requested before any
// row is written, so the misses overlap instead of each copy waiting for its own.
// write_kv's float32 rows into a 16-bit cache (checked by write_kv): each element converted by
// c10's rounding, the one torch's .to() uses.
template <typename cache_t>
void narrow_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache, at::Tensor& value_cache,
               const int64_t* slots) {
  const int64_t row = key.size(1) * key.size(2);
  const float* k_src = key.data_ptr<float>();
  const float* v_src = value.data_ptr<float>();
  const int64_t k_stride = key.stride(0), v_stride = value.stride(0);
  cache_t* k_dst = key_cache.data_ptr<cache_t>();
  cache_t* v_dst = value_cache.data_ptr<cache_t>();
  at::parallel_for(0, key.size(0), 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      cache_t* k = k_dst + slots[t] * row;
      cache_t* v = v_dst + slots[t] * row;
      for (int64_t i = 0; i < row; ++i) k[i] = static_cast<cache_t>(k_src[t * k_stride + i]);
      for (int64_t i = 0; i < row; ++i) v[i] = static_cast<cache_t>(v_src[t * v_stride + i]);
    }
  });
}

void write_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor key_cache, at::Tensor value_cache,
              const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && value.dim() == 3 && key.sizes() == value.sizes(),
              "key and value must both be [T, kv_heads, head_dim]");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes(),
              "key_cache/value_cache must be [num_blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "the caches must be contiguous");
  const bool narrowing = key.scalar_type() == at::kFloat &&
                         (key_cache.scalar_type() == at::kBFloat16 || key_cache.scalar_type() == at::kHalf);
  TORCH_CHECK(value.scalar_type() == key.scalar_type() && value_cache.scalar_type() == key_cache.scalar_type() &&
                  (key.scalar_type() == key_cache.scalar_type() || narrowing),
              "key, value and the caches must share a dtype, or float32 rows go to a bfloat16 or float16 cache; "
              "got ", key.scalar_type(), " rows and a ", key_cache.scalar_type(), " cache");
  TORCH_CHECK(key.size(1) == key_cache.size(2) && key.size(2) == key_cache.size(3),
              "key rows do not match the cache's [kv_heads, head_dim]");
  TORCH_CHECK(key.stride(2) == 1 && key.stride(1) == key.size(2) && value.stride(2) == 1 &&
                  value.stride(1) == value.size(2),
              "each token's key/value row must be contiguous");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 && slot_mapping.is_contiguous() &&
                  slot_mapping.size(0) == key.size(0),
              "slot_mapping must be contiguous int64 [T]");
  TORCH_CHECK(key.device().is_cpu() && key_cache.device().is_cpu() && slot_mapping.device().is_cpu(),
              "write_kv runs on CPU tensors");
  const int64_t num_tokens = key.size(0);
  const int64_t num_slots = key_cache.size(0) * key_cache.size(1);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot ", slots[t], " outside the cache's ", num_slots);
  if (narrowing) {
    AT_DISPATCH_SWITCH(key_cache.scalar_type(), "write_kv",
                       AT_DISPATCH_CASE(at::kBFloat16, [&] { narrow_kv<scalar_t>(key, value, key_cache, value_cache, slots); })
                           AT_DISPATCH_CASE(at::kHalf, [&] { narrow_kv<scalar_t>(key, value, key_cache, value_cache, slots); }));
    return;
  }
  const int64_t row_bytes = key.size(1) * key.size(2) * key.element_size();
  const char* k_src = static_cast<const char*>(key.data_ptr());
  const char* v_src = static_cast<const char*>(value.data_ptr());
  const int64_t k_stride = key.stride(0) * key.element_size(), v_stride = value.stride(0) * value.element_size();
  char* k_dst = static_cast<char*>(key_cache.data_ptr());
  char* v_dst = static_cast<char*>(value_cache.data_ptr());
  at::parallel_for(0, num_tokens, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t b = 0; b < row_bytes; b += 64) {
        __builtin_prefetch(k_dst + slots[t] * row_bytes + b, 1, 3);
        __builtin_prefetch(v_dst + slots[t] * row_bytes + b, 1, 3);
      }
    for (int64_t t = begin; t < end; ++t) {
      std::memcpy(k_dst + slots[t] * row_bytes, k_src + t * k_stride, row_bytes);
      std::memcpy(v_dst + slots[t] * row_bytes, v_src + t * v_stride, row_bytes);
    }
  });
}

}  // namespace
}  // namespace tokenmill

namespace tokenmill::ops {
bool attention_tiles_available() {
#ifdef TOKENMILL_ATTENTION_AMX
  return amx_permitted();
#else
  return false;
#endif
}
void write_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor key_cache, at::Tensor value_cache,
              const at::Tensor& slot_mapping) {
  ::tokenmill::write_kv(key, value, key_cache, value_cache, slot_mapping);
}
at::Tensor paged_attention_decode(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                                  int64_t window, const std::optional<at::Tensor>& sinks, bool tiles) {
  return ::tokenmill::paged_attention_decode(query, key_cache, value_cache, block_tables, seq_lens, scale, window,
                                             tiles, sinks);
}
}  // namespace tokenmill::ops

TORCH_LIBRARY(tokenmill, m) {
  m.def(
      "paged_attention_decode(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
      "Tensor seq_lens, float scale, int window, bool tiles=True, Tensor? sinks=None) -> Tensor");
  m.def("write_kv(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor slot_mapping) -> ()");
  m.def("attention_tiles_available() -> bool", &tokenmill::ops::attention_tiles_available);
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("paged_attention_decode", &tokenmill::paged_attention_decode);
  m.impl("write_kv", &tokenmill::write_kv);
}
