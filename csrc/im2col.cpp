// im2col the Caffe way: one bounds check per pixel, sequential writes, zeros for padding;
// col2im is the += mirror. Threads split rows of col (im2col) or input channels (col2im), so
// no two threads ever write the same element.
#include "im2col.h"

#include <cstring>

#include "parallel.h"

namespace pyhet {

void im2col(const float* x, int64_t N, int64_t C, int64_t H, int64_t W, int64_t KH, int64_t KW,
            int64_t stride, int64_t pad, float* col, int threads, int64_t r_begin,
            int64_t r_end) {
  const int64_t OH = conv_out_size(H, KH, stride, pad), OW = conv_out_size(W, KW, stride, pad);
  const int64_t P = OH * OW;
#pragma omp parallel for schedule(static) num_threads(clamp_threads(threads))
  for (int64_t r = r_begin; r < r_end; ++r) {
    const int64_t c = r / (KH * KW), i = (r / KW) % KH, j = r % KW;
    float* dst = col + r * N * P;
    for (int64_t n = 0; n < N; ++n) {
      const float* plane = x + (n * C + c) * H * W;
      for (int64_t oh = 0; oh < OH; ++oh, dst += OW) {
        const int64_t ih = oh * stride - pad + i;
        if (ih < 0 || ih >= H) {
          std::memset(dst, 0, sizeof(float) * OW);
          continue;
        }
        const float* src = plane + ih * W;
        if (stride == 1) {
          // Columns ow with 0 <= ow - pad + j < W are one contiguous run; zeros around it.
          int64_t lo = pad - j, hi = W + pad - j;  // valid ow in [lo, hi)
          if (lo < 0) lo = 0;
          if (hi > OW) hi = OW;
          if (hi < lo) hi = lo;
          for (int64_t ow = 0; ow < lo; ++ow) dst[ow] = 0.f;
          if (hi > lo) std::memcpy(dst + lo, src + lo - pad + j, sizeof(float) * (hi - lo));
          for (int64_t ow = hi; ow < OW; ++ow) dst[ow] = 0.f;
        } else {
          for (int64_t ow = 0; ow < OW; ++ow) {
            const int64_t iw = ow * stride - pad + j;
            dst[ow] = (iw >= 0 && iw < W) ? src[iw] : 0.f;
          }
        }
      }
    }
  }
}

void col2im(const float* col, int64_t N, int64_t C, int64_t H, int64_t W, int64_t KH, int64_t KW,
            int64_t stride, int64_t pad, float* x, int threads, int64_t c_begin, int64_t c_end) {
  const int64_t OH = conv_out_size(H, KH, stride, pad), OW = conv_out_size(W, KW, stride, pad);
  const int64_t P = OH * OW;
#pragma omp parallel for schedule(static) num_threads(clamp_threads(threads))
  for (int64_t c = c_begin; c < c_end; ++c) {
    for (int64_t n = 0; n < N; ++n) std::memset(x + (n * C + c) * H * W, 0, sizeof(float) * H * W);
    for (int64_t i = 0; i < KH; ++i)
      for (int64_t j = 0; j < KW; ++j) {
        const float* src = col + ((c * KH + i) * KW + j) * N * P;
        for (int64_t n = 0; n < N; ++n) {
          float* plane = x + (n * C + c) * H * W;
          for (int64_t oh = 0; oh < OH; ++oh, src += OW) {
            const int64_t ih = oh * stride - pad + i;
            if (ih < 0 || ih >= H) continue;
            float* dst = plane + ih * W;
            for (int64_t ow = 0; ow < OW; ++ow) {
              const int64_t iw = ow * stride - pad + j;
              if (iw >= 0 && iw < W) dst[iw] += src[ow];
            }
          }
        }
      }
  }
}

}  // namespace pyhet
