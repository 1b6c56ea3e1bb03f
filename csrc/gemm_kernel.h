// Internal to the GEMM: the micro-kernel contract shared by gemm.cpp (packing, blocking, threads,
// the portable kernel) and gemm_avx2.cpp (the AVX2/FMA kernel, compiled with -mavx2 -mfma).
//
// Packed panels (made by gemm.cpp, zero-padded at the edges):
//   a: an MR x kc sliver of op(A), column after column: a[p * MR + i] = op(A)[i][p]
//   b: a  kc x NR sliver of op(B), row after row:       b[p * NR + j] = op(B)[p][j]
// The micro-kernel computes the full MR x NR tile  c = alpha * a @ b + beta * c  (c row-major with
// row stride ldc; beta == 0 writes c without reading it). Edge tiles go through a temporary, so
// the kernel never needs to know about them.
//
// Keep this header free of inline functions with external linkage: gemm_avx2.cpp is compiled for
// AVX2, and an inline function emitted there could be picked by the linker for every caller.
#pragma once
#include <cstdint>

namespace pyhet {
namespace gemm {

constexpr int MR = 6;   // rows of a micro-tile: 6 broadcasts of a
constexpr int NR = 16;  // columns: two 8-float ymm vectors of b; 6 x 2 = 12 ymm accumulators

using MicroKernel = void (*)(int64_t kc, const float* a, const float* b, float* c, int64_t ldc,
                             float alpha, float beta);

void micro_kernel_portable(int64_t kc, const float* a, const float* b, float* c, int64_t ldc,
                           float alpha, float beta);
#ifdef PYHET_HAVE_AVX2_KERNEL
void micro_kernel_avx2(int64_t kc, const float* a, const float* b, float* c, int64_t ldc,
                       float alpha, float beta);
#endif

// Test hook: force "portable" or "avx2-fma", or go back to "auto" (the best this CPU runs).
// Returns false, changing nothing, for an unknown name or a kernel this CPU cannot run.
bool set_kernel(const char* name);

// Test hook: split a product among its threads only when each gets at least `flops` FLOPs
// (0: always, as many threads as asked; < 0: back to the default). Returns the previous value.
double set_min_flops_per_thread(double flops);

}  // namespace gemm
}  // namespace pyhet
