// Max-pooling and the fused bias + ReLU + max-pool. Threads split output planes, which own
// disjoint input planes, so writes never collide (even when windows overlap).
#include "pool.h"

#include <cmath>
#include <cstring>

#ifdef __SSE2__  // every x86-64: the 2 x 2 pool four windows at a time
#include <emmintrin.h>
#endif

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

// One row of 2 x 2 windows at stride 2 (the usual pool): rows h0 and h0 + 1 of the plane. The
// four candidates are taken in row-major order, each replacing the
// maximum so far where it is greater (v > m), as window_max does; with SSE2, four windows at a
// time, the candidates taken apart from the rows by shuffles. A window that holds a NaN is
// redone alone by the exact rule (window_max).
inline void pool_row_2x2(const float* plane, int64_t W, int64_t h0, float b, int64_t PW,
                         float* out, int32_t* arg) {
  const float* r0 = plane + h0 * W;
  const float* r1 = r0 + W;
  const int32_t at0 = static_cast<int32_t>(h0 * W);  // r0's first element, in the plane
  int64_t pw = 0;
#ifdef __SSE2__
  const __m128 bias = _mm_set1_ps(b), zero = _mm_setzero_ps();
  const __m128i one = _mm_set1_epi32(1), below = _mm_set1_epi32(static_cast<int32_t>(W)),
                diag = _mm_set1_epi32(static_cast<int32_t>(W + 1)), none = _mm_set1_epi32(-1);
  for (; pw + 4 <= PW; pw += 4) {
    const __m128 a0 = _mm_loadu_ps(r0 + 2 * pw), a1 = _mm_loadu_ps(r0 + 2 * pw + 4);
    const __m128 c0 = _mm_loadu_ps(r1 + 2 * pw), c1 = _mm_loadu_ps(r1 + 2 * pw + 4);
    const __m128 v0 = _mm_shuffle_ps(a0, a1, _MM_SHUFFLE(2, 0, 2, 0));
    const __m128 v1 = _mm_shuffle_ps(a0, a1, _MM_SHUFFLE(3, 1, 3, 1));
    const __m128 v2 = _mm_shuffle_ps(c0, c1, _MM_SHUFFLE(2, 0, 2, 0));
    const __m128 v3 = _mm_shuffle_ps(c0, c1, _MM_SHUFFLE(3, 1, 3, 1));
    __m128 m = v0;
    __m128i at = _mm_setzero_si128();
    // candidate v, at `offset` from the window's first element, where it beats the max so far
    auto take = [&](__m128 v, __m128i offset) {
      const __m128 gt = _mm_cmpgt_ps(v, m);
      const __m128i gti = _mm_castps_si128(gt);
      m = _mm_or_ps(_mm_and_ps(gt, v), _mm_andnot_ps(gt, m));
      at = _mm_or_si128(_mm_and_si128(gti, offset), _mm_andnot_si128(gti, at));
    };
    take(v1, one);
    take(v2, below);
    take(v3, diag);
    m = _mm_add_ps(m, bias);
    // a NaN in a window, or made by the bias (inf - inf, a NaN bias): the exact rule, alone
    if (_mm_movemask_ps(_mm_or_ps(_mm_or_ps(_mm_cmpunord_ps(v0, v1), _mm_cmpunord_ps(v2, v3)),
                                  _mm_cmpunord_ps(m, m)))) {
      for (int64_t q = pw; q < pw + 4; ++q) {
        float mq;
        int32_t aq;
        window_max(plane, W, h0, 2 * q, 2, &mq, &aq);
        bias_relu(mq, b, aq, out + q, arg + q);
      }
      continue;
    }
    const __m128 pos = _mm_cmpgt_ps(m, zero);  // no NaN left: ReLU is the mask
    const int32_t first = at0 + static_cast<int32_t>(2 * pw);
    at = _mm_add_epi32(at, _mm_setr_epi32(first, first + 2, first + 4, first + 6));
    _mm_storeu_ps(out + pw, _mm_and_ps(pos, m));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(arg + pw),
                     _mm_or_si128(_mm_and_si128(_mm_castps_si128(pos), at),
                                  _mm_andnot_si128(_mm_castps_si128(pos), none)));
  }
#endif
  for (; pw < PW; ++pw) {
    float m;
    int32_t at;
    window_max(plane, W, h0, 2 * pw, 2, &m, &at);
    bias_relu(m, b, at, out + pw, arg + pw);
  }
}

// One (H, W) plane of y -> its (PH, PW) block of out and arg, for any window and stride.
inline void pool_plane(const float* plane, float b, int64_t W, int64_t k, int64_t s,
                       int64_t PH, int64_t PW, float* out, int32_t* arg) {
  if (k == 2 && s == 2) {
    for (int64_t ph = 0; ph < PH; ++ph)
      pool_row_2x2(plane, W, 2 * ph, b, PW, out + ph * PW, arg + ph * PW);
    return;
  }
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
      if (k == 2 && s == 2 && H == 2 * PH && W == 2 * PW) {
        // Windows that tile the plane: each element is in one window and gets its gradient
        // or 0, written once (no zeroing pass before); with SSE2, four windows at a time.
        const int32_t w32 = static_cast<int32_t>(W);
        for (int64_t ph = 0; ph < PH; ++ph) {
          float* r0 = plane + 2 * ph * W;
          float* r1 = r0 + W;
          const int32_t at0 = static_cast<int32_t>(2 * ph * W);
          const int32_t* ar = a + ph * PW;
          const float* dr = d + ph * PW;
          int64_t pw = 0;
#ifdef __SSE2__
          for (; pw + 4 <= PW; pw += 4) {
            const int32_t first = at0 + static_cast<int32_t>(2 * pw);
            // each window's choice, relative to its first element (negative: none)
            const __m128i rel = _mm_sub_epi32(
                _mm_loadu_si128(reinterpret_cast<const __m128i*>(ar + pw)),
                _mm_setr_epi32(first, first + 2, first + 4, first + 6));
            const __m128 v = _mm_loadu_ps(dr + pw);
            auto where = [&](int32_t offset) {
              return _mm_and_ps(_mm_castsi128_ps(_mm_cmpeq_epi32(rel, _mm_set1_epi32(offset))),
                                v);
            };
            const __m128 e0 = where(0), e1 = where(1), e2 = where(w32), e3 = where(w32 + 1);
            _mm_storeu_ps(r0 + 2 * pw, _mm_unpacklo_ps(e0, e1));
            _mm_storeu_ps(r0 + 2 * pw + 4, _mm_unpackhi_ps(e0, e1));
            _mm_storeu_ps(r1 + 2 * pw, _mm_unpacklo_ps(e2, e3));
            _mm_storeu_ps(r1 + 2 * pw + 4, _mm_unpackhi_ps(e2, e3));
          }
#endif
          for (; pw < PW; ++pw) {
            const int32_t at = ar[pw] - at0 - static_cast<int32_t>(2 * pw);
            const float v = dr[pw];
            r0[2 * pw] = at == 0 ? v : 0.f;
            r0[2 * pw + 1] = at == 1 ? v : 0.f;
            r1[2 * pw] = at == w32 ? v : 0.f;
            r1[2 * pw + 1] = at == w32 + 1 ? v : 0.f;
          }
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
