"""The Python face of the C++ core, with readable errors.

Every function takes float32 NumPy arrays and returns new arrays (or writes into ``out=``).
An array of another dtype (float32 of the other byte order too), or something that is not an
array, raises ``TypeError``: nothing is converted behind your back. Wrong ndim or shapes, sizes
out of range, or ``threads`` outside 1..MAX_THREADS, raise ``ValueError``. Non-contiguous
inputs are copied to contiguous ones (the result is still exact); outputs must be
C-contiguous. Every message is one short line: it says what was expected and what came, never
the arrays' contents.

Letters: x (N, C, H, W) images in NCHW; col (C*KH*KW, N*OH*OW) the im2col matrix.
"""

from __future__ import annotations

import math
import numbers
import os
import re
import sys
import threading

import numpy as np

from .geometry import conv_out_size, int_arg, pool_out_size

# OpenMP threads that finish a parallel region wait for the next one. By default they spin for a
# while (libgomp: about a millisecond or more), on a core that another device's thread, or another
# rank, needs then: on the default network that made two one-thread devices 30% slower a step.
# The core is loaded with passive waiting unless the user chose a policy; the setting is put back
# at once, so that other OpenMP libraries loaded later, and child processes, keep their defaults.
_POLICY = "OMP_WAIT_POLICY"
_chosen = _POLICY in os.environ
if not _chosen:
    os.environ[_POLICY] = "PASSIVE"
# The cores this process may run on, before libgomp loads: under OMP_PROC_BIND it binds the
# loading thread to one core, which every thread made later (each device's worker) would
# inherit, so that `cpu:1,cpu:1` ran on one core and a `cpu` device took one thread. pyhet
# places its threads itself: the mask is put back below (its OpenMP teams still bind as asked).
try:
    _AFFINITY = os.sched_getaffinity(0)
except AttributeError:  # not Linux
    _AFFINITY = None
try:
    from . import _core
except ImportError as e:  # a source tree without the built extension, usually
    _here = os.path.dirname(os.path.abspath(__file__))
    if os.path.exists(os.path.join(_here, "..", "CMakeLists.txt")):   # the source folder
        _error = ImportError(
            f"pyhet was imported from its source folder ({os.path.dirname(_here)}), whose "
            f"pyhet/ has no built core: run Python from another folder (pip install . first, "
            f"if it is not installed)")
        _error.said_whole = True     # (the pyhet command says it in one line: pyhet/__init__)
        raise _error from None
    raise ImportError(
        f"pyhet's compiled core (pyhet._core) cannot be imported ({e}). Install the package "
        f"with `pip install .`, and run it from outside the source folder, whose pyhet/ has "
        f"no built core") from e
finally:
    if not _chosen:
        del os.environ[_POLICY]
    if _AFFINITY is not None and os.sched_getaffinity(0) != _AFFINITY:
        try:
            os.sched_setaffinity(0, _AFFINITY)
        except OSError:
            pass


def _openmp_stack_size(environ=os.environ) -> "tuple[int, str] | None":
    """(bytes, variable): the stack size of the threads libgomp makes, read from the environment
    as libgomp reads it when the core is loaded: OMP_STACKSIZE, else GOMP_STACKSIZE, a number of
    KiB, or one with a suffix B, K, M or G (strtoul's: an optional +); None where neither is
    set or valid (libgomp then uses the default, as Python's threads do)."""
    for name in ("OMP_STACKSIZE", "GOMP_STACKSIZE"):
        m = re.fullmatch(r"\s*\+?(\d+)\s*(?:([bkmgBKMG])\s*)?", environ.get(name, ""))
        if m:
            size = int(m.group(1)) << {"b": 0, "k": 10, "m": 20, "g": 30}[
                (m.group(2) or "k").lower()]
            if size < 2**64:
                return size, name
    return None


OPENMP_STACK_SIZE = _openmp_stack_size()

__all__ = [
    "gemm", "sgemm", "packed_b", "pack_b", "sgemm_packed", "gemm_kernel", "have_openmp",
    "PackedQuadrants", "packed_quadrants", "pack_quadrants", "uses_packed_strassen",
    "strassen_min_dim", "uses_strassen", "splits_k", "start_team",
    "default_threads", "gemm_blocks", "im2col", "im2col_pack", "im2col_pack_quadrants",
    "quadrant_units",
    "col2im", "col2im_product",
    "maxpool", "maxpool_backward", "bias_relu_maxpool", "bias_relu_maxpool_backward",
    "conv_out_size",
]


