"""The packed SGEMM (csrc/gemm.cpp) against a float64 NumPy product and against sgemm_ref.

C (M, N) = alpha * op(A) (M, K) @ op(B) (K, N) + beta * C, float32, row-major.

Tolerance: every element must be within gamma_n * (|alpha| * (|op(A)| @ |op(B)|) + |beta| * |C0|)
of the float64 result, gamma_n = n*u / (1 - n*u), u = 2**-24 (Higham's bound for a dot product
summed in any order with n roundings). Here n = K + K // 32 + 4: one rounding per product-sum,
plus the alpha scale and the add into C once per K block (blocks hold >= 64 values of K), plus
beta. A correct kernel cannot miss it; a dropped, doubled or misplaced term misses it by orders
of magnitude.
"""

import contextlib
import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pyhet import _core, ops

U = 2.0 ** -24
TRANS = [(False, False), (False, True), (True, False), (True, True)]


def _kernel_available(name) -> bool:
    try:
        _core.set_gemm_kernel(name)
    except ValueError:
        return False
    finally:
        _core.set_gemm_kernel("auto")
    return True


HAVE_AVX2 = _kernel_available("avx2-fma")
HAVE_AVX512 = _kernel_available("avx512")
# Every micro-kernel this CPU and build run; the others are skipped, saying why.
RUNNABLE = ["portable"] + ["avx2-fma"] * HAVE_AVX2 + ["avx512"] * HAVE_AVX512
KERNELS = ["portable",
           pytest.param("avx2-fma", marks=pytest.mark.skipif(
               not HAVE_AVX2, reason="this CPU or build has no AVX2/FMA kernel")),
           pytest.param("avx512", marks=pytest.mark.skipif(
               not HAVE_AVX512, reason="this CPU or build has no AVX-512F/VL kernel"))]


@contextlib.contextmanager
def micro_kernel(name):
    _core.set_gemm_kernel(name)
    try:
        assert ops.gemm_kernel() == name
        yield
    finally:
        _core.set_gemm_kernel("auto")


@contextlib.contextmanager
def split_every_product():
    """Split every product among as many threads as asked, however small (the core splits only
    products worth it), so that small shapes reach every thread layout and edge."""
    old = _core.set_gemm_min_flops_per_thread(0)
    try:
        yield
    finally:
        _core.set_gemm_min_flops_per_thread(old)


@pytest.fixture(params=KERNELS)
def kernel(request):
    with micro_kernel(request.param):
        yield request.param


# ------------------------------------------------------------------------------------------------
# Helpers


def operands(rng, m, n, k, trans_a, trans_b):
    """Stored a, b (transposed layouts when asked) and a C0, all float32 in [-1, 1)."""
    a = rng.uniform(-1, 1, (k, m) if trans_a else (m, k)).astype(np.float32)
    b = rng.uniform(-1, 1, (n, k) if trans_b else (k, n)).astype(np.float32)
    c0 = rng.uniform(-1, 1, (m, n)).astype(np.float32)
    return a, b, c0


def expect_close(c, a, b, c0, trans_a=False, trans_b=False, alpha=1.0, beta=0.0,
                 normwise=False):
    """Assert c meets the stated bound against the float64 product (see the module doc); with
    normwise, Strassen's: 8 times it, taken at the largest scale of the matrix (see below)."""
    A = (a.T if trans_a else a).astype(np.float64)
    B = (b.T if trans_b else b).astype(np.float64)
    alpha, beta = float(np.float32(alpha)), float(np.float32(beta))
    exact = alpha * (A @ B)
    scale = abs(alpha) * (np.abs(A) @ np.abs(B))
    if beta != 0:
        exact += beta * c0.astype(np.float64)
        scale += abs(beta) * np.abs(c0.astype(np.float64))
    k = A.shape[1]
    n = k + k // 32 + 4
    if normwise:
        scale = 8 * (scale.max() if scale.size else 0.0)
    tol = np.broadcast_to(n * U / (1 - n * U) * scale + 1e-30, exact.shape)
    assert c.dtype == np.float32 and c.shape == exact.shape
    assert np.all(np.isfinite(c))
    err = np.abs(c.astype(np.float64) - exact)
    worst = np.unravel_index(np.argmax(err - tol), err.shape) if err.size else None
    assert np.all(err <= tol), (f"at {worst}: error {err[worst]:.3g} > tolerance {tol[worst]:.3g}")


def run_sgemm(a, b, c0, trans_a, trans_b, alpha, beta, threads, nan_c=False):
    c = np.full(c0.shape, np.nan, np.float32) if nan_c else c0.copy()
    _core.sgemm(a, b, c, trans_a=trans_a, trans_b=trans_b, alpha=alpha, beta=beta,
                threads=threads)
    return c


def as_block(x, rng):
    """x as a block of a bigger C-contiguous matrix, a few columns in from its left edge (rows
    contiguous, row stride > width), as `w[:, r0:r1]` passes it; returns (block, bigger matrix).
    The columns around it are NaN, and the GEMM must leave them so."""
    left, right = rng.integers(1, 9, 2)
    big = np.full((x.shape[0], left + x.shape[1] + right), np.nan, np.float32)
    block = big[:, left:left + x.shape[1]]
    block[...] = x
    return block, big


def run_ref(a, b, c0, trans_a, trans_b, alpha, beta):
    c = c0.copy()
    _core.sgemm_ref(a, b, c, trans_a=trans_a, trans_b=trans_b, alpha=alpha, beta=beta)
    return c


# ------------------------------------------------------------------------------------------------
# Odd sizes, every transpose, both micro-kernels, one and two threads

# (M, N, K): 1 and primes; not multiples of the tiles (MR x NR = 6 x 16, 12 x 32) or KC = 512;
# exact tiles of each; one more or one less than a 12 x 32 tile; several K blocks; several
# MC = 120 blocks; N > NC = 2048; M, N or K far below a tile. Products of more than 32 MFLOP
# (two threads' worth) are really split: by rows sharing one packed B (255 x 300 x 513), by rows
# each packing its own small B (1500 x 10 x 1200), by columns (7 x 4133 x 600, also across NC
# blocks).
SHAPES = [
    (1, 1, 1), (3, 7, 17), (17, 3, 7), (7, 17, 3), (6, 16, 64), (12, 32, 512), (5, 15, 257),
    (11, 31, 9), (13, 33, 65), (24, 64, 3), (25, 63, 130), (121, 95, 40),
    (255, 17, 1), (1, 255, 300), (17, 255, 7), (97, 101, 103), (255, 300, 257), (300, 255, 513),
    (37, 41, 1537), (3, 4133, 5), (16, 10, 3001), (10, 3001, 16), (7, 4133, 600),
    (1500, 10, 1200),
]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("trans_a,trans_b", TRANS)
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_sizes(kernel, m, n, k, trans_a, trans_b, threads):
    rng = np.random.default_rng(m * 1_000_003 + n * 1009 + k)
    a, b, c0 = operands(rng, m, n, k, trans_a, trans_b)
    c = run_sgemm(a, b, c0, trans_a, trans_b, 1.0, 0.0, threads, nan_c=True)
    expect_close(c, a, b, c0, trans_a, trans_b)
    if m * n * k <= 2_000_000:  # the triple loop is slow; it is checked on the smaller shapes
        expect_close(run_ref(a, b, c0, trans_a, trans_b, 1.0, 0.0), a, b, c0, trans_a, trans_b)


@pytest.mark.parametrize("alpha,beta", [(1.0, 0.0), (-1.5, 0.5)])
def test_every_row_count_of_an_edge_tile(kernel, alpha, beta):
    # tiles cut off by the last row of C, 1 to MR - 1 rows (the AVX-512 kernel computes only
    # those rows, in 4 or 8 of them), and by its last column, plain and from a packed B
    rng = np.random.default_rng(11)
    for m in range(1, 26):
        a, b, c0 = operands(rng, m, 45, 37, False, False)
        c = run_sgemm(a, b, c0, False, False, alpha, beta, 1)
        expect_close(c, a, b, c0, False, False, alpha, beta)
        packed = packed_parts(b, 37, 45, False, "grid", 1)
        c = c0.copy()
        ops.sgemm_packed(a, packed, c, alpha=alpha, beta=beta, threads=1)
        expect_close(c, a, b, c0, False, False, alpha, beta)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("alpha,beta", [(1.0, 1.0), (-1.5, 0.0), (0.5, -0.75), (2.0, 1.0),
                                        (1.0, 0.0), (0.0, 0.5), (0.0, 0.0)])
@pytest.mark.parametrize("trans_a,trans_b", TRANS)
def test_alpha_beta(kernel, trans_a, trans_b, alpha, beta, threads):
    # Several K blocks and edge tiles on both sides, so beta is applied once and alpha per block;
    # big enough to be split between two threads.
    rng = np.random.default_rng(7)
    m, n, k = 131, 197, 700
    a, b, c0 = operands(rng, m, n, k, trans_a, trans_b)
    c = run_sgemm(a, b, c0, trans_a, trans_b, alpha, beta, threads)
    expect_close(c, a, b, c0, trans_a, trans_b, alpha, beta)
    expect_close(run_ref(a, b, c0, trans_a, trans_b, alpha, beta), a, b, c0, trans_a, trans_b,
                 alpha, beta)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("alpha", [1.0, -2.0])
