// The hot loops of the hybrid models' recurrent layers (layers/recurrent_kernel.py; the torch reference
// is layers/gated_delta.py and layers/mamba2.py), float32 throughout, written once against vec16.h
// (AVX-512, AVX2 halves, or plain loops):
//   causal_conv       depthwise causal convolution + bias + SiLU over a prompt chunk (vectors over channels)
//   causal_conv_step  one new input per sequence, the convolution state shifted in place
//   gated_delta       the gated delta rule (Qwen3-Next), token by token from the carried state; the
//                     state's columns (value dims) are independent, so a work item holds a block of
//                     up to 64 columns and walks the tokens, one pass over the block per token
//   ssd_scan          Mamba-2's selective scan, token by token; each head_dim row of the state is
//                     independent, held in registers across the tokens
// The scans take S sequences of n tokens each: decode is n = 1 with the batch in S, a prompt is S = 1.
// States are updated in place.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <vector>

#include "vec16.h"

// The op library's name; a test builds the AVX2 variant under another name beside the native one.
#ifndef TOKENMILL_RECURRENT_LIBRARY
#define TOKENMILL_RECURRENT_LIBRARY tokenmill_recurrent
#endif

namespace tokenmill_recurrent {
namespace {

namespace vec = tokenmill::vec;
using vec::Vec;

constexpr int kMaxVecs = 4;  // columns per work item / state row chunk: 4 vectors of 16 floats

inline Vec silu(Vec x) {
  const Vec e = vec::exp(vec::sub(vec::zero(), x));
  return vec::div(x, vec::add(vec::splat(1.0f), e));
}

inline float silu1(float x) { return x / (1.0f + std::exp(-x)); }

void check_float(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.device().is_cpu(), what,
              " must be a contiguous float32 CPU tensor");
}

// out[t, c] = silu(bias[c] + sum_j weight_t[j, c] * full[t + j, c]) for t < L - K + 1.
at::Tensor causal_conv(const at::Tensor& full, const at::Tensor& weight_t, const c10::optional<at::Tensor>& bias) {
  check_float(full, "causal_conv: full");
  check_float(weight_t, "causal_conv: weight_t");
  TORCH_CHECK(full.dim() == 2 && weight_t.dim() == 2 && full.size(1) == weight_t.size(1),
              "causal_conv: full [L, C], weight_t [K, C]");
  const int64_t kernel = weight_t.size(0), channels = full.size(1), n = full.size(0) - kernel + 1;
  TORCH_CHECK(n >= 0, "causal_conv: fewer rows than the kernel");
  const float* b = nullptr;
  if (bias.has_value()) {
    check_float(*bias, "causal_conv: bias");
    TORCH_CHECK(bias->numel() == channels, "causal_conv: bias [C]");
    b = bias->data_ptr<float>();
  }
  at::Tensor out = at::empty({n, channels}, full.options());
  const float* f = full.data_ptr<float>();
  const float* w = weight_t.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t c = 0; c < channels; c += vec::kLanes) {
        const int lanes = static_cast<int>(std::min<int64_t>(vec::kLanes, channels - c));
        Vec acc = b ? vec::load(b + c, lanes) : vec::zero();
        for (int64_t j = 0; j < kernel; ++j)
          acc = vec::fmadd(vec::load(w + j * channels + c, lanes), vec::load(f + (t + j) * channels + c, lanes), acc);
        vec::store(o + t * channels + c, silu(acc), lanes);
      }
    }
  });
  return out;
}

