// im2col and its mirror col2im, batched over the images of a minibatch.
//
// Letters: x (N, C, H, W) input in NCHW; kernel (KH, KW); output plane (OH, OW) with
//   OH = (H + 2 * pad - KH) / stride + 1, OW likewise;
//   col (C * KH * KW, N * OH * OW): row (c, i, j), column (n, oh, ow), so that
//   W (K, C*KH*KW) @ col gives the conv output in (K, N, OH, OW) order.
#pragma once
#include <cstdint>

#include "gemm.h"

namespace pyhet {

inline int64_t conv_out_size(int64_t size, int64_t k, int64_t stride, int64_t pad) {
  return (size + 2 * pad - k) / stride + 1;
}

// col = im2col(x); padding rows and columns come out as zeros. Only rows [r_begin, r_end) of
// col are written (the rows of input channels [c0, c1) are [c0 * KH * KW, c1 * KH * KW)), so that
// several devices can fill one shared matrix at once, whatever the number of channels.
void im2col(const float* x, int64_t N, int64_t C, int64_t H, int64_t W, int64_t KH, int64_t KW,
            int64_t stride, int64_t pad, float* col, int threads, int64_t r_begin,
            int64_t r_end);

// im2col(x) straight into the GEMM's packed panels (gemm.h), without the matrix itself, for the
// images [n_begin, n_end) (their columns of col): into fwd, op(B) = col packed for W @ col (made
// with trans false, K = C*KH*KW, N = N*OH*OW), and into t, op(B) = col^T packed for dY @ col^T
// (made with trans true, K = N*OH*OW, N = C*KH*KW); either may be null. The same values as
// sgemm_pack_b of the matrix, padding included. Disjoint ranges of images may be filled at once.
void im2col_pack(const float* x, int64_t N, int64_t C, int64_t H, int64_t W, int64_t KH,
                 int64_t KW, int64_t stride, int64_t pad, PackedB* fwd, PackedB* t,
                 int64_t n_begin, int64_t n_end, int threads);

// im2col_pack into the quadrants' seven sums of col (fwd: 7 PackedB of the quadrant size
// (C/2*KH*KW, N/2*OH*OW), trans false) and of col^T (t: 7 of (N/2*OH*OW, C/2*KH*KW), trans
// true), in the order of sgemm_packed_quadrants (gemm.h); N and C even; either may be null.
// The same values as sgemm_pack_b of the sums of col's quadrants. The work is counted in
// (image, sum) units, image by image of each half of the batch: image n's units are
// [n * S, (n + 1) * S), S = quadrant_sum_count(fwd, t) distinct sums of the input's blocks
// (11 for both, 7 for one); this fills units [u_begin, u_end). Disjoint ranges may be filled
// at once.
int quadrant_sum_count(bool fwd, bool t);
void im2col_pack_quadrants(const float* x, int64_t N, int64_t C, int64_t H, int64_t W,
                           int64_t KH, int64_t KW, int64_t stride, int64_t pad,
                           PackedB* const* fwd, PackedB* const* t, int64_t u_begin,
                           int64_t u_end, int threads);

// x = col2im(col): x is overwritten with the sum of every col entry that im2col copied from it.
// Only channels [c_begin, c_end) of x are read from col and written.
void col2im(const float* col, int64_t N, int64_t C, int64_t H, int64_t W, int64_t KH, int64_t KW,
            int64_t stride, int64_t pad, float* x, int threads, int64_t c_begin, int64_t c_end);

// The input gradient's channels [c_begin, c_end) of x (N, C, H, W) straight from the product
// that makes their rows of dcol: col2im of sum_j w_j^T @ dy_j, w_j (k[j], C * KH * KW) with rows
// ldw[j] floats apart, dy_j (k[j], N * OH * OW) with rows lddy[j] apart. dcol is made a block
// at a time (a few images and channels, half the core's L2 at most where one channel of the
// images fits) and summed into x at once, while it is in the core's cache: it never goes to
// memory, nor is it read back. Each thread takes whole blocks (products on one thread each).
// It pays where the product is short (a few hundred kernels: its output is most of its memory
// traffic); on a long one its blocks pack the operands again and again.
void col2im_product(int parts, const float* const* w, const int64_t* k, const int64_t* ldw,
                    const float* const* dy, const int64_t* lddy, int64_t N, int64_t C,
                    int64_t H, int64_t W, int64_t KH, int64_t KW, int64_t stride, int64_t pad,
                    float* x, int threads, int64_t c_begin, int64_t c_end);

}  // namespace pyhet
