// Packed, blocked single-precision GEMM (BLIS-style), no BLAS library.
//
//   C (M, N) = alpha * op(A) (M, K) @ op(B) (K, N) + beta * C
//
// All matrices are row-major. op(A) = A when trans_a is false (A is M x K, row stride lda >= K),
// and A^T when it is true (A is stored K x M, row stride lda >= M); likewise for B. beta == 0
// overwrites C without reading it (NaNs in C do not leak through). Transposes are handled while
// packing, never by copying the matrix.
#pragma once
#include <cstdint>

namespace pyhet {

// The fast path: packed panels, one MR x NR micro-kernel, OpenMP with `threads` threads
// (threads <= 0 means one). Picks the micro-kernel at run time for the CPU (see gemm.cpp).
void sgemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
           const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C,
           int64_t ldc, int threads);

// The plain triple loop, for tests and as the readable definition of the above.
void sgemm_ref(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
               const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C,
               int64_t ldc);

// The plain i-k-j loop, C (M, N) = A (M, K) @ B (K, N) without transposes, left for the compiler
// to vectorise; rows split among `threads`. For the benchmark: the bar the packed GEMM must clear.
void sgemm_naive(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
                 int64_t ldb, float* C, int64_t ldc, int threads);

// Which micro-kernel sgemm uses on this CPU: "avx512", "avx2-fma" or "portable".
const char* sgemm_kernel_name();

}  // namespace pyhet