def default_threads() -> int:
    """The cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def gemm_kernel() -> str:
    """The GEMM micro-kernel chosen for this CPU: ``"avx512"``, ``"avx2-fma"`` or
    ``"portable"``."""
    return _core.gemm_kernel()


def gemm_blocks() -> tuple:
    """The blocks (MC, KC, NC) of the chosen micro-kernel: its K blocks are longer on a CPU
    whose cores have an L2 of 2 MiB or more (the AVX-512 kernel's KC 1024, else 512)."""
    return tuple(_core.gemm_blocks())


def have_openmp() -> bool:
    return _core.have_openmp()


def start_team(threads=None) -> int:
    """Start the calling thread's team of OpenMP threads now, rather than at its first call
    (a device's worker does, after pyhet.specs.check_threads found the threads can be had);
    returns its size (1 without OpenMP). libgomp keeps the team for that thread's later calls.
    """
    return _core.start_team(_threads(threads))


def strassen_min_dim() -> int:
    """The GEMM runs a product by one level of Strassen's scheme (1/8 fewer operations, a
    rounding of its own) when each of its dimensions is at least this; 0: never (the
    environment variable PYHET_GEMM_STRASSEN=0 turns it off)."""
    return _core.gemm_strassen_min_dim()


STRASSEN_ENV = "PYHET_GEMM_STRASSEN"
_STRASSEN_VALUES = ("0", "off", "1", "on", "")   # the core reads 0 and off as off, all else on
_strassen_env_told = False


def strassen_environment_problem() -> "str | None":
    """What is wrong with PYHET_GEMM_STRASSEN in the environment, or None: the core takes 0 and
    off for off and any other value for on, so a misspelt off (``false``, ``OFF``) would keep
    Strassen's scheme on without a word."""
    value = os.environ.get(STRASSEN_ENV)
    if value is None or value in _STRASSEN_VALUES:
        return None
    return (f"{STRASSEN_ENV}={value!r} is none of 0, off, 1, on: Strassen's scheme stays "
            f"{'off' if strassen_min_dim() == 0 else 'on'}")


def warn_about_environment() -> None:
    """Warn once per process about a PYHET_GEMM_STRASSEN the core does not read as meant."""
    global _strassen_env_told
    problem = strassen_environment_problem()
    if problem and not _strassen_env_told:
        _strassen_env_told = True
        from .errors import warn
        warn(problem)


def uses_strassen(m: int, n: int, k: int, threads: int = 1) -> bool:
    """Whether an (m, n) x k product on `threads` threads runs by Strassen's scheme (on several
    threads each of its seven products must also be big enough to wake them for)."""
    what = "uses_strassen"     # (a product no memory holds is refused by the core)
    return _core.gemm_uses_strassen(_dim(m, "m", what), _dim(n, "n", what), _dim(k, "k", what),
                                    _threads(threads))


def splits_k(m: int, n: int, k: int, threads: int = 1) -> bool:
    """Whether the threads of an (m, n) x k product share out k rather than the rows and columns
    of the output (which then has too few tiles to share out evenly): each sums its own blocks
    of k, and the partial sums are added in a fixed order."""
    what = "splits_k"          # (a product no memory holds is refused by the core)
    return _core.gemm_splits_k(_dim(m, "m", what), _dim(n, "n", what), _dim(k, "k", what),
                               _threads(threads))


# ------------------------------------------------------------------------------------------------
# Checks


MAX_THREADS = _core.max_threads   # the core's limit (1024): more than any machine's cores
_INT_MAX = 2**31 - 1   # the core's sizes are C ints


def _threads(threads) -> int:
    if threads is None:
        return default_threads()
    if isinstance(threads, bool) or not isinstance(threads, (int, np.integer)):
        raise TypeError(f"threads must be an int or None, got {type(threads).__name__}")
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    if threads > MAX_THREADS:
        raise ValueError(f"threads must be at most {MAX_THREADS}, got {threads}")
    threads = int(threads)
    if threads > getattr(_team, "checked", 1):
        _check_startable(threads)
    return threads


_team = threading.local()   # .checked: the largest team this thread was found able to start


def _check_startable(threads: int) -> None:
    """libgomp ends the process where it cannot make a team's thread (ulimit -u, or -v at
    ulimit -s of stack each): a calling thread's team larger than its largest before (libgomp
    keeps a team for each thread that starts one) is tried first, its threads made as libgomp
    makes them, at an OpenMP thread's stack size (with OpenMP only)."""
    if not _core.have_openmp():
        return
    from .specs import stack_reserved, startable_threads
    started = startable_threads(0, openmp=threads - 1)   # the calling thread is the team's first
    if started < threads - 1:
        raise RuntimeError(f"threads={threads}: this process could start only {started + 1} "
                           f"threads at once (see ulimit -u, and ulimit -v: "
                           f"{stack_reserved()}); give fewer threads")
    _team.checked = threads


def _size(v, name: str, what: str, minimum: int = 0) -> int:
    """An int argument of the core (a kernel size, stride, padding, window) in minimum..2**31-1."""
    v = int_arg(v, name, what, minimum)
    if v > _INT_MAX:
        raise ValueError(f"{what}: {name} must be at most 2**31 - 1, got {v}")
    return v


_FLOAT32_MAX = float(np.finfo(np.float32).max)


def _flag(v, name: str, what: str) -> bool:
    """A bool argument (trans_a, strassen): None or 0 would otherwise pass as False."""
    if not isinstance(v, (bool, np.bool_)):
        raise TypeError(f"{what}: {name} must be a bool, got {type(v).__name__}")
    return bool(v)


def _scale(v, name: str, what: str) -> float:
    """alpha or beta of a product: a real number (a 0-d array of one too) that float32, the
    core's type, holds: finite, within its range, and not so small that it would become 0
    there (a bigger one became inf, a smaller one 0, without a word)."""
    if isinstance(v, np.ndarray) and v.ndim == 0 and v.dtype.kind in "iuf":
        v = v.item()
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Real):
        raise TypeError(f"{what}: {name} must be a real number, got {type(v).__name__}")
    try:
        f = float(v)
    except OverflowError:     # an int beyond float64
        f = math.inf
    if not abs(f) <= _FLOAT32_MAX or (f != 0 and np.float32(f) == 0):
        got = f"an int of {int(v).bit_length()} bits" if isinstance(v, numbers.Integral) and \
            not math.isfinite(f) else f"{f:.6g}"
        raise ValueError(f"{what}: {name} must be 0 or of a magnitude float32, the core's "
                         f"type, holds (1.4e-45 to {_FLOAT32_MAX:.4g}); got {got}")
    return f