def test_beta_zero_ignores_nan_in_c(kernel, alpha, threads):
    rng = np.random.default_rng(3)
    a, b, c0 = operands(rng, 301, 203, 700, False, True)
    c = run_sgemm(a, b, c0, False, True, alpha, 0.0, threads, nan_c=True)
    expect_close(c, a, b, c0, False, True, alpha, 0.0)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("beta", [0.0, 1.0, -3.0])
def test_k_zero_scales_c(beta, threads):
    c0 = np.arange(12, dtype=np.float32).reshape(3, 4) - 5
    c = c0.copy() if beta else np.full((3, 4), np.nan, np.float32)
    _core.sgemm(np.zeros((3, 0), np.float32), np.zeros((0, 4), np.float32), c, beta=beta,
                threads=threads)
    np.testing.assert_array_equal(c, beta * c0 if beta else np.zeros((3, 4), np.float32))


@pytest.mark.parametrize("m,n", [(0, 5), (5, 0), (0, 0)])
@pytest.mark.parametrize("trans_a,trans_b", TRANS)
def test_empty_output(m, n, trans_a, trans_b):
    a, b, c0 = operands(np.random.default_rng(0), m, n, 9, trans_a, trans_b)
    c = c0.copy()
    _core.sgemm(a, b, c, trans_a=trans_a, trans_b=trans_b, beta=2.0, threads=2)
    assert c.shape == (m, n)


@settings(max_examples=settings.default.max_examples * 3 // 2)
@given(m=st.integers(1, 150), n=st.integers(1, 150), k=st.integers(0, 700),
       trans=st.sampled_from(TRANS), alpha=st.sampled_from([1.0, -1.0, 0.375]),
       beta=st.sampled_from([0.0, 1.0, -0.5]), threads=st.sampled_from([1, 2, 3, 7]),
       split=st.booleans(), blocks=st.booleans(),
       kernel_name=st.sampled_from(RUNNABLE),
       seed=st.integers(0, 2**32 - 1))
def test_hypothesis_shapes(m, n, k, trans, alpha, beta, threads, split, blocks, kernel_name,
                           seed):
    """Odd shapes on 1, 2, 3 or 7 threads (split: however small the product), on contiguous
    operands or on blocks of bigger matrices (blocks: a, b and c), whose neighbours stay
    untouched."""
    trans_a, trans_b = trans
    rng = np.random.default_rng(seed)
    a, b, c0 = operands(rng, m, n, k, trans_a, trans_b)
    c = np.full(c0.shape, np.nan, np.float32) if beta == 0 else c0.copy()
    if blocks:
        a, b = as_block(a, rng)[0], as_block(b, rng)[0]
        c, big_c = as_block(c, rng)
    with micro_kernel(kernel_name), (split_every_product() if split else
                                     contextlib.nullcontext()):
        _core.sgemm(a, b, c, trans_a=trans_a, trans_b=trans_b, alpha=alpha, beta=beta,
                    threads=threads)
    expect_close(c, a, b, c0, trans_a, trans_b, alpha, beta)
    if blocks:
        left = (c.ctypes.data - big_c.ctypes.data) // 4
        assert np.isnan(big_c[:, :left]).all() and np.isnan(big_c[:, left + n:]).all(), \
            "the GEMM wrote outside its block of C"
    if m * n * k <= 2_000_000:
        expect_close(run_ref(a, b, c0, trans_a, trans_b, alpha, beta), a, b, c0, trans_a,
                     trans_b, alpha, beta)


# ------------------------------------------------------------------------------------------------
# One level of Strassen's scheme (products whose every dimension is >= 768 by default; forced
# here on small ones). Its error bound is normwise, not per element: each entry of C is a signed
# sum of seven quadrant products whose operands are themselves sums (Higham, "Accuracy and
# Stability of Numerical Algorithms", 2002, 23.2.2). So the tolerance is the blocked product's,
# taken at the largest |alpha| |op(A)| @ |op(B)| + |beta| |C0| of the matrix, times 8 (a few
# more roundings at each of the sums and of the combination). A wrong sign, quadrant or fringe
# misses it by orders of magnitude on the small shapes, and several times on the big ones.


@contextlib.contextmanager
def strassen_from(dim):
    old = _core.set_gemm_strassen_min_dim(dim)
    try:
        yield
    finally:
        _core.set_gemm_strassen_min_dim(old)


# Every dimension odd or even (a fringe row, column or rank-1 update, or none), quadrants below
# and above a tile, several K blocks (K / 2 > KC: 37 x 41 x 1537), N / 2 > NC, and products
# split between two threads by rows (1201 x 301 x 301: the quadrant sums of B packed together
# into one shared block by every kernel's tile) and by columns.
STRASSEN_SHAPES = [
    (2, 2, 2), (3, 3, 3), (2, 3, 5), (5, 3, 2), (7, 17, 3), (12, 32, 64), (13, 33, 65),
    (25, 63, 130), (97, 101, 103), (255, 300, 257), (300, 255, 1025), (37, 41, 1537),
    (9, 4133, 20), (1501, 22, 1200), (1201, 301, 301),
]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("trans_a,trans_b", TRANS)
@pytest.mark.parametrize("m,n,k", STRASSEN_SHAPES)
def test_strassen_sizes(kernel, m, n, k, trans_a, trans_b, threads):
    rng = np.random.default_rng(m * 1_000_003 + n * 1009 + k)
    a, b, c0 = operands(rng, m, n, k, trans_a, trans_b)
    with strassen_from(2), split_every_product():
        c = run_sgemm(a, b, c0, trans_a, trans_b, 1.0, 0.0, threads, nan_c=True)
    expect_close(c, a, b, c0, trans_a, trans_b, normwise=True)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("alpha,beta", [(1.0, 1.0), (-1.5, 0.0), (0.5, -0.75), (2.0, 1.0),
                                        (0.0, 0.5)])
@pytest.mark.parametrize("trans_a,trans_b", TRANS)
def test_strassen_alpha_beta(kernel, trans_a, trans_b, alpha, beta, threads):
    """beta reaches each quadrant of C once (the first product that writes it), and each fringe
    once; alpha every product."""
    rng = np.random.default_rng(11)
    # several K blocks; and a small odd K, where the tolerance is tight enough that beta applied
    # twice or never to any quadrant or fringe misses it by far
    for m, n, k in [(131, 197, 1101), (131, 197, 9)]:
        a, b, c0 = operands(rng, m, n, k, trans_a, trans_b)
        with strassen_from(2), split_every_product():
            c = run_sgemm(a, b, c0, trans_a, trans_b, alpha, beta, threads, nan_c=beta == 0)
        expect_close(c, a, b, c0, trans_a, trans_b, alpha, beta, normwise=True)


@given(m=st.integers(2, 120), n=st.integers(2, 120), k=st.integers(2, 600),
       trans=st.sampled_from(TRANS), alpha=st.sampled_from([1.0, -1.0, 0.375]),
       beta=st.sampled_from([0.0, 1.0, -0.5]), threads=st.sampled_from([1, 2, 3]),
       kernel_name=st.sampled_from(RUNNABLE), seed=st.integers(0, 2**32 - 1))
def test_strassen_hypothesis_blocks(m, n, k, trans, alpha, beta, threads, kernel_name, seed):
    """Odd shapes on blocks of bigger matrices (row strides above the widths): the quadrants and
    fringes are found with the strides, and the neighbours of C stay untouched."""
    trans_a, trans_b = trans
    rng = np.random.default_rng(seed)
    a, b, c0 = operands(rng, m, n, k, trans_a, trans_b)
    a, b = as_block(a, rng)[0], as_block(b, rng)[0]
    c, big_c = as_block(np.full(c0.shape, np.nan, np.float32) if beta == 0 else c0.copy(), rng)
    with micro_kernel(kernel_name), strassen_from(2), split_every_product():
        _core.sgemm(a, b, c, trans_a=trans_a, trans_b=trans_b, alpha=alpha, beta=beta,
                    threads=threads)
    expect_close(c, a, b, c0, trans_a, trans_b, alpha, beta, normwise=True)
    left = (c.ctypes.data - big_c.ctypes.data) // 4
    assert np.isnan(big_c[:, :left]).all() and np.isnan(big_c[:, left + n:]).all(), \
        "the GEMM wrote outside its block of C"


def test_strassen_runs_from_its_threshold_only():
    """By default a product with every dimension >= 768 takes Strassen's scheme (its rounding
    differs from the blocked product's), and one dimension below keeps the blocked product (the
    same bits as with the scheme off)."""
    rng = np.random.default_rng(5)
    a, b, _ = operands(rng, 768, 774, 770, False, False)

    def product(a, b, dim, threads=1):
        c = np.empty((a.shape[0], b.shape[1]), np.float32)
        with strassen_from(dim):
            _core.sgemm(a, b, c, threads=threads)
        return c

    default = _core.set_gemm_strassen_min_dim(-1)
    _core.set_gemm_strassen_min_dim(default)
    assert default == 768
    on, off = product(a, b, -1), product(a, b, 0)
    assert not np.array_equal(on, off)
    expect_close(on, a, b, None, normwise=True)
    np.testing.assert_array_equal(product(a[:767], b, -1), off[:767])
    assert ops.uses_strassen(768, 774, 770) and not ops.uses_strassen(767, 774, 770)
    # on two threads each of its seven products must also give each thread >= 1 GFLOP (waking
    # the team seven times costs more than the scheme saves on smaller ones)
    if ops.have_openmp():
        assert not ops.uses_strassen(1024, 1030, 1026, threads=2)
        np.testing.assert_array_equal(product(a, b, -1, threads=2), product(a, b, 0, threads=2))
        assert ops.uses_strassen(1500, 1600, 12500, threads=2)


@pytest.mark.parametrize("value,dim", [("0", 0), ("off", 0), ("1", 768), ("", 768)])
def test_strassen_environment_switch(value, dim, tmp_path):
    """PYHET_GEMM_STRASSEN=0 (or off) turns the scheme off for the process: a product that would
    take it gives the blocked product's bits."""
    code = textwrap.dedent("""
        import numpy as np
        from pyhet import _core
        rng = np.random.default_rng(0)
        a, b = (rng.standard_normal((1024, 1024)).astype(np.float32) for _ in range(2))
        c, d = np.empty_like(a), np.empty_like(a)
        _core.sgemm(a, b, c)
        _core.set_gemm_strassen_min_dim(0)
        _core.sgemm(a, b, d)
        _core.set_gemm_strassen_min_dim(-1)
        print(_core.gemm_strassen_min_dim(), int(np.array_equal(c, d)))
    """)
    env = dict(os.environ, PYHET_GEMM_STRASSEN=value)
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path,
                         capture_output=True, text=True, check=True, timeout=60).stdout
    assert out.split() == [str(dim), "1" if dim == 0 else "0"]


