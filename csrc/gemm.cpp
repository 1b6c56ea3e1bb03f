// Packed, blocked SGEMM in the BLIS manner: the reference triple loops, the packing routines, the
// five loops around one MR x NR micro-kernel, the threading, the portable micro-kernel and the
// run-time choice between it, the AVX2/FMA one (gemm_avx2.cpp) and the AVX-512 one
// (gemm_avx512.cpp). MR x NR is the tile of the chosen kernel: the packing, the macro-kernel and
// the five loops are templates instantiated once per tile, so each runs with constant MR and NR.
//
// Letters: C (M, N) = alpha * op(A) (M, K) @ op(B) (K, N) + beta * C, all row-major.
//
//   for jc in N by NC:              a KC x NC block of op(B) is packed once per K block, shared
//     for pc in K by KC:            by the threads that use it (it lives in L3; each KC x NR
//       for ic in M by MC:          sliver of it in L1); each thread packs its own MC x KC
//         for jr in NC by NR:       block of op(A) (in L2); the macro-kernel makes one
//           for ir in MC by MR:     micro-kernel call per MR x NR tile of C
//
// Threads split M (each thread owns a band of rows of C) and/or the NR slivers of each NC block
// (a band of columns), chosen by shape, so no two threads ever write the same element of C; or,
// where C has too few tiles for that (plan_split_k), K: each thread sums its own K blocks into
// C or a partial sum of its own, and the partial sums are added to C by bands of rows.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <new>
#include <stdexcept>
#include <string>

#include "gemm.h"
#include "gemm_kernel.h"
#include "parallel.h"

#ifdef PYHET_HAVE_AVX512_KERNEL  // x86-64 with GCC or Clang: the CPU's family for prefer_avx512
#include <cpuid.h>
#endif
#ifdef __SSE2__  // every x86-64: transposing while packing, 4 x 4 at a time
#include <emmintrin.h>
#endif

