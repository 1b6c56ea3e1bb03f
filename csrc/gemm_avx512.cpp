// The AVX-512 micro-kernel: a 12 x 32 tile of C in 24 zmm accumulators.
//
// Each step p loads one 32-float row of the packed b sliver (2 zmm), broadcasts the 12 floats of
// the packed a column one at a time and issues 24 FMAs. Registers: 24 accumulators + 2 of b + 1
// broadcast = 27 of the 32 zmm (14 x 32 would fit too, but 12 divides the MC block that the
// 6-row kernels use, and the loads are already far below the FMAs: 14 loads feed 24 FMAs of 16
// floats, against 8 loads per 12 FMAs of 8 floats for the AVX2 kernel). This is the shape of
// BLIS's SkylakeX sgemm kernel (32 x 12 there, column-major) seen from a row-major C.
//
// This file is compiled with -mavx512f -mavx512vl -mfma -mavx2 and only called after
// __builtin_cpu_supports says the CPU has AVX-512F and VL (see gemm.cpp).
#include "gemm_kernel.h"

#ifdef PYHET_HAVE_AVX512_KERNEL  // set by CMakeLists.txt on x86-64 with GCC or Clang
#include <immintrin.h>

namespace pyhet {
namespace gemm {

constexpr int MR = Avx512Tile::MR, NR = Avx512Tile::NR;
static_assert(NR == 32, "the AVX-512 kernel holds a row of the tile in two zmm");

namespace {

// c_row = alpha * acc + beta * c_row for one 32-float row of the tile; beta == 0 never reads c.
inline void store_row(float* c, __m512 lo, __m512 hi, __m512 alpha, __m512 beta, bool read_c,
                      bool scale) {
  if (scale) {
    lo = _mm512_mul_ps(lo, alpha);
    hi = _mm512_mul_ps(hi, alpha);
  }
  if (read_c) {
    lo = _mm512_fmadd_ps(beta, _mm512_loadu_ps(c), lo);
    hi = _mm512_fmadd_ps(beta, _mm512_loadu_ps(c + 16), hi);
  }
  _mm512_storeu_ps(c, lo);
  _mm512_storeu_ps(c + 16, hi);
}

}  // namespace

void micro_kernel_avx512(int64_t kc, const float* a, const float* b, float* c, int64_t ldc,
                         float alpha, float beta, const SecondTile* second) {
  // The tiles of C (two 64-byte lines per row) are needed at the end; start bringing them in.
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
  // ci_h: row i of the tile, columns 16h ... 16h + 15. Named variables, not an array: GCC 12
  // spilled an array of 24 accumulators several times a step; these it keeps in registers but
  // for one or two spills and reloads per trip of the loop (96 FMAs).
#define PYHET_ZERO(i) __m512 c##i##_0 = _mm512_setzero_ps(), c##i##_1 = _mm512_setzero_ps()
  PYHET_ZERO(0); PYHET_ZERO(1); PYHET_ZERO(2); PYHET_ZERO(3); PYHET_ZERO(4); PYHET_ZERO(5);
  PYHET_ZERO(6); PYHET_ZERO(7); PYHET_ZERO(8); PYHET_ZERO(9); PYHET_ZERO(10); PYHET_ZERO(11);
#undef PYHET_ZERO

#define PYHET_ROW(i, p)                                                   \
  ai = _mm512_set1_ps(a[(p) * MR + (i)]);                                 \
  c##i##_0 = _mm512_fmadd_ps(ai, b0, c##i##_0);                           \
  c##i##_1 = _mm512_fmadd_ps(ai, b1, c##i##_1)

#define PYHET_STEP(p)                                                     \
  do {                                                                    \
    const __m512 b0 = _mm512_load_ps(b + (p) * NR);                       \
    const __m512 b1 = _mm512_load_ps(b + (p) * NR + 16);                  \
    __m512 ai;                                                            \
    PYHET_ROW(0, p); PYHET_ROW(1, p); PYHET_ROW(2, p); PYHET_ROW(3, p);   \
    PYHET_ROW(4, p); PYHET_ROW(5, p); PYHET_ROW(6, p); PYHET_ROW(7, p);   \
    PYHET_ROW(8, p); PYHET_ROW(9, p); PYHET_ROW(10, p); PYHET_ROW(11, p); \
  } while (0)

  // Four steps per trip keep the loop overhead off the FMA pipes.
  int64_t p = 0;
  for (; p + 4 <= kc; p += 4) {
    _mm_prefetch(reinterpret_cast<const char*>(a + 8 * MR), _MM_HINT_T0);
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
#undef PYHET_ROW

  const __m512 va = _mm512_set1_ps(alpha), vb = _mm512_set1_ps(beta);
  const bool read_c = beta != 0.f, scale = alpha != 1.f;
  if (second) {
    // To two tiles: the accumulators go through memory once (L1), so that none of them has to
    // stay in a register past the first tile's stores, which would make the compiler spill
    // more of them inside the loop.
    alignas(64) float acc[MR * NR];
    __m512* v = reinterpret_cast<__m512*>(acc);
#define PYHET_SAVE(i) v[2 * (i)] = c##i##_0; v[2 * (i) + 1] = c##i##_1
    PYHET_SAVE(0); PYHET_SAVE(1); PYHET_SAVE(2); PYHET_SAVE(3); PYHET_SAVE(4); PYHET_SAVE(5);
    PYHET_SAVE(6); PYHET_SAVE(7); PYHET_SAVE(8); PYHET_SAVE(9); PYHET_SAVE(10); PYHET_SAVE(11);
#undef PYHET_SAVE
    const __m512 va2 = _mm512_set1_ps(second->alpha), vb2 = _mm512_set1_ps(second->beta);
    const bool read_c2 = second->beta != 0.f, scale2 = second->alpha != 1.f;
    for (int i = 0; i < MR; ++i) {
      store_row(c + i * ldc, v[2 * i], v[2 * i + 1], va, vb, read_c, scale);
      store_row(second->c + i * ldc, v[2 * i], v[2 * i + 1], va2, vb2, read_c2, scale2);
    }
    return;
  }
#define PYHET_STORE(i) store_row(c + (i) * ldc, c##i##_0, c##i##_1, va, vb, read_c, scale)
  PYHET_STORE(0); PYHET_STORE(1); PYHET_STORE(2); PYHET_STORE(3); PYHET_STORE(4);
  PYHET_STORE(5); PYHET_STORE(6); PYHET_STORE(7); PYHET_STORE(8); PYHET_STORE(9);
  PYHET_STORE(10); PYHET_STORE(11);
#undef PYHET_STORE
}

namespace {

// The first ROWS rows of a tile (of the MR that the packed a holds, zero-padded past the edge of
// A) into tile (row stride NR), alpha 1 and beta 0: 2 * ROWS FMAs a step instead of 24.
template <int ROWS>
void edge_rows(int64_t kc, const float* a, const float* b, float* tile) {
  __m512 lo[ROWS], hi[ROWS];
  for (int i = 0; i < ROWS; ++i) lo[i] = hi[i] = _mm512_setzero_ps();
  for (int64_t p = 0; p < kc; ++p, a += MR, b += NR) {
    const __m512 b0 = _mm512_load_ps(b), b1 = _mm512_load_ps(b + 16);
    for (int i = 0; i < ROWS; ++i) {
      const __m512 ai = _mm512_set1_ps(a[i]);
      lo[i] = _mm512_fmadd_ps(ai, b0, lo[i]);
      hi[i] = _mm512_fmadd_ps(ai, b1, hi[i]);
    }
  }
  for (int i = 0; i < ROWS; ++i) {
    _mm512_store_ps(tile + i * NR, lo[i]);
    _mm512_store_ps(tile + i * NR + 16, hi[i]);
  }
}

}  // namespace

void edge_kernel_avx512(int64_t kc, const float* a, const float* b, float* tile, int64_t m) {
  if (m <= 4)
    edge_rows<4>(kc, a, b, tile);
  else if (m <= 8)
    edge_rows<8>(kc, a, b, tile);
  else
    micro_kernel_avx512(kc, a, b, tile, NR, 1.f, 0.f, nullptr);
}

}  // namespace gemm
}  // namespace pyhet

#endif  // PYHET_HAVE_AVX512_KERNEL
