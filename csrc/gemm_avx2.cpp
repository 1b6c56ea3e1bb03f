// The AVX2/FMA micro-kernel: a 6 x 16 tile of C in 12 ymm accumulators.
//
// Each step p loads one 16-float row of the packed b sliver (2 ymm), broadcasts the 6 floats of
// the packed a column one at a time and issues 12 FMAs: 8 loads feed 12 FMAs, so the two FMA
// pipes, not the load ports, set the pace; 12 independent accumulators cover the FMA latency
// (4 cycles x 2 pipes). This file is compiled with -mavx2 -mfma and only called after
// __builtin_cpu_supports says the CPU has both (see gemm.cpp).
#include "gemm_kernel.h"

#ifdef PYHET_HAVE_AVX2_KERNEL  // set by CMakeLists.txt on x86-64 with GCC or Clang
#include <immintrin.h>

namespace pyhet {
namespace gemm {

constexpr int MR = Avx2Tile::MR, NR = Avx2Tile::NR;
static_assert(MR == 6 && NR == 16, "the AVX2 kernel is written for 6 x 16 tiles");

namespace {

// c_row = alpha * acc + beta * c_row for one 16-float row of the tile.
inline void store_row(float* c, __m256 lo, __m256 hi, __m256 alpha, __m256 beta, bool read_c,
                      bool scale) {
  if (scale) {
    lo = _mm256_mul_ps(lo, alpha);
    hi = _mm256_mul_ps(hi, alpha);
  }
  if (read_c) {
    lo = _mm256_fmadd_ps(beta, _mm256_loadu_ps(c), lo);
    hi = _mm256_fmadd_ps(beta, _mm256_loadu_ps(c + 8), hi);
  }
  _mm256_storeu_ps(c, lo);
  _mm256_storeu_ps(c + 8, hi);
}

}  // namespace

void micro_kernel_avx2(int64_t kc, const float* a, const float* b, float* c, int64_t ldc,
                       float alpha, float beta, const SecondTile* second) {
  // The tiles of C are needed at the end; start bringing them in now.
  for (int i = 0; i < MR; ++i) {
    _mm_prefetch(reinterpret_cast<const char*>(c + i * ldc), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(c + i * ldc + NR - 1), _MM_HINT_T0);
  }
  if (second) {
    const float* c2 = second->c;
    for (int i = 0; i < MR; ++i) {
      _mm_prefetch(reinterpret_cast<const char*>(c2 + i * ldc), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(c2 + i * ldc + NR - 1), _MM_HINT_T0);
    }
  }
  __m256 c00 = _mm256_setzero_ps(), c01 = _mm256_setzero_ps();
  __m256 c10 = _mm256_setzero_ps(), c11 = _mm256_setzero_ps();
  __m256 c20 = _mm256_setzero_ps(), c21 = _mm256_setzero_ps();
  __m256 c30 = _mm256_setzero_ps(), c31 = _mm256_setzero_ps();
  __m256 c40 = _mm256_setzero_ps(), c41 = _mm256_setzero_ps();
  __m256 c50 = _mm256_setzero_ps(), c51 = _mm256_setzero_ps();

#define PYHET_STEP(p)                                                   \
  do {                                                                  \
    const __m256 b0 = _mm256_load_ps(b + (p) * NR);                     \
    const __m256 b1 = _mm256_load_ps(b + (p) * NR + 8);                 \
    __m256 ai = _mm256_broadcast_ss(a + (p) * MR + 0);                  \
    c00 = _mm256_fmadd_ps(ai, b0, c00);                                 \
    c01 = _mm256_fmadd_ps(ai, b1, c01);                                 \
    ai = _mm256_broadcast_ss(a + (p) * MR + 1);                         \
    c10 = _mm256_fmadd_ps(ai, b0, c10);                                 \
    c11 = _mm256_fmadd_ps(ai, b1, c11);                                 \
    ai = _mm256_broadcast_ss(a + (p) * MR + 2);                         \
    c20 = _mm256_fmadd_ps(ai, b0, c20);                                 \
    c21 = _mm256_fmadd_ps(ai, b1, c21);                                 \
    ai = _mm256_broadcast_ss(a + (p) * MR + 3);                         \
    c30 = _mm256_fmadd_ps(ai, b0, c30);                                 \
    c31 = _mm256_fmadd_ps(ai, b1, c31);                                 \
    ai = _mm256_broadcast_ss(a + (p) * MR + 4);                         \
    c40 = _mm256_fmadd_ps(ai, b0, c40);                                 \
    c41 = _mm256_fmadd_ps(ai, b1, c41);                                 \
    ai = _mm256_broadcast_ss(a + (p) * MR + 5);                         \
    c50 = _mm256_fmadd_ps(ai, b0, c50);                                 \
    c51 = _mm256_fmadd_ps(ai, b1, c51);                                 \
  } while (0)

  // Four steps per trip keep the loop overhead off the FMA pipes.
  int64_t p = 0;
  for (; p + 4 <= kc; p += 4) {
    _mm_prefetch(reinterpret_cast<const char*>(a + 4 * MR * 4), _MM_HINT_T0);
    PYHET_STEP(0);
    PYHET_STEP(1);
    PYHET_STEP(2);
    PYHET_STEP(3);
    a += 4 * MR;
    b += 4 * NR;
  }
  for (; p < kc; ++p) {
    PYHET_STEP(0);
    a += MR;
    b += NR;
  }
#undef PYHET_STEP

  const __m256 va = _mm256_set1_ps(alpha), vb = _mm256_set1_ps(beta);
  const bool read_c = beta != 0.f, scale = alpha != 1.f;
  if (second) {
    // To two tiles: the accumulators go through memory once (L1), so that none of them has to
    // stay in a register past the loop, where the compiler would then spill one inside it.
    alignas(32) float acc[MR * NR];
    __m256* v = reinterpret_cast<__m256*>(acc);
    v[0] = c00; v[1] = c01; v[2] = c10; v[3] = c11; v[4] = c20; v[5] = c21;
    v[6] = c30; v[7] = c31; v[8] = c40; v[9] = c41; v[10] = c50; v[11] = c51;
    const __m256 va2 = _mm256_set1_ps(second->alpha), vb2 = _mm256_set1_ps(second->beta);
    const bool read_c2 = second->beta != 0.f, scale2 = second->alpha != 1.f;
    for (int i = 0; i < MR; ++i) {
      store_row(c + i * ldc, v[2 * i], v[2 * i + 1], va, vb, read_c, scale);
      store_row(second->c + i * ldc, v[2 * i], v[2 * i + 1], va2, vb2, read_c2, scale2);
    }
    return;
  }
  store_row(c + 0 * ldc, c00, c01, va, vb, read_c, scale);
  store_row(c + 1 * ldc, c10, c11, va, vb, read_c, scale);
  store_row(c + 2 * ldc, c20, c21, va, vb, read_c, scale);
  store_row(c + 3 * ldc, c30, c31, va, vb, read_c, scale);
  store_row(c + 4 * ldc, c40, c41, va, vb, read_c, scale);
  store_row(c + 5 * ldc, c50, c51, va, vb, read_c, scale);
}

}  // namespace gemm
}  // namespace pyhet

#endif  // PYHET_HAVE_AVX2_KERNEL
