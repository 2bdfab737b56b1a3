// Float32 linear layer over a weight packed in panels of 16 output features, for AVX2 CPUs
// (layers/cpu_gemm.py uses it where the CPU has no AVX-512: there oneDNN's float32 kernels reach ~45
// GFLOP/s at the 16 rows of a decode step on a 2-core Zen 3, this one ~75).
//
// Layout: a weight [out, in] becomes panels [ceil(out / 16), in, 16]: panel p holds output features
// 16p .. 16p + 15 (zeros past `out`), and for each input feature i the 16 weights of those outputs
// side by side, so a step of the inner loop reads one 64-byte line. A register tile of up to 6 rows x
// 16 outputs keeps 12 float32 accumulators (of AVX2's 16 registers); each step broadcasts one input
// value per row and does 12 fused multiply-adds. Threads split the panels; each thread runs every
// row tile of a panel while the panel is in its caches (it is read from memory once), and meanwhile
// prefetches the thread's next panel into L2, so that streaming the weights overlaps the arithmetic:
// with up to three row tiles (2 to 18 rows, decode steps) every tile asks for an equal share of its
// lines, spread over the whole panel's arithmetic; with more tiles the second asks for all of them
// (spreading was 4-6% slower at 32 and 66 rows); a single row leaves the stream to the hardware
// prefetcher. SmolLM2's 30 layers on a Zen 3, against the second tile alone (best of 12,
// alternating in one process): 16 rows 31.3 vs 35.5 ms, 8 rows 25.6 vs 31.3, 12 rows 27.5 vs 28.7,
// 6 rows (one tile, no prefetch before) 22.4 vs 24.1; 1 and 32 rows unchanged. Each output is one
// float32 sum over the input features in order, plus the bias: it does not depend on the number of
// rows or threads.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "cpu_ops.h"
#include "vec16.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TOKENMILL_F32_PANELS 1
#endif

namespace tokenmill {
namespace {

constexpr int64_t kPanelWidth = 16;  // output features per panel: two 8-lane vectors
constexpr int64_t kTileRows = 6;     // rows per register tile: 6 x 2 accumulators
constexpr int64_t kSpreadTiles = 3;  // up to this many row tiles share the next panel's prefetches

#ifdef TOKENMILL_F32_PANELS

// y[r][0..cols) = x[r] . panel (+ bias) for the R rows of one tile; `prefetch` (or null) is a panel
// whose lines i with i % pf_every == pf_phase (the tile's share) are brought into L2 meanwhile, one at
// the step of the same index.
template <int R>
void panel_tile(const float* x, int64_t x_stride, const float* panel, int64_t in_features, const float* bias,
                float* y, int64_t y_stride, int64_t cols, const float* prefetch, int64_t pf_every, int64_t pf_phase) {
  __m256 acc[R][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  // GCC keeps the accumulators in registers only when every loop over the rows is unrolled.
  int64_t countdown = pf_phase + 1;  // steps to this tile's next line to prefetch (no division in the loop)
  for (int64_t i = 0; i < in_features; ++i) {
    const __m256 w0 = _mm256_loadu_ps(panel + i * kPanelWidth);
    const __m256 w1 = _mm256_loadu_ps(panel + i * kPanelWidth + 8);
    if (prefetch != nullptr && --countdown == 0) {
      vec::prefetch_l2(prefetch + i * kPanelWidth);
      countdown = pf_every;
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 xr = _mm256_broadcast_ss(x + r * x_stride + i);
      acc[r][0] = _mm256_fmadd_ps(xr, w0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(xr, w1, acc[r][1]);
    }
  }
  alignas(32) float sums[kPanelWidth];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    _mm256_store_ps(sums, acc[r][0]);
    _mm256_store_ps(sums + 8, acc[r][1]);
    float* out = y + r * y_stride;
    for (int64_t c = 0; c < cols; ++c) out[c] = bias == nullptr ? sums[c] : sums[c] + bias[c];
  }
}

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, const float*, float*, int64_t, int64_t,
                        const float*, int64_t, int64_t);
constexpr TileFn kTiles[kTileRows + 1] = {nullptr,          panel_tile<1>, panel_tile<2>, panel_tile<3>,
                                          panel_tile<4>, panel_tile<5>, panel_tile<6>};

#endif  // TOKENMILL_F32_PANELS

bool f32_panels_available() {
#ifdef TOKENMILL_F32_PANELS
  return true;
#else
  return false;
#endif
}

at::Tensor f32_panel_linear(const at::Tensor& x, const at::Tensor& panels, const c10::optional<at::Tensor>& bias,
                            int64_t out_features) {
  TORCH_CHECK(f32_panels_available(), "f32_panel_linear needs a CPU with AVX2 and FMA");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "f32_panel_linear: x must be float32 [rows, in_features] with contiguous rows");
  TORCH_CHECK(panels.dim() == 3 && panels.scalar_type() == at::kFloat && panels.is_contiguous() &&
                  panels.size(2) == kPanelWidth,
              "f32_panel_linear: panels must be contiguous float32 [num_panels, in_features, 16]");
  const int64_t rows = x.size(0), in_features = x.size(1), num_panels = panels.size(0);
  TORCH_CHECK(panels.size(1) == in_features, "f32_panel_linear: x has ", in_features, " features, the panels ",
              panels.size(1));
  TORCH_CHECK(out_features > (num_panels - 1) * kPanelWidth && out_features <= num_panels * kPanelWidth,
              "f32_panel_linear: ", num_panels, " panels cannot hold ", out_features, " output features");
  const float* bias_data = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out_features && bias->scalar_type() == at::kFloat &&
                    bias->is_contiguous(),
                "f32_panel_linear: bias must be contiguous float32 [out_features]");
    bias_data = bias->data_ptr<float>();
  }
  at::Tensor y = at::empty({rows, out_features}, x.options());  // [rows, out_features]