def _dim(v, name: str, what: str) -> int:
    """A product's dimension, for the questions about how the core would run it: an int in
    0..2**63-1."""
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{what}: {name} must be an int, got {type(v).__name__}")
    if not 0 <= v < 2**63:
        raise ValueError(f"{what}: {name} must be in 0..2**63-1, got {v}")
    return int(v)


def _shape(shape, name: str, what: str) -> tuple:
    """An (N, C, H, W) shape of whole numbers >= 0 (an empty batch or map is a valid no-op)."""
    try:
        dims = tuple(shape)
    except TypeError:
        raise TypeError(f"{what}: {name} must be a tuple of 4 ints (N, C, H, W), got "
                        f"{type(shape).__name__}") from None
    if len(dims) != 4:
        raise ValueError(f"{what}: {name} must have 4 dimensions (N, C, H, W), got {len(dims)}")
    return tuple(_size(d, name, what, 0) for d in dims)


def _core_call(what: str, expected: str, fn, *args, **kwargs):
    """fn(*args, **kwargs) of the core. pybind11 answers arguments it cannot convert with a
    TypeError that prints every argument, whole arrays included: say instead, in one line, what
    the function takes."""
    try:
        return fn(*args, **kwargs)
    except TypeError as e:
        if "incompatible function arguments" not in str(e):
            raise
        raise TypeError(f"{what}: arguments of the wrong types; expected {expected}") from None


def _byte_order_problem(got: np.dtype, dtype, name: str) -> "str | None":
    """Where `got` is `dtype` of the other byte order (a big-endian machine's file): what to
    say after the array's name ("expected ..."); else None."""
    want = np.dtype(dtype)
    if got.isnative or got.newbyteorder("=") != want:
        return None
    native = sys.byteorder
    other = "big" if native == "little" else "little"
    return (f"expected native ({native}-endian) {want.name}, got {other}-endian {got.str}: "
            f"convert with {name}.astype(np.{want.name})")


def _array(a, name: str, ndim: int, dtype=np.float32) -> np.ndarray:
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{name}: expected a numpy {np.dtype(dtype).name} array, "
                        f"got {type(a).__name__}")
    if isinstance(a, np.ma.MaskedArray):   # its mask would be dropped: masked values used
        raise TypeError(f"{name}: expected a numpy {np.dtype(dtype).name} array, got a masked "
                        f"array (fill its masked values first: a.filled(value))")
    if a.dtype != dtype:
        raise TypeError(f"{name}: " + (_byte_order_problem(a.dtype, dtype, name) or
                                       f"expected dtype {np.dtype(dtype).name}, got {a.dtype}"))
    if a.ndim != ndim:
        raise ValueError(f"{name}: expected a {ndim}-d array, got shape {a.shape}")
    return np.ascontiguousarray(a)


def _matrix(a, name: str) -> np.ndarray:
    """A float32 matrix for the GEMM: a block of a bigger C-contiguous matrix (rows contiguous,
    further apart) is passed as it is, with its row stride as leading dimension."""
    if type(a) is np.ndarray and a.ndim == 2 and a.dtype == np.float32 and (
            a.strides[1] == 4 and a.strides[0] >= 4 * a.shape[1] and a.strides[0] % 4 == 0):
        return a
    return _array(a, name, 2)


_ADDRESSABLE = 1 << 47    # bytes: a process's address space on x86-64 (48-bit addresses)


def _out(out, shape, name: str, dtype=np.float32, what: str | None = None) -> np.ndarray:
    if out is None:
        size = math.prod(int(d) for d in shape) * np.dtype(dtype).itemsize
        failure = None
        if size < _ADDRESSABLE:   # beyond it, not even asked for: no process has that much
            try:
                return np.empty(shape, dtype)
            except (MemoryError, ValueError) as e:  # NumPy's words name neither call nor size
                failure = e
        if size == 0:     # NumPy refuses dimensions whose product (zeros left out) is too large
            raise ValueError(f"{what or name}: the result's shape {tuple(shape)} is empty, but "
                             f"NumPy refuses it (the product of its other dimensions is too "
                             f"large)") from failure
        raise MemoryError(f"{what or name}: cannot allocate the result, shape {tuple(shape)} "
                          f"({size / 2**30:.3g} GiB)") from failure
    if isinstance(out, np.ndarray) and _byte_order_problem(out.dtype, dtype, name):
        # written in place: no conversion can serve
        raise TypeError(f"{name}: expected a numpy {np.dtype(dtype).name} array of native "
                        f"({sys.byteorder}-endian) byte order, got dtype {out.dtype.str}")
    if not isinstance(out, np.ndarray) or out.dtype != dtype:
        raise TypeError(f"{name}: expected a numpy {np.dtype(dtype).name} array, got " + (
            f"dtype {out.dtype}" if isinstance(out, np.ndarray) else type(out).__name__))
    if isinstance(out, np.ma.MaskedArray):    # its mask would be left over the new values
        raise TypeError(f"{name}: expected a numpy {np.dtype(dtype).name} array, got a masked "
                        f"array")
    if out.shape != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {out.shape}")
    if not out.flags.c_contiguous:
        raise ValueError(f"{name}: the output must be C-contiguous")
    return out


# ------------------------------------------------------------------------------------------------
# GEMM

_GEMM_ARGS = ("float32 matrices a, b, c, bools trans_a and trans_b, numbers alpha and beta, "
              "an int threads")