@pytest.mark.parametrize("value,said", [("false", "on"), ("OFF", "on"), ("off", None),
                                        ("1", None)])
def test_a_strassen_switch_the_core_does_not_read_is_named(value, said, tmp_path):
    """The core reads only 0 and off as off: any other value but 1, on or empty is named in one
    warning line, with what the core made of it, when the command makes its devices."""
    env = dict(os.environ, PYHET_GEMM_STRASSEN=value)
    run = subprocess.run([sys.executable, "-m", "pyhet", "train", "--arch", "4C3-P2", "--steps",
                          "1", "--dataset", "synthetic", "--devices", "cpu:1", "--quiet"],
                         env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    warned = [ln for ln in run.stderr.splitlines() if "PYHET_GEMM_STRASSEN" in ln]
    if said is None:
        assert warned == [], run.stderr
    else:
        assert warned == [f"pyhet: warning: PYHET_GEMM_STRASSEN={value!r} is none of 0, off, "
                          f"1, on: Strassen's scheme stays {said}"], run.stderr


# ------------------------------------------------------------------------------------------------
# K split among the threads: where C has too few tiles to share out (the weight gradient of a
# first conv layer: 32 kernels x 25 = 1 x 5 x 5 weights over 64 images of 24 x 24), each thread
# sums its own K blocks, and the partial sums are added to C at the end.

# (M, N, K, threads, split every product): the first at its real size and threshold; the rest
# small, so split only under the test hook, on 2, 3 and 7 threads (K too short for 7 blocks of
# the usual size: smaller blocks), with edge tiles, one tile, and a single row and column.
SPLIT_K_CASES = [
    (32, 25, 36864, 2, False), (7, 20, 2000, 2, True), (30, 20, 500, 3, True),
    (1, 1, 5000, 2, True), (20, 10, 4100, 7, True), (12, 32, 1024, 3, True),
]


@pytest.mark.skipif(not ops.have_openmp(), reason="built without OpenMP")
@pytest.mark.parametrize("m,n,k,threads,split", SPLIT_K_CASES)
def test_split_k(kernel, m, n, k, threads, split):
    rng = np.random.default_rng(m * 1_000_003 + n * 1009 + k)
    with split_every_product() if split else contextlib.nullcontext():
        assert _core.gemm_splits_k(m, n, k, threads) and ops.splits_k(m, n, k, threads)
        assert not ops.splits_k(m, n, k, 1)
        for trans_a, trans_b in TRANS:
            a, b, c0 = operands(rng, m, n, k, trans_a, trans_b)
            c = run_sgemm(a, b, c0, trans_a, trans_b, 1.0, 0.0, threads, nan_c=True)
            expect_close(c, a, b, c0, trans_a, trans_b)
            # the partial sums are added in a fixed order: the same bits every call
            again = run_sgemm(a, b, c0, trans_a, trans_b, 1.0, 0.0, threads, nan_c=True)
            np.testing.assert_array_equal(c, again)
            for alpha, beta in [(-1.5, 1.0), (0.5, -0.75), (1.0, 0.0)]:
                c, big_c = as_block(c0.copy() if beta else np.full_like(c0, np.nan), rng)
                _core.sgemm(as_block(a, rng)[0], as_block(b, rng)[0], c, trans_a=trans_a,
                            trans_b=trans_b, alpha=alpha, beta=beta, threads=threads)
                expect_close(c, a, b, c0, trans_a, trans_b, alpha, beta)
                left = (c.ctypes.data - big_c.ctypes.data) // 4
                assert np.isnan(big_c[:, :left]).all() and np.isnan(big_c[:, left + n:]).all()


@pytest.mark.skipif(not ops.have_openmp(), reason="built without OpenMP")
@pytest.mark.parametrize("m,n,k,threads,split", SPLIT_K_CASES)
def test_split_k_packed(kernel, m, n, k, threads, split):
    # sgemm_packed (op(b) packed whole, in blocks that cannot change) and sgemm_packed_t (the
    # weight gradient read from the forward's packed im2col matrix, in blocks of whole tiles)
    rng = np.random.default_rng(m * 1_000_003 + n * 1009 + k + 1)
    a = rng.uniform(-1, 1, (m, k)).astype(np.float32)
    b = rng.uniform(-1, 1, (k, n)).astype(np.float32)
    with split_every_product() if split else contextlib.nullcontext():
        assert _core.gemm_splits_k(m, n, k, threads)  # as sgemm plans it
        packed = packed_parts(b, k, n, False, "grid", 2)
        c = np.full((m, n), np.nan, np.float32)
        ops.sgemm_packed(a, packed, c, threads=threads)
        expect_close(c, a, b, c)
        fwd = packed_parts(b.T.copy(), n, k, False, "rows", 2)  # b^T (n, k), as w @ col packs
        c = np.full((m, n), np.nan, np.float32)
        ops.sgemm_packed_t(a, fwd, c, threads=threads)
        expect_close(c, a, b, c)
        c0 = rng.uniform(-1, 1, (m, n)).astype(np.float32)
        c = c0.copy()
        ops.sgemm_packed_t(a, fwd, c, alpha=0.5, beta=-0.75, threads=threads)
        expect_close(c, a, b, c0, alpha=0.5, beta=-0.75)


# ------------------------------------------------------------------------------------------------
# Concurrency: each Python thread's call has its own OpenMP team and its own pack buffers


def test_concurrent_calls_from_python_threads():
    rng = np.random.default_rng(11)
    jobs = []
    # 38-57 MFLOP each, so each call runs two threads: five split rows, one splits columns.
    shapes = [(250 + 13 * i, 200 - 7 * i, 400 + 31 * i) for i in range(5)] + [(8, 3000, 800)]
    for i, (m, n, k) in enumerate(shapes):
        ta, tb = TRANS[i % 4]
        jobs.append((ta, tb) + operands(rng, m, n, k, ta, tb))
    results = [[None] * 4 for _ in jobs]
    start = threading.Barrier(len(jobs))

    def work(i):
        ta, tb, a, b, c0 = jobs[i]
        start.wait()
        for r in range(4):
            results[i][r] = run_sgemm(a, b, c0, ta, tb, 1.0, 0.0, 2, nan_c=True)

    workers = [threading.Thread(target=work, args=(i,)) for i in range(len(jobs))]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    for (ta, tb, a, b, c0), outs in zip(jobs, results):
        for c in outs:
            assert c is not None
            expect_close(c, a, b, c0, ta, tb)


def _thread_ids() -> set:
    return {int(t) for t in os.listdir("/proc/self/task")}


@pytest.mark.skipif(not ops.have_openmp(), reason="built without OpenMP")
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="no /proc/self/task")
def test_a_callers_team_is_kept_by_calls_that_use_fewer_of_its_threads():
    """libgomp lets the threads of a caller's team past a smaller region's size end, and makes
    them anew for the next larger one: calls that use fewer of a caller's threads than it has
    (2 or more) open its whole team, and no thread is made after ops.start_team (a device's
    worker starts its team once; under a memory limit a thread made later could fail, and
    libgomp ends the process there). The products whose team packs B together (barriers in
    each block) still take a smaller team: none of those here."""
    threads, rng = 6, np.random.default_rng(5)
    big = [rng.standard_normal((480, 480)).astype(np.float32) for _ in range(2)]  # all 6
    a, b = rng.standard_normal((32, 75)).astype(np.float32), \
        rng.standard_normal((75, 16000)).astype(np.float32)   # 4 threads by columns
    dy, col = rng.standard_normal((32, 16000)).astype(np.float32), \
        rng.standard_normal((75, 16000)).astype(np.float32)   # K split among 4 (any kernel)
    x = rng.standard_normal((2, 3, 12, 12)).astype(np.float32)  # 2 images: 2 chunks
    bp = rng.standard_normal((16000, 64)).astype(np.float32)
    packed = ops.packed_b(16000, 64)                  # 2 to 4 slivers (NR 32 to 16): as many
    n = 3 << 20                                                   # the update: 3 threads
    p, g, v = (rng.standard_normal(n).astype(np.float32) for _ in range(3))
    quads = ops.packed_quadrants(6 * 9, 4 * 100)                  # 2 items: 2 threads
    xq = rng.standard_normal((4, 6, 12, 12)).astype(np.float32)
    assert _core.gemm_splits_k(32, 75, 16000, threads)
    outcome = {}

    def work():
        try:
            run()
        except Exception as e:  # noqa: BLE001 (reported by the test's thread)
            outcome["error"] = e

    def run():
        outcome["team"] = ops.start_team(threads)
        before = seen = _thread_ids()
        fwd = ops.packed_b(27, 2 * 100)
        calls = [
            lambda: ops.sgemm(*big, threads=threads),
            lambda: ops.sgemm(a, b, threads=threads),
            lambda: ops.sgemm(dy, col, trans_b=True, threads=threads),
            lambda: ops.pack_b(bp, packed, threads=threads),
            lambda: ops.im2col_pack(x, 3, 3, fwd=fwd, threads=threads),
            lambda: _core.sgd_update(p, g, v, 0.1, 0.9, 0.0, False, threads, p.copy(), v.copy()),
            lambda: ops.im2col_pack_quadrants(xq, 3, 3, fwd=quads, images=(0, 2),
                                              threads=threads),
        ]
        for _ in range(2):
            for call in calls:   # each followed by a product on the whole team
                call()
                seen = seen | _thread_ids()
                calls[0]()
                seen = seen | _thread_ids()
        c, dw = ops.sgemm(a, b, threads=threads), ops.sgemm(dy, col, trans_b=True,
                                                             threads=threads)
        outcome["made"] = seen - before
        outcome["right"] = (np.allclose(c, a @ b, rtol=1e-4, atol=1e-3)
                            and np.allclose(dw, dy @ col.T, rtol=1e-4, atol=1e-2))

    worker = threading.Thread(target=work)
    worker.start()
    worker.join()
    assert "error" not in outcome, outcome["error"]
    assert outcome["team"] == threads and outcome["right"]
    assert outcome["made"] == set(), f"{len(outcome['made'])} threads made after start_team"