#ifdef TOKENMILL_F32_PANELS
  if (rows == 0) return y;
  const float* x_data = x.data_ptr<float>();
  const int64_t x_stride = x.stride(0);
  const float* panel_data = panels.data_ptr<float>();
  float* y_data = y.data_ptr<float>();
  const int64_t panel_size = in_features * kPanelWidth;
  const int64_t num_tiles = (rows + kTileRows - 1) / kTileRows;
  const bool spread = rows > 1 && num_tiles <= kSpreadTiles;  // else the second tile prefetches all
  at::parallel_for(0, num_panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t col0 = p * kPanelWidth, cols = std::min(kPanelWidth, out_features - col0);
      const float* panel = panel_data + p * panel_size;
      const float* next = p + 1 < end ? panel + panel_size : nullptr;
      for (int64_t r0 = 0, tile = 0; r0 < rows; r0 += kTileRows, ++tile) {
        const int64_t tile_rows = std::min(kTileRows, rows - r0);
        const float* prefetch = spread || tile == 1 ? next : nullptr;
        kTiles[tile_rows](x_data + r0 * x_stride, x_stride, panel, in_features,
                          bias_data == nullptr ? nullptr : bias_data + col0, y_data + r0 * out_features + col0,
                          out_features, cols, prefetch, spread ? num_tiles : 1, spread ? tile : 0);
      }
    }
  });
#endif
  return y;
}

}  // namespace
}  // namespace tokenmill

namespace tokenmill::ops {
at::Tensor f32_panel_linear(const at::Tensor& x, const at::Tensor& panels, const std::optional<at::Tensor>& bias,
                            int64_t out_features) {
  return ::tokenmill::f32_panel_linear(x, panels, bias, out_features);
}
}  // namespace tokenmill::ops

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("f32_panels_available() -> bool", &tokenmill::f32_panels_available);
  m.def("f32_panel_linear(Tensor x, Tensor panels, Tensor? bias, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) { m.impl("f32_panel_linear", &tokenmill::f32_panel_linear); }
