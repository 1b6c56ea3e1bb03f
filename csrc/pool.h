// Max-pooling (floor mode, as PyTorch), and the fused bias + ReLU + max-pool that ends a
// conv block.
//
// Letters: K kernels (channels), N images, (H, W) input plane, pooling window k with stride s,
//   PH = (H - k) / s + 1, PW likewise (rows and columns that do not fill a window are dropped).
// arg holds, for each output, the flat index (h * W + w) of the chosen input in its plane; the
// first maximum wins and NaN propagates, as in PyTorch.
#pragma once
#include <cstdint>

namespace pyhet {

// x (NC, H, W) -> out, arg (NC, PH, PW)
void maxpool_forward(const float* x, int64_t NC, int64_t H, int64_t W, int64_t k, int64_t s,
                     float* out, int32_t* arg, int threads);
// dout, arg (NC, PH, PW) -> dx (NC, H, W), overwritten (windows may overlap when s < k)
void maxpool_backward(const float* dout, const int32_t* arg, int64_t NC, int64_t H, int64_t W,
                      int64_t PH, int64_t PW, float* dx, int threads);

// The end of a conv block, in one pass over the conv output:
//   y (K, N, H, W) as the GEMM leaves it, bias (K,)
//   -> out (N, K, PH, PW) = maxpool_p(relu(y + bias)), in NCHW order, window = stride = p;
//   arg (N, K, PH, PW): index of the max in its (H, W) plane, or -1 where ReLU zeroed it.
void bias_relu_maxpool(const float* y, const float* bias, int64_t K, int64_t N, int64_t H,
                       int64_t W, int64_t p, float* out, int32_t* arg, int threads);
// Its backward: dout, arg (N, K, PH, PW) -> dy (K, N, H, W), overwritten: the gradient of the
// conv output (before the bias), ready for the weight-gradient GEMM.
void bias_relu_maxpool_backward(const float* dout, const int32_t* arg, int64_t K, int64_t N,
                                int64_t H, int64_t W, int64_t p, float* dy, int threads);

}  // namespace pyhet