def gemm(a, b, threads=None) -> np.ndarray:
    """float32 ``C = A @ B`` on the core's packed GEMM; A (M, K), B (K, N) -> C (M, N)."""
    a = _array(a, "a", 2)
    b = _array(b, "b", 2)
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"gemm: a is {a.shape} and b is {b.shape}; "
                         f"a's columns ({a.shape[1]}) must equal b's rows ({b.shape[0]})")
    c = np.empty((a.shape[0], b.shape[1]), np.float32)
    _core_call("gemm", _GEMM_ARGS, _core.sgemm, a, b, c, threads=_threads(threads))
    return c


def sgemm(a, b, c=None, *, trans_a=False, trans_b=False, alpha=1.0, beta=0.0, threads=None):
    """``c = alpha * op(a) @ op(b) + beta * c`` in place (c is allocated when None and beta == 0).

    op(a) is a.T when trans_a (the transpose is handled while packing, not copied). a, b and c
    may be blocks of bigger matrices whose rows are contiguous (``w[:, r0:r1]``).
    """
    a, b = _matrix(a, "a"), _matrix(b, "b")
    trans_a, trans_b = _flag(trans_a, "trans_a", "sgemm"), _flag(trans_b, "trans_b", "sgemm")
    alpha, beta = _scale(alpha, "alpha", "sgemm"), _scale(beta, "beta", "sgemm")
    m = a.shape[1] if trans_a else a.shape[0]
    n = b.shape[0] if trans_b else b.shape[1]
    if c is None:
        if beta != 0:
            raise ValueError("sgemm: beta != 0 needs an existing c")
        c = np.empty((m, n), np.float32)
    elif not (type(c) is np.ndarray and c.ndim == 2 and c.strides[1] == 4
              and c.dtype == np.float32):
        c = _out(c, (m, n), "c")  # raises the right error
    _core_call("sgemm", _GEMM_ARGS, _core.sgemm, a, b, c, trans_a=trans_a, trans_b=trans_b,
               alpha=alpha, beta=beta, threads=_threads(threads))
    return c


# ------------------------------------------------------------------------------------------------
# GEMM with op(B) packed once, for several products that share B (the devices of one process
# multiplying their own rows of weights by one im2col matrix): made of zeros by packed_b, filled in
# parts by pack_b (parts that do not overlap may be packed at once from different threads), used
# by sgemm_packed, which then packs only its A.


def packed_b(k, n, *, trans_b=False):
    """Room for op(b) (k, n) packed for the GEMM's micro-kernel in use now (b is stored (n, k)
    when trans_b), zeros until pack_b fills it. Its ``slivers`` are its panels of columns, the
    unit of pack_b's parts."""
    k, n = _size(k, "k", "packed_b"), _size(n, "n", "packed_b")
    try:
        return _core_call("packed_b", "ints k and n and a bool trans_b", _core.PackedB, k, n,
                          trans_b=_flag(trans_b, "trans_b", "packed_b"))
    except MemoryError:   # the core's words: std::bad_alloc
        raise MemoryError(f"packed_b: cannot allocate op(b) of shape ({k}, {n}) packed "
                          f"(at least {k * n * 4 / 2**30:.3g} GiB)") from None


def _packed(packed, what: str):
    if not isinstance(packed, _core.PackedB):
        raise TypeError(f"{what}: packed must be made by pyhet.ops.packed_b, got "
                        f"{type(packed).__name__}")
    return packed


def _range(r, name: str, what: str):
    """None, or (begin, end) of ints: a range of input channels, rows, slivers or images."""
    if r is None:
        return None
    try:
        r0, r1 = r
    except (TypeError, ValueError):
        raise TypeError(f"{what}: {name} must be None or a pair (begin, end), got "
                        f"{type(r).__name__}") from None
    return _size(r0, name, what), _size(r1, name, what)


def pack_b(b, packed, *, rows=None, slivers=None, threads=None):
    """Pack rows (r0, r1) of op(b), in its slivers (s0, s1), into `packed` (None: all of them);
    b is (k, n), or (n, k) when packed.trans_b, and may be a block of a bigger matrix whose rows
    are contiguous."""
    packed = _packed(packed, "pack_b")
    b = _matrix(b, "b")
    _core_call("pack_b", "a float32 matrix b, a PackedB, pairs of ints and an int threads",
               _core.pack_b, b, packed, rows=_range(rows, "rows", "pack_b"),
               slivers=_range(slivers, "slivers", "pack_b"), threads=_threads(threads))
    return packed


def _product_args(what, trans_a, strassen, alpha, beta):
    """sgemm_packed's and sgemm_packed_t's trans_a, strassen (None or a bool), alpha, beta."""
    return (_flag(trans_a, "trans_a", what),
            None if strassen is None else _flag(strassen, "strassen", what),
            _scale(alpha, "alpha", what), _scale(beta, "beta", what))