namespace pyhet {

// ---------------------------------------------------------------------------------------------
// The reference

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

// The loop a compiler vectorises by itself (i-k-j: the inner loop runs along rows of B and C),
// compiled with the build's flags like the portable kernel; for the benchmark, which checks that
// the packed GEMM with that kernel is no slower than this. Rows of C are split among threads.
void sgemm_naive(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
                 int64_t ldb, float* C, int64_t ldc, int threads) {
  (void)threads;
#pragma omp parallel for num_threads(clamp_threads(threads)) schedule(static)
  for (int64_t i = 0; i < M; ++i) {
    float* __restrict c = C + i * ldc;
    std::memset(c, 0, sizeof(float) * N);
    for (int64_t p = 0; p < K; ++p) {
      const float a = A[i * lda + p];
      const float* __restrict b = B + p * ldb;
      for (int64_t j = 0; j < N; ++j) c[j] += a * b[j];
    }
  }
}

// The L2 per core as the C library reports it, 0 where it cannot say; PYHET_GEMM_L2_BYTES, where
// set to a number, stands in for it (the tests run every block size on any CPU).
int64_t core_l2_bytes() {
  static const int64_t l2 = [] {
    if (const char* given = std::getenv("PYHET_GEMM_L2_BYTES")) {
      char* end = nullptr;
      const long v = std::strtol(given, &end, 10);
      if (end != given && *end == '\0' && v >= 0) return static_cast<int64_t>(v);
    }
    long found = 0;
#ifdef _SC_LEVEL2_CACHE_SIZE
    found = sysconf(_SC_LEVEL2_CACHE_SIZE);
#endif
    return static_cast<int64_t>(found > 0 ? found : 0);
  }();
  return l2;
}

namespace gemm {
namespace {

// ---------------------------------------------------------------------------------------------
// Block sizes of the 6 x 16 kernels (Zen 3: 32 KiB L1d, 512 KiB L2 per core, 32 MiB L3 shared),
// chosen by measuring 1024^3 and the conv2 products on one core (override with
// -DPYHET_GEMM_KC=... to tune).
//
// KC: the length of the dot products the micro-kernel sums in registers before it touches C.
//     512 halves the C traffic of 256 and measured ~4% faster on 1024^3; the KC x NR sliver of
//     packed B (32 KiB) then just fills L1, and what falls out is refetched from L2 in time.
// MC: the packed MC x KC block of A (240 KiB) stays in L2, half of it on Zen 3.
// NC: the packed KC x NC block of B (4 MiB) stays in L3 beside the other core's.

#ifndef PYHET_GEMM_KC
#define PYHET_GEMM_KC 512
#endif
#ifndef PYHET_GEMM_MC
#define PYHET_GEMM_MC 120
#endif
#ifndef PYHET_GEMM_NC
#define PYHET_GEMM_NC 2048
#endif

// The blocks of one kernel. MC and NC must hold whole tiles of it (checked where the kernels are
// listed, below the portable kernel).
struct Blocks {
  int64_t mc, kc, nc;
};
constexpr Blocks kBlocks6x16{PYHET_GEMM_MC, PYHET_GEMM_KC, PYHET_GEMM_NC};

// The blocks of the 12 x 32 AVX-512 kernel (-DPYHET_GEMM_AVX512_KC=... to tune): the same. On
// Zen 4 (32 KiB L1d, 1 MiB L2), 1024^3 on one core ran within noise (3%) of these with KC = 256
// and with MC = 60 or 240. Its KC x NR sliver of packed B (64 KiB) overflows L1, but it
// is read at 128 bytes per 24 FMAs, which L2 serves with room to spare.
#ifndef PYHET_GEMM_AVX512_KC
#define PYHET_GEMM_AVX512_KC 512
#endif
#ifndef PYHET_GEMM_AVX512_MC
#define PYHET_GEMM_AVX512_MC 120
#endif
#ifndef PYHET_GEMM_AVX512_NC
#define PYHET_GEMM_AVX512_NC 2048
#endif
constexpr Blocks kBlocksAvx512{PYHET_GEMM_AVX512_MC, PYHET_GEMM_AVX512_KC,
                               PYHET_GEMM_AVX512_NC};
// The same with K blocks twice as long, where a core has an L2 of 2 MiB or more (Intel's server
// cores): the packed MC x KC block of A (480 KiB) takes the same quarter of it that KC = 512 takes
// of Zen 4's and Zen 5's 1 MiB, and each tile of C is read and written half as often. On a
// 2-core Intel Xeon VM (48 KiB L1d, 2 MiB L2), one thread, one build after the other: the conv2
// weight and input gradients (1500 x 12500 x 1600 and 12500 x 1600 x 1500) went from 0.87 and
// 0.91 of OpenBLAS to 0.94 and 1.00, 1024^3 from 0.98 to 0.99-1.10, and the paper network's
// step at batch 16 from 1.34 to 1.23 s.
#ifndef PYHET_GEMM_AVX512_WIDE_L2_KC
#define PYHET_GEMM_AVX512_WIDE_L2_KC 1024
#endif
constexpr Blocks kBlocksAvx512WideL2{PYHET_GEMM_AVX512_MC, PYHET_GEMM_AVX512_WIDE_L2_KC,
                                     PYHET_GEMM_AVX512_NC};
constexpr long kWideL2Bytes = 2L << 20;

// A product below this many FLOPs per thread (about 0.15 ms of one core) runs on fewer threads.
// Splitting it would save at most that much, and waking an OpenMP team that has gone to sleep
// costs up to several ms on the 2-vCPU VMs this is measured on (the woken thread is sometimes
// queued behind the caller's until the next scheduler tick). The small fc products (M = 16,
// N = 10, K = 37500: 12 MFLOP) stay on one thread; the conv products are thousands of times
// bigger.
constexpr double kMinFlopsPerThread = 1.6e7;
// The threshold in use: the tests lower it (set_min_flops_per_thread) so that products small
// enough to check quickly are split among threads too, with all their edge cases.
std::atomic<double> min_flops_per_thread{kMinFlopsPerThread};
// Rows split among threads share one packed B block when it holds at least this many floats
// (64 KiB); smaller blocks are cheaper to pack twice than to wait for each other at a barrier.
constexpr int64_t kMinSharedBFloats = 16384;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

// ---------------------------------------------------------------------------------------------
// Packing: op() is applied here, edges are padded with zeros. A source is one matrix, or (for a
// sub-product of Strassen's scheme) the sum of two stored alike: x + s2 * x2, made as it is
// packed, so that the sum never exists as a matrix of its own.

struct Source {
  const float* x;
  const float* x2;  // null: x alone
  float s2;
  int64_t ld;
};

// The element at offset `off` from the start of each matrix.
template <bool Sum>
inline float at(const Source& s, int64_t off) {
  return Sum ? s.x[off] + s.s2 * s.x2[off] : s.x[off];
}

// dst[q] = source at off + q, for q < n.
template <bool Sum>
inline void copy_run(const Source& s, int64_t off, int64_t n, float* dst) {
  if (!Sum) {
    std::memcpy(dst, s.x + off, sizeof(float) * n);
    return;
  }
  const float* x = s.x + off;
  const float* x2 = s.x2 + off;
  for (int64_t q = 0; q < n; ++q) dst[q] = x[q] + s.s2 * x2[q];
}

#ifdef __SSE2__
template <bool Sum>
inline __m128 load4(const Source& s, int64_t off) {
  const __m128 v = _mm_loadu_ps(s.x + off);
  return Sum ? _mm_add_ps(v, _mm_mul_ps(_mm_set1_ps(s.s2), _mm_loadu_ps(s.x2 + off))) : v;
}

// dst[q * ld_dst + r] = source[off + r * ld + q] for r, q < 4: four floats of four rows read at
// once and transposed in registers, not sixteen scalars.
template <bool Sum>
inline void transpose_4x4(const Source& s, int64_t off, float* dst, int64_t ld_dst) {
  __m128 r0 = load4<Sum>(s, off);
  __m128 r1 = load4<Sum>(s, off + s.ld);
  __m128 r2 = load4<Sum>(s, off + 2 * s.ld);
  __m128 r3 = load4<Sum>(s, off + 3 * s.ld);
  _MM_TRANSPOSE4_PS(r0, r1, r2, r3);
  _mm_storeu_ps(dst, r0);
  _mm_storeu_ps(dst + ld_dst, r1);
  _mm_storeu_ps(dst + 2 * ld_dst, r2);
  _mm_storeu_ps(dst + 3 * ld_dst, r3);
}
#endif

// dst[q * T + r] = the source at off + r * ld + q, for q < kc and r < rows (rows <= T), and zeros
// for rows <= r < T: T rows of a matrix, kc floats of each, as a sliver of T side by side (an
// MR x kc sliver of op(A) from rows of A; a kc x NR sliver of op(B) from rows of a transposed
// B). By 4 x 4 transposes in registers where 4 rows are left, one float at a time past them (an
// edge sliver, N = C * R * S = 25 of a first conv layer's weight gradient, went one float at a
// time before: its product 1.9x slower on one thread). 16 q (a cache line of each row) at a
// time: rows a power of two apart (ld = 4096) share a set of L1, and T of them at once may
// overflow its ways (measured within noise of 4 q of all T rows at a time on Zen 5).
template <int T, bool Sum>
void transpose_rows(const Source& s, int64_t off, int64_t rows, int64_t kc, float* dst) {
  const int64_t ld = s.ld, whole = rows / 4 * 4;
  // the rows past the last group of 4 and the zeros, for q in [q0, q1)
  auto rest = [&](int64_t q0, int64_t q1) {
    for (int64_t q = q0; q < q1; ++q) {
      for (int64_t r = whole; r < rows; ++r) dst[q * T + r] = at<Sum>(s, off + r * ld + q);
      for (int64_t r = rows; r < T; ++r) dst[q * T + r] = 0.f;
    }
  };
  int64_t p = 0;
#ifdef __SSE2__
  for (; p + 16 <= kc; p += 16) {
    for (int64_t r = 0; r < whole; r += 4)
      for (int64_t q = p; q < p + 16; q += 4)
        transpose_4x4<Sum>(s, off + r * ld + q, dst + q * T + r, T);
    rest(p, p + 16);
  }
  for (; p + 4 <= kc; p += 4) {
    for (int64_t r = 0; r < whole; r += 4)
      transpose_4x4<Sum>(s, off + r * ld + p, dst + p * T + r, T);
    rest(p, p + 4);
  }
#endif
  for (int64_t r = 0; r < whole; ++r)  // without SSE2, or the last kc % 4
    for (int64_t q = p; q < kc; ++q) dst[q * T + r] = at<Sum>(s, off + r * ld + q);
  rest(p, kc);
}

// The rows [i0, i0 + mc) and columns [p0, p0 + kc) of op(A), as MR x kc slivers.
template <int MR, bool Sum>
void pack_a_from(bool trans, const Source& A, int64_t i0, int64_t mc, int64_t p0, int64_t kc,
                 float* dst) {
  const int64_t lda = A.ld;
  if (trans) {
    // op(A)[i][p] = A[p * lda + i]: row p of A holds column p of every sliver side by side.
    // Row by row across the whole block, so that each row of A is read once as one run of mc
    // floats (sliver by sliver read MR floats of kc rows lda apart at a time, and spent 7% of
    // the input gradient's product waiting for them), with the row a few ahead prefetched.
    constexpr int64_t ahead = 4;
    int64_t row = p0 * lda + i0;
    for (int64_t p = 0; p < kc; ++p, row += lda) {
#ifdef __SSE2__
      if (p + ahead < kc) {
        for (const float* x : {A.x, A.x2}) {
          if (!x) continue;
          const char* next = reinterpret_cast<const char*>(x + row + ahead * lda);
          for (int64_t off = 0; off < mc * static_cast<int64_t>(sizeof(float)); off += 64)
            _mm_prefetch(next + off, _MM_HINT_T0);
        }
      }
#endif
      float* d = dst + p * MR;
      for (int64_t ir = 0; ir < mc; ir += MR, d += kc * MR) {
        const int64_t m = std::min<int64_t>(MR, mc - ir);
        if (m == MR) {
          copy_run<Sum>(A, row + ir, MR, d);
        } else {
          for (int i = 0; i < MR; ++i) d[i] = i < m ? at<Sum>(A, row + ir + i) : 0.f;
        }
      }
    }
    return;
  }
  // op(A)[i][p] = A[i * lda + p]: MR rows read side by side, sliver by sliver
  for (int64_t ir = 0; ir < mc; ir += MR, dst += kc * MR)
    transpose_rows<MR, Sum>(A, (i0 + ir) * lda + p0, std::min<int64_t>(MR, mc - ir), kc, dst);
}

template <int MR>
void pack_a(bool trans, const Source& A, int64_t i0, int64_t mc, int64_t p0, int64_t kc,
            float* dst) {
  if (A.x2)
    pack_a_from<MR, true>(trans, A, i0, mc, p0, kc, dst);
  else
    pack_a_from<MR, false>(trans, A, i0, mc, p0, kc, dst);
}

// The NR slivers [s0, s1) of the block of op(B) with rows [p0, p0 + kc) and columns
// [j0, j0 + nc); sliver s goes to dst + s * stride and holds columns j0 + s * NR ...
template <int NR, bool Sum>
void pack_b_from(bool trans, const Source& B, int64_t p0, int64_t kc, int64_t j0, int64_t nc,
                 int64_t s0, int64_t s1, float* dst, int64_t stride) {
  const int64_t ldb = B.ld;
  if (!trans) {
    // op(B)[p][j] = B[p * ldb + j]: 8 rows at a time across all the slivers, so that B is read
    // in runs along its rows and each sliver is written 8 * NR floats at a time (sliver by sliver
    // would touch a new page every 64 bytes when B is wide: 2-3x slower).
    constexpr int64_t rows = 8;
    for (int64_t pb = 0; pb < kc; pb += rows) {
      const int64_t pe = std::min(kc, pb + rows);
      for (int64_t s = s0; s < s1; ++s) {
        const int64_t j = s * NR, n = std::min<int64_t>(NR, nc - j);
        int64_t src = (p0 + pb) * ldb + j0 + j;
        float* d = dst + s * stride + pb * NR;
        for (int64_t p = pb; p < pe; ++p, src += ldb, d += NR) {
          if (n == NR) {
            copy_run<Sum>(B, src, NR, d);
          } else {
            for (int q = 0; q < NR; ++q) d[q] = q < n ? at<Sum>(B, src + q) : 0.f;
          }
        }
      }
    }
    return;
  }
  // op(B)[p][j] = B[j * ldb + p]: sliver by sliver, NR rows of B read side by side (the edge
  // sliver's fewer: the weight gradient of a layer of few input channels has N = C * R * S = 25)
  for (int64_t s = s0; s < s1; ++s)
    transpose_rows<NR, Sum>(B, (j0 + s * NR) * ldb + p0, std::min<int64_t>(NR, nc - s * NR), kc,
                            dst + s * stride);
}

template <int NR>
void pack_b(bool trans, const Source& B, int64_t p0, int64_t kc, int64_t j0, int64_t nc,
            int64_t s0, int64_t s1, float* dst, int64_t stride) {
  if (B.x2)
    pack_b_from<NR, true>(trans, B, p0, kc, j0, nc, s0, s1, dst, stride);
  else
    pack_b_from<NR, false>(trans, B, p0, kc, j0, nc, s0, s1, dst, stride);
}

// The NR slivers [s0, s1) of the block of op(B) with rows [p0, p0 + kc) and columns
// [j0, j0 + nc), where op(B)[p][j] = src[row0 + j][p] and src is another product's op(B) packed
// whole (PackedB, same NR): the im2col matrix packed for the forward, read as col^T for the
// weight gradient. A row of src holds NR consecutive p of one sliver of it side by side, so NR
// rows of src by NR of p are an NR x NR tile, transposed here 4 x 4 at a time in registers. p0
// is a multiple of NR (the plan's K blocks are, for this source).
template <int NR>
void pack_b_packed_t(const PackedB& src, int64_t row0, int64_t p0, int64_t kc, int64_t j0,
                     int64_t nc, int64_t s0, int64_t s1, float* dst, int64_t stride) {
  const int64_t kcs = src.kc_step(), sliver = kcs * NR;
  const float* const data = src.block(0, 0);
  const int64_t block = src.slivers() * sliver;  // one K block of src
  auto row_at = [&](int64_t r) {                 // row r of src, at its sliver 0
    return data + (r / kcs) * block + (r % kcs) * NR;
  };
  // Tile by tile of p, sliver by sliver within: the NR rows of a sliver follow those of the one
  // before in src (within a K block of src), so src is read in runs of its slivers' length
  // rather than a tile from each of them in turn.
  for (int64_t p = p0; p < p0 + kc; p += NR) {  // the NR x NR tiles of p's sliver of src
    const int64_t m = std::min<int64_t>(NR, p0 + kc - p), off = (p / NR) * sliver;
    for (int64_t s = s0; s < s1; ++s) {
      const int64_t n = std::min<int64_t>(NR, nc - s * NR), r = row0 + j0 + s * NR;
      float* t = dst + s * stride + (p - p0) * NR;
#ifdef __SSE2__
      if (n == NR && m == NR && NR % 4 == 0 && r % kcs + NR <= kcs) {
        const float* tile = row_at(r) + off;  // NR rows of NR floats, one after the other
        for (int jb = 0; jb < NR; jb += 4) {
          const float* r0 = tile + jb * NR;
          for (int pb = 0; pb < NR; pb += 4) {
            __m128 a0 = _mm_loadu_ps(r0 + pb), a1 = _mm_loadu_ps(r0 + NR + pb);
            __m128 a2 = _mm_loadu_ps(r0 + 2 * NR + pb), a3 = _mm_loadu_ps(r0 + 3 * NR + pb);
            _MM_TRANSPOSE4_PS(a0, a1, a2, a3);
            _mm_storeu_ps(t + pb * NR + jb, a0);
            _mm_storeu_ps(t + (pb + 1) * NR + jb, a1);
            _mm_storeu_ps(t + (pb + 2) * NR + jb, a2);
            _mm_storeu_ps(t + (pb + 3) * NR + jb, a3);
          }
        }
        continue;
      }
#endif
      for (int64_t jj = 0; jj < NR; ++jj) {
        const float* row = jj < n ? row_at(r + jj) + off : nullptr;
        for (int64_t q = 0; q < m; ++q) t[q * NR + jj] = row ? row[q] : 0.f;
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Work space: one aligned block per calling thread, reused from call to call. Its owner (the
// thread that called sgemm) hands slices of it to its OpenMP team, so concurrent calls from
// different threads never share a buffer.

class Workspace {
 public:
  ~Workspace() { std::free(data_); }
  float* get(size_t floats) {
    if (floats > size_) {
      std::free(data_);
      data_ = nullptr;
      size_ = 0;
      const size_t bytes = round_up(static_cast<int64_t>(floats * sizeof(float)), 64);
      data_ = static_cast<float*>(std::aligned_alloc(64, bytes));
      if (!data_) throw std::bad_alloc();
      size_ = floats;
    }
    return data_;
  }

 private:
  float* data_ = nullptr;
  size_t size_ = 0;
};

float* workspace(size_t floats) {
  thread_local Workspace ws;
  return ws.get(floats);
}

// ---------------------------------------------------------------------------------------------
// C = beta * C over an M x N block (K == 0 or alpha == 0); beta == 0 writes zeros.

void scale_c(int64_t M, int64_t N, float beta, float* C, int64_t ldc) {
  for (int64_t i = 0; i < M; ++i) {
    float* c = C + i * ldc;
    if (beta == 0.f)
      std::memset(c, 0, sizeof(float) * N);
    else if (beta != 1.f)
      for (int64_t j = 0; j < N; ++j) c[j] *= beta;
  }
}

// ---------------------------------------------------------------------------------------------
// The macro-kernel: the packed mc x kc block of A times the NR slivers [s0, s1) of packed B
// (sliver s at bpack + s * b_stride).

// dst = alpha * tile + beta * dst over m x n (beta == 0: dst is not read).
template <int NR>
void tile_out(const float* tile, int64_t m, int64_t n, float alpha, float beta, float* dst,
              int64_t ldc) {
  for (int64_t i = 0; i < m; ++i) {
    const float* t = tile + i * NR;
    float* d = dst + i * ldc;
    if (beta == 0.f) {
      for (int64_t j = 0; j < n; ++j) d[j] = alpha * t[j];
    } else {
      for (int64_t j = 0; j < n; ++j) d[j] = alpha * t[j] + beta * d[j];
    }
  }
}

// The edge kernel of a micro-kernel (rows of a tile cut off by the edge of C), or null.
inline EdgeKernel edge_kernel_of(MicroKernel kernel) {
#ifdef PYHET_HAVE_AVX512_KERNEL
  if (kernel == micro_kernel_avx512) return edge_kernel_avx512;
#endif
  (void)kernel;
  return nullptr;
}

// C2 (with alpha2, beta2, same row stride): where a Strassen sub-product also goes, or null.
template <int MR, int NR>
void macro_kernel(MicroKernel kernel, int64_t mc, int64_t nc, int64_t kc, int64_t s0,
                  int64_t s1, const float* apack, const float* bpack, int64_t b_stride,
                  float alpha, float beta, float* C, int64_t ldc, float* C2 = nullptr,
                  float alpha2 = 0.f, float beta2 = 0.f) {
  alignas(64) float tile[MR * NR];
  const EdgeKernel edge = edge_kernel_of(kernel);
  for (int64_t s = s0; s < s1; ++s) {
    const int64_t j = s * NR, n = std::min<int64_t>(NR, nc - j);
    const float* b = bpack + s * b_stride;
    for (int64_t ir = 0; ir < mc; ir += MR) {
      const int64_t m = std::min<int64_t>(MR, mc - ir);
      const float* a = apack + ir * kc;
      float* c = C + ir * ldc + j;
      const SecondTile second{C2 ? C2 + ir * ldc + j : nullptr, alpha2, beta2};
      if (m == MR && n == NR) {
        kernel(kc, a, b, c, ldc, alpha, beta, C2 ? &second : nullptr);
        continue;
      }
      // An edge tile: compute it into `tile` (its rows inside C, where the kernel has an edge
      // kernel, else the whole tile), then write only the part inside C.
      if (edge && m < MR)
        edge(kc, a, b, tile, m);
      else
        kernel(kc, a, b, tile, NR, 1.f, 0.f, nullptr);
      tile_out<NR>(tile, m, n, alpha, beta, c, ldc);
      if (C2) tile_out<NR>(tile, m, n, alpha2, beta2, second.c, ldc);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// How a call is split among threads

struct Problem {
  bool trans_a, trans_b;
  int64_t M, N, K;
  float alpha, beta;
  const float* A;
  int64_t lda;
  const float* B;
  int64_t ldb;
  float* C;
  int64_t ldc;
  // A sub-product of Strassen's scheme (see run_strassen below), else left as they are:
  // op(A) + a2 * op(A2) and op(B) + b2 * op(B2) (both stored as A and B), and the product also
  // added to C2 (row stride ldc) as C2 = alpha2 * product + beta2 * C2.
  const float* A2 = nullptr;
  float a2 = 0.f;
  const float* B2 = nullptr;
  float b2 = 0.f;
  float* C2 = nullptr;
  float alpha2 = 0.f, beta2 = 0.f;
  // op(B) read from another product's packed operand instead of B (sgemm_packed_t): rows
  // [bt_row0, bt_row0 + N) of bt's op(B), transposed.
  const PackedB* bt = nullptr;
  int64_t bt_row0 = 0;
};

// A team of tm x tn threads: thread t owns a band of rows of C (row t / tn of tm, in whole MR
// tiles) and, within every NC block, a band of its NR slivers (column t % tn of tn).
//
// When rows are split (tm > 1), the threads of a column need the same packed B. If the B block
// is big, they pack it together into one shared buffer (`cooperative`: each packs a share;
// barriers keep anyone from reading it before it is whole or overwriting it while it is read).
// If it is small, a barrier would cost more than packing it twice, so each thread packs its own
// copy (`b_private`) and never waits for the others. When only columns are split (tm == 1),
// every thread packs just its own slivers into its part of the shared buffer, again without
// barriers.
struct Plan {
  int team = 1, tm = 1, tn = 1;
  bool cooperative = false, b_private = false;
  // Blocks of equal size, at most NC and KC, rather than full ones and a small remainder
  // (K = 1600 in blocks of 400, not 512 + 512 + 512 + 64).
  int64_t nc_step = 0, kc_step = 0;
  int64_t b_floats = 0, a_floats = 0;  // one buffer of packed B, of packed A
  // Sliver s of packed B starts at s * b_stride, whatever the kc of the current block: a thread
  // that runs ahead into the next (shorter) K block then never writes over a neighbour's sliver.
  int64_t b_stride = 0;
  int64_t mc = 0;  // the kernel's MC
  // K split among the threads (see split_k below): thread t runs the K blocks
  // [k_blocks * t / team, k_blocks * (t + 1) / team), every row and column of C, into C itself
  // (t = 0) or into its own M x N partial sum, which are then added to C.
  bool split_k = false;
  int64_t k_blocks = 0;
};

// n split into blocks of at most `block`, all of the same size rounded up to a multiple of `unit`.
int64_t even_step(int64_t n, int64_t block, int64_t unit) {
  return round_up(ceil_div(n, std::max<int64_t>(1, ceil_div(n, block))), unit);
}

// Pick tm x tn = threads so that the busiest thread has the fewest mr x nr micro-tiles.
// Splitting rows gets a 5% head start while every band keeps at least 96 rows (16 tiles of 6):
// it packs no block of A twice and measured a few percent faster on the conv products at 2
// threads. Thinner bands of rows get a 5% handicap instead, so near-ties go to splitting
// columns, which needs no barriers (M = 7 in bands of 6 and 1 rows does no less work than two
// bands of columns, and waits).
void thread_grid(int64_t M, int64_t nc, int mr, int nr, int threads, int* tm, int* tn) {
  const int64_t m_tiles = ceil_div(M, mr), n_tiles = ceil_div(nc, nr);
  double best = -1;
  for (int r = 1; r <= threads; ++r) {
    if (threads % r) continue;
    const int c = threads / r;
    double cost = static_cast<double>(ceil_div(m_tiles, r) * ceil_div(n_tiles, c));
    if (r > 1) cost *= ceil_div(m_tiles, r) * mr >= 96 ? 0.95 : 1.05;
    if (best < 0 || cost < best) {
      best = cost;
      *tm = r;
      *tn = c;
    }
  }
}

Plan make_plan(int64_t M, int64_t N, int64_t K, int threads, int mr, int nr,
               const Blocks& blocks, int64_t kc_unit = 1) {
  Plan plan;
#ifdef _OPENMP
  const double flops =
      2.0 * static_cast<double>(M) * static_cast<double>(N) * static_cast<double>(K);
  const double min_flops = min_flops_per_thread.load(std::memory_order_relaxed);
  plan.team = clamp_threads(threads);
  if (min_flops > 0) {
    const double fit = flops / min_flops;  // threads worth waking
    if (fit < plan.team) plan.team = std::max(1, static_cast<int>(fit));
  }
#else
  (void)threads;
#endif
  plan.nc_step = even_step(N, blocks.nc, nr);
  plan.kc_step = even_step(K, blocks.kc, kc_unit);
  thread_grid(M, plan.nc_step, mr, nr, plan.team, &plan.tm, &plan.tn);
  plan.b_stride = plan.kc_step * nr;
  plan.b_floats = ceil_div(plan.nc_step, nr) * plan.b_stride;
  plan.mc = blocks.mc;
  plan.a_floats = std::min(blocks.mc, round_up(M, mr)) * plan.kc_step;
  plan.cooperative = plan.tm > 1 && plan.b_floats >= kMinSharedBFloats;
  plan.b_private = plan.tm > 1 && !plan.cooperative;
  return plan;
}

// A K block is worth a thread of its own only from this many steps of K (the tile of C is
// loaded and stored once a block).
constexpr int64_t kMinSplitKc = 128;

// Packing a float of A or B, in FLOPs of the micro-kernel's time: 27 (copies) to 68 (4 x 4
// transposes) measured on a Zen 5 core against its 180 GFLOP/s (pack_b of 800 x 4096 floats;
// sgemm_packed of the same).
constexpr double kPackFlops = 48;
// The partial sums of a split K stay below this many floats (16 MiB).
constexpr int64_t kMaxPartialFloats = int64_t{1} << 22;

// Whether to split K among the threads instead of the rows and columns of C: where C has too few
// micro-tiles to share out evenly, and each thread of the grid would pack as much as it
// multiplies (the weight gradient of a first conv layer of few kernels and channels: 32 x 25
// floats of C over K = 36864 image positions, three 12 x 32 tiles between two threads, a
// barrier per K block as they share B; or 6 x 16 tiles split by columns, each thread packing
// all of A). Each thread then packs only its own part of A and B and never waits, and the
// partial sums, M x N floats a thread, are added up at the end in a fixed order (so a call on
// the same threads gives the same bits every time). Taken where the busiest thread's work, its
// micro-tiles' FLOPs and its packing (and the addition of the partial sums), comes to at most
// 0.9 of the grid's. `b_packed`: op(B) packed beforehand, in K blocks that cannot change.
void plan_split_k(Plan& plan, int64_t M, int64_t N, int64_t K, int mr, int nr, int64_t kc,
                  int64_t kc_unit, bool b_packed) {
  if (plan.team < 2) return;
  int64_t kc_step = plan.kc_step, blocks = ceil_div(K, kc_step);
  if (blocks < plan.team && !b_packed) {  // smaller blocks, so that every thread has one
    const int64_t step = even_step(K, std::min(kc, ceil_div(K, plan.team)), kc_unit);
    if (step >= kMinSplitKc) {
      kc_step = step;
      blocks = ceil_div(K, kc_step);
    }
  }
  const int64_t team = std::min<int64_t>(plan.team, blocks);
  if (team < 2 || M * N * (team - 1) > kMaxPartialFloats) return;
  const double tile = 2.0 * mr * nr, m = static_cast<double>(M), n = static_cast<double>(N);
  const double m_tiles = static_cast<double>(ceil_div(M, mr));
  const double n_blocks = static_cast<double>(ceil_div(N, plan.nc_step));
  const double block_tiles = static_cast<double>(ceil_div(plan.nc_step, nr));
  // the grid's busiest thread: its tiles, its rows of A (packed again for every NC block), its
  // share of B (all of its columns' slivers, or an even share of each block where they share)
  const double k = static_cast<double>(K);
  const double rows = std::min(m, std::ceil(m_tiles / plan.tm) * mr);
  const double grid =
      tile * std::ceil(m_tiles / plan.tm) * n_blocks * std::ceil(block_tiles / plan.tn) * k +
      kPackFlops * (rows * k * n_blocks +
                    (b_packed ? 0.0 : n * k / (plan.cooperative ? plan.team : plan.tn)));
  // split: every tile over its K blocks, all rows of A and columns of B over them, and its rows'
  // share of the addition
  const double kt = std::min(k, static_cast<double>(ceil_div(blocks, team) * kc_step));
  const double split = tile * m_tiles * std::ceil(n / nr) * kt +
                       kPackFlops * (m * kt * n_blocks + (b_packed ? 0.0 : n * kt) + m * n);
  if (split > 0.9 * grid) return;
  plan.split_k = true;
  plan.team = static_cast<int>(team);
  plan.tm = plan.tn = 1;
  plan.cooperative = false;
  plan.b_private = true;  // each thread packs its own K blocks of B
  plan.kc_step = kc_step;
  plan.k_blocks = blocks;
  plan.b_stride = kc_step * nr;
  plan.b_floats = ceil_div(plan.nc_step, nr) * plan.b_stride;
  plan.a_floats = std::min(plan.mc, round_up(M, mr)) * kc_step;
}

// ---------------------------------------------------------------------------------------------
// The five loops, as run by thread t of the plan's team (or alone: t = 0, tm = tn = 1).
// `#pragma omp barrier` binds to the team of sgemm's parallel region.

template <int MR, int NR>
void run_thread(const Problem& P, const Plan& plan, MicroKernel kernel, int t, float* bpack,
                float* apack, const PackedB* packed, float* partial = nullptr) {
  const int row = plan.split_k ? 0 : t / plan.tn, col = plan.split_k ? 0 : t % plan.tn;
  // Where this thread's K blocks go: C, or (split_k, t > 0) its partial sum, M x N.
  int64_t k0 = 0, k1 = P.K;
  float* const C = plan.split_k && t > 0 ? partial : P.C;
  const int64_t ldc = plan.split_k && t > 0 ? P.N : P.ldc;
  const float beta0 = plan.split_k && t > 0 ? 0.f : P.beta;
  if (plan.split_k) {
    k0 = std::min(P.K, plan.k_blocks * t / plan.team * plan.kc_step);
    k1 = std::min(P.K, plan.k_blocks * (t + 1) / plan.team * plan.kc_step);
  }
  const int64_t m_tiles = ceil_div(P.M, MR);
  const int64_t m0 = std::min(P.M, m_tiles * row / plan.tm * MR);
  const int64_t m1 = std::min(P.M, m_tiles * (row + 1) / plan.tm * MR);
  const int64_t mc_step = even_step(m1 - m0, plan.mc, MR);
  // The slivers this thread owns, the same in every NC block (cut off in a shorter last one):
  // when columns are split without barriers, a thread that moves on to the next block early
  // then only overwrites slivers that no one else is still reading.
  const int64_t max_slivers = ceil_div(plan.nc_step, NR);
  const int64_t own0 = max_slivers * col / plan.tn, own1 = max_slivers * (col + 1) / plan.tn;
  const Source A{P.A, P.A2, P.a2, P.lda}, B{P.B, P.B2, P.b2, P.ldb};
  // slivers [q0, q1) of the block of op(B) at (pc, jc)
  auto pack_block = [&](int64_t pc, int64_t kc, int64_t jc, int64_t nc, int64_t q0, int64_t q1) {
    if (P.bt)
      pack_b_packed_t<NR>(*P.bt, P.bt_row0, pc, kc, jc, nc, q0, q1, bpack, plan.b_stride);
    else
      pack_b<NR>(P.trans_b, B, pc, kc, jc, nc, q0, q1, bpack, plan.b_stride);
  };

  for (int64_t jc = 0; jc < P.N; jc += plan.nc_step) {
    const int64_t nc = std::min(plan.nc_step, P.N - jc);
    const int64_t slivers = ceil_div(nc, NR);
    const int64_t s0 = std::min(own0, slivers), s1 = std::min(own1, slivers);
    for (int64_t pc = k0; pc < k1; pc += plan.kc_step) {
      const int64_t kc = std::min(plan.kc_step, k1 - pc);
      const float beta = pc == k0 ? beta0 : 1.f;  // later K blocks add to the first one
      const float beta2 = pc == k0 ? P.beta2 : 1.f;
      const float* b = bpack;
      if (packed) {  // op(B) packed whole beforehand: nothing to pack, nothing to wait for
        b = packed->block(pc, jc);
      } else if (plan.cooperative) {
        // Everyone packs an equal share of the whole block, then waits until all is packed.
        const int64_t q0 = slivers * t / plan.team, q1 = slivers * (t + 1) / plan.team;
        pack_block(pc, kc, jc, nc, q0, q1);
#pragma omp barrier
      } else {
        pack_block(pc, kc, jc, nc, s0, s1);
      }

      for (int64_t ic = m0; ic < m1; ic += mc_step) {
        const int64_t mc = std::min(mc_step, m1 - ic);
        pack_a<MR>(P.trans_a, A, ic, mc, pc, kc, apack);
        macro_kernel<MR, NR>(kernel, mc, nc, kc, s0, s1, apack, b, plan.b_stride, P.alpha, beta,
                             C + ic * ldc + jc, ldc,
                             P.C2 ? P.C2 + ic * P.ldc + jc : nullptr, P.alpha2, beta2);
      }
      if (plan.cooperative) {
#pragma omp barrier
      }
    }
  }
}

// Whether run_tiled splits K for a plain product (sgemm's; no packed operand).
template <int MR, int NR>
bool plans_split_k(int64_t M, int64_t N, int64_t K, int threads, const Blocks& blocks) {
  Plan plan = make_plan(M, N, K, threads, MR, NR, blocks);
  plan_split_k(plan, M, N, K, MR, NR, blocks.kc, 1, false);
  return plan.split_k;
}

// ---------------------------------------------------------------------------------------------
// One call on a kernel with tile MR x NR: the plan, the work space, the team. `packed`: op(B)
// packed whole beforehand (PackedB), or null to pack it here block by block.

template <int MR, int NR>
void run_tiled(const Problem& P, MicroKernel kernel, const Blocks& blocks, int threads,
               const PackedB* packed) {
  // K blocks of whole NR x NR tiles of a packed source read transposed (pack_b_packed_t)
  const int64_t kc_unit = P.bt ? NR : 1;
  Plan plan = make_plan(P.M, P.N, P.K, threads, MR, NR, blocks, kc_unit);
  if (packed && (packed->kc_step() != plan.kc_step || packed->nr() != NR))
    throw std::logic_error("sgemm_packed: B packed with other blocks than this kernel's");
  if (!P.C2) plan_split_k(plan, P.M, P.N, P.K, MR, NR, blocks.kc, kc_unit, packed != nullptr);
  if (packed) {  // every thread reads the shared packed B: no B work space, no barriers
    plan.cooperative = plan.b_private = false;
    plan.b_floats = 0;
  }

  // The work space: the packed B block (one per thread when b_private), one A block per thread,
  // and with K split, the partial sums of threads 1 ... team - 1.
  const int64_t b_total = plan.b_floats * (plan.b_private ? plan.team : 1);
  const int64_t a_total = plan.a_floats * plan.team;
  const int64_t c_floats = plan.split_k ? P.M * P.N : 0;
  float* ws = workspace(static_cast<size_t>(b_total + a_total + c_floats * (plan.team - 1)));
  float* const partials = ws + b_total + a_total;  // thread t's at (t - 1) * c_floats
  // C += the partial sums, over rows [i0, i1), adding them in the order of their threads.
  auto add_partials = [&](int64_t i0, int64_t i1) {
    for (int u = 1; u < plan.team; ++u) {
      const float* part = partials + (u - 1) * c_floats;
      for (int64_t i = i0; i < i1; ++i) {
        float* c = P.C + i * P.ldc;
        const float* q = part + i * P.N;
        for (int64_t j = 0; j < P.N; ++j) c[j] += q[j];
      }
    }
  };

  // One thread runs inline (an inactive region). Barriers, reached only when cooperative, bind
  // to this region's team, never to that of a caller who is itself inside a parallel region.
  // The region opens the caller's whole team (region_size; threads past plan.team meet only the
  // barrier of a split K), except where the team packs B together: there a thread that sat out
  // would be woken at both barriers of every block of B (passive waiting), which costs more
  // than libgomp's making it anew (a small product of a long K, 2 x 72 barriers).
  const int region = plan.cooperative ? plan.team : region_size(plan.team, threads);
  (void)region;
#pragma omp parallel num_threads(region) if (plan.team > 1)
  {
    int t = 0, got = 1;
#ifdef _OPENMP
    t = omp_get_thread_num();
    got = omp_get_num_threads();
#endif
    // (thread t's buffers, for t < plan.team)
    float* apack = ws + b_total + plan.a_floats * std::min(t, plan.team - 1);
    float* bpack = ws + (plan.b_private ? plan.b_floats * std::min(t, plan.team - 1) : 0);
    float* partial = t > 0 && t < plan.team ? partials + (t - 1) * c_floats : nullptr;
    if (got >= plan.team && t >= plan.team) {
      if (plan.split_k) {  // sits out, but meets the team's one barrier
#pragma omp barrier
      }
    } else if (got >= plan.team) {
      run_thread<MR, NR>(P, plan, kernel, t, bpack, apack, packed, partial);
      if (plan.split_k) {
#pragma omp barrier
        add_partials(P.M * t / plan.team, P.M * (t + 1) / plan.team);
      }
    } else if (t == 0 && plan.split_k) {
      // The runtime gave fewer threads than asked for: thread 0 runs each thread's K blocks in
      // turn (the same sums, so the same bits as on the whole team).
      for (int u = 0; u < plan.team; ++u)
        run_thread<MR, NR>(P, plan, kernel, u, bpack, apack, packed,
                           u > 0 ? partials + (u - 1) * c_floats : nullptr);
      add_partials(0, P.M);
    } else if (t == 0) {  // the runtime gave fewer threads than asked for: thread 0 does it all
      Plan alone = plan;
      alone.team = alone.tm = alone.tn = 1;
      alone.cooperative = alone.b_private = false;
      run_thread<MR, NR>(P, alone, kernel, 0, bpack, apack, packed);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Packing a part of op(B) whole (PackedB): rows [p0, p1) x slivers [s0, s1), K block by K block,
// the slivers split among the threads.

template <int NR>
void pack_part(const float* B, int64_t ldb, PackedB& packed, int64_t p0, int64_t p1, int64_t s0,
               int64_t s1, int threads) {
  const int64_t kcs = packed.kc_step(), stride = kcs * NR;
  const int team = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(
      clamp_threads(threads), s1 - s0)));
  const int region = region_size(team, threads);
  (void)region;
#pragma omp parallel for num_threads(region) schedule(static) if (team > 1)
  for (int t = 0; t < team; ++t) {
    const int64_t q0 = s0 + (s1 - s0) * t / team, q1 = s0 + (s1 - s0) * (t + 1) / team;
    for (int64_t r0 = p0; r0 < p1;) {  // the rows of one K block at a time
      const int64_t start = r0 / kcs * kcs, r1 = std::min(p1, start + kcs);
      float* dst = packed.block(start, 0) + (r0 - start) * NR;
      pack_b<NR>(packed.trans(), Source{B, nullptr, 0.f, ldb}, r0, r1 - r0, 0, packed.N(), q0,
                 q1, dst, stride);
      r0 = r1;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The portable micro-kernel: plain loops that the compiler vectorises for whatever the build
// targets (SSE2 on a generic x86-64 build). A whole 6 x 16 tile would need 24 SSE registers of
// accumulators, more than there are, so it goes two rows at a time: 8 accumulators, 4 vectors
// of b, 2 broadcasts of a; the kc x NR sliver of b is read three times, from L1.

}  // namespace

void micro_kernel_portable(int64_t kc, const float* a, const float* b, float* c, int64_t ldc,
                           float alpha, float beta, const SecondTile* second) {
  constexpr int MR = PortableTile::MR, NR = PortableTile::NR;
  static_assert(MR % 2 == 0, "the portable kernel takes rows in pairs");
  for (int i = 0; i < MR; i += 2) {
    float acc0[NR] = {}, acc1[NR] = {};
    const float* ap = a + i;
    const float* bp = b;
    for (int64_t p = 0; p < kc; ++p, ap += MR, bp += NR) {
      const float a0 = ap[0], a1 = ap[1];
      for (int j = 0; j < NR; ++j) {
        acc0[j] += a0 * bp[j];
        acc1[j] += a1 * bp[j];
      }
    }
    // rows i and i + 1 of a tile: alpha_ * acc + beta_ * tile
    auto store = [&](float* t, float alpha_, float beta_) {
      float* t0 = t + i * ldc;
      float* t1 = t0 + ldc;
      for (int j = 0; j < NR; ++j) {
        t0[j] = alpha_ * acc0[j] + (beta_ == 0.f ? 0.f : beta_ * t0[j]);
        t1[j] = alpha_ * acc1[j] + (beta_ == 0.f ? 0.f : beta_ * t1[j]);
      }
    };
    store(c, alpha, beta);
    if (second) store(second->c, second->alpha, second->beta);
  }
}

// ---------------------------------------------------------------------------------------------
// Choosing the micro-kernel at run time

namespace {

// A kernel, its tile and its blocks, and the five loops and the packing of a whole op(B)
// instantiated for its tile.
struct Kernel {
  const char* name;
  MicroKernel micro;
  Blocks blocks;
  int nr;
  void (*run)(const Problem& P, MicroKernel kernel, const Blocks& blocks, int threads,
              const PackedB* packed);
  void (*pack)(const float* B, int64_t ldb, PackedB& packed, int64_t p0, int64_t p1, int64_t s0,
               int64_t s1, int threads);
  bool (*split_k)(int64_t M, int64_t N, int64_t K, int threads, const Blocks& blocks);
};

template <class Tile>
constexpr Kernel make_kernel(const char* name, MicroKernel micro, const Blocks& blocks) {
  return Kernel{name, micro, blocks, Tile::NR, &run_tiled<Tile::MR, Tile::NR>,
                &pack_part<Tile::NR>, &plans_split_k<Tile::MR, Tile::NR>};
}

template <class Tile>
constexpr bool whole_tiles(const Blocks& b) {
  return b.mc % Tile::MR == 0 && b.nc % Tile::NR == 0;
}
static_assert(whole_tiles<PortableTile>(kBlocks6x16), "MC, NC must hold whole 6 x 16 tiles");
static_assert(whole_tiles<Avx2Tile>(kBlocks6x16), "MC, NC must hold whole 6 x 16 tiles");

constexpr Kernel kPortableKernel =
    make_kernel<PortableTile>("portable", micro_kernel_portable, kBlocks6x16);
#ifdef PYHET_HAVE_AVX2_KERNEL
constexpr Kernel kAvx2Kernel = make_kernel<Avx2Tile>("avx2-fma", micro_kernel_avx2, kBlocks6x16);
#endif
#ifdef PYHET_HAVE_AVX512_KERNEL
static_assert(whole_tiles<Avx512Tile>(kBlocksAvx512), "MC, NC must hold whole 12 x 32 tiles");
static_assert(whole_tiles<Avx512Tile>(kBlocksAvx512WideL2), "MC, NC must hold whole 12 x 32 tiles");
constexpr Kernel kAvx512Kernel =
    make_kernel<Avx512Tile>("avx512", micro_kernel_avx512, kBlocksAvx512);
constexpr Kernel kAvx512KernelWideL2 =
    make_kernel<Avx512Tile>("avx512", micro_kernel_avx512, kBlocksAvx512WideL2);

// The AVX-512 kernel with the blocks for this CPU's L2 (one per process: a PackedB made by it is
// read by it): the wider ones where core_l2_bytes() is kWideL2Bytes or more.
const Kernel& avx512_kernel() {
  static const bool wide = core_l2_bytes() >= kWideL2Bytes;
  return wide ? kAvx512KernelWideL2 : kAvx512Kernel;
}
#endif

enum Choice { kAuto, kPortable, kAvx2, kAvx512 };
std::atomic<int> forced_kernel{kAuto};

bool cpu_has_avx2_fma() {
#ifdef PYHET_HAVE_AVX2_KERNEL
  static const bool yes = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }();
  return yes;
#else
  return false;
#endif
}

// gemm_avx512.cpp is compiled with -mavx512vl as well as -mavx512f (the compiler may use VL's
// encodings anywhere in it), so both are required. GCC's check includes the OS saving the zmm
// and mask registers (XCR0).
bool cpu_has_avx512() {
#ifdef PYHET_HAVE_AVX512_KERNEL
  static const bool yes = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
           cpu_has_avx2_fma();
  }();
  return yes;
#else
  return false;
#endif
}

// Whether "auto" takes the AVX-512 kernel where the CPU runs it: everywhere but on AMD's Zen 4
// (family 0x19, the only one of that family with AVX-512). Zen 4 runs a 512-bit FMA on both of
// its 256-bit FMA pipes at once, so the 12 x 32 kernel has the same peak as the 6 x 16 AVX2 one.
// Measured there (`pyhet bench gemm`, interleaved runs at 1 and 2 threads), the two tie on the
// big products (1024^3 and the three conv2 products: avx512 / avx2 from 0.81 to 1.13, 1.03 on
// average, both near the core's peak), and the bigger tile loses where it pads the edges
// further: 0.48x on the fc product (16 x 10 x 37500), 0.92x on 100^3, 0.98x on conv1
// (500 x 12544 x 75). So Zen 4 keeps AVX2. CPUs with 512-bit FMA units (Intel's server cores,
// Zen 5) do twice the work per FMA instruction with AVX-512; there it is the default (on a
// Zen 5, family 0x1a: 1.64-1.73x the AVX2 kernel on 1024^3 and the conv2 forward, one thread).
bool prefer_avx512() {
#ifdef PYHET_HAVE_AVX512_KERNEL
  static const bool yes = [] {
    if (!cpu_has_avx512()) return false;
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!__builtin_cpu_is("amd") || !__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return true;
    const unsigned family = ((eax >> 8) & 0xf) + ((eax >> 20) & 0xff);  // base + extended
    return family != 0x19;
  }();
  return yes;
#else
  return false;
#endif
}

const Kernel& chosen_kernel() {
  const int choice = forced_kernel.load(std::memory_order_relaxed);
#ifdef PYHET_HAVE_AVX512_KERNEL
  if ((choice == kAvx512 && cpu_has_avx512()) || (choice == kAuto && prefer_avx512()))
    return avx512_kernel();
#endif
#ifdef PYHET_HAVE_AVX2_KERNEL
  if ((choice == kAvx2 || choice == kAuto) && cpu_has_avx2_fma()) return kAvx2Kernel;
#endif
  (void)choice;
  return kPortableKernel;
}

// The kernel called `name` (a PackedB's): one of those compiled in.
const Kernel& kernel_named(const char* name) {
#ifdef PYHET_HAVE_AVX512_KERNEL
  if (std::strcmp(name, kAvx512Kernel.name) == 0) return avx512_kernel();
#endif
#ifdef PYHET_HAVE_AVX2_KERNEL
  if (std::strcmp(name, kAvx2Kernel.name) == 0) return kAvx2Kernel;
#endif
  return kPortableKernel;
}

}  // namespace

bool set_kernel(const char* name) {
  if (std::strcmp(name, "auto") == 0) {
    forced_kernel = kAuto;
  } else if (std::strcmp(name, "portable") == 0) {
    forced_kernel = kPortable;
  } else if (std::strcmp(name, "avx2-fma") == 0) {
    if (!cpu_has_avx2_fma()) return false;
    forced_kernel = kAvx2;
  } else if (std::strcmp(name, "avx512") == 0) {
    if (!cpu_has_avx512()) return false;
    forced_kernel = kAvx512;
  } else {
    return false;
  }
  return true;
}

double set_min_flops_per_thread(double flops) {
  return min_flops_per_thread.exchange(flops < 0 ? kMinFlopsPerThread : flops);
}

}  // namespace gemm

const char* sgemm_kernel_name() { return gemm::chosen_kernel().name; }

std::array<int64_t, 3> sgemm_blocks() {
  const gemm::Blocks& b = gemm::chosen_kernel().blocks;
  return {b.mc, b.kc, b.nc};
}

// ---------------------------------------------------------------------------------------------
// One level of Strassen's scheme, for the big products
//
// With op(A), op(B) and C cut in 2 x 2 quadrants (the even part of each dimension), seven
// products of quadrant size replace the eight of the blocked product (1/8 less arithmetic):
//
//   M1 = (A11 + A22)(B11 + B22)   C11 = M1 + M4 - M5 + M7
//   M2 = (A21 + A22) B11          C12 = M3 + M5
//   M3 = A11 (B12 - B22)          C21 = M2 + M4
//   M4 = A22 (B21 - B11)          C22 = M1 - M2 + M3 + M6
//   M5 = (A11 + A12) B22
//   M6 = (A21 - A11)(B11 + B12)
//   M7 = (A12 - A22)(B21 + B22)
//
// As in "Strassen's Algorithm Reloaded" (Huang, Smith, Henry, van de Geijn, SC16), the sums are
// made while packing (both quadrants read in one pass, their sum written to the packed block)
// and each product goes straight to the quadrants of C that it adds to, tile by tile: no matrix
// of quadrant size is ever made, and no memory is taken beyond the packing buffers. The cost is
// more packing (the sums read up to twice the operands) and a second write of some tiles, so
// it pays only for big products: on the conv2 products of the paper network (each dimension
// >= 1500) it measured 5-15% faster than the blocked product alone (BENCHMARKS.md). The
// rounding differs from the blocked product's (each entry of C is a signed sum of the seven
// products), within a small multiple of its error bound, normwise; and an infinity in an
// operand can make NaN of entries of C that do not depend on it (inf - inf in the sums), where
// the blocked product keeps them finite. PYHET_GEMM_STRASSEN=0 (or off) in the environment
// turns it off. A dimension of odd size leaves a last row, column or rank-1 update, which the
// blocked product does.

namespace gemm {
namespace {

// Products whose every dimension is at least this use Strassen's scheme (0: never). On one
// core of the machine it was tuned on, every product measured with dimensions from 768 up
// gained (768^3 and 1000^3: 3-7%; 800 or 1011 by 1,600 by 12,500 in any order: 4-7%), while
// some with a dimension near 500 lost up to 7% (BENCHMARKS.md).
constexpr int64_t kStrassenMinDim = 768;

int64_t strassen_default() {
  const char* env = std::getenv("PYHET_GEMM_STRASSEN");
  return env && (std::strcmp(env, "0") == 0 || std::strcmp(env, "off") == 0) ? 0
                                                                             : kStrassenMinDim;
}

std::atomic<int64_t>& strassen_min_dim() {
  static std::atomic<int64_t> dim{strassen_default()};
  return dim;
}

// On several threads each of the seven products is an OpenMP region of its own, and waking a
// team whose threads wait passively costs up to a few ms on the VMs this is measured on: there a
// sub-product must also give each thread this many times the FLOPs that split a product among
// threads at all (1e9 by default). 1024^3 at 2 threads (0.13 GFLOP a thread) ran at 0.58x of
// the blocked product; the conv2 forward (3.75 GFLOP a thread) at 0.97-1.04x.
constexpr double kStrassenFlopsPerThreadFactor = 64;

}  // namespace

// With op(B)'s quadrant sums packed beforehand and shared (sgemm_packed_quadrants), the
// scheme's extra packing is only A's: it pays from fewer rows of A than sgemm's products need.
constexpr int64_t kPackedStrassenMinRows = 256;

namespace {

// Whether a sub-product of `sub` FLOPs is worth waking a team of `threads` for (see above).
bool sub_products_worth_threads(double sub, int threads) {
#ifdef _OPENMP
  const int team = clamp_threads(threads);
  if (team > 1) {
    const double min_flops = min_flops_per_thread.load(std::memory_order_relaxed);
    if (sub / team < kStrassenFlopsPerThreadFactor * min_flops) return false;
  }
#else
  (void)sub;
  (void)threads;
#endif
  return true;
}

}  // namespace

bool strassen_applies(int64_t M, int64_t N, int64_t K, int threads) {
  const int64_t dim = strassen_min_dim().load(std::memory_order_relaxed);
  if (dim <= 0 || std::min({M, N, K}) < std::max<int64_t>(dim, 2)) return false;
  return sub_products_worth_threads(
      2.0 * static_cast<double>(M / 2) * static_cast<double>(N / 2) * static_cast<double>(K / 2),
      threads);
}

bool strassen_applies_packed(int64_t M, int64_t K2, int64_t N2, int threads) {
  const int64_t dim = strassen_min_dim().load(std::memory_order_relaxed);
  if (dim <= 0 || std::min(2 * K2, 2 * N2) < dim ||
      M < std::max<int64_t>(2, std::min(dim, kPackedStrassenMinRows)))
    return false;
  return sub_products_worth_threads(
      2.0 * static_cast<double>(M / 2) * static_cast<double>(N2) * static_cast<double>(K2),
      threads);
}

namespace {

// The seven products, quadrants (row, column) from 0: op(A) quadrant a (+ sa * quadrant a2),
// times op(B) quadrant b (+ sb * quadrant b2) (the sum packed as pack i of
// sgemm_packed_quadrants, i its index here), added to C quadrant c times sc (and to c2 times
// sc2), the product that writes a quadrant first taking beta (first, first2). None: -1.
struct Quadrant {
  int i, j;
};
struct StrassenProduct {
  Quadrant a, a2;
  float sa;
  Quadrant b, b2;
  float sb;
  Quadrant c;
  float sc;
  bool first;
  Quadrant c2;
  float sc2;
  bool first2;
};
constexpr Quadrant kNone{-1, -1};
constexpr StrassenProduct kProducts[7] = {
    {{0, 0}, {1, 1}, 1.f, {0, 0}, {1, 1}, 1.f, {0, 0}, 1.f, true, {1, 1}, 1.f, true},
    {{1, 0}, {1, 1}, 1.f, {0, 0}, kNone, 0.f, {1, 0}, 1.f, true, {1, 1}, -1.f, false},
    {{0, 0}, kNone, 0.f, {0, 1}, {1, 1}, -1.f, {0, 1}, 1.f, true, {1, 1}, 1.f, false},
    {{1, 1}, kNone, 0.f, {1, 0}, {0, 0}, -1.f, {0, 0}, 1.f, false, {1, 0}, 1.f, false},
    {{0, 0}, {0, 1}, 1.f, {1, 1}, kNone, 0.f, {0, 0}, -1.f, false, {0, 1}, 1.f, false},
    {{1, 0}, {0, 0}, -1.f, {0, 0}, {0, 1}, 1.f, {1, 1}, 1.f, false, kNone, 0.f, false},
    {{0, 1}, {1, 1}, -1.f, {1, 0}, {1, 1}, 1.f, {0, 0}, 1.f, false, kNone, 0.f, false},
};

// The same scheme for C = op(A) S^T, where S's quadrant sums are packed for another product
// (sgemm_packed_quadrants_t: the weight gradient dy @ col^T from col's sums packed for the
// forward). Applied to C^T = S op(A)^T, Strassen's sums of S (the left operand there) are the
// seven sums of the right operand above (S11 + S22, S21 + S22, S11, S22, S11 + S12, S21 - S11,
// S12 - S22), and transposing every product back gives, with D = op(A):
//
//   M1 = (D11 + D22)(S11 + S22)^T   C11 = M1 + M4 - M5 + M7
//   M2 = D11 (S21 + S22)^T          C12 = M2 + M4
//   M3 = (D21 - D22) S11^T          C21 = M3 + M5
//   M4 = (D12 - D11) S22^T          C22 = M1 - M2 + M3 + M6
//   M5 = D22 (S11 + S12)^T
//   M6 = (D11 + D21)(S21 - S11)^T
//   M7 = (D12 + D22)(S12 - S22)^T
//
// kPackOfProductT: the pack (of sgemm_packed_quadrants' order) that product i reads transposed.
constexpr StrassenProduct kProductsT[7] = {
    {{0, 0}, {1, 1}, 1.f, kNone, kNone, 0.f, {0, 0}, 1.f, true, {1, 1}, 1.f, true},
    {{0, 0}, kNone, 0.f, kNone, kNone, 0.f, {0, 1}, 1.f, true, {1, 1}, -1.f, false},
    {{1, 0}, {1, 1}, -1.f, kNone, kNone, 0.f, {1, 0}, 1.f, true, {1, 1}, 1.f, false},
    {{0, 1}, {0, 0}, -1.f, kNone, kNone, 0.f, {0, 0}, 1.f, false, {0, 1}, 1.f, false},
    {{1, 1}, kNone, 0.f, kNone, kNone, 0.f, {0, 0}, -1.f, false, {1, 0}, 1.f, false},
    {{0, 0}, {1, 0}, 1.f, kNone, kNone, 0.f, {1, 1}, 1.f, false, kNone, 0.f, false},
    {{0, 1}, {1, 1}, 1.f, kNone, kNone, 0.f, {0, 0}, 1.f, false, kNone, 0.f, false},
};
constexpr int kPackOfProductT[7] = {0, 6, 1, 4, 5, 3, 2};

// Runs the seven products of a problem's even part: `run(S, i)` runs sub-problem S (its B,
// B2 and b2 set from op(B)'s quadrants by quadrant b, where the problem has them) as product
// i. qa, qb, qc: pointers to quadrants of op(A), op(B) (null: none) and C.
template <class QA, class QB, class QC, class Run>
void strassen_products(const StrassenProduct (&table)[7], const Problem& P, int64_t M2,
                       int64_t N2, int64_t K2, QA qa, QB qb, QC qc, Run run) {
  for (int i = 0; i < 7; ++i) {
    const StrassenProduct& p = table[i];
    Problem S{P.trans_a, P.trans_b, M2, N2, K2, p.sc * P.alpha, p.first ? P.beta : 1.f,
              qa(p.a), P.lda, qb(p.b), P.ldb, qc(p.c), P.ldc};
    S.A2 = p.a2.i >= 0 ? qa(p.a2) : nullptr;
    S.a2 = p.sa;
    S.B2 = p.b2.i >= 0 ? qb(p.b2) : nullptr;
    S.b2 = p.sb;
    S.C2 = p.c2.i >= 0 ? qc(p.c2) : nullptr;
    S.alpha2 = p.sc2 * P.alpha;
    S.beta2 = p.first2 ? P.beta : 1.f;
    run(S, i);
  }
}

}  // namespace

namespace {

void run_strassen(const Kernel& kernel, const Problem& P, int threads) {
  const int64_t M2 = P.M / 2, N2 = P.N / 2, K2 = P.K / 2;
  auto qa = [&](int i, int j) {  // quadrant (i, j) of op(A)
    return P.trans_a ? P.A + j * K2 * P.lda + i * M2 : P.A + i * M2 * P.lda + j * K2;
  };
  auto qb = [&](int i, int j) {  // of op(B)
    return P.trans_b ? P.B + j * N2 * P.ldb + i * K2 : P.B + i * K2 * P.ldb + j * N2;
  };
  auto qc = [&](int i, int j) { return P.C + i * M2 * P.ldc + j * N2; };
  strassen_products(
      kProducts, P, M2, N2, K2, [&](Quadrant q) { return qa(q.i, q.j); },
      [&](Quadrant q) { return q.i >= 0 ? qb(q.i, q.j) : nullptr; },
      [&](Quadrant q) { return qc(q.i, q.j); },
      [&](const Problem& S, int) { kernel.run(S, kernel.micro, kernel.blocks, threads, nullptr); });
  const float al = P.alpha, be = P.beta;

  // What the even part leaves, by the blocked product: the last index of K (a rank-1 update
  // of the even part), the last column of C (its even rows), the last row of C (all of it).
  auto blocked = [&](int64_t M, int64_t N, int64_t K, const float* A, const float* B, float* C,
                     float beta) {
    const Problem S{P.trans_a, P.trans_b, M, N, K, al, beta, A, P.lda, B, P.ldb, C, P.ldc};
    kernel.run(S, kernel.micro, kernel.blocks, threads, nullptr);
  };
  const int64_t k = P.K - 1, n = P.N - 1, m = P.M - 1;
  if (P.K % 2)
    blocked(2 * M2, 2 * N2, 1, P.trans_a ? P.A + k * P.lda : P.A + k,
            P.trans_b ? P.B + k : P.B + k * P.ldb, P.C, 1.f);
  if (P.N % 2)
    blocked(2 * M2, 1, P.K, P.A, P.trans_b ? P.B + n * P.ldb : P.B + n, P.C + n, be);
  if (P.M % 2)
    blocked(1, P.N, P.K, P.trans_a ? P.A + m : P.A + m * P.lda, P.B, P.C + m * P.ldc, be);
}

}  // namespace

int64_t set_strassen_min_dim(int64_t dim) {
  return strassen_min_dim().exchange(dim < 0 ? strassen_default() : dim);
}

int64_t get_strassen_min_dim() { return strassen_min_dim().load(std::memory_order_relaxed); }

}  // namespace gemm

bool packed_strassen_applies(int64_t M, int64_t K2, int64_t N2, int threads) {
  return gemm::strassen_applies_packed(M, K2, N2, threads);
}

bool gemm::splits_k(int64_t M, int64_t N, int64_t K, int threads) {
  using namespace gemm;
  if (M <= 0 || N <= 0 || K <= 0 || strassen_applies(M, N, K, threads)) return false;
  const Kernel& kernel = chosen_kernel();
  return kernel.split_k(M, N, K, threads, kernel.blocks);
}

// ---------------------------------------------------------------------------------------------
// The entry point

void sgemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
           const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C,
           int64_t ldc, int threads) {
  using namespace gemm;
  if (M <= 0 || N <= 0) return;
  if (K <= 0 || alpha == 0.f) {  // as in BLAS: A and B are not read
    scale_c(M, N, beta, C, ldc);
    return;
  }
  const Kernel& kernel = chosen_kernel();
  const Problem P{trans_a, trans_b, M, N, K, alpha, beta, A, lda, B, ldb, C, ldc};
  if (strassen_applies(M, N, K, threads)) {
    run_strassen(kernel, P, threads);
    return;
  }
  kernel.run(P, kernel.micro, kernel.blocks, threads, nullptr);
}

// ---------------------------------------------------------------------------------------------
// op(B) packed once, shared by several products

void PackedB::Free::operator()(float* p) const { std::free(p); }

PackedB::PackedB(bool trans, int64_t K, int64_t N) : trans_(trans), K_(K), N_(N) {
  using namespace gemm;
  const Kernel& kernel = chosen_kernel();
  kernel_ = kernel.name;
  nr_ = kernel.nr;
  kc_step_ = std::max<int64_t>(1, even_step(K, kernel.blocks.kc, 1));  // as sgemm blocks K
  slivers_ = ceil_div(N, nr_);
  floats_ = ceil_div(K, kc_step_) * slivers_ * kc_step_ * nr_;  // whole K blocks
  if (floats_ > 0) {
    const size_t bytes = round_up(floats_ * static_cast<int64_t>(sizeof(float)), 64);
    data_.reset(static_cast<float*>(std::aligned_alloc(64, bytes)));
    if (!data_) throw std::bad_alloc();
    // zeros until packed: a product read from parts never packed gives zeros, not whatever
    // the memory held (once per buffer, which a layer keeps from step to step)
    std::memset(data_.get(), 0, bytes);
  }
}

void sgemm_pack_b(const float* B, int64_t ldb, PackedB& packed, int64_t p0, int64_t p1,
                  int64_t s0, int64_t s1, int threads) {
  if (p1 <= p0 || s1 <= s0) return;
  gemm::kernel_named(packed.kernel()).pack(B, ldb, packed, p0, p1, s0, s1, threads);
}

namespace gemm {
namespace {

// A packed op(B) must be in the panels of the micro-kernel that runs the product.
void expect_kernel(const Kernel& kernel, const PackedB& packed, const char* what) {
  if (std::strcmp(kernel.name, packed.kernel()) != 0)
    throw std::invalid_argument(std::string(what) + ": B was packed for the '" +
                                packed.kernel() + "' micro-kernel, the GEMM now uses '" +
                                kernel.name + "'; pack it again");
}

}  // namespace
}  // namespace gemm

void sgemm_packed(bool trans_a, int64_t M, float alpha, const float* A, int64_t lda,
                  const PackedB& packed, float beta, float* C, int64_t ldc, int threads) {
  using namespace gemm;
  const int64_t N = packed.N(), K = packed.K();
  if (M <= 0 || N <= 0) return;
  if (K <= 0 || alpha == 0.f) {  // as sgemm: B is not read
    scale_c(M, N, beta, C, ldc);
    return;
  }
  const Kernel& kernel = chosen_kernel();
  expect_kernel(kernel, packed, "sgemm_packed");
  const Problem P{trans_a, packed.trans(), M, N, K, alpha, beta, A, lda, nullptr, 0, C, ldc};
  kernel.run(P, kernel.micro, kernel.blocks, threads, &packed);
}

void sgemm_packed_t(bool trans_a, int64_t M, int64_t N, float alpha, const float* A,
                    int64_t lda, const PackedB& src, int64_t row0, float beta, float* C,
                    int64_t ldc, int threads) {
  using namespace gemm;
  if (row0 < 0 || N < 0 || row0 + N > src.K())
    throw std::invalid_argument("sgemm_packed_t: rows [" + std::to_string(row0) + ", " +
                                std::to_string(row0 + N) + ") of a packed op(B) of " +
                                std::to_string(src.K()) + " rows");
  const int64_t K = src.N();
  if (M <= 0 || N <= 0) return;
  if (K <= 0 || alpha == 0.f) {
    scale_c(M, N, beta, C, ldc);
    return;
  }
  const Kernel& kernel = chosen_kernel();
  expect_kernel(kernel, src, "sgemm_packed_t");
  Problem P{trans_a, false, M, N, K, alpha, beta, A, lda, nullptr, 0, C, ldc};
  P.bt = &src;
  P.bt_row0 = row0;
  kernel.run(P, kernel.micro, kernel.blocks, threads, nullptr);
}

// ---------------------------------------------------------------------------------------------
// op(B) as seven packed sums of its quadrants, shared by several products

namespace gemm {
namespace {

// The seven packs of quadrant sums must be there, of one size, storage and micro-kernel: the
// one in use (else std::invalid_argument naming `what`).
void expect_packs(const Kernel& kernel, const PackedB* const* packs, const char* what) {
  for (int p = 0; p < 7; ++p) {
    if (!packs[p]) throw std::invalid_argument(std::string(what) + ": a pack is missing");
    if (packs[p]->K() != packs[0]->K() || packs[p]->N() != packs[0]->N() ||
        packs[p]->trans() != packs[0]->trans() ||
        std::strcmp(packs[p]->kernel(), packs[0]->kernel()) != 0)
      throw std::invalid_argument(std::string(what) + ": the seven packs differ in size, "
                                  "storage or micro-kernel");
  }
  expect_kernel(kernel, *packs[0], what);
}

}  // namespace
}  // namespace gemm

namespace gemm {
namespace {

// The rows of C left to four products of quadrant size (odd M, or the scheme not taken): C's
// half c (0 or 1) += alpha * (op(A)'s half a + sa * its half a2) times the pack `pack` (or its
// transpose), the first product into each half taking beta.
struct FourProduct {
  int pack, a, a2;
  float sa;
  int c;
  bool first;
};
// C1 = (A1 + A2) B11 + A2 (B21 - B11), C2 = A1 (B12 - B22) + (A1 + A2) B22
constexpr FourProduct kFour[4] = {
    {1, 0, 1, 1.f, 0, true}, {3, 1, -1, 0.f, 0, false},
    {2, 0, -1, 0.f, 1, true}, {4, 0, 1, 1.f, 1, false}};
// C1 = (D1 - D2) S11^T + D2 (S11 + S12)^T, C2 = D1 (S21 + S22)^T + (D2 - D1) S22^T
constexpr FourProduct kFourT[4] = {
    {1, 0, 1, -1.f, 0, true}, {5, 1, -1, 0.f, 0, false},
    {6, 0, -1, 0.f, 1, true}, {4, 1, 0, -1.f, 1, false}};

// C = alpha * op(A) (M, 2 K2) @ op(B) + beta * C, op(B) given by the seven packs of its
// quadrants' sums: as packed (`transposed` false: op(B) (2 K2, 2 N2), N2 the packs' N), or
// read transposed (true: op(B) = S^T, S's sums packed, N2 of the packs' K rows from row0).
// C's halves (N2 columns each) start at C and C + c_half.
void packed_quadrants_product(bool transposed, bool trans_a, int64_t M, float alpha,
                              const float* A, int64_t lda, const PackedB* const* packs,
                              int64_t row0, int64_t N2, int strassen, float beta, float* C,
                              int64_t ldc, int64_t c_half, int threads) {
  const Kernel& kernel = chosen_kernel();
  const int64_t K2 = transposed ? packs[0]->N() : packs[0]->K();
  if (M <= 0 || N2 <= 0) return;
  if (K2 <= 0 || alpha == 0.f) {
    scale_c(M, N2, beta, C, ldc);
    scale_c(M, N2, beta, C + c_half, ldc);
    return;
  }
  const bool trans_b = !transposed && packs[0]->trans();
  auto qa = [&](int64_t r, int j) {  // op(A) from row r, column block j (of K2 columns)
    return trans_a ? A + j * K2 * lda + r : A + r * lda + j * K2;
  };
  // the problem S as a product with pack p: packed whole, or read transposed from row0
  auto run = [&](Problem S, int p) {
    if (transposed) {
      S.bt = packs[p];
      S.bt_row0 = row0;
    }
    kernel.run(S, kernel.micro, kernel.blocks, threads, transposed ? nullptr : packs[p]);
  };
  const bool use = strassen > 0 ? M >= 2
                                : strassen < 0 && packed_strassen_applies(M, K2, N2, threads);
  int64_t r0 = 0;  // the first row left to the four products
  if (use) {
    const int64_t M2 = M / 2;
    const Problem P{trans_a, trans_b, M, 2 * N2, 2 * K2, alpha, beta, A, lda, nullptr, 0, C,
                    ldc};
    strassen_products(
        transposed ? kProductsT : kProducts, P, M2, N2, K2,
        [&](Quadrant q) { return qa(q.i * M2, q.j); },
        [](Quadrant) -> const float* { return nullptr; },  // op(B): the packs
        [&](Quadrant q) { return C + q.i * M2 * ldc + q.j * c_half; },
        [&](const Problem& S, int i) { run(S, transposed ? kPackOfProductT[i] : i); });
    r0 = 2 * M2;
  }
  if (r0 < M) {
    for (const FourProduct& f : transposed ? kFourT : kFour) {
      Problem S{trans_a, trans_b, M - r0, N2, K2, alpha, f.first ? beta : 1.f, qa(r0, f.a),
                lda, nullptr, 0, C + r0 * ldc + f.c * c_half, ldc};
      S.A2 = f.a2 >= 0 ? qa(r0, f.a2) : nullptr;
      S.a2 = f.sa;
      run(S, f.pack);
    }
  }
}

}  // namespace
}  // namespace gemm

void sgemm_packed_quadrants(bool trans_a, int64_t M, float alpha, const float* A, int64_t lda,
                            const PackedB* const* packs, int strassen, float beta, float* C,
                            int64_t ldc, int threads) {
  gemm::expect_packs(gemm::chosen_kernel(), packs, "sgemm_packed_quadrants");
  const int64_t N2 = packs[0]->N();
  gemm::packed_quadrants_product(false, trans_a, M, alpha, A, lda, packs, 0, N2, strassen, beta,
                                 C, ldc, N2, threads);
}

void sgemm_packed_quadrants_t(bool trans_a, int64_t M, float alpha, const float* A,
                              int64_t lda, const PackedB* const* packs, int64_t row0,
                              int64_t rows, int strassen, float beta, float* C, int64_t ldc,
                              int64_t c_half, int threads) {
  gemm::expect_packs(gemm::chosen_kernel(), packs, "sgemm_packed_quadrants_t");
  if (row0 < 0 || rows < 0 || row0 + rows > packs[0]->K())
    throw std::invalid_argument("sgemm_packed_quadrants_t: rows [" + std::to_string(row0) +
                                ", " + std::to_string(row0 + rows) + ") of quadrants of " +
                                std::to_string(packs[0]->K()) + " rows");
  gemm::packed_quadrants_product(true, trans_a, M, alpha, A, lda, packs, row0, rows, strassen,
                                 beta, C, ldc, c_half, threads);
}

}  // namespace pyhet