@pytest.mark.skipif(not ops.have_openmp(), reason="built without OpenMP")
def test_runtime_gives_fewer_threads_than_asked(tmp_path):
    # OMP_THREAD_LIMIT=1 makes num_threads(2) yield one thread: the split planned for two must
    # not be run by one (it would leave half of C unwritten). In a fresh process, since the
    # limit is read when the OpenMP runtime starts.
    code = textwrap.dedent("""
        import numpy as np
        from pyhet import _core
        rng = np.random.default_rng(0)
        for m, n, k in [(300, 200, 700), (7, 4133, 700), (32, 25, 36864)]:
            a = rng.uniform(-1, 1, (m, k)).astype(np.float32)
            b = rng.uniform(-1, 1, (k, n)).astype(np.float32)
            c = np.full((m, n), np.nan, np.float32)
            _core.sgemm(a, b, c, threads=2)
            exact = a.astype(np.float64) @ b.astype(np.float64)
            scale = np.abs(a).astype(np.float64) @ np.abs(b)
            rounds = k + k // 32 + 4  # the bound of the module doc
            tol = rounds * 2.0**-24 / (1 - rounds * 2.0**-24) * scale
            assert np.all(np.abs(c - exact) <= tol), (m, n, k)
        np.save("split_k.npy", c)
        a = rng.uniform(-1, 1, (32, 24000)).astype(np.float32)
        b = rng.uniform(-1, 1, (25, 24000)).astype(np.float32)
        c = np.full((32, 25), np.nan, np.float32)
        _core.sgemm(a, b, c, trans_b=True, threads=6)
        np.save("sit_out.npy", c)
    """)
    # The product of 32 x 25 x 36864 splits K between the two threads planned (the fewer
    # threads' process runs both halves in turn): the same bits as where the runtime gives
    # both. 32 x 25 x 24000 on 6 threads splits K between 2 (with any kernel) and opens a region of all 6, the
    # other 4 meeting the team's one barrier: with 3 threads given, one of them sits out;
    # with 1, it runs both halves: the same bits each time.
    whole = {k: v for k, v in os.environ.items() if k != "OMP_THREAD_LIMIT"}
    for name, env in [("limited", dict(whole, OMP_THREAD_LIMIT="1")),
                      ("three", dict(whole, OMP_THREAD_LIMIT="3")), ("whole", whole)]:
        (tmp_path / name).mkdir()
        done = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path / name,
                              timeout=120, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
    assert _core.gemm_splits_k(32, 25, 36864, 2) and _core.gemm_splits_k(32, 25, 24000, 6)
    for name in ("split_k.npy", "sit_out.npy"):
        for limited in ("limited", "three"):
            np.testing.assert_array_equal(np.load(tmp_path / limited / name),
                                          np.load(tmp_path / "whole" / name))


@pytest.mark.skipif(not ops.have_openmp(), reason="built without OpenMP")
@pytest.mark.parametrize("chosen", [None, "ACTIVE"])
def test_core_waits_passively_unless_the_user_chose(tmp_path, chosen):
    # idle OpenMP threads must not spin on cores that other devices need; the runtime prints
    # the policy it read at load (OMP_DISPLAY_ENV), and the variable is put back as it was
    env = dict(os.environ, OMP_DISPLAY_ENV="TRUE")
    env.pop("OMP_WAIT_POLICY", None)
    if chosen:
        env["OMP_WAIT_POLICY"] = chosen
    code = "import os, pyhet; print('after import:', os.environ.get('OMP_WAIT_POLICY'))"
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, timeout=120,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    out = done.stdout + done.stderr
    assert f"OMP_WAIT_POLICY = '{chosen or 'PASSIVE'}'" in out, out
    assert f"after import: {chosen}" in out, out


# ------------------------------------------------------------------------------------------------
# op(B) packed once (PackedB, pack_b), then products that pack only their A (sgemm_packed)