// One input per sequence: full = [states[b, c, :], inputs[b, c]]; out = silu(bias + weight . full);
// states[b, c, :] = full[1:].
at::Tensor causal_conv_step(const at::Tensor& inputs, at::Tensor& states, const at::Tensor& weight,
                            const c10::optional<at::Tensor>& bias) {
  check_float(inputs, "causal_conv_step: inputs");
  check_float(states, "causal_conv_step: states");
  check_float(weight, "causal_conv_step: weight");
  const int64_t batch = inputs.size(0), channels = inputs.size(1), kernel = weight.size(1);
  TORCH_CHECK(states.dim() == 3 && states.size(0) == batch && states.size(1) == channels &&
                  states.size(2) == kernel - 1 && weight.size(0) == channels,
              "causal_conv_step: inputs [B, C], states [B, C, K - 1], weight [C, K]");
  const float* b = nullptr;
  if (bias.has_value()) {
    check_float(*bias, "causal_conv_step: bias");
    b = bias->data_ptr<float>();
  }
  at::Tensor out = at::empty({batch, channels}, inputs.options());
  const float* x = inputs.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* st = states.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, batch * channels, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t c = i % channels;
      float* s = st + i * (kernel - 1);
      const float* wc = w + c * kernel;
      float acc = b ? b[c] : 0.0f;
      for (int64_t j = 0; j < kernel - 1; ++j) acc += wc[j] * s[j];
      acc += wc[kernel - 1] * x[i];
      for (int64_t j = 0; j + 1 < kernel - 1; ++j) s[j] = s[j + 1];
      if (kernel > 1) s[kernel - 2] = x[i];
      o[i] = silu1(acc);
    }
  });
  return out;
}

// One work item of gated_delta: sequence s, head h, columns [c0, c0 + 16 * NV) (the last `lanes_last`).
// Per token: S *= exp(g); r = S^T k; d = beta (v - r); S += k d^T; o = S^T q. The decay and the recall
// of token t + 1 are fused into token t's update pass.
template <int NV>
void delta_block(const float* q, const float* k, const float* v, const float* g, const float* beta, float* state,
                 float* out, int64_t n, int64_t heads, int64_t k_dim, int64_t v_dim, int64_t c0, int lanes_last) {
  auto lanes = [&](int u) { return u == NV - 1 ? lanes_last : vec::kLanes; };
  const int64_t qk_stride = heads * k_dim, v_stride = heads * v_dim;
  Vec r[NV];
  for (int u = 0; u < NV; ++u) r[u] = vec::zero();
  {
    const Vec decay = vec::splat(std::exp(g[0]));
    for (int64_t i = 0; i < k_dim; ++i) {
      float* row = state + i * v_dim + c0;
      const Vec ki = vec::splat(k[i]);
      for (int u = 0; u < NV; ++u) {
        const Vec s = vec::mul(vec::load(row + 16 * u, lanes(u)), decay);
        vec::store(row + 16 * u, s, lanes(u));
        r[u] = vec::fmadd(ki, s, r[u]);
      }
    }
  }
  for (int64_t t = 0; t < n; ++t) {
    const float* qt = q + t * qk_stride;
    const float* kt = k + t * qk_stride;
    const float* vt = v + t * v_stride + c0;
    const bool next = t + 1 < n;
    const float* kn = next ? k + (t + 1) * qk_stride : kt;
    const Vec decay = vec::splat(next ? std::exp(g[(t + 1) * heads]) : 1.0f);
    const Vec b = vec::splat(beta[t * heads]);
    Vec d[NV], o[NV], rn[NV];
    for (int u = 0; u < NV; ++u) {
      d[u] = vec::mul(vec::sub(vec::load(vt + 16 * u, lanes(u)), r[u]), b);
      o[u] = vec::zero();
      rn[u] = vec::zero();
    }
    for (int64_t i = 0; i < k_dim; ++i) {
      float* row = state + i * v_dim + c0;
      const Vec ki = vec::splat(kt[i]), qi = vec::splat(qt[i]), kni = vec::splat(kn[i]);
      for (int u = 0; u < NV; ++u) {
        Vec s = vec::fmadd(ki, d[u], vec::load(row + 16 * u, lanes(u)));
        o[u] = vec::fmadd(qi, s, o[u]);
        if (next) {
          s = vec::mul(s, decay);
          rn[u] = vec::fmadd(kni, s, rn[u]);
        }
        vec::store(row + 16 * u, s, lanes(u));
      }
    }
    float* ot = out + t * v_stride + c0;
    for (int u = 0; u < NV; ++u) {
      vec::store(ot + 16 * u, o[u], lanes(u));
      r[u] = rn[u];
    }
  }
}

