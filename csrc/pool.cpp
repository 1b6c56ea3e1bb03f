// Max-pooling and the fused bias + ReLU + max-pool. Threads split output planes, which own
// disjoint input planes, so writes never collide (even when windows overlap).
#include "pool.h"

#include <cmath>
#include <cstring>

#include "parallel.h"

namespace pyhet {

namespace {

// Max of one k x k window, exactly by PyTorch's rule: the first maximum (row-major) wins, and a
// NaN wins over everything (the first NaN, if several). The rare path for windows with a NaN.
inline void window_max_nan(const float* plane, int64_t W, int64_t h0, int64_t w0, int64_t k,
                           float* best, int32_t* where) {
  float m = plane[h0 * W + w0];
  int32_t at = static_cast<int32_t>(h0 * W + w0);
  for (int64_t i = 0; i < k && !std::isnan(m); ++i)
    for (int64_t j = 0; j < k; ++j) {
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

// The same, fast: `v > m` alone gives the rule when the window has no NaN, and the compiler
// turns its two selects into maxss/cmov. Branching on that comparison instead (as
// window_max_nan does) costs a mispredicted branch every other element on real data, most of
// the kernel's time. A window that holds a NaN is redone by window_max_nan.
inline void window_max(const float* plane, int64_t W, int64_t h0, int64_t w0, int64_t k,
                       float* best, int32_t* where) {
  float m = plane[h0 * W + w0];
  int32_t at = static_cast<int32_t>(h0 * W + w0);
  bool nan = false;
  for (int64_t i = 0; i < k; ++i) {
    const float* row = plane + (h0 + i) * W + w0;
    for (int64_t j = 0; j < k; ++j) {
      const float v = row[j];
      nan |= std::isnan(v);
      const bool take = v > m;
      m = take ? v : m;
      at = take ? static_cast<int32_t>((h0 + i) * W + w0 + j) : at;
    }
  }
  if (nan) return window_max_nan(plane, W, h0, w0, k, best, where);
  *best = m;
  *where = at;
}

// bias + ReLU of a window's max m (taken before the bias: max(relu(v + b)) = relu(max(v) + b)).
// ReLU keeps m + b where it is positive or NaN; elsewhere the output is 0 and its arg -1, so the
// backward sends no gradient there. Written as selects on `m > 0` plus a fix-up for NaN, which
// compile without branches (and vectorise in relu_plane); selecting on `!(m <= 0)` directly
// compiles to a branch (GCC 12), as unpredictable as the sign of the conv output.
inline void bias_relu(float m, float b, int32_t at, float* out, int32_t* arg) {
  m += b;
  float r = m > 0.f ? m : 0.f;
  int32_t a = m > 0.f ? at : -1;
  if (std::isnan(m)) {
    r = m;
    a = at;
  }
  *out = r;
  *arg = a;
}

// One (H, W) plane of y -> its (PH, PW) block of out and arg, for any window and stride.
inline void pool_plane(const float* plane, float b, int64_t W, int64_t k, int64_t s,
                       int64_t PH, int64_t PW, float* out, int32_t* arg) {
  for (int64_t ph = 0; ph < PH; ++ph)
    for (int64_t pw = 0; pw < PW; ++pw) {
      float m;
      int32_t at;
      window_max(plane, W, ph * s, pw * s, k, &m, &at);
      bias_relu(m, b, at, out + ph * PW + pw, arg + ph * PW + pw);
    }
}

// k == s == 1, no pooling: every element is its own window. A straight loop the compiler
// vectorises; it runs on full-size conv outputs.
inline void relu_plane(const float* plane, float b, int64_t HW, float* out, int32_t* arg) {
  for (int64_t i = 0; i < HW; ++i)
    bias_relu(plane[i], b, static_cast<int32_t>(i), out + i, arg + i);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Plain max-pool

void maxpool_forward(const float* x, int64_t NC, int64_t H, int64_t W, int64_t k, int64_t s,
                     float* out, int32_t* arg, int threads) {
  const int64_t PH = pool_out_size(H, k, s), PW = pool_out_size(W, k, s);
#pragma omp parallel for schedule(static) num_threads(clamp_threads(threads))
  for (int64_t q = 0; q < NC; ++q) {
    const float* plane = x + q * H * W;
    for (int64_t ph = 0; ph < PH; ++ph)
      for (int64_t pw = 0; pw < PW; ++pw) {
        const int64_t o = (q * PH + ph) * PW + pw;
        window_max(plane, W, ph * s, pw * s, k, out + o, arg + o);
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
// Fused bias + ReLU + max-pool. Plane (kk, n) of y is read once and fills block (n, kk) of out.

void bias_relu_maxpool(const float* y, const float* bias, int64_t K, int64_t N, int64_t H,
                       int64_t W, int64_t k, int64_t s, float* out, int32_t* arg, int threads) {
  const int64_t PH = pool_out_size(H, k, s), PW = pool_out_size(W, k, s);
  const bool no_pool = k == 1 && s == 1;
#pragma omp parallel for collapse(2) schedule(static) num_threads(clamp_threads(threads))
  for (int64_t kk = 0; kk < K; ++kk)
    for (int64_t n = 0; n < N; ++n) {
      const float* plane = y + (kk * N + n) * H * W;
      const int64_t base = (n * K + kk) * PH * PW;
      if (no_pool)
        relu_plane(plane, bias[kk], H * W, out + base, arg + base);
      else
        pool_plane(plane, bias[kk], W, k, s, PH, PW, out + base, arg + base);
    }
}

void bias_relu_maxpool_backward(const float* dout, const int32_t* arg, int64_t K, int64_t N,
                                int64_t H, int64_t W, int64_t k, int64_t s, float* dy,
                                int threads) {
  const int64_t PH = pool_out_size(H, k, s), PW = pool_out_size(W, k, s);
  const bool no_pool = k == 1 && s == 1;
#pragma omp parallel for collapse(2) schedule(static) num_threads(clamp_threads(threads))
  for (int64_t kk = 0; kk < K; ++kk)
    for (int64_t n = 0; n < N; ++n) {
      float* plane = dy + (kk * N + n) * H * W;
      const float* d = dout + (n * K + kk) * PH * PW;
      const int32_t* a = arg + (n * K + kk) * PH * PW;
      if (no_pool) {
        // arg is -1 or the element's own index (the binding checks): a mask, no scatter.
        // d[i] is loaded unconditionally so that the loop vectorises.
        for (int64_t i = 0; i < H * W; ++i) {
          const float v = d[i];
          plane[i] = a[i] >= 0 ? v : 0.f;
        }
        continue;
      }
      // Accumulate: with s < k one input can be the max of several windows.
      std::memset(plane, 0, sizeof(float) * H * W);
      for (int64_t o = 0; o < PH * PW; ++o)
        if (a[o] >= 0) plane[a[o]] += d[o];
    }
}

}  // namespace pyhet