def packed_parts(b, k, n, trans_b, how, parts, threads=1):
    """op(b) (k, n) packed into a new PackedB in `parts` pieces: by rows of op(b) ("rows", as
    the devices pack the im2col rows they fill), by slivers ("slivers"), or in a row x sliver
    grid ("grid"); the pieces are packed in a shuffled order."""
    packed = ops.packed_b(k, n, trans_b=trans_b)
    S = packed.slivers
    row_edges = [k * i // parts for i in range(parts + 1)]
    sliver_edges = [S * i // parts for i in range(parts + 1)]
    if how == "rows":
        pieces = [((row_edges[i], row_edges[i + 1]), None) for i in range(parts)]
    elif how == "slivers":
        pieces = [(None, (sliver_edges[i], sliver_edges[i + 1])) for i in range(parts)]
    else:
        pieces = [((row_edges[i], row_edges[i + 1]), (sliver_edges[j], sliver_edges[j + 1]))
                  for i in range(parts) for j in range(parts)]
    for i in np.random.default_rng(k + n).permutation(len(pieces)):
        ops.pack_b(b, packed, rows=pieces[i][0], slivers=pieces[i][1], threads=threads)
    return packed


# The conv products are among them: conv1's and conv2's forward (M rows of weights by the
# im2col matrix) and weight gradient (by its transpose), at the sizes of a pair's half.
PACKED_SHAPES = [
    (1, 1, 1), (3, 7, 17), (7, 17, 3), (6, 16, 64), (13, 33, 65), (12, 32, 512), (5, 15, 257),
    (97, 101, 103), (37, 41, 1537), (3, 4133, 5), (16, 10, 3001), (7, 4133, 600),
    (32, 4096, 800), (32, 800, 4096), (16, 2304, 25), (16, 25, 2304),
]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("trans_a,trans_b", TRANS)
@pytest.mark.parametrize("m,n,k", PACKED_SHAPES)
def test_packed_b_sizes(kernel, m, n, k, trans_a, trans_b, threads):
    # packed in a 3 x 3 grid of parts (rows alone and slivers alone: the hypothesis test)
    rng = np.random.default_rng(m * 1_000_003 + n * 1009 + k)
    a, b, c0 = operands(rng, m, n, k, trans_a, trans_b)
    packed = packed_parts(b, k, n, trans_b, "grid", 3, threads)
    assert packed.kernel == kernel and (packed.k, packed.n, packed.trans_b) == (k, n, trans_b)
    c = np.full((m, n), np.nan, np.float32)
    with split_every_product():
        ops.sgemm_packed(a, packed, c, trans_a=trans_a, threads=threads)
    expect_close(c, a, b, c0, trans_a, trans_b)
    if m * n * k <= 2_000_000:
        expect_close(run_ref(a, b, c0, trans_a, trans_b, 1.0, 0.0), a, b, c0, trans_a, trans_b)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("alpha,beta", [(1.0, 1.0), (-1.5, 0.0), (0.5, -0.75), (0.0, 0.5),
                                        (0.0, 0.0)])
def test_packed_b_alpha_beta_and_blocks(kernel, alpha, beta, threads):
    # several K blocks, edge tiles, and a, b, c as blocks of bigger matrices
    rng = np.random.default_rng(9)
    m, n, k = 131, 197, 700
    for trans_a, trans_b in TRANS:
        a, b, c0 = operands(rng, m, n, k, trans_a, trans_b)
        a_block, b_block = as_block(a, rng)[0], as_block(b, rng)[0]
        packed = packed_parts(b_block, k, n, trans_b, "grid", 2)
        c, big_c = as_block(c0.copy(), rng)
        ops.sgemm_packed(a_block, packed, c, trans_a=trans_a, alpha=alpha, beta=beta,
                         threads=threads)
        expect_close(c, a, b, c0, trans_a, trans_b, alpha, beta)
        left = (c.ctypes.data - big_c.ctypes.data) // 4
        assert np.isnan(big_c[:, :left]).all() and np.isnan(big_c[:, left + n:]).all()


@settings(max_examples=settings.default.max_examples)
@given(m=st.integers(1, 100), n=st.integers(1, 150), k=st.integers(0, 1100),
       trans=st.sampled_from(TRANS), how=st.sampled_from(["rows", "slivers", "grid"]),
       parts=st.integers(1, 4), threads=st.sampled_from([1, 2, 3]),
       kernel_name=st.sampled_from(RUNNABLE), seed=st.integers(0, 2**32 - 1))
def test_packed_b_hypothesis(m, n, k, trans, how, parts, threads, kernel_name, seed):
    trans_a, trans_b = trans
    rng = np.random.default_rng(seed)
    a, b, c0 = operands(rng, m, n, k, trans_a, trans_b)
    with micro_kernel(kernel_name), split_every_product():
        packed = packed_parts(b, k, n, trans_b, how, parts, threads)
        c = ops.sgemm_packed(a, packed, trans_a=trans_a, threads=threads)
    expect_close(c, a, b, c0, trans_a, trans_b)


def test_packed_b_shared_by_concurrent_products():
    # Two Python threads pack halves of one B at once (by rows, then by slivers for B^T), then
    # each multiplies its own rows of A by all of it, as the devices of one process do.
    rng = np.random.default_rng(12)
    m, n, k = 64, 1000, 300
    a = rng.uniform(-1, 1, (m, k)).astype(np.float32)
    b = rng.uniform(-1, 1, (k, n)).astype(np.float32)
    fwd, bwd = ops.packed_b(k, n), ops.packed_b(n, k, trans_b=True)
    out = np.full((m, n), np.nan, np.float32)
    dw = np.full((m, k), np.nan, np.float32)
    dy = rng.uniform(-1, 1, (m, n)).astype(np.float32)
    step = threading.Barrier(2)

    def device(i):
        ops.pack_b(b, fwd, rows=(k * i // 2, k * (i + 1) // 2))
        ops.pack_b(b, bwd, slivers=(bwd.slivers * i // 2, bwd.slivers * (i + 1) // 2))
        step.wait(timeout=60)
        rows = slice(m * i // 2, m * (i + 1) // 2)
        ops.sgemm_packed(a[rows], fwd, out[rows])
        ops.sgemm_packed(dy[rows], bwd, dw[rows])

    workers = [threading.Thread(target=device, args=(i,)) for i in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=120)
    expect_close(out, a, b, out)
    expect_close(dw, dy, b, dw, trans_b=True)


# The weight gradient from the forward's packed operand (sgemm_packed_t): c = op(a) @ s^T, s the
# rows (r0, r1) of a packed op(b), its NR x NR tiles transposed as the product packs its blocks.
# Rows of one K block of the pack and across two (k > 512), a product K (the pack's n) of one
# and of several of its K blocks (in tiles and not), edge tiles, and the conv2 weight gradient
# of a pair's half (32 x 4096 by 400 of the 800 rows).
PACKED_T_SHAPES = [
    (1, 1, 1, None), (3, 17, 7, (2, 5)), (6, 16, 16, None), (13, 37, 65, (0, 64)),
    (5, 33, 600, (100, 101)), (64, 600, 25, None), (7, 1100, 1300, (511, 1299)),
    (32, 4096, 800, (400, 800)),
]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("m,n,k,rows", PACKED_T_SHAPES)
def test_packed_t_sizes(kernel, m, n, k, rows, threads):
    rng = np.random.default_rng(m * 1_000_003 + n * 1009 + k)
    r0, r1 = (0, k) if rows is None else rows
    for trans_a, trans_b in TRANS:   # trans_b: how the packed op(b) was stored
        a = rng.uniform(-1, 1, (n, m) if trans_a else (m, n)).astype(np.float32)
        b = rng.uniform(-1, 1, (k, n)).astype(np.float32)   # op(b), packed
        packed = packed_parts(b.T.copy() if trans_b else b, k, n, trans_b, "grid", 2)
        c = np.full((m, r1 - r0), np.nan, np.float32)
        with split_every_product():
            ops.sgemm_packed_t(a, packed, c, rows=rows, trans_a=trans_a, threads=threads)
        expect_close(c, a, b[r0:r1], c, trans_a, trans_b=True)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("alpha,beta", [(1.0, 1.0), (-1.5, 0.0), (0.5, -0.75), (0.0, 0.5)])
def test_packed_t_alpha_beta_and_blocks(kernel, alpha, beta, threads):
    rng = np.random.default_rng(19)
    m, n, k, r0, r1 = 29, 1037, 700, 123, 640
    b = rng.uniform(-1, 1, (k, n)).astype(np.float32)
    packed = packed_parts(as_block(b, rng)[0], k, n, False, "rows", 3)
    for trans_a in (False, True):
        a = rng.uniform(-1, 1, (n, m) if trans_a else (m, n)).astype(np.float32)
        c0 = rng.uniform(-1, 1, (m, r1 - r0)).astype(np.float32)
        c, big_c = as_block(c0.copy(), rng)
        ops.sgemm_packed_t(as_block(a, rng)[0], packed, c, rows=(r0, r1), trans_a=trans_a,
                           alpha=alpha, beta=beta, threads=threads)
        expect_close(c, a, b[r0:r1], c0, trans_a, True, alpha, beta)
        left = (c.ctypes.data - big_c.ctypes.data) // 4
        assert np.isnan(big_c[:, :left]).all() and np.isnan(big_c[:, left + r1 - r0:]).all()


@settings(max_examples=settings.default.max_examples)
@given(m=st.integers(1, 60), n=st.integers(0, 1200), k=st.integers(1, 300), data=st.data(),
       threads=st.sampled_from([1, 2, 3]), kernel_name=st.sampled_from(RUNNABLE),
       seed=st.integers(0, 2**32 - 1))
def test_packed_t_hypothesis(m, n, k, data, threads, kernel_name, seed):
    r0 = data.draw(st.integers(0, k))
    r1 = data.draw(st.integers(r0, k))
    rng = np.random.default_rng(seed)
    a = rng.uniform(-1, 1, (m, n)).astype(np.float32)
    b = rng.uniform(-1, 1, (k, n)).astype(np.float32)
    with micro_kernel(kernel_name), split_every_product():
        packed = packed_parts(b, k, n, False, "slivers", 2, threads)
        c = ops.sgemm_packed_t(a, packed, rows=(r0, r1), threads=threads)
    expect_close(c, a, b[r0:r1], np.zeros_like(c), trans_b=True)


def test_packed_t_errors_say_what_was_expected():
    b = np.ones((20, 30), np.float32)
    packed = ops.pack_b(b, ops.packed_b(20, 30))
    cases = [
        (lambda: ops.sgemm_packed_t(np.ones((2, 30), np.float32), "packed"), TypeError,
         "made by pyhet.ops.packed_b"),
        (lambda: ops.sgemm_packed_t(np.ones((2, 20), np.float32), packed), ValueError,
         r"inner dimensions differ: op\(a\) is \(2, 20\) and the packed op\(b\) transposed "
         r"is \(30, 20\)"),
        (lambda: ops.sgemm_packed_t(np.ones((2, 30), np.float32), packed, rows=(5, 21)),
         ValueError, "0 <= begin <= end <= 20, got"),
        (lambda: ops.sgemm_packed_t(np.ones((2, 30), np.float32), packed, rows=(3, 2)),
         ValueError, "rows"),
        (lambda: ops.sgemm_packed_t(np.ones((2, 30), np.float32), packed,
                                    np.ones((2, 20), np.float32), rows=(0, 10)), ValueError,
         r"expected shape \(2, 10\)"),
        (lambda: ops.sgemm_packed_t(np.ones((2, 30), np.float64), packed), TypeError, "float32"),
        (lambda: ops.sgemm_packed_t(np.ones((2, 30), np.float32), packed, beta=1.0), ValueError,
         "existing c"),
    ]
    for call, error, match in cases:
        with pytest.raises(error, match=match) as e:
            call()
        assert "\n" not in str(e.value)
    others = [name for name in RUNNABLE if name != ops.gemm_kernel()]
    if others:
        with micro_kernel(others[0]):
            other = ops.pack_b(b, ops.packed_b(20, 30))
        with pytest.raises(ValueError, match=f"packed for the '{others[0]}' micro-kernel"):
            ops.sgemm_packed_t(np.ones((2, 30), np.float32), other)


@pytest.mark.parametrize("beta", [0.0, 2.0])
def test_packed_b_k_zero_scales_c(beta):
    packed = ops.packed_b(0, 4)
    c0 = np.arange(12, dtype=np.float32).reshape(3, 4)
    c = ops.sgemm_packed(np.zeros((3, 0), np.float32), packed, c0.copy(), beta=beta)
    np.testing.assert_array_equal(c, beta * c0)


def test_packed_b_is_zeros_until_packed():
    """Parts never packed read as zeros (they held whatever the memory did: a different
    product each call): an empty PackedB gives beta * c, one packed in part the product of the
    rows packed."""
    rng = np.random.default_rng(4)
    m, n, k = 5, 37, 300
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    c0 = rng.standard_normal((m, n)).astype(np.float32)
    for _ in range(3):     # fresh allocations, which may reuse freed memory
        junk = ops.packed_b(k, n)
        ops.pack_b(rng.standard_normal((k, n)).astype(np.float32) * 1e30, junk)
        del junk
        packed = ops.packed_b(k, n)
        np.testing.assert_array_equal(ops.sgemm_packed(a, packed, c0.copy(), beta=0.5),
                                      0.5 * c0)
        ops.pack_b(b, packed, rows=(0, 100))
        want = a[:, :100].astype(np.float64) @ b[:100]
        np.testing.assert_allclose(ops.sgemm_packed(a, packed), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("pack,room", [(ops.pack_b, ops.packed_b),
                                       (ops.pack_quadrants, ops.packed_quadrants)])
def test_packed_b_of_another_kernel_is_refused(pack, room):
    """op(b) packed whole or as its quadrants' sums for one micro-kernel, then used with
    another."""
    others = [name for name in RUNNABLE if name != ops.gemm_kernel()]
    if not others:
        pytest.skip("this CPU or build runs one micro-kernel only")
    b = np.ones((20, 30), np.float32)
    with micro_kernel(others[0]):
        packed = pack(b, room(20, 30))
    with pytest.raises(ValueError, match=f"packed for the '{others[0]}' micro-kernel"):
        ops.sgemm_packed(np.ones((2, 20), np.float32), packed)


def test_ops_packed_b_errors_say_what_was_expected():
    b = np.ones((20, 30), np.float32)
    packed = ops.pack_b(b, ops.packed_b(20, 30))
    cases = [
        (lambda: ops.packed_b(-1, 3), ValueError, "k must be >= 0"),
        (lambda: ops.packed_b(2.5, 3), TypeError, "k must be an int"),
        (lambda: ops.pack_b(b, "packed"), TypeError, "made by pyhet.ops.packed_b"),
        (lambda: ops.pack_b(b.T.copy(), packed), ValueError, r"expected shape \(20, 30\)"),
        (lambda: ops.pack_b(b, packed, rows=(5, 21)), ValueError, "0 <= begin <= end <= 20"),
        (lambda: ops.pack_b(b, packed, slivers=(1, 0)), ValueError, "slivers"),
        (lambda: ops.pack_b(b, packed, rows=3), TypeError, "pair"),
        (lambda: ops.sgemm_packed(np.ones((2, 21), np.float32), packed), ValueError,
         "inner dimensions differ"),
        (lambda: ops.sgemm_packed(np.ones((2, 20), np.float32), packed,
                                  np.ones((2, 31), np.float32)), ValueError, "expected shape"),
        (lambda: ops.sgemm_packed(np.ones((2, 20), np.float64), packed), TypeError, "float32"),
        (lambda: ops.sgemm_packed(np.ones((2, 20), np.float32), packed, beta=1.0), ValueError,
         "existing c"),
    ]
    for call, error, match in cases:
        with pytest.raises(error, match=match) as e:
            call()
        assert "\n" not in str(e.value)


# ------------------------------------------------------------------------------------------------
# op(B) as its quadrants' seven packed sums (PackedQuadrants): Strassen's scheme on the even rows
# and four products of quadrant size on the rest (strassen=True), or on all rows (False)

# M odd and even, below and above a tile; quadrants below and above a tile and across K blocks
# (K / 2 > KC: 37 x 42 x 1538); products split among two threads by rows and columns.
QUADRANT_SHAPES = [
    (1, 2, 2), (2, 2, 2), (3, 8, 18), (7, 34, 6), (13, 34, 66), (25, 64, 130), (97, 102, 104),
    (255, 300, 258), (37, 42, 1538), (9, 4134, 20), (301, 302, 302),
]


@pytest.mark.parametrize("strassen", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("trans_a,trans_b", TRANS)
@pytest.mark.parametrize("m,n,k", QUADRANT_SHAPES)
def test_packed_quadrants_sizes(kernel, m, n, k, trans_a, trans_b, threads, strassen):
    rng = np.random.default_rng(m * 1_000_003 + n * 1009 + k)
    a, b, c0 = operands(rng, m, n, k, trans_a, trans_b)
    packed = ops.pack_quadrants(b, ops.packed_quadrants(k, n, trans_b=trans_b), threads=threads)
    assert packed.kernel == kernel and (packed.k, packed.n, packed.trans_b) == (k, n, trans_b)
    c = np.full((m, n), np.nan, np.float32)
    with split_every_product():
        ops.sgemm_packed(a, packed, c, trans_a=trans_a, strassen=strassen, threads=threads)
    expect_close(c, a, b, c0, trans_a, trans_b, normwise=True)


@pytest.mark.parametrize("strassen", [False, True])
@pytest.mark.parametrize("alpha,beta", [(1.0, 1.0), (-1.5, 0.0), (0.5, -0.75), (0.0, 0.5)])
def test_packed_quadrants_alpha_beta_and_blocks(kernel, alpha, beta, strassen):
    """beta reaches every row of C once (both the scheme's quadrants and the rows left to the
    four products), alpha every product; a, b, c as blocks of bigger matrices, whose
    neighbours of C stay untouched."""
    rng = np.random.default_rng(19)
    for m, n, k in [(131, 198, 1102), (131, 198, 10)]:
        for trans_a, trans_b in TRANS:
            a, b, c0 = operands(rng, m, n, k, trans_a, trans_b)
            a_block, b_block = as_block(a, rng)[0], as_block(b, rng)[0]
            packed = ops.pack_quadrants(b_block, ops.packed_quadrants(k, n, trans_b=trans_b))
            c, big_c = as_block(np.full(c0.shape, np.nan, np.float32) if beta == 0
                                else c0.copy(), rng)
            with split_every_product():
                ops.sgemm_packed(a_block, packed, c, trans_a=trans_a, alpha=alpha, beta=beta,
                                 strassen=strassen, threads=2)
            expect_close(c, a, b, c0, trans_a, trans_b, alpha, beta, normwise=True)
            left = (c.ctypes.data - big_c.ctypes.data) // 4
            assert np.isnan(big_c[:, :left]).all() and np.isnan(big_c[:, left + n:]).all()


def test_packed_quadrants_take_the_scheme_from_their_threshold():
    """strassen=None takes the scheme where uses_packed_strassen says so: from 256 rows of A
    (or the GEMM's threshold, when lower) against quadrants whose op(B) reaches the GEMM's
    threshold in both dimensions; never with the scheme off. The scheme's rounding differs
    from the four products' (the same bits as strassen=False where it is not taken)."""
    rng = np.random.default_rng(21)
    k, n = 1024, 1026
    b = rng.uniform(-1, 1, (k, n)).astype(np.float32)
    packed = ops.pack_quadrants(b, ops.packed_quadrants(k, n))
    assert ops.uses_packed_strassen(256, k, n) and not ops.uses_packed_strassen(255, k, n)
    assert not ops.uses_packed_strassen(300, 766, n)
    for m, taken in [(256, True), (255, False)]:
        a = rng.uniform(-1, 1, (m, k)).astype(np.float32)
        auto, four, scheme = (ops.sgemm_packed(a, packed, strassen=s, threads=1)
                              for s in (None, False, True))
        np.testing.assert_array_equal(auto, scheme if taken else four)
        assert not np.array_equal(four, scheme)
    with strassen_from(0):
        assert not ops.uses_packed_strassen(2000, k, n)
    with strassen_from(8):
        assert ops.uses_packed_strassen(8, 8, 8) and not ops.uses_packed_strassen(7, 8, 8)


def test_packed_quadrants_shared_by_concurrent_products():
    """Two Python threads pack halves of the images of one input's im2col in quadrants at once
    (each making the input's sums in its own work array), then each multiplies its own rows of
    weights by all of it, forward and weight gradient (from col^T's sums, and from the
    forward's read transposed), as the devices of one process do."""
    rng = np.random.default_rng(22)
    x = rng.uniform(-1, 1, (6, 4, 9, 9)).astype(np.float32)
    col = ops.im2col(x, 3, 3, 1, 1)
    k, n = col.shape
    fwd = ops.packed_quadrants(k, n)
    bwd = ops.packed_quadrants(n, k, trans_b=True)
    w = rng.uniform(-1, 1, (40, k)).astype(np.float32)
    dy = rng.uniform(-1, 1, (40, n)).astype(np.float32)
    out = np.full((40, n), np.nan, np.float32)
    dw = np.full((40, k), np.nan, np.float32)
    dw_t = np.full((40, k), np.nan, np.float32)   # from fwd, read transposed
    step = threading.Barrier(2)

    def device(i):
        ops.im2col_pack_quadrants(x, 3, 3, 1, 1, fwd=fwd, t=bwd, images=(i * 2, 2 + i))
        step.wait(timeout=60)
        rows = slice(20 * i, 20 * (i + 1))
        ops.sgemm_packed(w[rows], fwd, out[rows], strassen=bool(i))
        ops.sgemm_packed(dy[rows], bwd, dw[rows], strassen=not i)
        ops.sgemm_packed_t(dy[rows], fwd, dw_t[rows], strassen=bool(i))

    workers = [threading.Thread(target=device, args=(i,)) for i in range(2)]
    for t in workers:
        t.start()
    for t in workers:
        t.join(timeout=60)
    expect_close(out, w, col, out, normwise=True)
    expect_close(dw, dy, col, dw, trans_b=True, normwise=True)
    expect_close(dw_t, dy, col, dw_t, trans_b=True, normwise=True)


# The weight gradient from the forward's quadrant sums (sgemm_packed_t on a PackedQuadrants):
# c = op(a) @ s^T, s = op(b) held as its seven sums, read transposed; every shape above (the
# quadrants across K blocks of the pack: 9 x 4134 x 20, and of the product: 37 x 42 x 1538).
@pytest.mark.parametrize("strassen", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("trans_a,trans_b", TRANS)
@pytest.mark.parametrize("m,n,k", QUADRANT_SHAPES)
def test_packed_quadrants_read_transposed(kernel, m, n, k, trans_a, trans_b, threads, strassen):
    rng = np.random.default_rng(m * 1_000_003 + n * 1009 + k + 7)
    a = rng.uniform(-1, 1, (n, m) if trans_a else (m, n)).astype(np.float32)
    s = rng.uniform(-1, 1, (k, n)).astype(np.float32)   # op(b), packed as its quadrants' sums
    packed = ops.pack_quadrants(s.T.copy() if trans_b else s,
                                ops.packed_quadrants(k, n, trans_b=trans_b), threads=threads)
    c = np.full((m, k), np.nan, np.float32)
    with split_every_product():
        out = ops.sgemm_packed_t(a, packed, c, trans_a=trans_a, strassen=strassen,
                                 threads=threads)
    assert out is c
    expect_close(c, a, s, c, trans_a, trans_b=True, normwise=True)


@pytest.mark.parametrize("strassen", [False, True, None])
@pytest.mark.parametrize("alpha,beta", [(1.0, 1.0), (-1.5, 0.0), (0.5, -0.75), (0.0, 0.5)])
def test_packed_quadrants_read_transposed_alpha_beta_and_blocks(kernel, alpha, beta, strassen):
    """beta reaches every entry of C once and alpha every product, with a and c blocks of
    bigger matrices whose neighbours stay untouched; strassen=None takes the scheme where
    uses_packed_strassen says so (the same bits as strassen=True there)."""
    rng = np.random.default_rng(23)
    for m, n, k in [(131, 1102, 198), (9, 10, 198), (300, 800, 800)]:
        s = rng.uniform(-1, 1, (k, n)).astype(np.float32)
        packed = ops.pack_quadrants(s, ops.packed_quadrants(k, n))
        for trans_a in (False, True):
            a = rng.uniform(-1, 1, (n, m) if trans_a else (m, n)).astype(np.float32)
            c0 = rng.uniform(-1, 1, (m, k)).astype(np.float32)
            c, big_c = as_block(np.full(c0.shape, np.nan, np.float32) if beta == 0
                                else c0.copy(), rng)
            ops.sgemm_packed_t(as_block(a, rng)[0], packed, c, trans_a=trans_a, alpha=alpha,
                               beta=beta, strassen=strassen, threads=2)
            expect_close(c, a, s, c0, trans_a, True, alpha, beta, normwise=True)
            left = (c.ctypes.data - big_c.ctypes.data) // 4
            assert np.isnan(big_c[:, :left]).all() and np.isnan(big_c[:, left + k:]).all()
            if strassen is None and alpha != 0:
                with strassen_from(8):
                    taken = ops.uses_packed_strassen(m, k, n, 1)
                    auto = ops.sgemm_packed_t(a, packed, trans_a=trans_a, threads=1)
                    scheme, four = (ops.sgemm_packed_t(a, packed, trans_a=trans_a,
                                                       strassen=x, threads=1)
                                    for x in (True, False))
                np.testing.assert_array_equal(auto, scheme if taken else four)
                assert taken == (m >= 8)


@pytest.mark.parametrize("threads", [1, 2])
def test_packed_quadrants_read_transposed_by_columns(kernel, threads):
    """rows (r0, r1) of each half of s make only c's columns [r0, r1) and [k/2 + r0, k/2 + r1)
    (the rest untouched), so that callers splitting the rows make the whole product, at once
    from two threads, odd shares and empty ones included, by the scheme or not."""
    rng = np.random.default_rng(24)
    for m, n, k, cuts in [(9, 40, 46, [0, 7, 7, 16, 23]), (300, 802, 798, [0, 133, 399])]:
        s = rng.uniform(-1, 1, (k, n)).astype(np.float32)
        packed = ops.pack_quadrants(s, ops.packed_quadrants(k, n))
        a = rng.uniform(-1, 1, (m, n)).astype(np.float32)
        for strassen in (True, False):
            c = np.full((m, k), np.nan, np.float32)
            shares = list(zip(cuts[:-1], cuts[1:]))
            done = threading.Barrier(len(shares))

            def part(rows):
                ops.sgemm_packed_t(a, packed, c, rows=rows, strassen=strassen, threads=threads)
                done.wait(timeout=60)

            workers = [threading.Thread(target=part, args=(r,)) for r in shares[1:]]
            for t in workers:
                t.start()
            ops.sgemm_packed_t(a, packed, c, rows=shares[0], strassen=strassen, threads=threads)
            done.wait(timeout=60)
            for t in workers:
                t.join(timeout=60)
            expect_close(c, a, s, c, trans_b=True, normwise=True)
            alone = np.full((m, k), np.nan, np.float32)
            ops.sgemm_packed_t(a, packed, alone, rows=(cuts[1], cuts[2]), strassen=strassen)
            made = np.zeros(k, bool)
            made[cuts[1]:cuts[2]] = made[k // 2 + cuts[1]:k // 2 + cuts[2]] = True
            assert np.isnan(alone[:, ~made]).all() and not np.isnan(alone[:, made]).any()
            np.testing.assert_array_equal(alone[:, made], c[:, made])


def test_packed_quadrants_read_transposed_errors_say_what_was_expected():
    packed = ops.pack_quadrants(np.ones((20, 30), np.float32), ops.packed_quadrants(20, 30))
    cases = [
        (lambda: ops.sgemm_packed_t(np.ones((2, 20), np.float32), packed), ValueError,
         r"inner dimensions differ: op\(a\) is \(2, 20\) and s\^T, of quadrants \(15, 10\), "
         r"is \(30, 20\)"),
        (lambda: ops.sgemm_packed_t(np.ones((2, 30), np.float32), packed, rows=(0, 11)),
         ValueError, r"rows.*0 <= begin <= end <= 10 \(the rows of a half\), got \(0, 11\)"),
        (lambda: ops.sgemm_packed_t(np.ones((2, 30), np.float32), packed, rows=(3, 2)),
         ValueError, "rows"),
        (lambda: ops.sgemm_packed_t(np.ones((2, 30), np.float32), packed, rows=(0, 3)),
         ValueError, r"rows=\(0, 3\) of a PackedQuadrants make only those columns of c, so "
         r"they need an existing c"),
        (lambda: ops.sgemm_packed_t(np.ones((2, 30), np.float32), packed,
                                    np.ones((2, 30), np.float32)), ValueError, "expected shape"),
        (lambda: ops.sgemm_packed_t(np.ones((2, 30), np.float32), packed, beta=1.0), ValueError,
         "existing c"),
        (lambda: _core.sgemm_packed_quadrants_t(np.ones((2, 30), np.float32), packed.packs[:6],
                                                np.ones((2, 20), np.float32)), TypeError,
         "a sequence of 7 PackedB"),
    ]
    for call, error, match in cases:
        with pytest.raises(error, match=match) as e:
            call()
        assert "\n" not in str(e.value)


def test_ops_packed_quadrants_errors_say_what_was_expected():
    b = np.ones((20, 30), np.float32)
    packed = ops.pack_quadrants(b, ops.packed_quadrants(20, 30))
    cases = [
        (lambda: ops.packed_quadrants(21, 30), ValueError, "even k and n, got 21 and 30"),
        (lambda: ops.packed_quadrants(-2, 30), ValueError, "k must be >= 0"),
        (lambda: ops.pack_quadrants(b, ops.packed_b(20, 30)), TypeError,
         "expected a PackedQuadrants"),
        (lambda: ops.pack_quadrants(b.T.copy(), packed), ValueError,
         r"expected b of shape \(20, 30\), got \(30, 20\)"),
        (lambda: ops.sgemm_packed(np.ones((2, 22), np.float32), packed), ValueError,
         "inner dimensions differ"),
        (lambda: ops.sgemm_packed(np.ones((2, 20), np.float32), packed,
                                  np.ones((2, 31), np.float32)), ValueError, "expected shape"),
        (lambda: ops.sgemm_packed(np.ones((2, 20), np.float32), packed, beta=1.0), ValueError,
         "existing c"),
        (lambda: _core.sgemm_packed_quadrants(np.ones((2, 20), np.float32), packed.packs[:6],
                                              np.ones((2, 30), np.float32)), TypeError,
         "a sequence of 7 PackedB"),
        (lambda: _core.sgemm_packed_quadrants(
            np.ones((2, 20), np.float32), packed.packs[:6] + (ops.packed_b(10, 16),),
            np.ones((2, 30), np.float32)), ValueError, "one size and storage"),
    ]
    for call, error, match in cases:
        with pytest.raises(error, match=match) as e:
            call()
        assert "\n" not in str(e.value)


# ------------------------------------------------------------------------------------------------
# pyhet.ops.gemm: the Python face


def test_ops_gemm_matches_numpy():
    rng = np.random.default_rng(5)
    a, b, c0 = operands(rng, 123, 45, 678, False, False)
    for threads in (None, 1, 2):
        expect_close(ops.gemm(a, b, threads=threads), a, b, c0)


def test_ops_gemm_non_contiguous_inputs():
    rng = np.random.default_rng(6)
    a = rng.uniform(-1, 1, (80, 141)).astype(np.float32)[::2, 1::2]  # (40, 70), strided
    b = rng.uniform(-1, 1, (100, 140)).astype(np.float32).T[::2, :50]  # (70, 50), transposed
    assert not a.flags.c_contiguous and not b.flags.c_contiguous
    c = ops.gemm(a, b, threads=2)
    expect_close(c, np.ascontiguousarray(a), np.ascontiguousarray(b), np.zeros_like(c))


def test_ops_sgemm_transposes_and_beta():
    rng = np.random.default_rng(8)
    a, b, c0 = operands(rng, 50, 60, 70, True, True)
    c = ops.sgemm(a, b, c0.copy(), trans_a=True, trans_b=True, alpha=0.5, beta=2.0, threads=2)
    expect_close(c, a, b, c0, True, True, 0.5, 2.0)


@pytest.mark.parametrize("a,b,error", [
    (np.ones((3, 4), np.float64), np.ones((4, 5), np.float32), TypeError),
    (np.ones((3, 4), np.float32), np.ones((4, 5), np.int32), TypeError),
    ([[1.0, 2.0]], np.ones((2, 5), np.float32), TypeError),
    (np.ones((3, 4), np.float32), "b", TypeError),
    (np.ones(4, np.float32), np.ones((4, 5), np.float32), ValueError),
    (np.ones((3, 4), np.float32), np.ones((4, 5, 1), np.float32), ValueError),
    (np.ones((3, 4), np.float32), np.ones((5, 4), np.float32), ValueError),
])
def test_ops_gemm_errors(a, b, error):
    with pytest.raises(error):
        ops.gemm(a, b)


@pytest.mark.parametrize("threads", [0, -1])
def test_ops_gemm_threads_must_be_positive(threads):
    with pytest.raises(ValueError, match="threads"):
        ops.gemm(np.ones((2, 3), np.float32), np.ones((3, 4), np.float32), threads=threads)


def _cpuinfo():
    """(vendor_id, cpu family) of the first CPU in /proc/cpuinfo, or None off Linux."""
    try:
        with open("/proc/cpuinfo") as f:
            first = f.read().split("\n\n")[0]
    except OSError:
        return None
    fields = {k.strip(): v.strip() for k, _, v in
              (line.partition(":") for line in first.splitlines())}
    return fields.get("vendor_id"), int(fields.get("cpu family", "-1"))


def test_kernel_names():
    chosen = ops.gemm_kernel()
    assert chosen in RUNNABLE
    with pytest.raises(ValueError, match="set_gemm_kernel"):
        _core.set_gemm_kernel("sse9")
    assert ops.gemm_kernel() == chosen  # a refused name changes nothing


def test_default_kernel_follows_the_rule():
    # AVX-512 where the CPU runs it, but AVX2 on Zen 4 (AMD family 0x19; see gemm.cpp), then
    # AVX2, then portable.
    info = _cpuinfo()
    if HAVE_AVX512 and info is None:
        pytest.skip("no /proc/cpuinfo to tell Zen 4 from other AVX-512 CPUs")
    if HAVE_AVX512:
        expected = "avx2-fma" if info == ("AuthenticAMD", 0x19) else "avx512"
    else:
        expected = "avx2-fma" if HAVE_AVX2 else "portable"
    assert ops.gemm_kernel() == expected


def test_the_avx512_kernels_k_blocks_follow_the_cores_l2():
    """KC 1024 where the core's L2 holds 2 MiB or more (the packed block of A then takes the
    same quarter of it as KC 512 of a 1 MiB one), else 512; the other kernels' blocks are
    their own."""
    import shutil

    if shutil.which("getconf") is None:   # (Python's os.sysconf does not know the name)
        pytest.skip("no getconf to read the L2's size as the C library gives it")
    said = subprocess.run(["getconf", "LEVEL2_CACHE_SIZE"], capture_output=True, text=True,
                          env=dict(os.environ, PYHET_GEMM_L2_BYTES=""))
    l2 = int(said.stdout.strip()) if said.stdout.strip().isdigit() else 0
    if os.environ.get("PYHET_GEMM_L2_BYTES", "").isdigit():
        l2 = int(os.environ["PYHET_GEMM_L2_BYTES"])
    blocks = ops.gemm_blocks()
    assert len(blocks) == 3 and all(isinstance(v, int) and v > 0 for v in blocks)
    if ops.gemm_kernel() == "avx512":
        assert blocks[1] == (1024 if (l2 or 0) >= 2 << 20 else 512), (blocks, l2)
    else:
        assert blocks[1] == 512, blocks


@pytest.mark.skipif(not HAVE_AVX512, reason="this CPU or build has no avx512 kernel")
@pytest.mark.parametrize("l2", [1 << 20, 2 << 20])
def test_the_avx512_kernel_computes_the_same_with_either_k_block(tmp_path, l2):
    """Either length of K block (PYHET_GEMM_L2_BYTES stands in for the core's L2), on products
    of several K blocks and odd sizes, plain, transposed, from a packed B and by Strassen's
    scheme, against the float64 product; in a process of its own (the blocks are chosen once
    a process)."""
    code = textwrap.dedent("""
        import numpy as np
        from pyhet import _core, ops
        _core.set_gemm_kernel("avx512")
        print(ops.gemm_blocks()[1])
        rng = np.random.default_rng(0)
        worst = 0.0
        for m, n, k, ta, tb in [(37, 45, 2500, False, False), (61, 33, 2049, True, False),
                                (29, 70, 1100, False, True), (800, 800, 2100, False, False)]:
            a = rng.uniform(-1, 1, (k, m) if ta else (m, k)).astype(np.float32)
            b = rng.uniform(-1, 1, (n, k) if tb else (k, n)).astype(np.float32)
            want = (a.T if ta else a).astype(np.float64) @ (b.T if tb else b).astype(np.float64)
            got = ops.sgemm(a, b, trans_a=ta, trans_b=tb, threads=1)
            worst = max(worst, float(np.abs(got - want).max() / np.sqrt(k)))
            if not ta:
                packed = ops.packed_b(k, n, trans_b=tb)
                ops.pack_b(b, packed)
                got = ops.sgemm_packed(a, packed, threads=2)
                worst = max(worst, float(np.abs(got - want).max() / np.sqrt(k)))
        print(ops.uses_strassen(800, 800, 2100, 1), worst)
    """)
    env = dict(os.environ, PYHET_GEMM_L2_BYTES=str(l2))
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    kc, strassen, worst = out.stdout.split()
    assert int(kc) == (1024 if l2 >= 2 << 20 else 512)
    assert strassen == "True"
    assert float(worst) < 1e-5, worst


@pytest.mark.parametrize("name", ["portable", "avx2-fma", "avx512"])
def test_forcing_a_kernel_and_back(name):
    if name not in RUNNABLE:
        pytest.skip(f"this CPU or build has no {name} kernel")
    chosen = ops.gemm_kernel()
    with micro_kernel(name):
        assert ops.gemm_kernel() == name
    assert ops.gemm_kernel() == chosen


# ------------------------------------------------------------------------------------------------
# The plain loop that the benchmark measures the packed GEMM against


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("m,n,k", [(1, 1, 1), (7, 33, 5), (61, 3, 130), (130, 61, 17)])
def test_naive_loop_matches(m, n, k, threads):
    a, b, c0 = operands(np.random.default_rng(m + n + k), m, n, k, False, False)
    c = np.full((m, n), np.nan, np.float32)
    _core.sgemm_naive(a, b, c, threads=threads)
    expect_close(c, a, b, c0)


def test_naive_loop_checks_shapes():
    with pytest.raises(ValueError, match="inner dimensions"):
        _core.sgemm_naive(np.ones((2, 3), np.float32), np.ones((4, 5), np.float32),
                          np.empty((2, 5), np.float32))


def test_ops_questions_about_products_no_memory_holds_are_refused_by_the_core():
    for ask in (ops.splits_k, ops.uses_strassen, ops.uses_packed_strassen):
        with pytest.raises(ValueError, match=r"a product of \(m, n, k\) = \(8388608, "
                                             r"8388608, 2\) has a matrix of more floats than a "
                                             r"process can address"):
            ask(2**23, 2**23, 2, 2) if ask is not ops.uses_packed_strassen else ask(2**23, 2,
                                                                                     2**23, 2)
    assert ops.splits_k(16, 16, 2**40, 2) is ops.have_openmp()
    # an empty product is answered, as the core answers it
    assert ops.splits_k(0, 16, 2**63 - 1, 2) is _core.gemm_splits_k(0, 16, 2**63 - 1, 2) is False