def sgemm_packed(a, packed, c=None, *, trans_a=False, alpha=1.0, beta=0.0, strassen=None,
                 threads=None):
    """``c = alpha * op(a) @ op(b) + beta * c`` as sgemm, op(b) (k, n) packed whole by pack_b,
    or as its quadrants' sums (a PackedQuadrants), for the micro-kernel still in use (c is
    allocated when None and beta == 0). With quadrants, strassen: True (Strassen's scheme),
    False (four products of quadrant size, as much arithmetic as the blocked one) or None
    (the scheme where it pays, uses_packed_strassen)."""
    quads = isinstance(packed, PackedQuadrants)
    if not quads:
        packed = _packed(packed, "sgemm_packed")
    a = _matrix(a, "a")
    trans_a, strassen, alpha, beta = _product_args("sgemm_packed", trans_a, strassen, alpha,
                                                   beta)
    if c is None:
        if beta != 0:
            raise ValueError("sgemm_packed: beta != 0 needs an existing c")
        c = np.empty((a.shape[1] if trans_a else a.shape[0], packed.n), np.float32)
    elif not (type(c) is np.ndarray and c.ndim == 2 and c.strides[1] == 4
              and c.dtype == np.float32):
        c = _out(c, (a.shape[1] if trans_a else a.shape[0], packed.n), "c")  # the right error
    if quads:
        _core_call("sgemm_packed", "float32 matrices a and c, a PackedQuadrants, a bool "
                   "trans_a, numbers alpha and beta, None or a bool strassen, an int threads",
                   _core.sgemm_packed_quadrants, a, packed.packs, c, trans_a=trans_a,
                   alpha=alpha, beta=beta, strassen=-1 if strassen is None else int(strassen),
                   threads=_threads(threads))
        return c
    _core_call("sgemm_packed", "float32 matrices a and c, a PackedB, a bool trans_a, numbers "
               "alpha and beta, an int threads", _core.sgemm_packed, a, packed, c,
               trans_a=trans_a, alpha=alpha, beta=beta, threads=_threads(threads))
    return c


def sgemm_packed_t(a, packed, c=None, *, rows=None, trans_a=False, alpha=1.0, beta=0.0,
                   strassen=None, threads=None):
    """``c = alpha * op(a) @ s.T + beta * c``, s the rows (r0, r1) of the op(b) (k, n) that
    `packed` holds (pack_b'd for another product; None: all its k rows), read transposed as
    this product packs its blocks: dy @ col^T from col packed for w @ col, without packing
    col^T. op(a) is (m, n); c (m, r1 - r0) is allocated when None and beta == 0.

    packed may be a PackedQuadrants (s as its quadrants' sums): Strassen's scheme then needs
    no sums of s^T (the seven of s serve), and strassen is as in sgemm_packed. c is the whole
    product's (m, k) and rows (r0, r1) are rows of each half of s (within k/2): only c's
    columns [r0, r1) and [k/2 + r0, k/2 + r1) are made, the others left as they are, so that
    several callers may make disjoint columns of one c at once."""
    quads = isinstance(packed, PackedQuadrants)
    if not quads:
        packed = _packed(packed, "sgemm_packed_t")
    a = _matrix(a, "a")
    trans_a, strassen, alpha, beta = _product_args("sgemm_packed_t", trans_a, strassen, alpha,
                                                   beta)
    m = a.shape[1] if trans_a else a.shape[0]
    if quads:
        half = packed.k // 2
        r0, r1 = (0, half) if rows is None else _range(rows, "rows", "sgemm_packed_t")
        if not 0 <= r0 <= r1 <= half:
            raise ValueError(f"sgemm_packed_t: rows: expected a range (begin, end) with 0 <= "
                             f"begin <= end <= {half} (the rows of a half), got ({r0}, {r1})")
        width = packed.k
    else:
        r0, r1 = (0, packed.k) if rows is None else _range(rows, "rows", "sgemm_packed_t")
        width = max(r1 - r0, 0)
    if c is None:
        if beta != 0:
            raise ValueError("sgemm_packed_t: beta != 0 needs an existing c")
        if quads and (r0, r1) != (0, packed.k // 2):
            raise ValueError(f"sgemm_packed_t: rows={rows!r} of a PackedQuadrants make only "
                             f"those columns of c, so they need an existing c")
        c = np.empty((m, width), np.float32)
    elif not (type(c) is np.ndarray and c.ndim == 2 and c.strides[1] == 4
              and c.dtype == np.float32):
        c = _out(c, (m, width), "c")  # the right error
    if quads:
        _core_call("sgemm_packed_t", "float32 matrices a and c, a PackedQuadrants, a pair of "
                   "ints rows, a bool trans_a, numbers alpha and beta, None or a bool strassen, "
                   "an int threads", _core.sgemm_packed_quadrants_t, a, packed.packs, c,
                   rows=(r0, r1), trans_a=trans_a, alpha=alpha, beta=beta,
                   strassen=-1 if strassen is None else int(strassen),
                   threads=_threads(threads))
        return c
    _core_call("sgemm_packed_t", "float32 matrices a and c, a PackedB, a pair of ints rows, a "
               "bool trans_a, numbers alpha and beta, an int threads", _core.sgemm_packed_t, a,
               packed, c, rows=(r0, r1), trans_a=trans_a, alpha=alpha, beta=beta,
               threads=_threads(threads))
    return c


# op(B) as the seven packed sums of its quadrants that Strassen's scheme multiplies (op(B) cut
# in 2 x 2 quadrants B11 B12 / B21 B22): products that share op(B) then share those sums, packed
# once, and each runs the scheme with only its own A to pack. Pack i is quadrant q plus s times
# quadrant q2, as _QUADRANT_SUMS gives them ((row, column) of each quadrant, from 0).
_QUADRANT_SUMS = (((0, 0), 1, (1, 1)), ((0, 0), 0, None), ((0, 1), -1, (1, 1)),
                  ((1, 0), -1, (0, 0)), ((1, 1), 0, None), ((0, 0), 1, (0, 1)),
                  ((1, 0), 1, (1, 1)))


class PackedQuadrants:
    """op(b) (k, n), k and n even, as the seven packed sums of its quadrants B11 + B22, B11,
    B12 - B22, B21 - B11, B22, B11 + B12, B21 + B22 (``packs``, each a PackedB of (k/2, n/2)),
    for sgemm_packed. Made by packed_quadrants, filled by pack_quadrants or
    im2col_pack_quadrants."""

    __slots__ = ("packs", "k", "n", "trans_b")

    def __init__(self, packs, k: int, n: int, trans_b: bool):
        self.packs, self.k, self.n, self.trans_b = tuple(packs), k, n, trans_b

    @property
    def kernel(self) -> str:
        return self.packs[0].kernel

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.packs)

    def __repr__(self):
        return f"PackedQuadrants(k={self.k}, n={self.n}, trans_b={self.trans_b})"