at::Tensor gated_delta(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                       const at::Tensor& beta, at::Tensor& state) {
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&q, &k, &v, &g, &beta, &state}) check_float(*t, "gated_delta: every tensor");
  TORCH_CHECK(q.dim() == 4 && k.sizes() == q.sizes() && v.dim() == 4 && state.dim() == 4,
              "gated_delta: q, k [S, n, H, Dk], v [S, n, H, Dv], state [S, H, Dk, Dv]");
  const int64_t seqs = q.size(0), n = q.size(1), heads = q.size(2), k_dim = q.size(3), v_dim = v.size(3);
  TORCH_CHECK(v.size(0) == seqs && v.size(1) == n && v.size(2) == heads && g.numel() == seqs * n * heads &&
                  beta.numel() == seqs * n * heads && state.size(0) == seqs && state.size(1) == heads &&
                  state.size(2) == k_dim && state.size(3) == v_dim,
              "gated_delta: shapes do not match");
  at::Tensor out = at::empty({seqs, n, heads, v_dim}, v.options());
  if (n == 0) return out;
  const int64_t block = kMaxVecs * vec::kLanes, blocks = (v_dim + block - 1) / block;
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *gp = g.data_ptr<float>(), *bp = beta.data_ptr<float>();
  float* sp = state.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, seqs * heads * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t cb = item % blocks, sh = item / blocks, s = sh / heads, h = sh % heads;
      const int64_t c0 = cb * block, cols = std::min(block, v_dim - c0);
      const int nv = static_cast<int>((cols + vec::kLanes - 1) / vec::kLanes);
      const int lanes_last = static_cast<int>(cols - (nv - 1) * vec::kLanes);
      const int64_t tok0 = s * n * heads + h;  // (s, t = 0, h) in [S, n, H]
      const float* qs = qp + tok0 * k_dim;
      const float* ks = kp + tok0 * k_dim;
      const float* vs = vp + tok0 * v_dim;
      float* st = sp + sh * k_dim * v_dim;
      float* os = op + tok0 * v_dim;
      switch (nv) {
        case 1: delta_block<1>(qs, ks, vs, gp + tok0, bp + tok0, st, os, n, heads, k_dim, v_dim, c0, lanes_last); break;
        case 2: delta_block<2>(qs, ks, vs, gp + tok0, bp + tok0, st, os, n, heads, k_dim, v_dim, c0, lanes_last); break;
        case 3: delta_block<3>(qs, ks, vs, gp + tok0, bp + tok0, st, os, n, heads, k_dim, v_dim, c0, lanes_last); break;
        default: delta_block<4>(qs, ks, vs, gp + tok0, bp + tok0, st, os, n, heads, k_dim, v_dim, c0, lanes_last);
      }
    }
  });
  return out;
}

// One state row p (of head h, sequence s), columns [c0, c0 + 16 * NV): row = exp(dt a) row + dt x[p] B;
// y[t, p] += row . C, for every token.
template <int NV>
void ssd_row(const float* x, const float* dt, const float* decays, const float* b, const float* c, float* row,
             float* y, int64_t n, int64_t heads, int64_t head_dim, int64_t state_size, int lanes_last) {
  auto lanes = [&](int u) { return u == NV - 1 ? lanes_last : vec::kLanes; };
  Vec s[NV];
  for (int u = 0; u < NV; ++u) s[u] = vec::load(row + 16 * u, lanes(u));
  const int64_t bc_stride = heads * state_size, x_stride = heads * head_dim;
  for (int64_t t = 0; t < n; ++t) {
    const Vec decay = vec::splat(decays[t]);
    const Vec dx = vec::splat(dt[t * heads] * x[t * x_stride]);
    const float* bt = b + t * bc_stride;
    const float* ct = c + t * bc_stride;
    Vec acc = vec::zero();
    for (int u = 0; u < NV; ++u) {
      s[u] = vec::fmadd(s[u], decay, vec::mul(dx, vec::load(bt + 16 * u, lanes(u))));
      acc = vec::fmadd(s[u], vec::load(ct + 16 * u, lanes(u)), acc);
    }
    y[t * x_stride] += vec::reduce_add(acc);
  }
  for (int u = 0; u < NV; ++u) vec::store(row + 16 * u, s[u], lanes(u));
}

