// Placeholder: the triple loop until the packed kernel lands.
#include "gemm.h"

namespace pyhet {

void sgemm_ref(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
               const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C,
               int64_t ldc) {
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      float acc = 0.f;
      for (int64_t p = 0; p < K; ++p) {
        float a = trans_a ? A[p * lda + i] : A[i * lda + p];
        float b = trans_b ? B[j * ldb + p] : B[p * ldb + j];
        acc += a * b;
      }
      C[i * ldc + j] = alpha * acc + (beta == 0.f ? 0.f : beta * C[i * ldc + j]);
    }
}

void sgemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
           const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C,
           int64_t ldc, int) {
  sgemm_ref(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

const char* sgemm_kernel_name() { return "portable"; }

}  // namespace pyhet