def packed_quadrants(k, n, *, trans_b=False) -> PackedQuadrants:
    """Room for op(b) (k, n) as its quadrants' seven sums (PackedQuadrants); k and n even."""
    k, n = _size(k, "k", "packed_quadrants"), _size(n, "n", "packed_quadrants")
    if k % 2 or n % 2:
        raise ValueError(f"packed_quadrants: expected an even k and n, got {k} and {n}")
    trans_b = _flag(trans_b, "trans_b", "packed_quadrants")
    return PackedQuadrants([packed_b(k // 2, n // 2, trans_b=trans_b) for _ in range(7)],
                           k, n, trans_b)


def _quadrants(packed, what: str) -> PackedQuadrants:
    if not isinstance(packed, PackedQuadrants):
        raise TypeError(f"{what}: expected a PackedQuadrants (pyhet.ops.packed_quadrants), got "
                        f"{type(packed).__name__}")
    return packed


def pack_quadrants(b, packed, *, threads=None) -> PackedQuadrants:
    """Pack op(b) (b is (k, n), or (n, k) when packed.trans_b) as its quadrants' seven sums."""
    packed = _quadrants(packed, "pack_quadrants")
    b = _matrix(b, "b")
    shape = (packed.n, packed.k) if packed.trans_b else (packed.k, packed.n)
    if b.shape != shape:
        raise ValueError(f"pack_quadrants: expected b of shape {shape}, got {b.shape}")
    op = b.T if packed.trans_b else b
    k2, n2 = packed.k // 2, packed.n // 2

    def quadrant(q):
        return op[q[0] * k2:(q[0] + 1) * k2, q[1] * n2:(q[1] + 1) * n2]

    for p, (q, sign, q2) in zip(packed.packs, _QUADRANT_SUMS):
        part = quadrant(q) + sign * quadrant(q2) if q2 is not None else quadrant(q)
        pack_b(np.ascontiguousarray(part.T if packed.trans_b else part), p, threads=threads)
    return packed


def uses_packed_strassen(m: int, k: int, n: int, threads: int = 1) -> bool:
    """Whether sgemm_packed runs m rows of a against op(b) (k, n) in quadrants by Strassen's
    scheme (strassen=None): from fewer rows than sgemm needs, since op(b)'s sums are made
    once for every product that shares them."""
    what = "uses_packed_strassen"   # (a product no memory holds is refused by the core)
    return _core.gemm_packed_uses_strassen(_dim(m, "m", what), _dim(k, "k", what) // 2,
                                           _dim(n, "n", what) // 2, _threads(threads))


# ------------------------------------------------------------------------------------------------
# im2col / col2im


def _col_shape(x_shape, kh, kw, stride, pad):
    n, c, h, w = x_shape
    oh, ow = conv_out_size(h, kh, stride, pad), conv_out_size(w, kw, stride, pad)
    return (c * kh * kw, n * oh * ow)


def _conv_input(what: str, x, kh, kw, stride, pad) -> tuple:
    """(x, kh, kw, stride, pad) checked: x (N, C, H, W) float32 that the kernel fits."""
    x = _array(x, "x", 4)
    kh, kw = _size(kh, "kh", what, 1), _size(kw, "kw", what, 1)
    stride, pad = _size(stride, "stride", what, 1), _size(pad, "pad", what)
    if x.shape[2] + 2 * pad < kh or x.shape[3] + 2 * pad < kw:
        raise ValueError(f"{what}: a {kh}x{kw} kernel does not fit a {x.shape[2]}x{x.shape[3]} "
                         f"input with padding {pad}")
    return x, kh, kw, stride, pad


def im2col(x, kh, kw, stride=1, pad=0, *, out=None, channels=None, threads=None):
    """x (N, C, H, W) -> col (C*KH*KW, N*OH*OW): row (c, i, j), column (n, oh, ow).

    channels=(c0, c1) fills only the rows of those input channels (of `out`)."""
    x, kh, kw, stride, pad = _conv_input("im2col", x, kh, kw, stride, pad)
    col = _out(out, _col_shape(x.shape, kh, kw, stride, pad), "out", what="im2col")
    _core_call("im2col", "float32 arrays and ints", _core.im2col, x, kh, kw, stride, pad, col,
               threads=_threads(threads), channels=_range(channels, "channels", "im2col"))
    return col


def im2col_pack(x, kh, kw, stride=1, pad=0, *, fwd=None, t=None, images=None, threads=None):
    """im2col(x) straight into packed operands, without the im2col matrix: into `fwd`, col
    packed for w @ col (packed_b(C*KH*KW, N*OH*OW)), and into `t`, col^T packed for
    dy @ col^T (packed_b(N*OH*OW, C*KH*KW, trans_b=True)); either may be None. They hold what
    pack_b(im2col(x), ...) would put there. images=(n0, n1) fills only those images' columns
    (several callers may fill disjoint ranges at once); None: all of them."""
    x, kh, kw, stride, pad = _conv_input("im2col_pack", x, kh, kw, stride, pad)
    _core_call("im2col_pack", "a float32 array x, ints, PackedBs or None, a pair of ints and "
               "an int threads", _core.im2col_pack, x, kh, kw, stride, pad, fwd=fwd, t=t,
               images=_range(images, "images", "im2col_pack"), threads=_threads(threads))


def quadrant_units(batch: int, *, fwd: bool = True, t: bool = True) -> int:
    """The (image, sum) units of im2col_pack_quadrants for a batch (even) into fwd and/or t:
    each image of a half of the batch makes 11 distinct sums of the input's blocks for both,
    7 for one."""
    what = "quadrant_units"
    batch = int_arg(batch, "batch", what)
    if batch % 2:     # as im2col_pack_quadrants, which splits the batch in halves
        raise ValueError(f"{what}: expected an even batch, got {batch}")
    fwd, t = _flag(fwd, "fwd", what), _flag(t, "t", what)
    return batch // 2 * (11 if fwd and t else 7 if fwd or t else 0)


def im2col_pack_quadrants(x, kh, kw, stride=1, pad=0, *, fwd=None, t=None, images=None,
                          units=None, threads=None):
    """im2col(x) straight into its quadrants' packed sums (PackedQuadrants): into `fwd`, col
    for w @ col (packed_quadrants(C*KH*KW, N*OH*OW)), into `t`, col^T for dy @ col^T
    (packed_quadrants(N*OH*OW, C*KH*KW, trans_b=True)); x (N, C, H, W) with N and C even.
    col's rows are (channel, i, j) and its columns (image, oh, ow), so its quadrant (r, c) is
    the im2col of x[images half c, channels half r] (col^T's, of x[images half r, channels half
    c]), and a sum of quadrants the sum of those blocks' im2col: the four blocks' rows are made
    once, and each of the eleven distinct sums from them. images=(n0, n1) fills only those
    images of each half of the batch (a range within N/2; several callers may fill disjoint
    ranges at once); or units=(u0, u1), a range of the quadrant_units (image by image, the
    sums of each), for splits finer than an image; None: all."""
    x, kh, kw, stride, pad = _conv_input("im2col_pack_quadrants", x, kh, kw, stride, pad)
    k, cols = _col_shape(x.shape, kh, kw, stride, pad)
    for name, p, shape in (("fwd", fwd, (k, cols)), ("t", t, (cols, k))):
        if p is not None and ((_quadrants(p, "im2col_pack_quadrants").k, p.n) != shape
                              or p.trans_b != (name == "t")):
            raise ValueError(f"im2col_pack_quadrants: expected {name} of op(b) {shape}"
                             f"{' (trans_b)' if name == 't' else ''}, got ({p.k}, {p.n})"
                             f"{' (trans_b)' if p.trans_b else ''}")
    # the core checks the rest: an even batch and channel count, the ranges, not both
    _core_call("im2col_pack_quadrants", "a float32 array x, ints, PackedQuadrants or None, "
               "pairs of ints and an int threads", _core.im2col_pack_quadrants, x, kh, kw,
               stride, pad, fwd=None if fwd is None else fwd.packs,
               t=None if t is None else t.packs,
               images=_range(images, "images", "im2col_pack_quadrants"),
               units=_range(units, "units", "im2col_pack_quadrants"), threads=_threads(threads))


def col2im(col, x_shape, kh, kw, stride=1, pad=0, *, out=None, channels=None, threads=None):
    """The mirror of im2col: sums col's entries back into an (N, C, H, W) array.

    channels=(c0, c1) computes only those channels (of `out`), from their rows of col."""
    col = _array(col, "col", 2)
    kh, kw = _size(kh, "kh", "col2im", 1), _size(kw, "kw", "col2im", 1)
    stride, pad = _size(stride, "stride", "col2im", 1), _size(pad, "pad", "col2im")
    x = _out(out, _shape(x_shape, "x_shape", "col2im"), "out", what="col2im")
    _core_call("col2im", "float32 arrays and ints", _core.col2im, col, kh, kw, stride, pad, x,
               threads=_threads(threads), channels=_range(channels, "channels", "col2im"))
    return x


def col2im_product(ws, dys, x_shape, kh, kw, stride=1, pad=0, *, out=None, channels=None,
                   threads=None):
    """col2im(sum_j ws[j]^T @ dys[j]) without the matrix dcol in between: the input gradient of
    a conv layer straight from its weights ws[j] (k_j, C*KH*KW) and output gradients dys[j]
    (k_j, N*OH*OW) (one pair a shard, or one of them all). dcol is made a block at a time (a
    few images and channels, half the core's L2), each added into `out` while it is in cache.
    Faster where the kernels are few (a few hundred: the product's output is then most of its
    memory traffic); on many, its blocks pack the operands again and again, and sgemm then
    col2im is faster. channels=(c0, c1) makes only those channels (of `out`)."""
    if isinstance(ws, np.ndarray) or isinstance(dys, np.ndarray) or not isinstance(
            ws, (list, tuple)) or not isinstance(dys, (list, tuple)):
        raise TypeError(f"col2im_product: ws and dys: expected lists of float32 matrices, got "
                        f"{type(ws).__name__} and {type(dys).__name__}")
    if len(ws) != len(dys):
        raise ValueError(f"col2im_product: expected one dy a w, got {len(ws)} ws and "
                         f"{len(dys)} dys")
    ws = [_matrix(w, f"ws[{j}]") for j, w in enumerate(ws)]
    dys = [_matrix(d, f"dys[{j}]") for j, d in enumerate(dys)]
    kh, kw = _size(kh, "kh", "col2im_product", 1), _size(kw, "kw", "col2im_product", 1)
    stride = _size(stride, "stride", "col2im_product", 1)
    pad = _size(pad, "pad", "col2im_product")
    x = _out(out, _shape(x_shape, "x_shape", "col2im_product"), "out", what="col2im_product")
    _core_call("col2im_product", "lists of float32 matrices, a float32 array and ints",
               _core.col2im_product, ws, dys, kh, kw, stride, pad, x, threads=_threads(threads),
               channels=_range(channels, "channels", "col2im_product"))
    return x


# ------------------------------------------------------------------------------------------------
# Pooling


def _pool_window(what: str, k, stride):
    """(k, stride) of a k x k pooling window, stride None meaning k; both ints >= 1."""
    stride = k if stride is None else stride
    return _size(k, "pool size", what, 1), _size(stride, "pool stride", what, 1)


def _pool_shape(what: str, h: int, w: int, k: int, stride: int):
    """(PH, PW) of a k x k window moved by stride over an h x w plane, floor mode."""
    if h < k or w < k:
        raise ValueError(f"{what}: window {k} is larger than the {h}x{w} input")
    return pool_out_size(h, k, stride), pool_out_size(w, k, stride)


def maxpool(x, k=2, stride=None, *, threads=None):
    """x (N, C, H, W) -> (out, arg), floor mode; arg is the flat index of each max in its plane."""
    x = _array(x, "x", 4)
    n, c, h, w = x.shape
    k, stride = _pool_window("maxpool", k, stride)
    ph, pw = _pool_shape("maxpool", h, w, k, stride)
    out, arg = np.empty((n, c, ph, pw), np.float32), np.empty((n, c, ph, pw), np.int32)
    _core_call("maxpool", "float32 x and ints", _core.maxpool, x, k, stride, out, arg,
               threads=_threads(threads))
    return out, arg


def maxpool_backward(dout, arg, x_shape, *, threads=None) -> np.ndarray:
    dout = _array(dout, "dout", 4)
    arg = _array(arg, "arg", 4, np.int32)
    x_shape = _shape(x_shape, "x_shape", "maxpool_backward")
    if x_shape[:2] != dout.shape[:2]:      # the core's check, before the result is made
        raise ValueError(f"dx: expected {dout.shape[0]} x {dout.shape[1]} planes, got shape "
                         f"{x_shape}")
    # No window is known here, so only what every max-pool keeps: a pooled plane is no larger
    # than its input, and not empty unless that is (the core checks that arg's indices land in
    # dx's planes).
    (ph, pw), (h, w) = dout.shape[2:], x_shape[2:]
    if not (0 < ph <= h or ph == h == 0) or not (0 < pw <= w or pw == w == 0):
        def span(n):
            return "0" if n == 0 else "1" if n == 1 else f"1..{n}"
        raise ValueError(f"maxpool_backward: dout: expected planes of {span(h)} x {span(w)} "
                         f"(a max-pool of x_shape {x_shape}'s {h}x{w} planes), got shape "
                         f"{dout.shape}")
    dx = _out(None, x_shape, "dx", what="maxpool_backward")
    _core_call("maxpool_backward", "float32 dout, int32 arg and an int threads",
               _core.maxpool_backward, dout, arg, dx, threads=_threads(threads))
    return dx


def bias_relu_maxpool(y, bias, pool=2, stride=None, *, threads=None):
    """y (K, N, H, W), bias (K,) -> (out (N, K, PH, PW), arg): maxpool(relu(y + bias)).

    The window is pool x pool, moved by `stride` (default: pool), floor mode. pool = stride = 1
    is a conv block without pooling: out = relu(y + bias) in NCHW, arg the element's own index.
    arg is -1 where ReLU zeroed the output."""
    y = _array(y, "y", 4)
    bias = _array(bias, "bias", 1)
    k, n, h, w = y.shape
    pool, stride = _pool_window("bias_relu_maxpool", pool, stride)
    ph, pw = _pool_shape("bias_relu_maxpool", h, w, pool, stride)
    out, arg = np.empty((n, k, ph, pw), np.float32), np.empty((n, k, ph, pw), np.int32)
    _core_call("bias_relu_maxpool", "float32 y and bias, and ints", _core.bias_relu_maxpool,
               y, bias, pool, stride, out, arg, threads=_threads(threads))
    return out, arg


def bias_relu_maxpool_backward(dout, arg, y_shape, pool=2, stride=None, *, out=None,
                               threads=None):
    """dout, arg (N, K, PH, PW) -> dy (K, N, H, W), the gradient of the conv output; pool and
    stride as given to bias_relu_maxpool, arg as it gives it: each entry -1 or an index of the
    plane inside its own window (another is a ValueError)."""
    dout = _array(dout, "dout", 4)
    arg = _array(arg, "arg", 4, np.int32)
    dy = _out(out, _shape(y_shape, "y_shape", "bias_relu_maxpool_backward"), "out",
              what="bias_relu_maxpool_backward")
    pool, stride = _pool_window("bias_relu_maxpool_backward", pool, stride)
    _core_call("bias_relu_maxpool_backward", "float32 dout, int32 arg and ints",
               _core.bias_relu_maxpool_backward, dout, arg, pool, stride, dy,
               threads=_threads(threads))
    return dy
