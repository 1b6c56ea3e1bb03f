// im2col the Caffe way: one bounds check per pixel, sequential writes, zeros for padding;
// col2im is the += mirror. Threads split rows of col (im2col) or input channels (col2im), so
// no two threads ever write the same element.
#include "im2col.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>
#ifdef __SSE2__
#include <xmmintrin.h>
#endif

#include "parallel.h"

namespace pyhet {

namespace {

// dst[0, n) = src[0, n) for the short runs of an output row (often 8 to 32 floats): inline
// vector moves; a call of memcpy per run cost more than the copy (the paper network's and the
// default network's im2col ran at a third of the speed).
inline void copy_short(float* dst, const float* src, int64_t n) {
  if (n > 64) {
    std::memcpy(dst, src, sizeof(float) * n);
    return;
  }
  int64_t k = 0;
#ifdef __SSE2__
  for (; k + 4 <= n; k += 4) _mm_storeu_ps(dst + k, _mm_loadu_ps(src + k));
#endif
  for (; k < n; ++k) dst[k] = src[k];
}

// Row r = (c, i, j) of col for images [n0, n1): for each image and output pixel (oh, ow), the
// input pixel the kernel's (i, j) tap sees there, or 0 in the padding. dst: (n1 - n0) * OH * OW.
inline void im2col_row(const float* x, int64_t C, int64_t H, int64_t W, int64_t KH, int64_t KW,
                       int64_t stride, int64_t pad, int64_t OH, int64_t OW, int64_t r,
                       int64_t n0, int64_t n1, float* dst) {
  const int64_t c = r / (KH * KW), i = (r / KW) % KH, j = r % KW;
  for (int64_t n = n0; n < n1; ++n) {
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
        if (hi > lo) copy_short(dst + lo, src + lo - pad + j, hi - lo);
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

// dst[0, n) = src[0, n): a sliver's row (16 or 32 floats) in a few vector moves, not a call.
inline void copy_run(float* dst, const float* src, int64_t n) {
  if (n == 16)
    std::memcpy(dst, src, sizeof(float) * 16);
  else if (n == 32)
    std::memcpy(dst, src, sizeof(float) * 32);
  else
    std::memcpy(dst, src, sizeof(float) * n);
}

}  // namespace

void im2col(const float* x, int64_t N, int64_t C, int64_t H, int64_t W, int64_t KH, int64_t KW,
            int64_t stride, int64_t pad, float* col, int threads, int64_t r_begin,
            int64_t r_end) {
  const int64_t OH = conv_out_size(H, KH, stride, pad), OW = conv_out_size(W, KW, stride, pad);
  const int64_t NP = N * OH * OW;
#pragma omp parallel for schedule(static) num_threads(clamp_threads(threads))
  for (int64_t r = r_begin; r < r_end; ++r)
    im2col_row(x, C, H, W, KH, KW, stride, pad, OH, OW, r, 0, N, col + r * NP);
}

// Image by image, NR rows at a time: the rows are made in a small buffer (NR x OH*OW floats, in
// L1 or L2), then copied to fwd in runs of a sliver's width and written to t transposed, NR rows
// of one pixel in a row. The im2col matrix never goes to memory, nor is it read back to pack.
void im2col_pack(const float* x, int64_t N, int64_t C, int64_t H, int64_t W, int64_t KH,
                 int64_t KW, int64_t stride, int64_t pad, PackedB* fwd, PackedB* t,
                 int64_t n_begin, int64_t n_end, int threads) {
  const int64_t OH = conv_out_size(H, KH, stride, pad), OW = conv_out_size(W, KW, stride, pad);
  const int64_t P = OH * OW, NP = N * P, R = C * KH * KW;
  if (n_end <= n_begin || P == 0 || R == 0 || (fwd == nullptr && t == nullptr)) return;
  // both packings share the micro-kernel's NR (gemm.h): the rows go in groups of NR
  const int64_t nr = fwd != nullptr ? fwd->nr() : t->nr();
  // Where things go, without a division in the loops (PackedB::block): row r of col starts at
  // row_at[r] in fwd, then every fwd_sliver floats a sliver of NR columns; pixel q of col^T
  // (its K block q / kc_t, row q % kc_t) holds NR rows of col in sliver r0 / NR.
  std::vector<int64_t> row_at;
  int64_t fwd_sliver = 0;
  float* const fwd_data = fwd != nullptr ? fwd->block(0, 0) : nullptr;
  if (fwd != nullptr) {
    const int64_t kc = fwd->kc_step();
    fwd_sliver = kc * nr;
    row_at.resize(R);
    for (int64_t r = 0; r < R; ++r)
      row_at[r] = (r / kc) * fwd->slivers() * fwd_sliver + (r % kc) * nr;
  }
  const int64_t kc_t = t != nullptr ? t->kc_step() : 1;
  const int64_t t_sliver = kc_t * nr, t_block = t != nullptr ? t->slivers() * t_sliver : 0;
  float* const t_data = t != nullptr ? t->block(0, 0) : nullptr;
  // no more threads than images (the work is split by images), and a buffer each
  const int team = static_cast<int>(std::min<int64_t>(clamp_threads(threads), n_end - n_begin));
  std::vector<float> bufs(static_cast<size_t>(team) * nr * P);  // before the team starts
  // t's rows start 16-byte aligned where its data does (every offset is a multiple of NR)
  const bool stream = t_data != nullptr && nr % 4 == 0 &&
                      reinterpret_cast<std::uintptr_t>(t_data) % 16 == 0;
#pragma omp parallel num_threads(team)
  {
    float* buf = bufs.data() + thread_id() * nr * P;
#pragma omp for schedule(static)
    for (int64_t n = n_begin; n < n_end; ++n) {
      const int64_t q0 = n * P;  // this image's first column of col
      for (int64_t r0 = 0; r0 < R; r0 += nr) {
        const int64_t rows = std::min(nr, R - r0);
        for (int64_t u = 0; u < rows; ++u)
          im2col_row(x, C, H, W, KH, KW, stride, pad, OH, OW, r0 + u, n, n + 1, buf + u * P);
        if (rows < nr && t != nullptr)  // past col's last row: zeros in col^T's last sliver
          std::memset(buf + rows * P, 0, sizeof(float) * (nr - rows) * P);
        if (fwd != nullptr) {
          // op(B) = col, sliver by sliver, so that its rows are written one after another
          for (int64_t q = q0; q < q0 + P;) {
            const int64_t s = q / nr, end = std::min(q0 + P, (s + 1) * nr);
            const bool last = end == NP && end % nr != 0;  // zeros past the last column
            float* at = fwd_data + s * fwd_sliver + (q - s * nr);
            const float* src = buf + (q - q0);
            for (int64_t u = 0; u < rows; ++u) {
              float* d = at + row_at[r0 + u];
              copy_run(d, src + u * P, end - q);
              if (last) std::memset(d + (end - q), 0, sizeof(float) * (nr - end % nr));
            }
            q = end;
          }
        }
        if (t != nullptr) {
          // op(B) = col^T: pixel by pixel (4 at a time, transposed in registers, within a K
          // block), its NR rows r0.. of col as one row of the sliver. Streaming stores: t is
          // read only in the backward, long after (the layer's forward and everything after
          // it have gone through the caches by then), and a plain store first reads each line
          // it writes from memory, which doubled this loop's time.
          float* const sliver = t_data + (r0 / nr) * t_sliver;
          int64_t kb = q0 / kc_t, w = q0 % kc_t;  // pixel q0's K block and row in it
          for (int64_t p = 0; p < P;) {
            float* d = sliver + kb * t_block + w * nr;
#ifdef __SSE2__
            if (nr % 4 == 0 && p + 4 <= P && w + 4 <= kc_t) {
              for (int64_t u = 0; u < nr; u += 4) {
                const float* src = buf + u * P + p;
                __m128 a0 = _mm_loadu_ps(src), a1 = _mm_loadu_ps(src + P);
                __m128 a2 = _mm_loadu_ps(src + 2 * P), a3 = _mm_loadu_ps(src + 3 * P);
                _MM_TRANSPOSE4_PS(a0, a1, a2, a3);
                if (stream) {
                  _mm_stream_ps(d + u, a0);
                  _mm_stream_ps(d + nr + u, a1);
                  _mm_stream_ps(d + 2 * nr + u, a2);
                  _mm_stream_ps(d + 3 * nr + u, a3);
                } else {
                  _mm_storeu_ps(d + u, a0);
                  _mm_storeu_ps(d + nr + u, a1);
                  _mm_storeu_ps(d + 2 * nr + u, a2);
                  _mm_storeu_ps(d + 3 * nr + u, a3);
                }
              }
              p += 4;
              w += 4;
            } else
#endif
            {
              for (int64_t u = 0; u < nr; ++u) d[u] = buf[u * P + p];
              ++p;
              ++w;
            }
            if (w == kc_t) {
              ++kb;
              w = 0;
            }
          }
        }
      }
    }
#ifdef __SSE2__
    _mm_sfence();  // the streaming stores are seen by every thread before the team ends
#endif
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
