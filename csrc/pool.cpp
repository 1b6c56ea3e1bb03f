// Max-pooling and the fused bias + ReLU + max-pool. Threads split output planes, which own
// disjoint input planes, so writes never collide.
#include "pool.h"

#include <cmath>
#include <cstring>

#include "parallel.h"

namespace pyhet {

namespace {

// Max of one window: the first maximum wins, a NaN wins over everything (PyTorch's rule).
inline void window_max(const float* plane, int64_t W, int64_t h0, int64_t w0, int64_t kh,
                       int64_t kw, float* best, int32_t* where) {
  float m = plane[h0 * W + w0];
  int32_t at = static_cast<int32_t>(h0 * W + w0);
  for (int64_t i = 0; i < kh && !std::isnan(m); ++i)
    for (int64_t j = 0; j < kw; ++j) {
      const float v = plane[(h0 + i) * W + w0 + j];
      if (v > m || std::isnan(v)) {
        m = v;
        at = static_cast<int32_t>((h0 + i) * W + w0 + j);
        if (std::isnan(v)) break;
      }
    }
  *best = m;
  *where = at;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Plain max-pool

void maxpool_forward(const float* x, int64_t NC, int64_t H, int64_t W, int64_t k, int64_t s,
                     float* out, int32_t* arg, int threads) {
  const int64_t PH = (H - k) / s + 1, PW = (W - k) / s + 1;
#pragma omp parallel for schedule(static) num_threads(clamp_threads(threads))
  for (int64_t q = 0; q < NC; ++q) {
    const float* plane = x + q * H * W;
    for (int64_t ph = 0; ph < PH; ++ph)
      for (int64_t pw = 0; pw < PW; ++pw) {
        const int64_t o = (q * PH + ph) * PW + pw;
        window_max(plane, W, ph * s, pw * s, k, k, out + o, arg + o);
      }
  }
}

void maxpool_backward(const float* dout, const int32_t* arg, int64_t NC, int64_t H, int64_t W,
                      int64_t PH, int64_t PW, float* dx, int threads) {
#pragma omp parallel for schedule(static) num_threads(clamp_threads(threads))
  for (int64_t q = 0; q < NC; ++q) {
    float* plane = dx + q * H * W;
    std::memset(plane, 0, sizeof(float) * H * W);
    for (int64_t o = q * PH * PW; o < (q + 1) * PH * PW; ++o) plane[arg[o]] += dout[o];
  }
}

// ---------------------------------------------------------------------------------------------
// Fused bias + ReLU + max-pool. max(relu(v + b)) = relu(max(v) + b), so the window max is taken
// on the raw conv output and the bias and ReLU are applied once per output.

void bias_relu_maxpool(const float* y, const float* bias, int64_t K, int64_t N, int64_t H,
                       int64_t W, int64_t p, float* out, int32_t* arg, int threads) {
  const int64_t PH = (H - p) / p + 1, PW = (W - p) / p + 1;
#pragma omp parallel for collapse(2) schedule(static) num_threads(clamp_threads(threads))
  for (int64_t kk = 0; kk < K; ++kk)
    for (int64_t n = 0; n < N; ++n) {
      const float* plane = y + (kk * N + n) * H * W;
      const int64_t base = (n * K + kk) * PH * PW;
      for (int64_t ph = 0; ph < PH; ++ph)
        for (int64_t pw = 0; pw < PW; ++pw) {
          float m;
          int32_t at;
          window_max(plane, W, ph * p, pw * p, p, p, &m, &at);
          m += bias[kk];
          const int64_t o = base + ph * PW + pw;
          if (m > 0.f || std::isnan(m)) {
            out[o] = m;
            arg[o] = at;
          } else {
            out[o] = 0.f;
            arg[o] = -1;
          }
        }
    }
}

void bias_relu_maxpool_backward(const float* dout, const int32_t* arg, int64_t K, int64_t N,
                                int64_t H, int64_t W, int64_t p, float* dy, int threads) {
  const int64_t PH = (H - p) / p + 1, PW = (W - p) / p + 1;
#pragma omp parallel for collapse(2) schedule(static) num_threads(clamp_threads(threads))
  for (int64_t kk = 0; kk < K; ++kk)
    for (int64_t n = 0; n < N; ++n) {
      float* plane = dy + (kk * N + n) * H * W;
      std::memset(plane, 0, sizeof(float) * H * W);
      const int64_t base = (n * K + kk) * PH * PW;
      for (int64_t o = 0; o < PH * PW; ++o)
        if (arg[base + o] >= 0) plane[arg[base + o]] = dout[base + o];
    }
}

}  // namespace pyhet
