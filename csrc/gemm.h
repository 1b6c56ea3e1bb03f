// Packed, blocked single-precision GEMM (BLIS-style), no BLAS library.
//
//   C (M, N) = alpha * op(A) (M, K) @ op(B) (K, N) + beta * C
//
// All matrices are row-major. op(A) = A when trans_a is false (A is M x K, row stride lda >= K),
// and A^T when it is true (A is stored K x M, row stride lda >= M); likewise for B. beta == 0
// overwrites C without reading it (NaNs in C do not leak through). Transposes are handled while
// packing, never by copying the matrix.
#pragma once
#include <array>
#include <cstdint>
#include <memory>

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
// The L2 per core (PYHET_GEMM_L2_BYTES, where set, stands in for it); 0 where unknown.
int64_t core_l2_bytes();
// The chosen kernel's blocks: {MC, KC, NC}.
std::array<int64_t, 3> sgemm_blocks();

// ---------------------------------------------------------------------------------------------
// op(B) packed once for several products that share it: the devices of one process multiply
// their own rows of weights by one im2col matrix, and each would otherwise pack all of it again
// for its few rows (and the packings would compete for memory bandwidth).

// op(B) (K, N) in the packed panels of the micro-kernel in use when it was made (see
// gemm_kernel.h): K blocks of kc_step rows (the last one shorter, as in sgemm), each a run of
// `slivers` kc_step x NR slivers, zero-padded past column N. Filled in parts by sgemm_pack_b,
// which several threads may call at once on disjoint parts; read by sgemm_packed.
class PackedB {
 public:
  PackedB(bool trans, int64_t K, int64_t N);  // sized for the kernel in use now
  PackedB(const PackedB&) = delete;
  PackedB& operator=(const PackedB&) = delete;

  bool trans() const { return trans_; }      // whether B is stored N x K (op(B) = B^T)
  int64_t K() const { return K_; }
  int64_t N() const { return N_; }
  int64_t nr() const { return nr_; }         // columns per sliver
  int64_t slivers() const { return slivers_; }
  int64_t kc_step() const { return kc_step_; }
  int64_t floats() const { return floats_; }
  const char* kernel() const { return kernel_; }  // the micro-kernel it was packed for
  // The K block starting at row p0 (a multiple of kc_step), from the sliver holding column j0
  // (a multiple of NR); its slivers are kc_step * NR floats apart.
  float* block(int64_t p0, int64_t j0) const {
    return data_.get() + ((p0 / kc_step_) * slivers_ + j0 / nr_) * kc_step_ * nr_;
  }

 private:
  struct Free {
    void operator()(float* p) const;
  };
  bool trans_;
  int64_t K_, N_, nr_, slivers_, kc_step_, floats_;
  const char* kernel_;
  std::unique_ptr<float, Free> data_;
};

// Pack rows [p0, p1) of op(B), in its slivers [s0, s1), into `packed` (B stored as packed.trans()
// says, row stride ldb), on `threads` threads. Parts that do not overlap may be packed at once by
// different callers. Requires 0 <= p0 <= p1 <= K, 0 <= s0 <= s1 <= slivers.
void sgemm_pack_b(const float* B, int64_t ldb, PackedB& packed, int64_t p0, int64_t p1,
                  int64_t s0, int64_t s1, int threads);

// C (M, N) = alpha * op(A) (M, K) @ op(B) (K, N) + beta * C as sgemm, with op(B) packed whole
// (K, N and the micro-kernel are packed's; the kernel must still be the one in use, or this
// throws std::invalid_argument): only A is packed here.
void sgemm_packed(bool trans_a, int64_t M, float alpha, const float* A, int64_t lda,
                  const PackedB& packed, float beta, float* C, int64_t ldc, int threads);

// C (M, N) = alpha * op(A) (M, K) @ S^T + beta * C, where S is rows [row0, row0 + N) of the
// op(B) (K' x K) that `src` holds packed (for another product): the weight gradient dy @ col^T
// from col packed for the forward, without packing col^T. Its NR x NR tiles are transposed as
// this product packs its own blocks of op(B). Requires 0 <= row0, row0 + N <= src.K() (else
// std::invalid_argument), and src packed for the micro-kernel in use.
void sgemm_packed_t(bool trans_a, int64_t M, int64_t N, float alpha, const float* A,
                    int64_t lda, const PackedB& src, int64_t row0, float beta, float* C,
                    int64_t ldc, int threads);

// op(B) (2 K2, 2 N2) given as seven packed combinations of its quadrants B11, B12, B21, B22
// (each K2 x N2; packs[0..6] in this order): B11 + B22, B11, B12 - B22, B21 - B11, B22,
// B11 + B12, B21 + B22, the operands of the seven products of Strassen's scheme (see gemm.cpp).
// Several products that share op(B) (the devices of one process, each with its own rows of A)
// then share the packing of those sums, made once, and each runs Strassen's scheme with only
// its A to pack. C (M, 2 N2) = alpha * op(A) (M, 2 K2) @ op(B) + beta * C: by Strassen's scheme
// on the even rows when `strassen` is 1 (0: never; -1: where packed_strassen_applies says so),
// the other rows by four products of quadrant size, (A1 + A2) B11 + A2 (B21 - B11) and
// A1 (B12 - B22) + (A1 + A2) B22, as much arithmetic as the blocked product. Every pack must have
// the same K2, N2, storage and micro-kernel, the one in use (else std::invalid_argument).
void sgemm_packed_quadrants(bool trans_a, int64_t M, float alpha, const float* A, int64_t lda,
                            const PackedB* const* packs, int strassen, float beta, float* C,
                            int64_t ldc, int threads);

// C = alpha * op(A) (M, 2 K2) @ S^T + beta * C, where S (2 N2, 2 K2) is the op(B) whose seven
// quadrant sums `packs` hold for sgemm_packed_quadrants (each N2 x K2): the weight gradient
// dy @ col^T from col's sums packed for the forward, read transposed as this product packs its
// blocks (as sgemm_packed_t does), with no sums of col^T to pack. The scheme's sums of S for
// C^T = S op(A)^T are those same seven (see gemm.cpp); strassen as there. Only the columns of
// rows [row0, row0 + rows) of each half of S are made: C's two halves of `rows` columns each
// start at C and at C + c_half (the whole product: row0 0, rows N2, c_half N2; C the block of
// those columns in a whole one: C at its column row0, c_half N2), so that devices may split
// the columns of one product. Requires 0 <= row0 <= row0 + rows <= N2 and c_half >= rows (the
// halves apart).
void sgemm_packed_quadrants_t(bool trans_a, int64_t M, float alpha, const float* A,
                              int64_t lda, const PackedB* const* packs, int64_t row0,
                              int64_t rows, int strassen, float beta, float* C, int64_t ldc,
                              int64_t c_half, int threads);

// Whether sgemm_packed_quadrants(strassen = -1) takes Strassen's scheme for M rows of A against
// packed quadrants K2 x N2 on `threads` threads.
bool packed_strassen_applies(int64_t M, int64_t K2, int64_t N2, int threads);

}  // namespace pyhet