at::Tensor ssd_scan(const at::Tensor& x, const at::Tensor& dt, const at::Tensor& a, const at::Tensor& b,
                    const at::Tensor& c, at::Tensor& state) {
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&x, &dt, &a, &b, &c, &state}) check_float(*t, "ssd_scan: every tensor");
  TORCH_CHECK(x.dim() == 4 && b.dim() == 4 && c.sizes() == b.sizes() && state.dim() == 4,
              "ssd_scan: x [S, n, H, P], b, c [S, n, H, N], state [S, H, P, N]");
  const int64_t seqs = x.size(0), n = x.size(1), heads = x.size(2), head_dim = x.size(3), state_size = b.size(3);
  TORCH_CHECK(b.size(0) == seqs && b.size(1) == n && b.size(2) == heads && dt.numel() == seqs * n * heads &&
                  a.numel() == heads && state.size(0) == seqs && state.size(1) == heads &&
                  state.size(2) == head_dim && state.size(3) == state_size,
              "ssd_scan: shapes do not match");
  at::Tensor y = at::zeros({seqs, n, heads, head_dim}, x.options());
  const float *xp = x.data_ptr<float>(), *dp = dt.data_ptr<float>(), *ap = a.data_ptr<float>();
  const float *bp = b.data_ptr<float>(), *cp = c.data_ptr<float>();
  float* sp = state.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  constexpr int64_t kRows = 8;  // state rows per work item
  const int64_t row_blocks = (head_dim + kRows - 1) / kRows;
  const int64_t block = kMaxVecs * vec::kLanes;
  at::parallel_for(0, seqs * heads * row_blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> decays(n);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t rb = item % row_blocks, sh = item / row_blocks, s = sh / heads, h = sh % heads;
      const int64_t tok0 = s * n * heads + h;
      for (int64_t t = 0; t < n; ++t) decays[t] = std::exp(dp[tok0 + t * heads] * ap[h]);
      for (int64_t p = rb * kRows; p < std::min(head_dim, (rb + 1) * kRows); ++p) {
        float* row = sp + (sh * head_dim + p) * state_size;
        for (int64_t c0 = 0; c0 < state_size; c0 += block) {
          const int64_t cols = std::min(block, state_size - c0);
          const int nv = static_cast<int>((cols + vec::kLanes - 1) / vec::kLanes);
          const int lanes_last = static_cast<int>(cols - (nv - 1) * vec::kLanes);
          const float* xs = xp + tok0 * head_dim + p;
          const float* bs = bp + tok0 * state_size + c0;
          const float* cs = cp + tok0 * state_size + c0;
          float* ys = yp + tok0 * head_dim + p;
          switch (nv) {
            case 1: ssd_row<1>(xs, dp + tok0, decays.data(), bs, cs, row + c0, ys, n, heads, head_dim, state_size, lanes_last); break;
            case 2: ssd_row<2>(xs, dp + tok0, decays.data(), bs, cs, row + c0, ys, n, heads, head_dim, state_size, lanes_last); break;
            case 3: ssd_row<3>(xs, dp + tok0, decays.data(), bs, cs, row + c0, ys, n, heads, head_dim, state_size, lanes_last); break;
            default: ssd_row<4>(xs, dp + tok0, decays.data(), bs, cs, row + c0, ys, n, heads, head_dim, state_size, lanes_last);
          }
        }
      }
    }
  });
  return y;
}

}  // namespace
}  // namespace tokenmill_recurrent

TORCH_LIBRARY(TOKENMILL_RECURRENT_LIBRARY, m) {
  m.def("causal_conv(Tensor full, Tensor weight_t, Tensor? bias) -> Tensor");
  m.def("causal_conv_step(Tensor inputs, Tensor(a!) states, Tensor weight, Tensor? bias) -> Tensor");
  m.def("gated_delta(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) state) -> Tensor");
  m.def("ssd_scan(Tensor x, Tensor dt, Tensor a, Tensor b, Tensor c, Tensor(a!) state) -> Tensor");
}

TORCH_LIBRARY_IMPL(TOKENMILL_RECURRENT_LIBRARY, CPU, m) {
  m.impl("causal_conv", &tokenmill_recurrent::causal_conv);
  m.impl("causal_conv_step", &tokenmill_recurrent::causal_conv_step);
  m.impl("gated_delta", &tokenmill_recurrent::gated_delta);
  m.impl("ssd_scan", &tokenmill_recurrent::ssd_scan);
}
