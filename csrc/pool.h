// Max-pooling (floor mode, as PyTorch), and the fused bias + ReLU + max-pool that ends a
// conv block.
//
// Letters: K kernels (channels), N images, (H, W) input plane, pooling window k with stride s,
//   PH = (H - k) / s + 1, PW likewise (rows and columns that do not fill a window are dropped);
//   windows overlap when s < k and skip inputs when s > k.
// arg holds, for each output, the flat index (h * W + w) of the chosen input in its plane; the
// first maximum (in row-major order within the window) wins and NaN propagates, as in PyTorch.
#pragma once
#include <cstdint>

namespace pyhet {

// PH from H (or PW from W); needs size >= k >= 1 and s >= 1.
inline int64_t pool_out_size(int64_t size, int64_t k, int64_t s) { return (size - k) / s + 1; }

// x (NC, H, W) -> out, arg (NC, PH, PW)
void maxpool_forward(const float* x, int64_t NC, int64_t H, int64_t W, int64_t k, int64_t s,
                     float* out, int32_t* arg, int threads);
// dout, arg (NC, PH, PW) -> dx (NC, H, W), overwritten with the sum of the gradients sent to
// each input (an input can be the max of several windows when s < k)
void maxpool_backward(const float* dout, const int32_t* arg, int64_t NC, int64_t H, int64_t W,
                      int64_t PH, int64_t PW, float* dx, int threads);

// The end of a conv block, in one pass over the conv output:
//   y (K, N, H, W) as the GEMM leaves it, bias (K,)
//   -> out (N, K, PH, PW) = maxpool_{k,s}(relu(y + bias)), in NCHW order;
//   arg (N, K, PH, PW): index of the max in its (H, W) plane, or -1 where ReLU zeroed it.
// k == s == 1 is a conv block without pooling: bias + ReLU + the transpose to NCHW, and arg is
// each element's own index h * W + w, or -1.
void bias_relu_maxpool(const float* y, const float* bias, int64_t K, int64_t N, int64_t H,
                       int64_t W, int64_t k, int64_t s, float* out, int32_t* arg, int threads);
// Its backward: dout, arg (N, K, PH, PW) -> dy (K, N, H, W), overwritten with the sum of the
// gradients sent to each input: the gradient of the conv output (before the bias), ready for
// the weight-gradient GEMM. Entries of arg are -1 or in [0, H * W); for k == s == 1 each must
// be -1 or the element's own index (the fast path reads arg as a mask).
void bias_relu_maxpool_backward(const float* dout, const int32_t* arg, int64_t K, int64_t N,
                                int64_t H, int64_t W, int64_t k, int64_t s, float* dy,
                                int threads);

}  // namespace pyhet
