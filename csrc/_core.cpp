// pybind11 bindings of the C++ core: argument checks, GIL release, calls. No arithmetic here.
//
// Every entry point takes NumPy arrays that must already have the right dtype, be C-contiguous
// and (for outputs) writeable; nothing is converted or copied behind the caller's back, so an
// output can never silently land in a temporary. Errors say what was expected and what came.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <cmath>
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "gemm.h"
#include "gemm_kernel.h"
#include "im2col.h"
#include "parallel.h"
#include "pool.h"
#include "update.h"

namespace py = pybind11;
using Shape = std::vector<int64_t>;

namespace {

// ---------------------------------------------------------------------------------------------
// Argument checks

std::string shape_str(const Shape& s) {
  std::ostringstream o;
  o << "(";
  for (size_t i = 0; i < s.size(); ++i) o << (i ? ", " : "") << s[i];
  o << (s.size() == 1 ? ",)" : ")");
  return o.str();
}

Shape shape_of(const py::array& a) { return Shape(a.shape(), a.shape() + a.ndim()); }

std::string type_name(py::handle obj) {
  return std::string(py::str(py::type::handle_of(obj).attr("__name__")));
}

// The array behind `obj`, checked for type, dtype, contiguity, ndim and writeability.
// row_strided: also accept a 2-d array whose rows are contiguous but further apart than their
// length (a block of a bigger matrix); its row stride becomes the GEMM's leading dimension.
template <class T>
py::array checked(py::handle obj, const char* name, int ndim, bool output,
                  bool row_strided = false) {
  const char* want = std::is_same<T, float>::value ? "float32" : "int32";
  if (!py::isinstance<py::array>(obj))
    throw py::type_error(std::string(name) + ": expected a numpy " + want + " array, got " +
                         type_name(obj));
  auto a = py::reinterpret_borrow<py::array>(obj);
  // the same type, not the same object: an array that went through pickle has a dtype of
  // its own (byte order counts: a big-endian float32 is not this one)
  if (!py::detail::npy_api::get().PyArray_EquivTypes_(a.dtype().ptr(),
                                                       py::dtype::of<T>().ptr()))
    throw py::type_error(std::string(name) + ": expected dtype " + want + ", got " +
                         std::string(py::str(a.dtype())));
  if (a.ndim() != ndim)
    throw py::value_error(std::string(name) + ": expected a " + std::to_string(ndim) +
                          "-d array, got shape " + shape_str(shape_of(a)));
  if (!(a.flags() & py::array::c_style) && !(row_strided && ndim == 2 && a.strides(1) ==
                                                static_cast<py::ssize_t>(sizeof(T)) &&
                                                a.strides(0) >= a.shape(1) * a.strides(1) &&
                                                a.strides(0) % a.strides(1) == 0))
    throw py::value_error(std::string(name) + (row_strided
        ? ": expected a 2-d array whose rows are contiguous (a row block or column block of a "
          "C-contiguous matrix), got other strides"
        : ": expected a C-contiguous array (use numpy.ascontiguousarray), got strides that are "
          "not"));
  if (output && !a.writeable())
    throw py::value_error(std::string(name) + ": the output array is read-only");
  return a;
}

void expect_shape(const py::array& a, const char* name, const Shape& want) {
  if (shape_of(a) != want)
    throw py::value_error(std::string(name) + ": expected shape " + shape_str(want) + ", got " +
                          shape_str(shape_of(a)));
}

void expect_positive(int64_t v, const char* name) {
  if (v < 1) throw py::value_error(std::string(name) + " must be >= 1, got " + std::to_string(v));
}

// The most threads a kernel may be asked for: more than any machine has cores, and far fewer
// than make the OpenMP runtime end the process (libgomp allocates per thread up front: asked
// for 100,000 threads it aborts, out of memory).
constexpr int64_t kMaxThreads = 1024;

// An int argument as given from Python: an int or a NumPy integer, not a bool or a float.
// Integer arguments are taken as objects and read here, so that a wrong type or a value beyond
// 64 bits gets one short message rather than pybind11's list of signatures.
int64_t int_arg(py::handle v, const char* name) {
  if (PyBool_Check(v.ptr()) || !PyIndex_Check(v.ptr()))
    throw py::type_error(std::string(name) + " must be an int, got " + type_name(v));
  auto n = py::reinterpret_steal<py::object>(PyNumber_Index(v.ptr()));
  if (!n) throw py::error_already_set();
  int overflow = 0;
  const long long r = PyLong_AsLongLongAndOverflow(n.ptr(), &overflow);
  if (overflow)
    throw py::value_error(std::string(name) + " must fit in 64 bits, got " +
                          std::string(py::str(n)));
  return r;
}

// OpenMP's threads do not survive fork(): in a child forked after a region of 2 or more
// threads, libgomp's next such region waits for threads that are not there (a hang; a
// multiprocessing.Pool forks by default). Such a child runs every region on one thread, and
// is told so once.
std::atomic<bool> g_threads_started{false};
std::atomic<bool> g_forked_after_threads{false};
std::atomic<bool> g_fork_told{false};

void after_fork_in_child() {
  if (g_threads_started.load()) g_forked_after_threads.store(true);
  g_fork_told.store(false);   // each forked process is told once (a fork of a fork too)
}

// `threads`: an int in [1, kMaxThreads]; 1 in a child forked after threads had started.
int thread_count(py::handle threads) {
  const int64_t v = int_arg(threads, "threads");
  if (v < 1) throw py::value_error("threads must be >= 1, got " + std::to_string(v));
  if (v > kMaxThreads)
    throw py::value_error("threads must be at most " + std::to_string(kMaxThreads) + ", got " +
                          std::to_string(v));
  if (v > 1 && g_forked_after_threads.load()) {
    // said through pyhet.errors.warn: at the program's line that called into pyhet (its
    // filters by module see their own code), not at pyhet's line that called the core
    if (!g_fork_told.exchange(true))
      py::module_::import("pyhet.errors").attr("warn")(
          "pyhet: this process was forked after pyhet's threads had started, and OpenMP's "
          "threads do not survive fork(): pyhet runs on one thread here (start processes "
          "with multiprocessing's 'spawn' or 'forkserver' method to use more)",
          py::handle(PyExc_RuntimeWarning));
    return 1;
  }
  if (v > 1 && pyhet::have_openmp()) g_threads_started.store(true);
  return static_cast<int>(v);
}

// `name`: None for all of [0, n), or a pair (begin, end) of ints within it.
std::pair<int64_t, int64_t> range_arg(py::handle range, const char* name, int64_t n) {
  if (range.is_none()) return {0, n};
  std::pair<int64_t, int64_t> r;
  try {
    r = range.cast<std::pair<int64_t, int64_t>>();
  } catch (const py::cast_error&) {
    throw py::type_error(std::string(name) + ": expected None or a pair (begin, end) of ints, "
                         "got " + type_name(range));
  }
  if (r.first < 0 || r.second > n || r.first > r.second)
    throw py::value_error(std::string(name) + ": expected a range (begin, end) with 0 <= begin "
                          "<= end <= " + std::to_string(n) + ", got (" +
                          std::to_string(r.first) + ", " + std::to_string(r.second) + ")");
  return r;
}

// a * b and a + b for sizes, refused when they do not fit in int64 (absurd kernel sizes,
// paddings or dimensions of an empty array) instead of overflowing.
int64_t size_mul(int64_t a, int64_t b) {
  int64_t r;
  if (__builtin_mul_overflow(a, b, &r))
    throw py::value_error("sizes too large: " + std::to_string(a) + " x " + std::to_string(b) +
                          " does not fit in 64 bits");
  return r;
}
int64_t size_add(int64_t a, int64_t b) {
  int64_t r;
  if (__builtin_add_overflow(a, b, &r))
    throw py::value_error("sizes too large: " + std::to_string(a) + " + " + std::to_string(b) +
                          " does not fit in 64 bits");
  return r;
}

// How many of the threads of `groups` ((count, stack bytes; 0: the default) each) this process
// can start and hold at once, each made by pthread_create as libgomp makes its team's threads:
// with its group's stack where pthread_attr_setstacksize takes it (libgomp, refused a size, says
// so and keeps the default); all ended again. Threads made here, not by Python: no setting of
// the process (threading.stack_size) changes.
int64_t startable_threads(const std::vector<std::pair<int64_t, int64_t>>& groups) {
  struct Gate {
    std::mutex m;
    std::condition_variable cv;
    bool open = false;
  } gate;
  auto wait = [](void* g) -> void* {
    auto* gate = static_cast<Gate*>(g);
    std::unique_lock<std::mutex> lock(gate->m);
    gate->cv.wait(lock, [gate] { return gate->open; });
    return nullptr;
  };
  std::vector<pthread_t> started;
  bool full = false;
  for (const auto& [n, stack] : groups) {
    pthread_attr_t attr;
    if (full || pthread_attr_init(&attr) != 0) break;
    if (stack > 0) pthread_attr_setstacksize(&attr, static_cast<size_t>(stack));
    for (int64_t i = 0; i < n && !full; ++i) {
      pthread_t t;
      if (pthread_create(&t, &attr, wait, &gate) != 0)
        full = true;
      else
        started.push_back(t);
    }
    pthread_attr_destroy(&attr);
  }
  {
    std::lock_guard<std::mutex> lock(gate.m);
    gate.open = true;
  }
  gate.cv.notify_all();
  for (pthread_t t : started) pthread_join(t, nullptr);
  return static_cast<int64_t>(started.size());
}

// The questions about how sgemm would run an (m, n) x k product are answered only for products
// whose matrices a process can hold (m x k, k x n and m x n floats each within 2**47 bytes): the
// plans multiply the dimensions, which overflow on sizes no memory holds. A dimension <= 0 is
// an empty product (answered: no).
void expect_holdable_product(int64_t m, int64_t n, int64_t k, const char* what) {
  if (m <= 0 || n <= 0 || k <= 0) return;
  constexpr int64_t kMaxFloats = int64_t{1} << 45;
  const int64_t dims[3][2] = {{m, k}, {k, n}, {m, n}};
  for (const auto& d : dims) {
    int64_t floats;
    if (__builtin_mul_overflow(d[0], d[1], &floats) || floats > kMaxFloats)
      throw py::value_error(std::string(what) + ": a product of (m, n, k) = (" +
                            std::to_string(m) + ", " + std::to_string(n) + ", " +
                            std::to_string(k) + ") has a matrix of more floats than a process " +
                            "can address (2**45)");
  }
}

// The pool kernels index a plane with int32 (arg): its H * W elements must fit.
void expect_int32_plane(int64_t H, int64_t W, const char* what) {
  if (H > 0 && W > INT32_MAX / H)
    throw py::value_error(std::string(what) + ": a " + std::to_string(H) + "x" +
                          std::to_string(W) + " plane has more than 2**31 - 1 elements, more "
                          "than the int32 indices of arg can address");
}

// Floor and ceiling of n / d, d > 0.
int64_t floor_div(int64_t n, int64_t d) { return n / d - (n % d < 0); }
int64_t ceil_div(int64_t n, int64_t d) { return n / d + (n % d > 0); }

// Whether two matrices whose byte spans meet are still apart: each row a run of contiguous
// entries, both rows at one stride (column blocks of one matrix, w[:, 0:4] and w[:, 4:8]),
// and no row of one meets a row of the other. Row i of a is the bytes [i L, i L + wa) from a's
// start, row k of b [d + k L, d + k L + wb): they meet iff t = i - k has (d - wa) < t L < d + wb,
// for some t in -(mb - 1)..ma - 1. Other layouts: false (their spans meeting is taken as meeting).
bool rows_apart(const py::array& a, const py::array& b) {
  if (a.ndim() != 2 || b.ndim() != 2 || a.itemsize() != b.itemsize() ||
      a.strides(1) != a.itemsize() || b.strides(1) != b.itemsize())
    return false;
  int64_t ma = a.shape(0), mb = b.shape(0);
  int64_t L = ma > 1 ? a.strides(0) : b.strides(0);   // a single row's stride is never read
  if (L <= 0 || (ma > 1 && mb > 1 && a.strides(0) != b.strides(0))) return false;
  int64_t wa = a.shape(1) * a.itemsize(), wb = b.shape(1) * b.itemsize();
  int64_t d = static_cast<int64_t>(reinterpret_cast<uintptr_t>(b.data()) -
                                   reinterpret_cast<uintptr_t>(a.data()));
  int64_t t_lo = std::max(floor_div(d - wa, L) + 1, -(mb - 1));
  int64_t t_hi = std::min(ceil_div(d + wb, L) - 1, ma - 1);
  return t_lo > t_hi;
}

// An output must not share memory with an input: the kernels read inputs while writing.
void expect_disjoint(const py::array& out, const py::array& in, const char* out_name,
                     const char* in_name) {
  // the byte span an array touches (arrays here have non-negative strides)
  auto lo = [](const py::array& a) { return reinterpret_cast<uintptr_t>(a.data()); };
  auto hi = [&](const py::array& a) {
    uintptr_t end = lo(a) + a.itemsize();
    for (py::ssize_t d = 0; d < a.ndim(); ++d) end += (a.shape(d) - 1) * a.strides(d);
    return end;
  };
  if (out.size() && in.size() && lo(out) < hi(in) && lo(in) < hi(out) &&
      !rows_apart(out, in))
    throw py::value_error(std::string(out_name) + " overlaps " + in_name +
                          "; pass a separate output array");
}

// The first of the n entries of a (from position 0) for which wrong(entry, position) holds, or
// -1. Index arrays can be as big as a conv output, so the scan ORs the verdicts without a branch
// per entry (the loop vectorises) and searches for the culprit only when one failed.
template <class Wrong>
int64_t first_wrong(const int32_t* a, int64_t n, Wrong wrong) {
  int bad = 0;
  for (int64_t i = 0; i < n; ++i) bad |= wrong(a[i], i);
  if (!bad) return -1;
  int64_t i = 0;
  while (!wrong(a[i], i)) ++i;
  return i;
}

template <class T>
T* ptr(py::array& a) { return static_cast<T*>(a.mutable_data()); }
template <class T>
const T* cptr(const py::array& a) { return static_cast<const T*>(a.data()); }

// ---------------------------------------------------------------------------------------------
// GEMM

// Which loops compute the product: the packed GEMM, the reference, or the plain loop.
enum class GemmPath { kPacked, kReference, kNaive };

void bind_sgemm(py::handle a_, py::handle b_, py::handle c_, bool trans_a, bool trans_b,
                float alpha, float beta, py::handle threads_, GemmPath path) {
  auto a = checked<float>(a_, "a", 2, false, true), b = checked<float>(b_, "b", 2, false, true);
  auto c = checked<float>(c_, "c", 2, true, true);
  const int64_t M = trans_a ? a.shape(1) : a.shape(0), K = trans_a ? a.shape(0) : a.shape(1);
  const int64_t Kb = trans_b ? b.shape(1) : b.shape(0), N = trans_b ? b.shape(0) : b.shape(1);
  if (K != Kb)
    throw py::value_error("gemm: inner dimensions differ: op(a) is " + shape_str({M, K}) +
                          " and op(b) is " + shape_str({Kb, N}));
  expect_shape(c, "c", {M, N});
  expect_disjoint(c, a, "c", "a");
  expect_disjoint(c, b, "c", "b");
  const int threads = thread_count(threads_);
  const float *pa = cptr<float>(a), *pb = cptr<float>(b);
  float* pc = ptr<float>(c);
  auto ld = [](const py::array& x) {
    return x.shape(0) > 1 ? static_cast<int64_t>(x.strides(0) / x.itemsize()) : x.shape(1);
  };
  const int64_t lda = ld(a), ldb = ld(b), ldc = ld(c);
  py::gil_scoped_release nogil;
  if (path == GemmPath::kReference)
    pyhet::sgemm_ref(trans_a, trans_b, M, N, K, alpha, pa, lda, pb, ldb, beta, pc, ldc);
  else if (path == GemmPath::kNaive)
    pyhet::sgemm_naive(M, N, K, pa, lda, pb, ldb, pc, ldc, threads);
  else
    pyhet::sgemm(trans_a, trans_b, M, N, K, alpha, pa, lda, pb, ldb, beta, pc, ldc, threads);
}

// ---------------------------------------------------------------------------------------------
// GEMM with op(B) packed once (pyhet::PackedB)

// The leading dimension of a checked matrix: its row stride in floats.
int64_t leading_dim(const py::array& x) {
  return x.shape(0) > 1 ? static_cast<int64_t>(x.strides(0) / x.itemsize()) : x.shape(1);
}

std::unique_ptr<pyhet::PackedB> make_packed_b(py::handle k_, py::handle n_, bool trans_b) {
  const int64_t K = int_arg(k_, "k"), N = int_arg(n_, "n");
  if (K < 0 || N < 0)
    throw py::value_error("PackedB: k and n must be >= 0, got " + std::to_string(K) + " and " +
                          std::to_string(N));
  // its size, K and N rounded up to whole blocks and slivers, must fit in 64 bits of bytes
  size_mul(size_mul(size_add(K, 4096), size_add(N, 64)), 4);
  return std::make_unique<pyhet::PackedB>(trans_b, K, N);
}

// `packed`: a PackedB, taken as an object so that anything else gets one short message.
pyhet::PackedB& packed_arg(py::handle packed) {
  if (!py::isinstance<pyhet::PackedB>(packed))
    throw py::type_error("packed: expected a PackedB (pyhet.ops.packed_b), got " +
                         type_name(packed));
  return packed.cast<pyhet::PackedB&>();
}

// A PackedB must have been packed for the micro-kernel the GEMM uses now.
void expect_current_kernel(const pyhet::PackedB& packed, const char* name) {
  if (std::string(packed.kernel()) != pyhet::sgemm_kernel_name())
    throw py::value_error(std::string(name) + ": packed for the '" + packed.kernel() +
                          "' micro-kernel, but the GEMM now uses '" +
                          pyhet::sgemm_kernel_name() + "'; pack it again");
}

void bind_pack_b(py::handle b_, py::handle packed_, py::handle rows, py::handle slivers,
                 py::handle threads_) {
  pyhet::PackedB& packed = packed_arg(packed_);
  auto b = checked<float>(b_, "b", 2, false, true);
  const int64_t K = packed.K(), N = packed.N();
  expect_shape(b, "b", packed.trans() ? Shape{N, K} : Shape{K, N});
  const auto r = range_arg(rows, "rows", K), s = range_arg(slivers, "slivers", packed.slivers());
  const int threads = thread_count(threads_);
  const float* pb = cptr<float>(b);
  const int64_t ldb = leading_dim(b);
  py::gil_scoped_release nogil;
  pyhet::sgemm_pack_b(pb, ldb, packed, r.first, r.second, s.first, s.second, threads);
}

void bind_sgemm_packed(py::handle a_, py::handle packed_, py::handle c_, bool trans_a,
                       float alpha, float beta, py::handle threads_) {
  const pyhet::PackedB& packed = packed_arg(packed_);
  auto a = checked<float>(a_, "a", 2, false, true);
  auto c = checked<float>(c_, "c", 2, true, true);
  const int64_t M = trans_a ? a.shape(1) : a.shape(0), K = trans_a ? a.shape(0) : a.shape(1);
  if (K != packed.K())
    throw py::value_error("sgemm_packed: inner dimensions differ: op(a) is " + shape_str({M, K}) +
                          " and the packed op(b) is " + shape_str({packed.K(), packed.N()}));
  expect_shape(c, "c", {M, packed.N()});
  expect_disjoint(c, a, "c", "a");
  expect_current_kernel(packed, "packed");
  const int threads = thread_count(threads_);
  const float* pa = cptr<float>(a);
  float* pc = ptr<float>(c);
  const int64_t lda = leading_dim(a), ldc = leading_dim(c);
  py::gil_scoped_release nogil;
  pyhet::sgemm_packed(trans_a, M, alpha, pa, lda, packed, beta, pc, ldc, threads);
}

void bind_sgemm_packed_t(py::handle a_, py::handle packed_, py::handle c_, py::handle rows,
                         bool trans_a, float alpha, float beta, py::handle threads_) {
  const pyhet::PackedB& packed = packed_arg(packed_);
  auto a = checked<float>(a_, "a", 2, false, true);
  auto c = checked<float>(c_, "c", 2, true, true);
  const int64_t M = trans_a ? a.shape(1) : a.shape(0), K = trans_a ? a.shape(0) : a.shape(1);
  const auto r = range_arg(rows, "rows", packed.K());
  if (K != packed.N())
    throw py::value_error("sgemm_packed_t: inner dimensions differ: op(a) is " +
                          shape_str({M, K}) + " and the packed op(b) transposed is " +
                          shape_str({packed.N(), packed.K()}));
  expect_shape(c, "c", {M, r.second - r.first});
  expect_disjoint(c, a, "c", "a");
  expect_current_kernel(packed, "packed");
  const int threads = thread_count(threads_);
  const float* pa = cptr<float>(a);
  float* pc = ptr<float>(c);
  const int64_t lda = leading_dim(a), ldc = leading_dim(c);
  py::gil_scoped_release nogil;
  pyhet::sgemm_packed_t(trans_a, M, r.second - r.first, alpha, pa, lda, packed, r.first, beta,
                        pc, ldc, threads);
}

// Seven PackedBs taken from a sequence, and the sequence's items held: the call reads (or
// writes) them with the GIL released, when another thread could drop the sequence's last
// reference to one (a list cleared, a sequence whose items are made as they are asked for).
template <class P>
struct HeldPacks {
  py::tuple held;
  std::vector<P*> ptrs;
  bool empty() const { return ptrs.empty(); }
  P* const* data() const { return ptrs.data(); }
  P* operator[](size_t i) const { return ptrs[i]; }
};

py::tuple seven_packs(py::handle packs_, const std::string& name, const char* what) {
  if (!py::isinstance<py::sequence>(packs_) || py::isinstance<py::str>(packs_) ||
      py::len(packs_) != 7)
    throw py::type_error(name + ": expected " + what + ", got " + type_name(packs_));
  py::tuple held = py::reinterpret_steal<py::tuple>(PySequence_Tuple(packs_.ptr()));
  if (!held) throw py::error_already_set();
  if (py::len(held) != 7)
    throw py::value_error(name + ": expected 7 PackedB, got a sequence that gave " +
                          std::to_string(py::len(held)));
  return held;
}

// Seven PackedBs of op(b)'s quadrant sums (pyhet::sgemm_packed_quadrants), from a sequence.
HeldPacks<const pyhet::PackedB> quadrant_packs(py::handle packs_) {
  HeldPacks<const pyhet::PackedB> packs{
      seven_packs(packs_, "packs", "a sequence of 7 PackedB (pyhet.ops.packed_b)"), {}};
  for (py::handle p : packs.held) {
    const pyhet::PackedB& q = packed_arg(p);
    if (!packs.empty() && (q.K() != packs[0]->K() || q.N() != packs[0]->N() ||
                           q.trans() != packs[0]->trans()))
      throw py::value_error("packs: expected 7 PackedB of one size and storage, got " +
                            shape_str({packs[0]->K(), packs[0]->N()}) + " and " +
                            shape_str({q.K(), q.N()}));
    packs.ptrs.push_back(&q);
  }
  return packs;
}

void bind_sgemm_packed_quadrants(py::handle a_, py::handle packs_, py::handle c_, bool trans_a,
                                 float alpha, float beta, int strassen, py::handle threads_) {
  const auto packs = quadrant_packs(packs_);
  auto a = checked<float>(a_, "a", 2, false, true);
  auto c = checked<float>(c_, "c", 2, true, true);
  const int64_t K2 = packs[0]->K(), N2 = packs[0]->N();
  const int64_t M = trans_a ? a.shape(1) : a.shape(0), K = trans_a ? a.shape(0) : a.shape(1);
  if (K != 2 * K2)
    throw py::value_error("sgemm_packed_quadrants: inner dimensions differ: op(a) is " +
                          shape_str({M, K}) + " and op(b), of quadrants " +
                          shape_str({K2, N2}) + ", is " + shape_str({2 * K2, 2 * N2}));
  expect_shape(c, "c", {M, 2 * N2});
  expect_disjoint(c, a, "c", "a");
  expect_current_kernel(*packs[0], "packs");
  const int threads = thread_count(threads_);
  const float* pa = cptr<float>(a);
  float* pc = ptr<float>(c);
  const int64_t lda = leading_dim(a), ldc = leading_dim(c);
  py::gil_scoped_release nogil;
  pyhet::sgemm_packed_quadrants(trans_a, M, alpha, pa, lda, packs.data(), strassen, beta, pc,
                                ldc, threads);
}

void bind_sgemm_packed_quadrants_t(py::handle a_, py::handle packs_, py::handle c_,
                                   py::handle rows_, bool trans_a, float alpha, float beta,
                                   int strassen, py::handle threads_) {
  const auto packs = quadrant_packs(packs_);
  auto a = checked<float>(a_, "a", 2, false, true);
  auto c = checked<float>(c_, "c", 2, true, true);
  const int64_t N2 = packs[0]->K(), K2 = packs[0]->N();  // s's quadrants
  const auto r = range_arg(rows_, "rows", N2);
  const int64_t M = trans_a ? a.shape(1) : a.shape(0), K = trans_a ? a.shape(0) : a.shape(1);
  if (K != 2 * K2)
    throw py::value_error("sgemm_packed_quadrants_t: inner dimensions differ: op(a) is " +
                          shape_str({M, K}) + " and s^T, of quadrants " + shape_str({K2, N2}) +
                          ", is " + shape_str({2 * K2, 2 * N2}));
  expect_shape(c, "c", {M, 2 * N2});
  expect_disjoint(c, a, "c", "a");
  expect_current_kernel(*packs[0], "packs");
  const int threads = thread_count(threads_);
  const float* pa = cptr<float>(a);
  float* pc = ptr<float>(c) + r.first;
  const int64_t lda = leading_dim(a), ldc = leading_dim(c);
  py::gil_scoped_release nogil;
  pyhet::sgemm_packed_quadrants_t(trans_a, M, alpha, pa, lda, packs.data(), r.first,
                                  r.second - r.first, strassen, beta, pc, ldc, N2, threads);
}

// ---------------------------------------------------------------------------------------------
// im2col / col2im

struct ConvGeom {
  int64_t N, C, H, W, KH, KW, stride, pad, OH, OW;
};

ConvGeom conv_geom(const py::array& x, py::handle kh_, py::handle kw_, py::handle stride_,
                   py::handle pad_) {
  const int64_t kh = int_arg(kh_, "kernel height"), kw = int_arg(kw_, "kernel width");
  const int64_t stride = int_arg(stride_, "stride"), pad = int_arg(pad_, "padding");
  expect_positive(kh, "kernel height");
  expect_positive(kw, "kernel width");
  expect_positive(stride, "stride");
  if (pad < 0) throw py::value_error("padding must be >= 0, got " + std::to_string(pad));
  ConvGeom g{x.shape(0), x.shape(1), x.shape(2), x.shape(3), kh, kw, stride, pad, 0, 0};
  const int64_t padded_h = size_add(g.H, size_mul(2, pad));
  const int64_t padded_w = size_add(g.W, size_mul(2, pad));
  if (padded_h < kh || padded_w < kw)
    throw py::value_error("a " + std::to_string(kh) + "x" + std::to_string(kw) +
                          " kernel does not fit a " + std::to_string(g.H) + "x" +
                          std::to_string(g.W) + " input with padding " + std::to_string(pad));
  g.OH = pyhet::conv_out_size(g.H, kh, stride, pad);
  g.OW = pyhet::conv_out_size(g.W, kw, stride, pad);
  return g;
}

// The shape of the im2col matrix: (C * KH * KW, N * OH * OW). OH * OW checked on its own, as
// the kernels compute it (an empty batch still has its maps' size).
Shape col_shape(const ConvGeom& g) {
  return {size_mul(size_mul(g.C, g.KH), g.KW), size_mul(g.N, size_mul(g.OH, g.OW))};
}

// channels: None for all, or (begin, end) to touch only those input channels.
std::pair<int64_t, int64_t> channel_range(py::handle channels, int64_t C) {
  return range_arg(channels, "channels", C);
}

void bind_im2col(py::handle x_, py::handle kh, py::handle kw, py::handle stride,
                 py::handle pad, py::handle col_, py::handle threads_, py::handle channels) {
  auto x = checked<float>(x_, "x", 4, false);
  auto col = checked<float>(col_, "col", 2, true);
  const ConvGeom g = conv_geom(x, kh, kw, stride, pad);
  expect_shape(col, "col", col_shape(g));
  expect_disjoint(col, x, "col", "x");
  const auto c = channel_range(channels, g.C);
  const int threads = thread_count(threads_);
  if (col.size() == 0) return;  // (its rows may still number 2**40: do not loop over them)
  const float* px = cptr<float>(x);
  float* pc = ptr<float>(col);
  py::gil_scoped_release nogil;
  // the rows of channels [c0, c1); no overflow: col_shape checked C * KH * KW
  pyhet::im2col(px, g.N, g.C, g.H, g.W, g.KH, g.KW, g.stride, g.pad, pc, threads,
                c.first * g.KH * g.KW, c.second * g.KH * g.KW);
}

// A PackedB of op(b) = col (transposed false) or col^T (true) for this geometry, or None.
pyhet::PackedB* packed_col_arg(py::handle packed_, const char* name, bool transposed,
                               const Shape& col) {
  if (packed_.is_none()) return nullptr;
  if (!py::isinstance<pyhet::PackedB>(packed_))
    throw py::type_error(std::string(name) + ": expected None or a PackedB (pyhet.ops.packed_b), "
                         "got " + type_name(packed_));
  pyhet::PackedB& packed = packed_.cast<pyhet::PackedB&>();
  const Shape want = transposed ? Shape{col[1], col[0]} : col;
  if (packed.trans() != transposed || packed.K() != want[0] || packed.N() != want[1])
    throw py::value_error(std::string(name) + ": expected a PackedB of op(b) = " +
                          (transposed ? "col^T " : "col ") + shape_str(want) + " (trans_b=" +
                          (transposed ? "True" : "False") + "), got one of " +
                          shape_str({packed.K(), packed.N()}) + " (trans_b=" +
                          (packed.trans() ? "True" : "False") + ")");
  return &packed;
}

void bind_im2col_pack(py::handle x_, py::handle kh, py::handle kw, py::handle stride,
                      py::handle pad, py::handle fwd_, py::handle t_, py::handle images,
                      py::handle threads_) {
  auto x = checked<float>(x_, "x", 4, false);
  const ConvGeom g = conv_geom(x, kh, kw, stride, pad);
  const Shape col = col_shape(g);
  pyhet::PackedB* fwd = packed_col_arg(fwd_, "fwd", false, col);
  pyhet::PackedB* t = packed_col_arg(t_, "t", true, col);
  if (fwd != nullptr && t != nullptr && fwd->nr() != t->nr())
    throw py::value_error(std::string("fwd and t: packed for different micro-kernels ('") +
                          fwd->kernel() + "' and '" + t->kernel() + "'); pack them again");
  const auto n = range_arg(images, "images", g.N);
  const int threads = thread_count(threads_);
  const float* px = cptr<float>(x);
  py::gil_scoped_release nogil;
  pyhet::im2col_pack(px, g.N, g.C, g.H, g.W, g.KH, g.KW, g.stride, g.pad, fwd, t, n.first,
                     n.second, threads);
}

// Seven PackedBs of the quadrants' sums of op(b) = col (or col^T), or none for None; each
// written, so no two the same (fwd's and t's differ in storage, so none is in both).
HeldPacks<pyhet::PackedB> quadrant_col_arg(py::handle packs_, const char* name,
                                           bool transposed, const Shape& quadrant) {
  if (packs_.is_none()) return HeldPacks<pyhet::PackedB>{py::tuple(), {}};
  HeldPacks<pyhet::PackedB> packs{
      seven_packs(packs_, name, "None or a sequence of 7 PackedB"), {}};
  for (py::handle p : packs.held) {
    pyhet::PackedB* q = packed_col_arg(p, name, transposed, quadrant);
    if (q == nullptr)
      throw py::type_error(std::string(name) + ": expected 7 PackedB, got None among them");
    if (!packs.empty() && std::string(q->kernel()) != packs[0]->kernel())
      throw py::value_error(std::string(name) + ": packed for different micro-kernels");
    for (size_t i = 0; i < packs.ptrs.size(); ++i)
      if (packs[i] == q)
        throw py::value_error(std::string(name) + ": expected 7 different PackedB (each is "
                              "written), got the same one at " + std::to_string(i) + " and " +
                              std::to_string(packs.ptrs.size()));
    packs.ptrs.push_back(q);
  }
  return packs;
}

void bind_im2col_pack_quadrants(py::handle x_, py::handle kh, py::handle kw, py::handle stride,
                                py::handle pad, py::handle fwd_, py::handle t_,
                                py::handle images, py::handle units, py::handle threads_) {
  auto x = checked<float>(x_, "x", 4, false);
  const ConvGeom g = conv_geom(x, kh, kw, stride, pad);
  if (g.N % 2 || g.C % 2)
    throw py::value_error("im2col_pack_quadrants: expected an even batch and channel count, "
                          "got x of shape " + shape_str({g.N, g.C, g.H, g.W}));
  const Shape col = col_shape(g);
  const Shape quadrant{col[0] / 2, col[1] / 2};
  auto fwd = quadrant_col_arg(fwd_, "fwd", false, quadrant);
  auto t = quadrant_col_arg(t_, "t", true, quadrant);
  if (!fwd.empty() && !t.empty() && fwd[0]->nr() != t[0]->nr())
    throw py::value_error(std::string("fwd and t: packed for different micro-kernels ('") +
                          fwd[0]->kernel() + "' and '" + t[0]->kernel() + "'); pack them again");
  const int64_t S = pyhet::quadrant_sum_count(!fwd.empty(), !t.empty());
  if (!images.is_none() && !units.is_none())
    throw py::value_error("im2col_pack_quadrants: expected images or units, not both");
  std::pair<int64_t, int64_t> u;
  if (!units.is_none()) {
    u = range_arg(units, "units", g.N / 2 * S);
  } else {
    const auto n = range_arg(images, "images", g.N / 2);
    u = {n.first * S, n.second * S};
  }
  const int threads = thread_count(threads_);
  const float* px = cptr<float>(x);
  py::gil_scoped_release nogil;
  pyhet::im2col_pack_quadrants(px, g.N, g.C, g.H, g.W, g.KH, g.KW, g.stride, g.pad,
                               fwd.empty() ? nullptr : fwd.data(),
                               t.empty() ? nullptr : t.data(), u.first, u.second, threads);
}

void bind_col2im(py::handle col_, py::handle kh, py::handle kw, py::handle stride,
                 py::handle pad, py::handle x_, py::handle threads_, py::handle channels) {
  auto col = checked<float>(col_, "col", 2, false);
  auto x = checked<float>(x_, "x", 4, true);
  const ConvGeom g = conv_geom(x, kh, kw, stride, pad);
  expect_shape(col, "col", col_shape(g));
  expect_disjoint(x, col, "x", "col");
  const auto c = channel_range(channels, g.C);
  const int threads = thread_count(threads_);
  if (x.size() == 0) return;
  const float* pc = cptr<float>(col);
  float* px = ptr<float>(x);
  py::gil_scoped_release nogil;
  pyhet::col2im(pc, g.N, g.C, g.H, g.W, g.KH, g.KW, g.stride, g.pad, px, threads, c.first,
                c.second);
}

// x's channels [c0, c1) = col2im(sum_j w_j^T @ dy_j): the input gradient without its dcol.
void bind_col2im_product(py::handle ws_, py::handle dys_, py::handle kh, py::handle kw,
                         py::handle stride, py::handle pad, py::handle x_, py::handle threads_,
                         py::handle channels) {
  auto x = checked<float>(x_, "x", 4, true);
  const ConvGeom g = conv_geom(x, kh, kw, stride, pad);
  const Shape col = col_shape(g);
  if (!py::isinstance<py::sequence>(ws_) || py::isinstance<py::str>(ws_) ||
      !py::isinstance<py::sequence>(dys_) || py::isinstance<py::str>(dys_))
    throw py::type_error("col2im_product: expected sequences ws and dys of float32 matrices, got " +
                         type_name(ws_) + " and " + type_name(dys_));
  auto ws_seq = py::reinterpret_borrow<py::sequence>(ws_);
  auto dys_seq = py::reinterpret_borrow<py::sequence>(dys_);
  if (ws_seq.size() != dys_seq.size())
    throw py::value_error("col2im_product: expected as many dys as ws, got " +
                          std::to_string(dys_seq.size()) + " and " +
                          std::to_string(ws_seq.size()));
  std::vector<py::array> held;
  std::vector<const float*> w, dy;
  std::vector<int64_t> k, ldw, lddy;
  for (size_t j = 0; j < ws_seq.size(); ++j) {
    const std::string wn = "ws[" + std::to_string(j) + "]", dn = "dys[" + std::to_string(j) + "]";
    auto wj = checked<float>(ws_seq[j], wn.c_str(), 2, false, true);
    auto dj = checked<float>(dys_seq[j], dn.c_str(), 2, false, true);
    expect_shape(wj, wn.c_str(), {wj.shape(0), col[0]});
    expect_shape(dj, dn.c_str(), {wj.shape(0), col[1]});
    expect_disjoint(x, wj, "x", wn.c_str());
    expect_disjoint(x, dj, "x", dn.c_str());
    w.push_back(cptr<float>(wj));
    dy.push_back(cptr<float>(dj));
    k.push_back(wj.shape(0));
    ldw.push_back(leading_dim(wj));
    lddy.push_back(leading_dim(dj));
    held.push_back(wj);
    held.push_back(dj);
  }
  const auto c = channel_range(channels, g.C);
  const int threads = thread_count(threads_);
  if (x.size() == 0) return;
  float* px = ptr<float>(x);
  py::gil_scoped_release nogil;
  pyhet::col2im_product(static_cast<int>(w.size()), w.data(), k.data(), ldw.data(), dy.data(),
                        lddy.data(), g.N, g.C, g.H, g.W, g.KH, g.KW, g.stride, g.pad, px,
                        threads, c.first, c.second);
}

// ---------------------------------------------------------------------------------------------
// Pooling

void bind_maxpool(py::handle x_, py::handle k_, py::handle s_, py::handle out_, py::handle arg_,
                  py::handle threads_) {
  const int64_t k = int_arg(k_, "pool size"), s = int_arg(s_, "pool stride");
  auto x = checked<float>(x_, "x", 4, false);
  auto out = checked<float>(out_, "out", 4, true);
  auto arg = checked<int32_t>(arg_, "arg", 4, true);
  expect_positive(k, "pool size");
  expect_positive(s, "pool stride");
  const int64_t N = x.shape(0), C = x.shape(1), H = x.shape(2), W = x.shape(3);
  if (H < k || W < k)
    throw py::value_error("max-pool window " + std::to_string(k) + " is larger than the " +
                          std::to_string(H) + "x" + std::to_string(W) + " input");
  expect_int32_plane(H, W, "x");
  const Shape want{N, C, pyhet::pool_out_size(H, k, s), pyhet::pool_out_size(W, k, s)};
  expect_shape(out, "out", want);
  expect_shape(arg, "arg", want);
  expect_disjoint(out, x, "out", "x");
  expect_disjoint(arg, x, "arg", "x");
  expect_disjoint(out, arg, "out", "arg");
  const int threads = thread_count(threads_);
  const float* px = cptr<float>(x);
  float* po = ptr<float>(out);
  int32_t* pa = ptr<int32_t>(arg);
  py::gil_scoped_release nogil;
  pyhet::maxpool_forward(px, N * C, H, W, k, s, po, pa, threads);
}

void bind_maxpool_backward(py::handle dout_, py::handle arg_, py::handle dx_,
                           py::handle threads_) {
  auto dout = checked<float>(dout_, "dout", 4, false);
  auto arg = checked<int32_t>(arg_, "arg", 4, false);
  auto dx = checked<float>(dx_, "dx", 4, true);
  expect_shape(arg, "arg", shape_of(dout));
  if (dx.shape(0) != dout.shape(0) || dx.shape(1) != dout.shape(1))
    throw py::value_error("dx: expected " + std::to_string(dout.shape(0)) + " x " +
                          std::to_string(dout.shape(1)) + " planes, got shape " +
                          shape_str(shape_of(dx)));
  expect_disjoint(dx, dout, "dx", "dout");
  // dx is zeroed and written while arg is read: an arg inside dx would change under the checks
  expect_disjoint(dx, arg, "dx", "arg");
  const int threads = thread_count(threads_);
  const int64_t N = dx.shape(0), C = dx.shape(1), H = dx.shape(2), W = dx.shape(3);
  const int32_t* pa = cptr<int32_t>(arg);
  // arg comes from Python: check every index lands in its plane before scattering.
  for (py::ssize_t i = 0; i < arg.size(); ++i)
    if (pa[i] < 0 || pa[i] >= H * W)
      throw py::value_error("arg: index " + std::to_string(pa[i]) + " is outside a " +
                            std::to_string(H) + "x" + std::to_string(W) + " plane");
  const float* pd = cptr<float>(dout);
  float* px = ptr<float>(dx);
  py::gil_scoped_release nogil;
  pyhet::maxpool_backward(pd, pa, N * C, H, W, dout.shape(2), dout.shape(3), px, threads);
}

// The pooled shape of a conv block's (K, N, H, W) output: (N, K, PH, PW). `what` names the
// array whose planes are pooled, for the error message.
Shape pooled_shape(int64_t K, int64_t N, int64_t H, int64_t W, int64_t k, int64_t s,
                   const char* what) {
  expect_positive(k, "pool size");
  expect_positive(s, "pool stride");
  if (H < k || W < k)
    throw py::value_error("max-pool window " + std::to_string(k) + " is larger than the " +
                          std::to_string(H) + "x" + std::to_string(W) + " " + what);
  return {N, K, pyhet::pool_out_size(H, k, s), pyhet::pool_out_size(W, k, s)};
}

void bind_bias_relu_maxpool(py::handle y_, py::handle bias_, py::handle k_, py::handle s_,
                            py::handle out_, py::handle arg_, py::handle threads_) {
  const int64_t k = int_arg(k_, "pool size"), s = int_arg(s_, "pool stride");
  auto y = checked<float>(y_, "y", 4, false);
  auto bias = checked<float>(bias_, "bias", 1, false);
  auto out = checked<float>(out_, "out", 4, true);
  auto arg = checked<int32_t>(arg_, "arg", 4, true);
  const int64_t K = y.shape(0), N = y.shape(1), H = y.shape(2), W = y.shape(3);
  const Shape want = pooled_shape(K, N, H, W, k, s, "conv output");
  expect_int32_plane(H, W, "y");
  expect_shape(bias, "bias", {K});
  expect_shape(out, "out", want);
  expect_shape(arg, "arg", want);
  expect_disjoint(out, y, "out", "y");
  expect_disjoint(out, bias, "out", "bias");
  expect_disjoint(arg, y, "arg", "y");
  expect_disjoint(arg, bias, "arg", "bias");
  expect_disjoint(out, arg, "out", "arg");
  const int threads = thread_count(threads_);
  const float *py_ = cptr<float>(y), *pb = cptr<float>(bias);
  float* po = ptr<float>(out);
  int32_t* pa = ptr<int32_t>(arg);
  py::gil_scoped_release nogil;
  pyhet::bias_relu_maxpool(py_, pb, K, N, H, W, k, s, po, pa, threads);
}

void bind_bias_relu_maxpool_backward(py::handle dout_, py::handle arg_, py::handle k_,
                                     py::handle s_, py::handle dy_, py::handle threads_) {
  const int64_t k = int_arg(k_, "pool size"), s = int_arg(s_, "pool stride");
  auto dout = checked<float>(dout_, "dout", 4, false);
  auto arg = checked<int32_t>(arg_, "arg", 4, false);
  auto dy = checked<float>(dy_, "dy", 4, true);
  const int64_t K = dy.shape(0), N = dy.shape(1), H = dy.shape(2), W = dy.shape(3);
  const Shape want = pooled_shape(K, N, H, W, k, s, "dy plane");
  expect_shape(dout, "dout", want);
  expect_shape(arg, "arg", want);
  expect_disjoint(dy, dout, "dy", "dout");
  // dy is zeroed and written while arg is read: an arg inside dy would change under the checks
  expect_disjoint(dy, arg, "dy", "arg");
  expect_int32_plane(H, W, "dy");
  const int threads = thread_count(threads_);
  // arg comes from Python: check every index before scattering, plane by plane. Without
  // pooling (k == s == 1) the kernel reads arg as a mask, so each entry must be -1 or its
  // element's own index; else -1 or inside its own window, as the forward chooses (a pool
  // that tiles the plane writes each window's block alone, and would drop any other index).
  // Branch-free compares a row of windows at a time (they vectorise), without the GIL:
  // the other devices' threads go on meanwhile.
  const int32_t* pa = cptr<int32_t>(arg);
  const int64_t PH = want[2], PW = want[3], P = PH * PW;
  int64_t bad = -1;   // the first wrong entry, as an index into arg
  {
    py::gil_scoped_release nogil;
    for (int64_t q = 0; q < N * K && bad < 0; ++q) {
      const int32_t* a = pa + q * P;
      if (k == 1 && s == 1) {
        const int64_t i = first_wrong(a, P, [](int32_t v, int64_t i) {
          return (v != -1) & (v != static_cast<int32_t>(i));
        });
        if (i >= 0) bad = q * P + i;
        continue;
      }
      for (int64_t ph = 0; ph < PH && bad < 0; ++ph) {
        const int64_t origin = ph * s * W;   // the first element of the row's first window
        const int64_t i =
            k == 2 && H * W < INT32_MAX
                // the common window, in int32 lanes: v less its window's first element,
                // unsigned, is 0, 1, W or W + 1
                ? first_wrong(a + ph * PW, PW,
                              [o = static_cast<uint32_t>(origin), s32 = static_cast<uint32_t>(s),
                               w = static_cast<uint32_t>(W)](int32_t v, int64_t pw) {
                                const uint32_t rel = static_cast<uint32_t>(v) - o -
                                                     static_cast<uint32_t>(pw) * s32;
                                return (v != -1) & (rel != 0u) & (rel != 1u) & (rel != w) &
                                       (rel != w + 1u);
                              })
                // dr * W + dc with 0 <= dr, dc < k
                : first_wrong(a + ph * PW, PW, [origin, s, W, k](int32_t v, int64_t pw) {
                    const int64_t rel = v - origin - pw * s;
                    int inside = 0;
                    for (int64_t dr = 0; dr < k; ++dr)
                      inside |= (rel - dr * W >= 0) & (rel - dr * W < k);
                    return (v != -1) & !inside;
                  });
        if (i >= 0) bad = q * P + ph * PW + i;
      }
    }
  }
  if (bad >= 0) {
    const int64_t i = bad % P;
    if (k == 1 && s == 1)
      throw py::value_error("arg: index " + std::to_string(pa[bad]) + " at position " +
                            std::to_string(i) + " of a plane without pooling (pool 1, stride "
                            "1), where only -1 or the position itself can come");
    throw py::value_error("arg: index " + std::to_string(pa[bad]) + " at position " +
                          std::to_string(i) + " of a " + std::to_string(H) + "x" +
                          std::to_string(W) + " plane is outside its " + std::to_string(k) +
                          "x" + std::to_string(k) + " window (stride " + std::to_string(s) +
                          "), where the max-pool's choice lies");
  }
  const float* pd = cptr<float>(dout);
  float* pdy = ptr<float>(dy);
  py::gil_scoped_release nogil;
  pyhet::bias_relu_maxpool_backward(pd, pa, K, N, H, W, k, s, pdy, threads);
}

// ---------------------------------------------------------------------------------------------
// SGD

void bind_sgd_update(py::handle p_, py::handle g_, py::handle v_, float lr, float momentum,
                     float weight_decay, bool first, py::handle threads_, py::handle p_out_,
                     py::handle v_out_) {
  // in place (p_out, v_out None), or into p_out and v_out, which overlap nothing
  const bool into = !p_out_.is_none() || !v_out_.is_none();
  if (into && (p_out_.is_none() || v_out_.is_none()))
    throw py::value_error("sgd_update: give both p_out and v_out, or neither (in place)");
  auto p = checked<float>(p_, "p", 1, !into);
  auto g = checked<float>(g_, "g", 1, false);
  auto v = checked<float>(v_, "v", 1, !into);
  expect_shape(g, "g", shape_of(p));
  expect_shape(v, "v", shape_of(p));
  expect_disjoint(p, g, "p", "g");
  expect_disjoint(v, g, "v", "g");
  expect_disjoint(p, v, "p", "v");
  py::array p_out = p, v_out = v;
  if (into) {
    p_out = checked<float>(p_out_, "p_out", 1, true);
    v_out = checked<float>(v_out_, "v_out", 1, true);
    expect_shape(p_out, "p_out", shape_of(p));
    expect_shape(v_out, "v_out", shape_of(p));
    for (const auto& [a, name] : {std::pair<const py::array*, const char*>{&p, "p"}, {&g, "g"},
                                   {&v, "v"}, {&v_out, "v_out"}})
      expect_disjoint(p_out, *a, "p_out", name);
    for (const auto& [a, name] : {std::pair<const py::array*, const char*>{&p, "p"}, {&g, "g"},
                                   {&v, "v"}})
      expect_disjoint(v_out, *a, "v_out", name);
  }
  const int threads = thread_count(threads_);
  const float *pp = cptr<float>(p), *pg = cptr<float>(g), *pv = cptr<float>(v);
  float *po = ptr<float>(p_out), *vo = ptr<float>(v_out);
  py::gil_scoped_release nogil;
  pyhet::sgd_update(pp, pg, pv, po, vo, p.shape(0), lr, momentum, weight_decay, first, threads);
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  pthread_atfork(nullptr, nullptr, after_fork_in_child);
  m.doc() = "pyhet's C++ core: packed SGEMM, im2col/col2im, pooling. Use pyhet.ops instead.";
  m.def("sgemm",
        [](py::handle a, py::handle b, py::handle c, bool ta, bool tb, float alpha, float beta,
           py::handle threads) {
          bind_sgemm(a, b, c, ta, tb, alpha, beta, threads, GemmPath::kPacked);
        },
        py::arg("a"), py::arg("b"), py::arg("c"), py::arg("trans_a") = false,
        py::arg("trans_b") = false, py::arg("alpha") = 1.0f, py::arg("beta") = 0.0f,
        py::arg("threads") = 1,
        "c = alpha * op(a) @ op(b) + beta * c on the packed kernel, in place.");
  m.def("sgemm_ref",
        [](py::handle a, py::handle b, py::handle c, bool ta, bool tb, float alpha, float beta) {
          bind_sgemm(a, b, c, ta, tb, alpha, beta, py::int_(1), GemmPath::kReference);
        },
        py::arg("a"), py::arg("b"), py::arg("c"), py::arg("trans_a") = false,
        py::arg("trans_b") = false, py::arg("alpha") = 1.0f, py::arg("beta") = 0.0f,
        "The triple-loop reference of sgemm.");
  m.def("sgemm_naive",
        [](py::handle a, py::handle b, py::handle c, py::handle threads) {
          bind_sgemm(a, b, c, false, false, 1.0f, 0.0f, threads, GemmPath::kNaive);
        },
        py::arg("a"), py::arg("b"), py::arg("c"), py::arg("threads") = 1,
        "For the benchmark: c = a @ b by the plain i-k-j loop the compiler vectorises.");
  m.def("gemm_kernel", &pyhet::sgemm_kernel_name, "The micro-kernel sgemm uses on this CPU.");
  m.def("gemm_blocks", &pyhet::sgemm_blocks,
        "The blocks (MC, KC, NC) of the micro-kernel sgemm uses on this CPU.");
  m.def("set_gemm_kernel",
        [](const std::string& name) {
          if (!pyhet::gemm::set_kernel(name.c_str()))
            throw py::value_error(
                "set_gemm_kernel: expected 'auto', 'portable', 'avx2-fma' or 'avx512' (the last "
                "two only where the CPU has AVX2 and FMA, or AVX-512F and VL), got '" + name +
                "'");
        },
        py::arg("name"),
        "Test hook: force the GEMM micro-kernel for every later call, or go back to 'auto'.");
  m.def("set_gemm_min_flops_per_thread",
        [](double flops) {
          if (std::isnan(flops))
            throw py::value_error("set_gemm_min_flops_per_thread: expected a number, got nan");
          return pyhet::gemm::set_min_flops_per_thread(flops);
        },
        py::arg("flops"),
        "Test hook: split a GEMM among its threads only when each gets at least `flops` FLOPs "
        "(0: always; < 0: the default again). Returns the previous threshold.");
  m.def("gemm_strassen_min_dim", &pyhet::gemm::get_strassen_min_dim,
        "The smallest dimension of the products that take Strassen's scheme (0: none).");
  m.def("gemm_uses_strassen",
        [](int64_t m, int64_t n, int64_t k, int threads) {
          expect_holdable_product(m, n, k, "gemm_uses_strassen");
          return pyhet::gemm::strassen_applies(m, n, k, threads);
        },
        py::arg("m"), py::arg("n"), py::arg("k"), py::arg("threads") = 1,
        "Whether sgemm runs an (m, n) x k product on `threads` threads by Strassen's scheme.");
  m.def("gemm_splits_k",
        [](int64_t m, int64_t n, int64_t k, int threads) {
          expect_holdable_product(m, n, k, "gemm_splits_k");
          return pyhet::gemm::splits_k(m, n, k, threads);
        },
        py::arg("m"), py::arg("n"), py::arg("k"), py::arg("threads") = 1,
        "Whether sgemm splits an (m, n) x k product's k among its `threads` threads (few tiles "
        "of the output over a long k) rather than the output's rows and columns.");
  m.def("set_gemm_strassen_min_dim", &pyhet::gemm::set_strassen_min_dim, py::arg("dim"),
        "Test hook and benchmark switch: products whose every dimension is at least `dim` use "
        "one level of Strassen's scheme (0: none; < 0: the default again, 768 unless "
        "PYHET_GEMM_STRASSEN is 0 or off). Returns the previous value.");
  py::class_<pyhet::PackedB>(m, "PackedB",
                             "op(b) (k, n) packed once into the GEMM's panels, for several "
                             "products that share it (sgemm_packed); filled by pack_b.")
      .def(py::init(&make_packed_b), py::arg("k"), py::arg("n"), py::arg("trans_b") = false,
           "Room for op(b) (k, n), packed for the micro-kernel in use now; b is stored (n, k) "
           "when trans_b.")
      .def_property_readonly("k", &pyhet::PackedB::K)
      .def_property_readonly("n", &pyhet::PackedB::N)
      .def_property_readonly("trans_b", &pyhet::PackedB::trans)
      .def_property_readonly("slivers", &pyhet::PackedB::slivers,
                             "Column panels of op(b); pack_b packs ranges of them.")
      .def_property_readonly("kernel", [](const pyhet::PackedB& p) {
        return std::string(p.kernel());
      })
      .def_property_readonly("nbytes", [](const pyhet::PackedB& p) {
        return p.floats() * static_cast<int64_t>(sizeof(float));
      });
  m.def("pack_b", &bind_pack_b, py::arg("b"), py::arg("packed"), py::arg("rows") = py::none(),
        py::arg("slivers") = py::none(), py::arg("threads") = 1,
        "Pack rows (begin, end) of op(b), in its slivers (begin, end) (None: all), into packed. "
        "Disjoint parts may be packed at once from different threads.");
  m.def("sgemm_packed", &bind_sgemm_packed, py::arg("a"), py::arg("packed"), py::arg("c"),
        py::arg("trans_a") = false, py::arg("alpha") = 1.0f, py::arg("beta") = 0.0f,
        py::arg("threads") = 1,
        "c = alpha * op(a) @ op(b) + beta * c in place, op(b) packed whole by pack_b.");
  m.def("sgemm_packed_t", &bind_sgemm_packed_t, py::arg("a"), py::arg("packed"), py::arg("c"),
        py::arg("rows") = py::none(), py::arg("trans_a") = false, py::arg("alpha") = 1.0f,
        py::arg("beta") = 0.0f, py::arg("threads") = 1,
        "c = alpha * op(a) @ s^T + beta * c in place, s the rows (r0, r1) of the op(b) that "
        "packed holds (None: all), packed whole by pack_b for another product.");
  m.def("sgemm_packed_quadrants", &bind_sgemm_packed_quadrants, py::arg("a"), py::arg("packs"),
        py::arg("c"), py::arg("trans_a") = false, py::arg("alpha") = 1.0f,
        py::arg("beta") = 0.0f, py::arg("strassen") = -1, py::arg("threads") = 1,
        "c = alpha * op(a) @ op(b) + beta * c in place, op(b) given as the 7 packed sums of its "
        "quadrants B11 + B22, B11, B12 - B22, B21 - B11, B22, B11 + B12, B21 + B22; by "
        "Strassen's scheme when strassen is 1, never when 0, where it pays when -1.");
  m.def("sgemm_packed_quadrants_t", &bind_sgemm_packed_quadrants_t, py::arg("a"),
        py::arg("packs"), py::arg("c"), py::arg("rows") = py::none(), py::arg("trans_a") = false,
        py::arg("alpha") = 1.0f, py::arg("beta") = 0.0f, py::arg("strassen") = -1,
        py::arg("threads") = 1,
        "c = alpha * op(a) @ s^T + beta * c in place, s the op(b) whose 7 quadrant sums packs "
        "holds for sgemm_packed_quadrants (read transposed: dy @ col^T from col's sums packed "
        "for the forward); strassen as there. rows (r0, r1) of each half of s (None: all): "
        "only c's columns [r0, r1) and [h + r0, h + r1) are made (h: half c's width).");
  m.def("gemm_packed_uses_strassen",
        [](int64_t m, int64_t k2, int64_t n2, int threads) {
          int64_t k, n;    // the product's: twice its quadrants'
          if (m > 0 && k2 > 0 && n2 > 0) {
            if (__builtin_mul_overflow(k2, 2, &k) || __builtin_mul_overflow(n2, 2, &n))
              throw py::value_error("gemm_packed_uses_strassen: quadrants of more than 2**62 "
                                    "rows or columns are more than a process can address");
            expect_holdable_product(m, n, k, "gemm_packed_uses_strassen");
          }
          return pyhet::packed_strassen_applies(m, k2, n2, threads);
        },
        py::arg("m"), py::arg("k2"), py::arg("n2"), py::arg("threads") = 1,
        "Whether sgemm_packed_quadrants(strassen=-1) takes Strassen's scheme for m rows of a "
        "and quadrants (k2, n2) on `threads` threads.");
  m.attr("max_threads") = kMaxThreads;
  m.def("have_openmp", &pyhet::have_openmp, "Whether the core was built with OpenMP.");
  m.def(
      "startable_threads",
      [](const std::vector<std::pair<int64_t, int64_t>>& groups) {
        int64_t total = 0;
        for (const auto& [n, stack] : groups) {
          if (n < 0 || stack < 0)
            throw py::value_error("startable_threads: expected (count, stack) pairs of "
                                  "numbers >= 0, got (" + std::to_string(n) + ", " +
                                  std::to_string(stack) + ")");
          total += std::min<int64_t>(n, int64_t{1} << 20);
          if (n > (int64_t{1} << 20) || total > (int64_t{1} << 20))
            throw py::value_error("startable_threads: at most 2**20 threads in all");
        }
        py::gil_scoped_release nogil;
        return startable_threads(groups);
      },
      py::arg("groups"),
      "How many of the threads of groups [(count, stack bytes; 0: the default), ...] this "
      "process can start and hold at once, made as libgomp makes its team's (pthread_create); "
      "all ended again.");
  m.def(
      "start_team",
      [](py::handle threads) {
        const int t = thread_count(threads);
        py::gil_scoped_release nogil;
        return pyhet::start_team(t);
      },
      py::arg("threads"),
      "Start the calling thread's team of `threads` OpenMP threads now (kept for its later "
      "calls); returns its size (1 without OpenMP).");
  m.def("im2col", &bind_im2col, py::arg("x"), py::arg("kh"), py::arg("kw"), py::arg("stride"),
        py::arg("pad"), py::arg("col"), py::arg("threads") = 1, py::arg("channels") = py::none());
  m.def("im2col_pack", &bind_im2col_pack, py::arg("x"), py::arg("kh"), py::arg("kw"),
        py::arg("stride"), py::arg("pad"), py::arg("fwd") = py::none(), py::arg("t") = py::none(),
        py::arg("images") = py::none(), py::arg("threads") = 1,
        "im2col(x) of the images (begin, end) straight into PackedBs of col (fwd) and col^T (t).");
  m.def("im2col_pack_quadrants", &bind_im2col_pack_quadrants, py::arg("x"), py::arg("kh"),
        py::arg("kw"), py::arg("stride"), py::arg("pad"), py::arg("fwd") = py::none(),
        py::arg("t") = py::none(), py::arg("images") = py::none(),
        py::arg("units") = py::none(), py::arg("threads") = 1,
        "im2col(x) of the images (begin, end) of each half of the batch, or of the (image, "
        "sum) units (begin, end), straight into the 7 PackedBs of the quadrants' sums of col "
        "(fwd) and of col^T (t).");
  m.def("col2im", &bind_col2im, py::arg("col"), py::arg("kh"), py::arg("kw"),
        py::arg("stride"), py::arg("pad"), py::arg("x"), py::arg("threads") = 1,
        py::arg("channels") = py::none());
  m.def("col2im_product", &bind_col2im_product, py::arg("ws"), py::arg("dys"), py::arg("kh"),
        py::arg("kw"), py::arg("stride"), py::arg("pad"), py::arg("x"), py::arg("threads") = 1,
        py::arg("channels") = py::none(),
        "x's channels (c0, c1) (None: all) = col2im(sum_j ws[j]^T @ dys[j]), ws[j] (k_j, C*KH*KW) "
        "and dys[j] (k_j, N*OH*OW), made in blocks that stay in cache (no dcol in memory).");
  m.def("maxpool", &bind_maxpool, py::arg("x"), py::arg("k"), py::arg("stride"), py::arg("out"),
        py::arg("arg"), py::arg("threads") = 1);
  m.def("maxpool_backward", &bind_maxpool_backward, py::arg("dout"), py::arg("arg"),
        py::arg("dx"), py::arg("threads") = 1);
  m.def("sgd_update", &bind_sgd_update, py::arg("p"), py::arg("g"), py::arg("v"), py::arg("lr"),
        py::arg("momentum"), py::arg("weight_decay"), py::arg("first"), py::arg("threads") = 1,
        py::arg("p_out") = py::none(), py::arg("v_out") = py::none(),
        "d = g + wd*p; v = d if first else momentum*v + d; p -= lr*v (flat arrays), in place, "
        "or into p_out and v_out (both given; they overlap nothing) leaving p and v as they were.");
  m.def("bias_relu_maxpool", &bind_bias_relu_maxpool, py::arg("y"), py::arg("bias"),
        py::arg("pool"), py::arg("stride"), py::arg("out"), py::arg("arg"),
        py::arg("threads") = 1,
        "y (K, N, H, W), bias (K,) -> out, arg (N, K, PH, PW) = maxpool(relu(y + bias)), with a "
        "pool x pool window moved by stride; pool = stride = 1 for no pooling.");
  m.def("bias_relu_maxpool_backward", &bind_bias_relu_maxpool_backward, py::arg("dout"),
        py::arg("arg"), py::arg("pool"), py::arg("stride"), py::arg("dy"),
        py::arg("threads") = 1,
        "dout, arg (N, K, PH, PW) -> dy (K, N, H, W), the gradient of the conv output.");
}
