// Internal to the GEMM: the micro-kernel contract shared by gemm.cpp (packing, blocking, threads,
// the portable kernel, the choice at run time) and the kernels compiled for one instruction set
// each: gemm_avx2.cpp (-mavx2 -mfma) and gemm_avx512.cpp (-mavx512f -mavx512vl).
//
// Every kernel has its own tile, MR x NR, given by its Tile below; gemm.cpp packs and blocks for
// the tile of the kernel it runs. Packed panels (made by gemm.cpp, zero-padded at the edges):
//   a: an MR x kc sliver of op(A), column after column: a[p * MR + i] = op(A)[i][p]
//   b: a  kc x NR sliver of op(B), row after row:       b[p * NR + j] = op(B)[p][j]
//      (64-byte aligned: every sliver starts at a multiple of kc * NR floats of an aligned buffer)
// The micro-kernel computes the full MR x NR tile  c = alpha * a @ b + beta * c  (c row-major with
// row stride ldc; beta == 0 writes c without reading it), and, where `second` is not null, the
// same product into a second tile, second->c = second->alpha * a @ b + second->beta * second->c
// (same row stride): a sub-product of Strassen's scheme adds to two quadrants of C. (A pointer,
// not three more arguments: floats passed in registers would stay live across the kernel's loop
// and crowd out its accumulators.) Edge tiles go through a temporary, so the kernel never needs
// to know about them.
//
// Keep this header free of inline functions with external linkage: the kernel files are compiled
// for AVX2 or AVX-512, and an inline function emitted there could be picked by the linker for
// every caller.
#pragma once
#include <cstdint>

namespace pyhet {
namespace gemm {

struct SecondTile {
  float* c;
  float alpha, beta;
};

using MicroKernel = void (*)(int64_t kc, const float* a, const float* b, float* c, int64_t ldc,
                             float alpha, float beta, const SecondTile* second);

// The tiles: MR rows of C (one broadcast of a each) x NR columns (vectors of b).
struct PortableTile {  // compiled for the build's target; 2 rows at a time (see gemm.cpp)
  static constexpr int MR = 6, NR = 16;
};
struct Avx2Tile {  // two 8-float ymm of b, 6 x 2 = 12 ymm accumulators of 16
  static constexpr int MR = 6, NR = 16;
};
struct Avx512Tile {  // two 16-float zmm of b, 12 x 2 = 24 zmm accumulators of 32
  static constexpr int MR = 12, NR = 32;
};

void micro_kernel_portable(int64_t kc, const float* a, const float* b, float* c, int64_t ldc,
                           float alpha, float beta, const SecondTile* second);
#ifdef PYHET_HAVE_AVX2_KERNEL
void micro_kernel_avx2(int64_t kc, const float* a, const float* b, float* c, int64_t ldc,
                       float alpha, float beta, const SecondTile* second);
#endif
#ifdef PYHET_HAVE_AVX512_KERNEL
void micro_kernel_avx512(int64_t kc, const float* a, const float* b, float* c, int64_t ldc,
                         float alpha, float beta, const SecondTile* second);
#endif

// An edge tile of m < MR rows: at least its first m rows into tile (row stride NR; alpha 1, beta
// 0), for fewer FMAs than the whole tile's. A kernel without one computes the whole tile.
using EdgeKernel = void (*)(int64_t kc, const float* a, const float* b, float* tile, int64_t m);
#ifdef PYHET_HAVE_AVX512_KERNEL
void edge_kernel_avx512(int64_t kc, const float* a, const float* b, float* tile, int64_t m);
#endif

// Test hook: force "portable", "avx2-fma" or "avx512", or go back to "auto" (the kernel chosen
// for this CPU). Returns false, changing nothing, for an unknown name or a kernel this CPU or
// build cannot run.
bool set_kernel(const char* name);

// Test hook: split a product among its threads only when each gets at least `flops` FLOPs
// (0: always, as many threads as asked; < 0: back to the default). Returns the previous value.
double set_min_flops_per_thread(double flops);

// Strassen's scheme (one level) for products whose every dimension is at least `dim` (0: never;
// < 0: back to the default, 768 unless PYHET_GEMM_STRASSEN=0 or off). Test hook and
// benchmark switch; returns the previous value.
int64_t set_strassen_min_dim(int64_t dim);
int64_t get_strassen_min_dim();  // the value in use
// Whether sgemm runs an (M, N) x K product on `threads` threads by the scheme.
bool strassen_applies(int64_t M, int64_t N, int64_t K, int threads);
// Whether sgemm splits K among the threads of an (M, N) x K product (few tiles of C over a long
// K; see plan_split_k in gemm.cpp) rather than the rows and columns of C.
bool splits_k(int64_t M, int64_t N, int64_t K, int threads);

}  // namespace gemm
}  // namespace pyhet
