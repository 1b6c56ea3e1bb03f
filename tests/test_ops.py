"""Each C++ op against the NumPy reference on random odd shapes (zero sizes included) and
thread counts, forward and backward.

Tolerances: im2col, col2im, pooling and the fused bias + ReLU + max-pool only move or compare
values (col2im adds at most R*S of them), so they must match to float32 rounding; products go
through the GEMM and are compared relative to the size of their terms. Hypothesis draws the
examples of the profile in conftest.py.
"""

import contextlib
import os
import re
import sys
import tempfile

import numpy as np
import pytest
from conftest import beyond_asan
from hypothesis import assume, example, given
from hypothesis import strategies as st

from pyhet import _core, ops
from pyhet.backends import numpy_ref as ref
from pyhet.backends.cpu import CpuBackend
from pyhet.errors import ArchitectureError
from pyhet.geometry import ConvGeometry
from pyhet.optim import SGDConfig, sgd_update, sgd_update_into

# 3 and 7 split rows, channels and planes unevenly, and 7 often gets more threads than work.
THREADS = st.sampled_from([1, 2, 3, 7])


@st.composite
def conv_geometry(draw):
    N = draw(st.integers(0, 3))
    C = draw(st.integers(0, 4))
    R = draw(st.integers(1, 5))
    S = draw(st.integers(1, 5))
    stride = draw(st.integers(1, 3))
    pad = draw(st.integers(0, 2))
    H = draw(st.integers(max(1, R - 2 * pad), 13))
    W = draw(st.integers(max(1, S - 2 * pad), 13))
    return N, C, H, W, R, S, stride, pad


@st.composite
def channel_ranges(draw, C):
    """None (every channel) or (c0, c1), 0 <= c0 <= c1 <= C: the share of one device."""
    if draw(st.booleans()):
        return None
    c0 = draw(st.integers(0, C))
    return c0, draw(st.integers(c0, C))


def rand(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


@contextlib.contextmanager
def forced_kernel(kernel):
    """The GEMM's micro-kernel forced to `kernel` (the test skipped where this CPU or build
    has none), then back to the default."""
    try:
        _core.set_gemm_kernel(kernel)
    except ValueError:
        pytest.skip(f"no {kernel} kernel on this CPU or build")
    try:
        yield
    finally:
        _core.set_gemm_kernel("auto")


def assert_packs_the_quadrant_sums(col, fwd, t, rng, strassen=(None,)):
    """fwd and t (PackedQuadrants, either None) hold what pack_quadrants of col and col^T
    would: products by them give the same bits, for each of the strassen settings."""
    K, NP = col.shape
    a, dy = rand(rng, 5, K), rand(rng, 4, NP)
    for packed, left, trans in ((fwd, a, False), (t, dy, True)):
        if packed is None:
            continue
        room = ops.packed_quadrants(NP, K, trans_b=True) if trans else ops.packed_quadrants(K, NP)
        want = ops.pack_quadrants(col, room)
        for s in strassen:
            np.testing.assert_array_equal(ops.sgemm_packed(left, packed, strassen=s),
                                          ops.sgemm_packed(left, want, strassen=s))


# ------------------------------------------------------------------------------------------------
# im2col / col2im


@given(conv_geometry(), THREADS, st.data(), st.integers(0, 2**31))
def test_im2col_matches_reference(geom, threads, data, seed):
    """With channels, only the rows of those input channels are written; the rest of the
    output keeps what it held (NaN here)."""
    N, C, H, W, R, S, stride, pad = geom
    channels = data.draw(channel_ranges(C), "channels")
    x = rand(np.random.default_rng(seed), N, C, H, W)
    want = ref.im2col(x, R, S, stride, pad)
    out = np.full(want.shape, np.nan, np.float32)
    got = ops.im2col(x, R, S, stride, pad, out=out, channels=channels, threads=threads)
    assert got is out
    if channels is not None:
        rows = np.arange(want.shape[0]) // (R * S)
        want[(rows < channels[0]) | (rows >= channels[1])] = np.nan
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("kernel", ["portable", "avx2-fma", "avx512"])
@given(conv_geometry(), THREADS, st.data(), st.integers(0, 2**31))
def test_im2col_pack_holds_the_packed_im2col(kernel, geom, threads, data, seed):
    """im2col_pack fills col packed (fwd) and col^T packed (t) as pack_b of the matrix would,
    in pieces of images filled in any order: multiplying by the identity gives the matrix back
    exactly, padding zeros included, for each micro-kernel's panel width."""
    N, C, H, W, R, S, stride, pad = geom
    with forced_kernel(kernel):
        x = rand(np.random.default_rng(seed), N, C, H, W)
        col = ref.im2col(x, R, S, stride, pad)
        K, NP = col.shape
        fwd, t = ops.packed_b(K, NP), ops.packed_b(NP, K, trans_b=True)
        cuts = sorted(data.draw(st.lists(st.integers(0, N), max_size=3), "cuts"))
        pieces = list(zip([0] + cuts, cuts + [N]))
        order = data.draw(st.permutations(pieces), "order")
        for n0, n1 in order:
            ops.im2col_pack(x, R, S, stride, pad, fwd=fwd, t=t, images=(n0, n1), threads=threads)
        np.testing.assert_array_equal(ops.sgemm_packed(np.eye(K, dtype=np.float32), fwd), col)
        np.testing.assert_array_equal(ops.sgemm_packed(np.eye(NP, dtype=np.float32), t), col.T)
        # one of them alone, all images at once
        only = ops.packed_b(NP, K, trans_b=True)
        ops.im2col_pack(x, R, S, stride, pad, t=only, threads=threads)
        np.testing.assert_array_equal(ops.sgemm_packed(np.eye(NP, dtype=np.float32), only), col.T)
        # fwd alone, in the same pieces
        alone = ops.packed_b(K, NP)
        for n0, n1 in order:
            ops.im2col_pack(x, R, S, stride, pad, fwd=alone, images=(n0, n1), threads=threads)
        np.testing.assert_array_equal(ops.sgemm_packed(np.eye(K, dtype=np.float32), alone), col)


def test_im2col_pack_says_what_it_expected():
    x = np.zeros((2, 3, 6, 6), np.float32)             # col (27, 32) for a 3x3 kernel
    with pytest.raises(ValueError, match=r"fwd: expected a PackedB of op\(b\) = col \(27, 32\)"):
        ops.im2col_pack(x, 3, 3, fwd=ops.packed_b(32, 27))
    with pytest.raises(ValueError, match=r"t: expected a PackedB of op\(b\) = col\^T \(32, 27\)"):
        ops.im2col_pack(x, 3, 3, t=ops.packed_b(32, 27))
    with pytest.raises(TypeError, match="fwd: expected None or a PackedB"):
        ops.im2col_pack(x, 3, 3, fwd=np.zeros((27, 32), np.float32))
    with pytest.raises(ValueError, match=r"images: expected a range .* <= 2, got \(1, 3\)"):
        ops.im2col_pack(x, 3, 3, t=ops.packed_b(32, 27, trans_b=True), images=(1, 3))
    with pytest.raises(ValueError, match="im2col_pack: a 7x7 kernel does not fit a 6x6 input"):
        ops.im2col_pack(x, 7, 7, fwd=ops.packed_b(147, 0))
    # both operands hold rows of the same micro-kernel's width: two kernels of two widths
    try:
        _core.set_gemm_kernel("avx512")
    except ValueError:
        return   # a CPU or build without the AVX-512 kernel has one width only
    try:
        wide = ops.packed_b(27, 32)
    finally:
        _core.set_gemm_kernel("portable")
    try:
        narrow = ops.packed_b(32, 27, trans_b=True)
    finally:
        _core.set_gemm_kernel("auto")
    with pytest.raises(ValueError, match="fwd and t: packed for different micro-kernels"):
        ops.im2col_pack(x, 3, 3, fwd=wide, t=narrow)


@pytest.mark.parametrize("kernel", ["portable", "avx512"])
@given(conv_geometry(), THREADS, st.data(), st.integers(0, 2**31))
def test_im2col_pack_quadrants_holds_the_quadrant_sums_of_im2col(kernel, geom, threads, data,
                                                                 seed):
    """im2col_pack_quadrants packs the same bits as pack_quadrants of the im2col matrix (the
    same sums of the same values), in pieces of each half's images filled in any order: a
    product by either gives the same bits, by Strassen's scheme and by the four products."""
    N, C, H, W, R, S, stride, pad = geom
    N, C = 2 * N, 2 * max(C, 1)
    with forced_kernel(kernel):
        rng = np.random.default_rng(seed)
        x = rand(rng, N, C, H, W)
        col = ref.im2col(x, R, S, stride, pad)
        K, NP = col.shape
        fwd, t = ops.packed_quadrants(K, NP), ops.packed_quadrants(NP, K, trans_b=True)
        cuts = sorted(data.draw(st.lists(st.integers(0, N // 2), max_size=3), "cuts"))
        pieces = list(zip([0] + cuts, cuts + [N // 2]))
        for n0, n1 in data.draw(st.permutations(pieces), "order"):
            ops.im2col_pack_quadrants(x, R, S, stride, pad, fwd=fwd, t=t, images=(n0, n1),
                                      threads=threads)
        assert_packs_the_quadrant_sums(col, fwd, t, rng, strassen=(False, True))
        # one of them alone, all images at once
        only = ops.packed_quadrants(NP, K, trans_b=True)
        ops.im2col_pack_quadrants(x, R, S, stride, pad, t=only, threads=threads)
        assert_packs_the_quadrant_sums(col, None, only, rng)


@pytest.mark.parametrize("kernel", ["portable", "avx512"])
@pytest.mark.parametrize("hw,k", [(12, 3), (14, 5), (3, 3)])
def test_im2col_pack_in_chunks_of_images(kernel, hw, k):
    """Both packings go through the images in chunks (as many as fill whole slivers: 8 of 100
    pixels on a 32-wide kernel), at multiples of the chunk: ranges that start and end inside
    chunks, filled in any order, still pack every column once, whole or in quadrants, and fwd
    alone too."""
    with forced_kernel(kernel):
        rng = np.random.default_rng(hw)
        x = rand(rng, 46, 4, hw, hw)
        col = ref.im2col(x, k, k, 1, 0)
        K, NP = col.shape
        fwd, t = ops.packed_b(K, NP), ops.packed_b(NP, K, trans_b=True)
        qf, qt = ops.packed_quadrants(K, NP), ops.packed_quadrants(NP, K, trans_b=True)
        alone = ops.packed_b(K, NP)
        for n0, n1 in [(13, 46), (0, 5), (5, 13)]:
            ops.im2col_pack(x, k, k, fwd=fwd, t=t, images=(n0, n1), threads=2)
            ops.im2col_pack(x, k, k, fwd=alone, images=(n0, n1), threads=2)
        for n0, n1 in [(9, 23), (0, 3), (3, 9)]:
            ops.im2col_pack_quadrants(x, k, k, fwd=qf, t=qt, images=(n0, n1), threads=2)
        np.testing.assert_array_equal(ops.sgemm_packed(np.eye(K, dtype=np.float32), fwd), col)
        np.testing.assert_array_equal(ops.sgemm_packed(np.eye(K, dtype=np.float32), alone), col)
        np.testing.assert_array_equal(ops.sgemm_packed(np.eye(NP, dtype=np.float32), t), col.T)
        assert_packs_the_quadrant_sums(col, qf, qt, rng)


@pytest.mark.parametrize("which", ["both", "fwd", "t"])
def test_im2col_pack_quadrants_in_units_of_an_image_and_a_sum(which):
    """Ranges of (image, sum) units that start and end inside images (some of an image's sums
    by one caller, the rest by another), filled in any order and across chunks of images,
    pack every sum of every image once: the same bits as pack_quadrants of the matrix."""
    rng = np.random.default_rng(7)
    x = rand(rng, 30, 4, 12, 12)
    col = ref.im2col(x, 3, 3, 1, 1)
    K, NP = col.shape
    fwd = ops.packed_quadrants(K, NP) if which != "t" else None
    t = ops.packed_quadrants(NP, K, trans_b=True) if which != "fwd" else None
    total = ops.quadrant_units(30, fwd=fwd is not None, t=t is not None)
    assert total == 15 * (11 if which == "both" else 7)
    cuts = sorted({5, 13, 40, total - 3})
    pieces = list(zip([0] + cuts, cuts + [total]))
    for u0, u1 in reversed(pieces):
        ops.im2col_pack_quadrants(x, 3, 3, 1, 1, fwd=fwd, t=t, units=(u0, u1), threads=2)
    assert_packs_the_quadrant_sums(col, fwd, t, rng)
    with pytest.raises(ValueError, match=f"units: .* <= {total}, got \\(0, {total + 1}\\)"):
        ops.im2col_pack_quadrants(x, 3, 3, 1, 1, fwd=fwd, t=t, units=(0, total + 1))
    with pytest.raises(ValueError, match="images or units, not both"):
        ops.im2col_pack_quadrants(x, 3, 3, 1, 1, fwd=fwd, t=t, units=(0, 1), images=(0, 1))


def test_im2col_pack_quadrants_says_what_it_expected():
    x = np.zeros((2, 4, 6, 6), np.float32)             # col (36, 32) for a 3x3 kernel
    fwd, t = ops.packed_quadrants(36, 32), ops.packed_quadrants(32, 36, trans_b=True)
    cases = [
        (lambda: ops.im2col_pack_quadrants(np.zeros((3, 4, 6, 6), np.float32), 3, 3),
         ValueError, r"even batch and channel count, got x of shape \(3, 4, 6, 6\)"),
        (lambda: ops.im2col_pack_quadrants(np.zeros((2, 3, 6, 6), np.float32), 3, 3),
         ValueError, "even batch and channel count"),
        (lambda: ops.im2col_pack_quadrants(x, 3, 3, fwd=t), ValueError,
         r"expected fwd of op\(b\) \(36, 32\), got \(32, 36\) \(trans_b\)"),
        (lambda: ops.im2col_pack_quadrants(x, 3, 3, t=fwd), ValueError,
         r"expected t of op\(b\) \(32, 36\) \(trans_b\)"),
        (lambda: ops.im2col_pack_quadrants(x, 3, 3, fwd=ops.packed_b(36, 32)), TypeError,
         "expected a PackedQuadrants"),
        (lambda: ops.im2col_pack_quadrants(x, 3, 3, fwd=fwd, images=(0, 2)), ValueError,
         r"images: expected a range .* <= 1, got \(0, 2\)"),
        (lambda: ops.im2col_pack_quadrants(x, 7, 7, fwd=fwd), ValueError, "does not fit"),
    ]
    for call, error, match in cases:
        with pytest.raises(error, match=match) as e:
            call()
        assert "\n" not in str(e.value)


@given(conv_geometry(), THREADS, st.data(), st.integers(0, 2**31))
def test_col2im_matches_reference(geom, threads, data, seed):
    """With channels, only those channels of the output are written (from their rows of col)."""
    N, C, H, W, R, S, stride, pad = geom
    channels = data.draw(channel_ranges(C), "channels")
    rng = np.random.default_rng(seed)
    OH, OW = ref.out_size(H, R, stride, pad), ref.out_size(W, S, stride, pad)
    col = rand(rng, C * R * S, N * OH * OW)
    out = np.full((N, C, H, W), np.nan, np.float32)
    got = ops.col2im(col, (N, C, H, W), R, S, stride, pad, out=out, channels=channels,
                     threads=threads)
    want = ref.col2im(col.astype(np.float64), (N, C, H, W), R, S, stride, pad)
    if channels is not None:
        want[:, :channels[0]] = want[:, channels[1]:] = np.nan
    # each value sums up to R * S float32 entries of col: its rounding grows with them
    atol = 1e-7 * R * S * max(1.0, float(np.abs(col).max(initial=0.0)))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=atol)


def test_col2im_overwrites_its_output():
    x = np.full((1, 1, 4, 4), np.nan, np.float32)
    ops.col2im(np.ones((9, 4), np.float32), (1, 1, 4, 4), 3, 3, out=x)
    assert np.isfinite(x).all() and x[0, 0, 1, 1] == 4 and x[0, 0, 0, 0] == 1


@given(conv_geometry(), THREADS, st.lists(st.integers(0, 9), max_size=3), st.data(),
       st.integers(0, 2**31))
def test_col2im_product_matches_reference(geom, threads, kernels, data, seed):
    """col2im(sum_j w_j^T @ dy_j): any number of parts (none: zeros), parts without kernels,
    weights and output gradients that are blocks of bigger matrices; with channels, only those
    channels of the output are written."""
    N, C, H, W, R, S, stride, pad = geom
    channels = data.draw(channel_ranges(C), "channels")
    rng = np.random.default_rng(seed)
    OH, OW = ref.out_size(H, R, stride, pad), ref.out_size(W, S, stride, pad)
    rows, cols = C * R * S, N * OH * OW
    ws = [rand(rng, k, rows + 3)[:, 1:rows + 1] for k in kernels]   # rows further apart
    dys = [rand(rng, k + 2, cols)[1:k + 1] for k in kernels]
    out = np.full((N, C, H, W), np.nan, np.float32)
    got = ops.col2im_product(ws, dys, (N, C, H, W), R, S, stride, pad, out=out,
                             channels=channels, threads=threads)
    assert got is out
    dcol = np.zeros((rows, cols))
    for w, dy in zip(ws, dys):
        dcol += w.T.astype(np.float64) @ dy.astype(np.float64)
    want = ref.col2im(dcol, (N, C, H, W), R, S, stride, pad)
    if channels is not None:
        want[:, :channels[0]] = want[:, channels[1]:] = np.nan
    scale = sum(float(np.abs(w).max(initial=0.0)) * float(np.abs(d).max(initial=0.0))
                for w, d in zip(ws, dys))
    atol = 1e-6 * R * S * (sum(kernels) + 1) * max(1.0, scale)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=atol)


@pytest.mark.parametrize("kernel", ["portable", "avx2-fma", "avx512"])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_col2im_product_is_sgemm_then_col2im(kernel, threads):
    """In blocks of images and channels (several of each here, for an L2 up to 4 MiB), the same bits
    as the product into dcol and col2im of it, for each micro-kernel (K within one K block);
    channels past the range are left as they were."""
    rng = np.random.default_rng(3)
    N, C, H, R, pad = 21, 200, 10, 5, 1                # 8x8 maps: 64 columns an image
    shape = (N, C, H, H)
    rows, cols = C * R * R, N * 64
    parts = [(rand(rng, k, rows), rand(rng, k, cols)) for k in (37, 0, 28)]
    with forced_kernel(kernel):
        dcol = np.zeros((rows, cols), np.float32)
        for w, dy in parts:
            ops.sgemm(w, dy, dcol, trans_a=True, beta=1.0, threads=threads)
        want = np.full(shape, 5.0, np.float32)
        ops.col2im(dcol, shape, R, R, 1, pad, out=want, channels=(3, 197), threads=threads)
        got = np.full(shape, 5.0, np.float32)
        ops.col2im_product([w for w, _ in parts], [dy for _, dy in parts], shape, R, R, 1, pad,
                           out=got, channels=(3, 197), threads=threads)
        np.testing.assert_array_equal(got, want)


def test_col2im_product_says_what_it_expected():
    w, dy = np.zeros((2, 18), np.float32), np.zeros((2, 32), np.float32)   # 2x3x6x6, 3x3
    x = np.zeros((2, 2, 6, 6), np.float32)
    cases = [
        (lambda: ops.col2im_product(w, [dy], x.shape, 3, 3), TypeError,
         "ws and dys: expected lists of float32 matrices, got ndarray and list"),
        (lambda: ops.col2im_product([w], [dy, dy], x.shape, 3, 3), ValueError,
         "one dy a w, got 1 ws and 2 dys"),
        (lambda: ops.col2im_product([w.astype(np.float64)], [dy], x.shape, 3, 3), TypeError,
         r"ws\[0\]: expected dtype float32, got float64"),
        (lambda: ops.col2im_product([w[:, :10]], [dy], x.shape, 3, 3), ValueError,
         r"ws\[0\]: expected shape \(2, 18\), got \(2, 10\)"),
        (lambda: ops.col2im_product([w], [dy[:1]], x.shape, 3, 3), ValueError,
         r"dys\[0\]: expected shape \(2, 32\), got \(1, 32\)"),
        (lambda: ops.col2im_product([w], [dy], x.shape, 3, 3, out=x[:1]), ValueError,
         "out"),
        (lambda: ops.col2im_product([w], [dy], x.shape, 3, 3, channels=(0, 3)), ValueError,
         "channels"),
        (lambda: ops.col2im_product([w], [dy], x.shape, 7, 7), ValueError, "does not fit"),
        (lambda: ops.col2im_product([w], [dy], x.shape, 3, 3, threads=0), ValueError,
         "threads"),
    ]
    for call, error, match in cases:
        with pytest.raises(error, match=match) as e:
            call()
        assert "\n" not in str(e.value)
    flat = x.reshape(-1)
    with pytest.raises(ValueError, match="overlaps"):
        ops.col2im_product([flat[:36].reshape(2, 18)], [dy], x.shape, 3, 3, out=x)
    # no kernels: zeros, whatever the kernel's size (no block of its rows is made)
    np.testing.assert_array_equal(
        ops.col2im_product([], [], (4, 1, 1, 1), 2**30, 2**30, 1, 2**29, threads=2),
        np.zeros((4, 1, 1, 1), np.float32))


# ------------------------------------------------------------------------------------------------
# Max-pool


@st.composite
def pool_geometry(draw):
    k = draw(st.integers(1, 4))
    s = draw(st.integers(1, 4))
    return (draw(st.integers(0, 3)), draw(st.integers(0, 4)), draw(st.integers(k, 12)),
            draw(st.integers(k, 12)), k, s)


@given(pool_geometry(), st.booleans(), THREADS, st.integers(0, 2**31))
def test_maxpool_matches_reference(geom, ties, threads, seed):
    N, C, H, W, k, s = geom
    rng = np.random.default_rng(seed)
    # small integers make ties common: the first maximum must win in both
    x = (rng.integers(-3, 4, (N, C, H, W)) if ties else rng.standard_normal((N, C, H, W)))
    x = x.astype(np.float32)
    out, arg = ops.maxpool(x, k, s, threads=threads)
    rout, rarg = ref.maxpool_forward(x, k, s)
    np.testing.assert_array_equal(out, rout)
    np.testing.assert_array_equal(arg, rarg)
    dout = rand(rng, *out.shape)
    np.testing.assert_allclose(ops.maxpool_backward(dout, arg, x.shape, threads=threads),
                               ref.maxpool_backward(dout, rarg, x.shape, k, s), rtol=1e-6,
                               atol=1e-6)
    # the reference's rounds of windows that do not overlap (a fixed order of the sums on a
    # GPU too) add every gradient once, as one scatter-add does: exact on whole numbers
    whole = rng.integers(-50, 50, out.shape).astype(np.float64)
    np.testing.assert_array_equal(ref.maxpool_backward(whole, rarg, x.shape, k, s),
                                  ref.maxpool_backward(whole, rarg, x.shape))


def _maxpool_loops(x, k, s):
    """Max-pool window by window in Python: the first maximum wins, a NaN over everything (the
    first of several), -0.0 and 0.0 equal (the first kept, bit for bit)."""
    N, C, H, W = x.shape
    PH, PW = (H - k) // s + 1, (W - k) // s + 1
    y, arg = np.empty((N, C, PH, PW), x.dtype), np.empty((N, C, PH, PW), np.int32)
    for n, c, p, q in np.ndindex(N, C, PH, PW):
        best, at = None, None
        for i in range(k):
            for j in range(k):
                h, w = p * s + i, q * s + j
                v = x[n, c, h, w]
                if best is None or (not np.isnan(best) and (v > best or np.isnan(v))):
                    best, at = v, h * W + w
        y[n, c, p, q], arg[n, c, p, q] = best, at
    return y, arg


@given(pool_geometry(), st.integers(0, 2**31), st.booleans(),
       st.sampled_from([np.float32, np.float64, np.longdouble]))
# a window that is x itself (one plane, one row of windows, stride 1): nothing may write to it
@example((1, 1, 2, 3, 2, 1), 0, False, np.float32)
@example((1, 1, 2, 5, 2, 1), 1, False, np.float64)
@example((1, 1, 3, 4, 3, 1), 2, False, np.float32)
def test_maxpool_reference_against_loops_bit_for_bit(geom, seed, strided, dtype):
    """The reference's select by bit masks against plain loops, on values with ties, signed
    zeros, infinities and NaNs, windows that overlap or skip, strided inputs; x is left as it
    was (a window can be x itself)."""
    N, C, H, W, k, s = geom
    rng = np.random.default_rng(seed)
    values = np.array([0.0, -0.0, 1.0, -1.0, 2.5, np.nan, np.inf, -np.inf], dtype)
    bits = {4: np.int32, 8: np.int64}.get(values.itemsize)   # (none for a long double)

    def same(a, b):   # bit for bit; a long double's by value and sign (it has padding bytes)
        if bits is not None:
            return np.testing.assert_array_equal(a.view(bits), b.view(bits))
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(np.signbit(a), np.signbit(b))

    x = rng.choice(values, (N, C, H, 2 * W if strided else W))
    if strided:
        x = x[..., ::2]
    before = x.copy()
    y, arg = ref.maxpool_forward(x, k, s)
    ly, larg = _maxpool_loops(x, k, s)
    same(y, ly)
    np.testing.assert_array_equal(arg, larg)
    assert y.dtype == dtype and arg.dtype == np.int32
    assert y.flags.c_contiguous and arg.flags.c_contiguous
    same(x, before)


def test_maxpool_propagates_nan_like_torch():
    x = np.array([[[[1, np.nan], [5, 2]]]], np.float32)
    out, arg = ops.maxpool(x, 2)
    rout, rarg = ref.maxpool_forward(x, 2)
    assert np.isnan(out).all() and np.isnan(rout).all()
    assert arg.item() == rarg.item() == 1


@st.composite
def block_geometry(draw):
    """K, N, H, W, pool k, stride s: no pooling (k = s = 1), overlapping windows (s < k),
    skipped inputs (s > k), odd plane sizes."""
    k = draw(st.integers(1, 3))
    s = draw(st.integers(1, 3))
    return (draw(st.integers(1, 7)), draw(st.integers(1, 3)), draw(st.integers(k, 11)),
            draw(st.integers(k, 11)), k, s)


def fused_reference(y, b, k, s):
    """The fused op composed from the reference: bias, ReLU, the transpose to NCHW, max-pool.
    y (K, N, H, W), b (K,) -> r (N, K, H, W) = relu(y + b), out, arg (N, K, PH, PW)."""
    r = np.ascontiguousarray(ref.relu_forward(y + b[:, None, None, None]).transpose(1, 0, 2, 3))
    out, arg = ref.maxpool_forward(r, k, s)
    return r, out, arg


def fused_grad_reference(dout, rarg, r, k, s):
    """dy (K, N, H, W) of the fused op, in float64: maxpool_backward then relu_backward. The
    fused op keeps the arg of a NaN output (a NaN beats ReLU), so its gradient reaches the NaN
    input, where relu_backward (as torch's) would drop it: the reference passes it there too."""
    d = ref.maxpool_backward(dout.astype(np.float64), rarg, r.shape, k, s)
    return np.where(np.isnan(r), d, ref.relu_backward(d, r)).transpose(1, 0, 2, 3)


def check_fused(y, b, k, s, threads, rng):
    """ops.bias_relu_maxpool and its backward against the composed reference.

    Tolerances: the forward only compares and adds the bias once, so it must match exactly;
    the backward adds at most ceil(k/s)^2 <= 9 float32 gradients per input, compared with the
    float64 sum to rtol 1e-6 plus 1e-6 per term of the size of the largest."""
    out, arg = ops.bias_relu_maxpool(y, b, k, s, threads=threads)
    r, rout, rarg = fused_reference(y, b, k, s)
    assert out.dtype == np.float32 and arg.dtype == np.int32
    assert out.shape == arg.shape == rout.shape
    np.testing.assert_array_equal(out, rout)
    # where the output is positive or NaN, the same input was chosen; elsewhere ReLU zeroed it
    kept = (rout > 0) | np.isnan(rout)
    np.testing.assert_array_equal(arg[kept], rarg[kept])
    assert (arg[~kept] == -1).all()
    dout = rand(rng, *out.shape)
    dy = ops.bias_relu_maxpool_backward(dout, arg, y.shape, k, s, threads=threads)
    assert dy.dtype == np.float32 and dy.shape == y.shape
    terms = (-(-k // s)) ** 2  # ceil(k / s) squared
    np.testing.assert_allclose(dy, fused_grad_reference(dout, rarg, r, k, s), rtol=1e-6,
                               atol=1e-6 * terms * (np.abs(dout).max() + 1))


@given(block_geometry(), st.booleans(), st.booleans(), THREADS, st.integers(0, 2**31))
def test_bias_relu_maxpool_matches_reference(geom, ties, nans, threads, seed):
    K, N, H, W, k, s = geom
    rng = np.random.default_rng(seed)
    # small integers make ties common: the first maximum must win in both
    y = (rng.integers(-2, 3, (K, N, H, W)) if ties else rng.standard_normal((K, N, H, W)))
    y = y.astype(np.float32)
    if nans:  # a NaN wins its window, and passes ReLU
        y.reshape(-1)[rng.integers(0, y.size, 1 + y.size // 10)] = np.nan
    b = (rng.integers(-1, 2, K) if ties else rng.standard_normal(K)).astype(np.float32)
    check_fused(y, b, k, s, threads, rng)


@pytest.mark.parametrize("H, W", [(2, 8), (4, 18), (5, 9), (28, 28)])
def test_bias_relu_maxpool_2x2_with_infinities_and_nans(H, W):
    """The 2 x 2 pool at stride 2 (four windows at a time, then the rest of the row) on planes
    with infinities, NaNs and ties, wider than the hypothesis test's: as the reference."""
    rng = np.random.default_rng(H * 100 + W)
    K, N = 4, 2
    y = rng.integers(-2, 3, (K, N, H, W)).astype(np.float32)
    y[0, 0, 0, :] = np.inf
    y[1, 1, -1, ::3] = -np.inf
    y[2, 0, :, 1] = np.nan
    y.reshape(-1)[rng.integers(0, y.size, 3)] = np.nan
    b = np.array([-1.0, 0.5, 0.0, 2.0], np.float32)
    check_fused(y, b, 2, 2, 1, rng)


@pytest.mark.parametrize("H, W", [(1, 1), (3, 5), (7, 7), (17, 13), (1, 255)])
def test_bias_relu_without_pooling(H, W):
    """pool = stride = 1: relu(y + bias) transposed to NCHW, arg the element's own index or -1,
    on plane sizes around the vector width (the fast path's loops have remainders)."""
    rng = np.random.default_rng(H * 1000 + W)
    K, N = 5, 3
    y = rand(rng, K, N, H, W)
    y[0, 0, 0, 0] = np.nan
    b = rand(rng, K)
    out, arg = ops.bias_relu_maxpool(y, b, 1, 1, threads=2)
    want = np.maximum(y + b[:, None, None, None], 0).transpose(1, 0, 2, 3)
    np.testing.assert_array_equal(out, want)
    own = np.broadcast_to(np.arange(H * W, dtype=np.int32).reshape(H, W), out.shape)
    np.testing.assert_array_equal(arg, np.where((want > 0) | np.isnan(want), own, -1))
    check_fused(y, b, 1, 1, 2, rng)


def test_bias_relu_maxpool_overlapping_windows_accumulate():
    """3x3 windows, stride 2: an input that is the max of several windows gets every gradient."""
    y = np.zeros((1, 1, 5, 5), np.float32)
    y[0, 0, 2, 2] = 1  # the centre belongs to all four windows
    out, arg = ops.bias_relu_maxpool(y, np.zeros(1, np.float32), 3, 2)
    assert out.shape == (1, 1, 2, 2) and (out == 1).all() and (arg == 2 * 5 + 2).all()
    dout = np.array([[[[1, 2], [3, 4]]]], np.float32)
    dy = ops.bias_relu_maxpool_backward(dout, arg, y.shape, 3, 2)
    assert dy[0, 0, 2, 2] == 10 and np.count_nonzero(dy) == 1


# ------------------------------------------------------------------------------------------------
# The conv block of the C++ backend against the reference, forward and backward


@st.composite
def conv_blocks(draw):
    """A conv block (ConvGeometry) with odd sizes, stride, padding and a pool of its own
    window and stride (1, 1: none), and a batch size."""
    R = draw(st.integers(1, 4))
    stride, pad = draw(st.integers(1, 2)), draw(st.integers(0, min(2, R - 1)))
    pool, pool_stride = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    assume(pool > 1 or pool_stride > 1 or draw(st.booleans()))
    # at least a pool window of conv output, and up to 4 strides more
    lo = max(1, (pool - 1) * stride + R - 2 * pad)
    H, W = draw(st.integers(lo, lo + 4 * stride)), draw(st.integers(lo, lo + 4 * stride))
    try:
        g = ConvGeometry("t", draw(st.integers(1, 5)), H, W, draw(st.integers(1, 9)), R, R,
                         stride, pad, pool, pool_stride)
    except ArchitectureError:
        assume(False)
    return g, draw(st.integers(1, 3))


@given(conv_blocks(), st.integers(0, 2**31))
def test_cpu_conv_block_matches_reference(block, seed):
    g, N = block
    rng = np.random.default_rng(seed)
    x, w, b = rand(rng, *g.x_shape(N)), rand(rng, *g.weight_shape), rand(rng, g.K)
    be = CpuBackend(2)
    col = be.im2col(x, g, key="t")
    out, saved = be.block_forward(col, x.shape, w, b, g, key="t")
    assert out.shape == g.out_batch_shape(g.K, N)
    rcol = ref.im2col(x.astype(np.float64), g.R, g.S, g.stride, g.pad)
    rout, rsaved = ref.conv_block_forward(rcol, x.shape, w.astype(np.float64),
                                          b.astype(np.float64), g.stride, g.pad, g.pool,
                                          g.pool_stride)
    scale = np.abs(w).reshape(g.K, -1).sum(1).max() * np.abs(x).max() + 1
    np.testing.assert_allclose(out, rout, rtol=0, atol=1e-5 * scale)
    dout = rand(rng, *out.shape)
    dcol, dw, db = be.block_backward(dout, saved, col, w, True)
    rdcol, rdw, rdb = ref.conv_block_backward(dout.astype(np.float64), rsaved, rcol,
                                              w.astype(np.float64))
    # an argmax may differ where two inputs of a window are within rounding; skip such draws
    assume(np.array_equal(saved[0] >= 0, rout > 0))
    np.testing.assert_allclose(dw, rdw, rtol=0, atol=1e-4 * (np.abs(rdw).max() + 1))
    np.testing.assert_allclose(db, rdb, rtol=0, atol=1e-4 * (np.abs(rdb).max() + 1))
    np.testing.assert_allclose(dcol, rdcol, rtol=0, atol=1e-4 * (np.abs(rdcol).max() + 1))
    dx = be.col2im(dcol, x.shape, g)
    rdx = ref.col2im(rdcol, x.shape, g.R, g.S, g.stride, g.pad)
    np.testing.assert_allclose(dx, rdx, rtol=0, atol=1e-4 * (np.abs(rdx).max() + 1))


def test_cpu_linear_matches_reference():
    rng = np.random.default_rng(0)
    x, w, b, dy = rand(rng, 5, 37), rand(rng, 3, 37), rand(rng, 3), rand(rng, 5, 3)
    be = CpuBackend(2)
    np.testing.assert_allclose(be.linear_forward(x, w, b), ref.linear_forward(x, w, b),
                               rtol=1e-5, atol=1e-5)
    for got, want in zip(be.linear_backward(dy, x, w), ref.linear_backward(dy, x, w)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------------
# The SGD update


@given(st.integers(0, 300), st.sampled_from([0.0, 0.9]), st.sampled_from([0.0, 1e-2]),
       st.booleans(), THREADS, st.integers(0, 2**31))
def test_sgd_update_matches_reference(n, momentum, weight_decay, first, threads, seed):
    """_core.sgd_update against pyhet.optim.sgd_update (torch.optim.SGD's rule), in place on
    flat arrays of odd lengths. Both round every operation to float32 in the same order, so they
    agree to a rounding or two (1e-6 relative, plus 1e-6 where p nearly cancels). Without
    momentum the buffer v is neither read nor written."""
    rng = np.random.default_rng(seed)
    p, g, v = rand(rng, n), rand(rng, n), rand(rng, n)
    cfg = SGDConfig(0.05, momentum, weight_decay)
    want_p = p.copy()
    want_v = sgd_update(want_p, g, None if first else v.copy(), cfg)
    got_p, got_v = p.copy(), v.copy()
    _core.sgd_update(got_p, g, got_v, cfg.lr, momentum, weight_decay, first, threads)
    np.testing.assert_allclose(got_p, want_p, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got_v, v if not momentum else want_v, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("threads", [2, 3])
def test_sgd_update_split_among_threads(threads):
    # split among threads only from 2^20 entries a thread (below, waking them costs more)
    n = (1 << 20) * threads + 7
    rng = np.random.default_rng(threads)
    p, g, v = rand(rng, n), rand(rng, n), rand(rng, n)
    cfg = SGDConfig(0.05, 0.9, 1e-2)
    want_p = p.copy()
    want_v = sgd_update(want_p, g, v.copy(), cfg)
    p_out, v_out = np.full_like(p, np.nan), np.full_like(v, np.nan)
    _core.sgd_update(p, g, v, cfg.lr, 0.9, 1e-2, False, threads, p_out, v_out)
    np.testing.assert_allclose(p_out, want_p, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(v_out, want_v, rtol=1e-6, atol=1e-6)
    _core.sgd_update(p, g, v, cfg.lr, 0.9, 1e-2, False, threads)  # in place
    np.testing.assert_array_equal(p, p_out)
    np.testing.assert_array_equal(v, v_out)

# ------------------------------------------------------------------------------------------------
# The SGD update


@given(st.integers(0, 300), st.sampled_from([0.0, 0.9]), st.sampled_from([0.0, 1e-2]),
       st.booleans(), THREADS, st.integers(0, 2**31))
def test_sgd_update_into_other_arrays_leaves_the_old_state(n, momentum, weight_decay, first,
                                                        threads, seed):
    """The out-of-place update (a device's staged update) writes the same new state as the
    reference into p_out and v_out, and leaves p, g and v exactly as they were; the backend's
    sgd_update_into agrees with pyhet.optim.sgd_update_into."""
    rng = np.random.default_rng(seed)
    p, g, v = rand(rng, n), rand(rng, n), rand(rng, n)
    cfg = SGDConfig(0.05, momentum, weight_decay)
    want_p = p.copy()
    want_v = sgd_update(want_p, g, None if first else v.copy(), cfg)
    before = (p.copy(), g.copy(), v.copy())
    p_out, v_out = np.full(n, np.nan, np.float32), np.full(n, np.nan, np.float32)
    _core.sgd_update(p, g, v, cfg.lr, momentum, weight_decay, first, threads, p_out, v_out)
    for a, b in zip((p, g, v), before):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(p_out, want_p, rtol=1e-6, atol=1e-6)
    if momentum:
        np.testing.assert_allclose(v_out, want_v, rtol=1e-6, atol=1e-6)
    ref_p, ref_v = sgd_update_into(p, g, None if first else v, cfg)
    got_p, got_v = CpuBackend(threads).sgd_update_into(p, g, None if first else v, cfg)
    np.testing.assert_allclose(got_p, ref_p, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(ref_p, want_p)     # the rule's operations in its order
    assert ref_p.dtype == np.float32
    # with momentum 0 the buffer is kept as it was (as sgd_update keeps it), in a buffer apart
    assert (got_v is None) == (ref_v is None) == (want_v is None) == (first and not momentum)
    if want_v is not None:
        np.testing.assert_allclose(got_v, want_v, rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(ref_v, want_v)
        assert not np.may_share_memory(got_v, v) and not np.may_share_memory(ref_v, v)
    with pytest.raises(ValueError, match="both p_out and v_out"):
        _core.sgd_update(p, g, v, 0.1, momentum, 0.0, first, threads, p_out, None)
    if n:   # empty arrays overlap nothing
        with pytest.raises(ValueError, match="p_out overlaps p"):
            _core.sgd_update(p, g, v, 0.1, momentum, 0.0, first, threads, p, v_out)



@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("weight_decay", [0.0, 1e-2])
def test_sgd_update_into_takes_one_temporary_and_keeps_mixed_dtypes_exact(momentum,
                                                                          weight_decay):
    """The update a GPU runs (pyhet.optim.sgd_update_into, on CuPy there) holds one
    temporary of p's size at most beside its five arrays (NumPy's allocations, traced); given
    outputs of another dtype, it writes the rule's expressions as NumPy promotes them."""
    import tracemalloc
    rng = np.random.default_rng(5)
    p, g, v = (rng.standard_normal(1 << 18).astype(np.float32) for _ in range(3))
    cfg = SGDConfig(0.05, momentum, weight_decay)
    p_out, v_out = np.empty_like(p), np.empty_like(p)
    tracemalloc.start()
    try:
        sgd_update_into(p, g, v, cfg, p_out, v_out)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak <= 1.1 * p.nbytes, peak / p.nbytes
    wide_p, wide_v = np.empty(p.shape), np.empty(p.shape)        # float64
    got_p, got_v = sgd_update_into(p, g, v, cfg, wide_p, wide_v)
    d = g + weight_decay * p if weight_decay else g
    want_v = (momentum * v + d).astype(np.float64) if momentum else v.astype(np.float64)
    want_p = p - 0.05 * (want_v if momentum else d)
    assert got_p is wide_p and got_v is wide_v
    np.testing.assert_array_equal(got_v, want_v)
    np.testing.assert_array_equal(got_p, want_p)


# ------------------------------------------------------------------------------------------------
# Bad input to the bindings: a clear exception, never a crash or a silent copy. (Every binding
# is also fuzzed with bad arguments in test_bindings.py.)


def test_core_refuses_wrong_dtype_layout_and_shapes():
    x = np.zeros((1, 2, 5, 5), np.float32)
    col = np.zeros((18, 9), np.float32)
    with pytest.raises(TypeError, match="float32"):
        _core.im2col(x.astype(np.float64), 3, 3, 1, 0, col)
    with pytest.raises(TypeError, match="array"):
        _core.im2col([[1.0]], 3, 3, 1, 0, col)
    with pytest.raises(ValueError, match="4-d"):
        _core.im2col(x[0], 3, 3, 1, 0, col)
    with pytest.raises(ValueError, match=r"expected shape \(18, 9\), got \(18, 8\)"):
        _core.im2col(x, 3, 3, 1, 0, np.zeros((18, 8), np.float32))
    with pytest.raises(ValueError, match="C-contiguous"):
        _core.im2col(x, 3, 3, 1, 0, np.zeros((9, 18), np.float32).T)
    ro = np.zeros((18, 9), np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        _core.im2col(x, 3, 3, 1, 0, ro)
    with pytest.raises(ValueError, match="does not fit"):
        ops.im2col(x, 7, 3)
    with pytest.raises(ValueError, match="stride"):
        _core.im2col(x, 3, 3, 0, 0, col)


def test_core_refuses_out_of_range_pool_indices():
    dout = np.ones((1, 1, 1, 1), np.float32)
    with pytest.raises(ValueError, match="outside"):
        ops.maxpool_backward(dout, np.array([[[[99]]]], np.int32), (1, 1, 2, 2))
    with pytest.raises(ValueError, match="outside"):
        ops.bias_relu_maxpool_backward(dout, np.array([[[[-2]]]], np.int32), (1, 1, 2, 2), 2)


@pytest.mark.parametrize("shape", [(1, 1, 4, 4), (1, 1, 5, 5), (1, 1, 5, 4)])
def test_pool_backward_refuses_an_index_outside_its_window(shape):
    """The forward picks each window's max inside that window: an index of another window of
    the plane is refused, with its position, not scattered (a pool that tiles the plane writes
    each window's block alone, and dropped it: 1 where 4 was due)."""
    dout, arg = np.ones((1, 1, 2, 2), np.float32), np.zeros((1, 1, 2, 2), np.int32)
    with pytest.raises(ValueError, match=r"index 0 at position 1 .* outside its 2x2 window"):
        ops.bias_relu_maxpool_backward(dout, arg, shape, 2, 2)
    arg[0, 0] = [[0, 3], [2 * shape[3] + 1, -1]]   # each inside its own window: taken
    dy = ops.bias_relu_maxpool_backward(dout, arg, shape, 2, 2)
    assert dy.sum() == 3 and dy[0, 0, 0, 0] == dy[0, 0, 0, 3] == dy[0, 0, 2, 1] == 1


def test_pool_refuses_bad_window_and_stride():
    y, b = np.zeros((2, 3, 4, 5), np.float32), np.zeros(2, np.float32)
    out, arg = np.zeros((3, 2, 1, 2), np.float32), np.zeros((3, 2, 1, 2), np.int32)
    dy = np.zeros_like(y)
    with pytest.raises(ValueError, match="pool stride must be >= 1, got 0"):
        ops.bias_relu_maxpool(y, b, 2, 0)
    with pytest.raises(ValueError, match="pool stride must be >= 1, got -1"):
        ops.bias_relu_maxpool_backward(out, arg, y.shape, 2, -1)
    with pytest.raises(ValueError, match="pool size must be >= 1, got 0"):
        ops.bias_relu_maxpool(y, b, 0)
    with pytest.raises(TypeError, match="pool stride must be an int, got float"):
        ops.bias_relu_maxpool(y, b, 2, 1.5)
    with pytest.raises(ValueError, match="window 5 is larger than the 4x5 input"):
        ops.bias_relu_maxpool(y, b, 5, 1)
    # the bindings check the same on their own
    with pytest.raises(ValueError, match="pool stride must be >= 1, got 0"):
        _core.bias_relu_maxpool(y, b, 2, 0, out, arg)
    with pytest.raises(ValueError, match="pool stride must be >= 1, got 0"):
        _core.bias_relu_maxpool_backward(out, arg, 2, 0, dy)
    with pytest.raises(ValueError, match="pool size must be >= 1, got 0"):
        _core.bias_relu_maxpool(y, b, 0, 1, out, arg)
    with pytest.raises(ValueError, match="window 5 is larger than the 4x5 conv output"):
        _core.bias_relu_maxpool(y, b, 5, 1, out, arg)
    with pytest.raises(ValueError, match="window 5 is larger than the 4x5 dy plane"):
        _core.bias_relu_maxpool_backward(out, arg, 5, 5, dy)
    # shapes follow the stride: 3x3 stride 1 on 4x5 is 2x3, not 1x1
    with pytest.raises(ValueError, match=r"out: expected shape \(3, 2, 2, 3\), got \(3, 2, 1, 2\)"):
        _core.bias_relu_maxpool(y, b, 3, 1, out, arg)
    with pytest.raises(ValueError, match=r"dout: expected shape \(3, 2, 2, 3\)"):
        _core.bias_relu_maxpool_backward(out, arg, 3, 1, dy)


def test_pool_without_pooling_refuses_foreign_indices():
    """pool = stride = 1 reads arg as a mask: an index other than -1 or its own is refused."""
    y, b = np.ones((1, 2, 3, 3), np.float32), np.zeros(1, np.float32)
    out, arg = ops.bias_relu_maxpool(y, b, 1)
    ops.bias_relu_maxpool_backward(out, arg, y.shape, 1)  # its own arg is fine
    bad = arg.copy()
    bad[1, 0, 2, 1] = 0
    with pytest.raises(ValueError, match="index 0 at position 7 of a plane without pooling"):
        ops.bias_relu_maxpool_backward(out, bad, y.shape, 1)
    bad = arg.copy()
    bad[0, 0, 0, 0] = -1  # a zeroed ReLU is fine
    dy = ops.bias_relu_maxpool_backward(out, bad, y.shape, 1)
    assert dy[0, 0, 0, 0] == 0 and dy[0, 0, 0, 1] == 1


def test_core_refuses_overlapping_output():
    a = np.ones((4, 4), np.float32)
    with pytest.raises(ValueError, match="overlaps"):
        _core.sgemm(a, a, a)


def test_blocks_of_one_matrix_are_refused_only_where_they_share_memory():
    """c and a (or b) as blocks of one matrix: refused exactly where they share an entry
    (np.shares_memory), and else the product is right and no entry of the matrix outside c
    changes (sgemm, and sgemm_packed with a and c of one matrix; 1 and 4 threads). Column
    blocks side by side used to be refused too, their byte spans meeting."""
    rng = np.random.default_rng(7)
    refused = accepted = 0
    for trial in range(600):
        w = rng.standard_normal((int(rng.integers(1, 9)), int(rng.integers(2, 13))),
                                dtype=np.float32)
        rows, cols = w.shape

        def block(h, wd):
            r0, c0 = int(rng.integers(0, rows - h + 1)), int(rng.integers(0, cols - wd + 1))
            return (slice(r0, r0 + h), slice(c0, c0 + wd))
        m, k = int(rng.integers(1, rows + 1)), int(rng.integers(1, min(rows, cols) + 1))
        n = int(rng.integers(1, cols + 1))
        a, into = w[block(m, k)], block(m, n)
        c = w[into]
        packed = trial % 3 == 2
        b = (np.ones((k, n), np.float32) if packed or rng.random() < 0.5 else w[block(k, n)])
        threads = 1 if trial % 2 else 4
        want = w.copy()
        want[into] = a.astype(np.float64) @ b.astype(np.float64)
        if packed:
            pb = ops.packed_b(k, n)
            ops.pack_b(b, pb)
            run = lambda: ops.sgemm_packed(a, pb, c, threads=threads)  # noqa: E731
        else:
            run = lambda: ops.sgemm(a, b, c, threads=threads)  # noqa: E731
        if np.shares_memory(c, a) or np.shares_memory(c, b):
            refused += 1
            before = w.copy()
            with pytest.raises(ValueError, match="overlaps"):
                run()
            np.testing.assert_array_equal(w, before)
        else:
            accepted += 1
            run()
            np.testing.assert_allclose(w, want, rtol=1e-5, atol=1e-5)
    assert refused > 50 and accepted > 50, (refused, accepted)
    w = np.ones((6, 8), np.float32)
    ops.sgemm(w[:, 0:4], w[:4, 4:6], w[:, 6:8])     # side by side: apart
    assert (w[:, 6:8] == 4).all() and (w[:, :6] == 1).all()


def test_ops_accept_non_contiguous_inputs():
    rng = np.random.default_rng(1)
    x = rand(rng, 2, 3, 9, 8)[:, :, ::-1]  # a reversed view
    np.testing.assert_array_equal(ops.im2col(x, 3, 3), ref.im2col(np.ascontiguousarray(x), 3, 3))


# ------------------------------------------------------------------------------------------------
# Bad arguments to pyhet.ops: one short line, never the arrays' contents


@pytest.mark.parametrize("call,error,words", [
    (lambda a, x: ops.gemm(a, a.T, threads=2**31), ValueError, ["threads", "at most 1024"]),
    (lambda a, x: ops.gemm(a, a.T, threads=2**63), ValueError, ["threads", "at most"]),
    (lambda a, x: ops.gemm(a, a.T, threads=1.0), TypeError, ["threads", "int"]),
    (lambda a, x: ops.sgemm(a, a.T, threads=10**6), ValueError, ["threads"]),
    (lambda a, x: ops.sgemm(a, a.T, alpha="2"), TypeError, ["sgemm", "alpha", "number"]),
    (lambda a, x: ops.sgemm(a, a.T, trans_a="yes"), TypeError, ["sgemm", "trans_a"]),
    (lambda a, x: ops.im2col(x, 2**31, 3), ValueError, ["im2col", "kh", "2**31 - 1"]),
    (lambda a, x: ops.im2col(x, 3, 3, 1.5), TypeError, ["im2col", "stride", "int"]),
    (lambda a, x: ops.im2col(x, 3, 3, 1, -1), ValueError, ["im2col", "pad", ">= 0"]),
    (lambda a, x: ops.im2col(x, 3, 3, 1, 10**7), MemoryError, ["im2col", "shape", "GiB"]),
    (lambda a, x: ops.im2col(x, 3, 3, 1, 10**9), MemoryError, ["im2col", "shape", "GiB"]),
    (lambda a, x: ops.col2im(np.ones((18, 1), np.float32), (1, 2, 10**9, 10**9), 3, 3),
     MemoryError, ["col2im", "shape", "GiB"]),
    (lambda a, x: ops.im2col(x, "3", 3), TypeError, ["im2col", "kh", "int", "str"]),
    (lambda a, x: ops.im2col(x, 3, 3, channels=(0, 2**40)), ValueError, ["channels"]),
    (lambda a, x: ops.im2col(x, 3, 3, channels="ab"), TypeError, ["channels", "int"]),
    (lambda a, x: ops.im2col(x, 3, 3, channels=5), TypeError, ["channels", "pair"]),
    (lambda a, x: ops.col2im(ops.im2col(x, 3, 3), x.shape, 3, 3, threads=0), ValueError,
     ["threads", ">= 1"]),
    (lambda a, x: ops.col2im(ops.im2col(x, 3, 3), (1, 2, 5), 3, 3), ValueError,
     ["x_shape", "4 dimensions"]),
    (lambda a, x: ops.col2im(ops.im2col(x, 3, 3), 7, 3, 3), TypeError, ["x_shape", "tuple"]),
    (lambda a, x: ops.maxpool(x, 2**40), ValueError, ["maxpool", "pool size", "2**31 - 1"]),
    (lambda a, x: ops.maxpool_backward(*ops.maxpool(x), (1, 2, 64, 2**40)), ValueError,
     ["x_shape", "2**31 - 1"]),
])
def test_bad_arguments_give_one_short_line(call, error, words):
    """pybind11 reports arguments it cannot convert with every argument printed, whole arrays
    included: pyhet.ops checks them first, and shortens what gets through."""
    a = np.random.default_rng(0).standard_normal((300, 300)).astype(np.float32)
    x = np.ones((1, 2, 5, 5), np.float32)
    with pytest.raises(error) as e:
        call(a, x)
    message = str(e.value)
    assert len(message) < 200 and "\n" not in message, message
    for w in words:
        assert w in message, (w, message)


def test_core_refuses_outputs_that_overlap_their_inputs():
    """An output that shares memory with an input is refused, index arrays included: the
    backward kernels zero and write their output while they read arg, so an arg inside it would
    change after its indices were checked, and send a write gigabytes past the array."""
    big = np.zeros(40, np.float32)
    dx = big[4:36].reshape(1, 2, 4, 4)
    arg = big[0:8].view(np.int32).reshape(1, 2, 2, 2)  # its second plane lies inside dx
    arg[...] = [[[[1, 2], [3, 5]], [[0, 0], [0, 0]]]]
    dout = np.ones((1, 2, 2, 2), np.float32)
    with pytest.raises(ValueError, match="dx overlaps arg"):
        _core.maxpool_backward(dout, arg, dx)
    with pytest.raises(ValueError, match="dy overlaps arg"):
        ops.bias_relu_maxpool_backward(dout, arg, (2, 1, 4, 4), 2, out=dx.reshape(2, 1, 4, 4))

    y, b = np.zeros((2, 1, 4, 4), np.float32), np.zeros(2, np.float32)
    out, arg = np.zeros((1, 2, 2, 2), np.float32), np.zeros((1, 2, 2, 2), np.int32)
    with pytest.raises(ValueError, match="out overlaps bias"):
        _core.bias_relu_maxpool(y, out.reshape(-1)[:2], 2, 2, out, arg)
    with pytest.raises(ValueError, match="arg overlaps y"):
        _core.bias_relu_maxpool(y, b, 2, 2, out, y.reshape(-1)[:8].view(np.int32).reshape(
            1, 2, 2, 2))
    with pytest.raises(ValueError, match="out overlaps arg"):
        _core.bias_relu_maxpool(y, b, 2, 2, out, out.view(np.int32))
    x = y.reshape(1, 2, 4, 4)
    with pytest.raises(ValueError, match="arg overlaps x"):
        _core.maxpool(x, 2, 2, out, x.reshape(-1)[8:16].view(np.int32).reshape(1, 2, 2, 2))
    with pytest.raises(ValueError, match="out overlaps arg"):
        _core.maxpool(x, 2, 2, out, out.view(np.int32))
    p = np.zeros(6, np.float32)
    with pytest.raises(ValueError, match="v overlaps g"):
        _core.sgd_update(p[:3], p[3:], p[3:], 0.1, 0.9, 0.0, True)


@pytest.mark.parametrize("threads, error, message", [
    (0, ValueError, "threads must be >= 1, got 0"),
    (-2**70, ValueError, "threads must fit in 64 bits"),
    (1025, ValueError, "threads must be at most 1024, got 1025"),
    (10**6, ValueError, "threads must be at most 1024, got 1000000"),
    (2.0, TypeError, "threads must be an int, got float"),
    (True, TypeError, "threads must be an int, got bool"),
    (None, TypeError, "threads must be an int, got NoneType"),
])
def test_core_refuses_bad_thread_counts(threads, error, message):
    """Every kernel checks its thread count (a million threads would make the OpenMP runtime
    abort the process) with one short message; the GEMM's among them."""
    x, col = np.zeros((1, 1, 4, 4), np.float32), np.zeros((9, 4), np.float32)
    with pytest.raises(error, match=message):
        _core.im2col(x, 3, 3, 1, 0, col, threads=threads)
    with pytest.raises(error, match=message):
        _core.col2im(col, 3, 3, 1, 0, x, threads=threads)
    with pytest.raises(error, match=message):
        _core.sgemm(col, col.T.copy(), np.zeros((9, 9), np.float32), threads=threads)
    assert _core.max_threads == 1024
    # a NumPy integer is an int
    _core.im2col(x, 3, 3, 1, 0, col, threads=np.int64(2))


@pytest.mark.parametrize("kw, error, message", [
    (dict(pad=2**62), ValueError, "sizes too large: 2 x 4611686018427387904 does not fit"),
    (dict(stride=2**70), ValueError, "stride must fit in 64 bits"),
    (dict(kh=1.0), TypeError, "kernel height must be an int, got float"),
    (dict(pad=-1), ValueError, "padding must be >= 0, got -1"),
    (dict(channels="ab"), TypeError, "channels: expected None or a pair"),
    (dict(channels=(0,)), TypeError, "channels: expected None or a pair"),
    (dict(channels=(2, 1)), ValueError, r"0 <= begin <= end <= 1, got \(2, 1\)"),
])
def test_im2col_refuses_absurd_geometry(kw, error, message):
    """Sizes whose products would overflow 64 bits are refused before any arithmetic on them."""
    args = dict(x=np.zeros((1, 1, 4, 4), np.float32), kh=3, kw=3, stride=1, pad=0,
                col=np.zeros((9, 4), np.float32))
    args.update(kw)
    with pytest.raises(error, match=message):
        _core.im2col(**args)


def test_core_sizes_that_overflow_on_empty_arrays():
    """An empty array can have huge dimensions: its im2col matrix would have more than 2**63
    elements, and an empty one with 2**40 rows is done without visiting them."""
    with pytest.raises(ValueError, match="sizes too large"):
        _core.im2col(np.zeros((0, 2**40, 5, 5), np.float32), 2**31, 2**31, 1, 2**40,
                     np.zeros((0, 0), np.float32))
    _core.im2col(np.zeros((0, 1, 5, 5), np.float32), 2**20, 2**20, 1, 2**20,
                 np.zeros((2**40, 0), np.float32))
    with pytest.raises(ValueError, match="more than the int32 indices of arg can address"):
        _core.maxpool(np.zeros((0, 1, 2**16, 2**16), np.float32), 2, 2,
                      np.zeros((0, 1, 2**15, 2**15), np.float32),
                      np.zeros((0, 1, 2**15, 2**15), np.int32))


@pytest.mark.parametrize("fn", ["uses_strassen", "splits_k", "uses_packed_strassen"])
def test_the_questions_about_a_product_check_their_arguments(fn):
    """As every function of the module: a size that is no int, or out of range, and threads
    outside 1..MAX_THREADS are one-line TypeError or ValueError (they were passed to the core
    as they came: pybind11's four-line message, and threads=0 answered)."""
    ask = getattr(ops, fn)
    assert isinstance(ask(64, 64, 64), bool) and isinstance(ask(64, 64, 64, 2), bool)
    for args, error, words in [((10**30, 1, 1), ValueError, "m must be in 0..2**63-1"),
                               ((1, -1, 1), ValueError, "must be in 0..2**63-1"),
                               ((1, 1, 1.5), TypeError, "must be an int, got float"),
                               ((1, True, 1), TypeError, "must be an int, got bool"),
                               ((1, 1, 1, 0), ValueError, "threads must be >= 1, got 0"),
                               ((1, 1, 1, -5), ValueError, "threads must be >= 1, got -5"),
                               ((1, 1, 1, 2.0), TypeError, "threads must be an int")]:
        with pytest.raises(error, match=re.escape(words)) as e:
            ask(*args)
        assert "\n" not in str(e.value)


def _product(fn):
    """A small call of each GEMM entry point, with keyword overrides."""
    a, b = np.ones((4, 6), np.float32), np.ones((6, 8), np.float32)
    if fn == "sgemm":
        return lambda **kw: ops.sgemm(a, b, **kw)
    packed = ops.packed_b(6, 8) if fn == "sgemm_packed" else ops.packed_quadrants(6, 8)
    ops.pack_b(b, packed) if fn == "sgemm_packed" else ops.pack_quadrants(b, packed)
    return lambda **kw: ops.sgemm_packed(a, packed, **kw)


@pytest.mark.parametrize("fn", ["sgemm", "sgemm_packed", "sgemm_packed quadrants"])
def test_a_product_takes_only_bools_and_float32_scales(fn):
    """trans_a=None (or 0, or a string) passed through pybind11 as False, and alpha = 1e300
    became inf in the core's float32, making a product of infinities without a word: each is
    a one-line error now."""
    run = _product(fn)
    np.testing.assert_array_equal(run(alpha=2, beta=0.0), np.full((4, 8), 12, np.float32))
    np.testing.assert_array_equal(run(trans_a=np.bool_(False), alpha=np.float64(0.5)),
                                  np.full((4, 8), 3, np.float32))
    np.testing.assert_array_equal(run(alpha=np.array(0.5)), np.full((4, 8), 3, np.float32))
    held = "must be 0 or of a magnitude float32, the core's type, holds (1.4e-45 to 3.403e+38)"
    cases = [(dict(trans_a=None), TypeError, "trans_a must be a bool, got NoneType"),
             (dict(trans_a=0), TypeError, "trans_a must be a bool, got int"),
             (dict(alpha=1e300), ValueError, f"alpha {held}; got 1e+300"),
             (dict(alpha=-4e38), ValueError, "got -4e+38"),
             (dict(alpha=1e-60), ValueError, "got 1e-60"),
             (dict(alpha=10**400), ValueError, "got an int of 1329 bits"),
             (dict(alpha=10**5000), ValueError, "got an int of 16610 bits"),
             (dict(beta=float("nan")), ValueError, f"beta {held}; got nan"),
             (dict(alpha="2"), TypeError, "alpha must be a real number, got str"),
             (dict(alpha=True), TypeError, "alpha must be a real number, got bool")]
    if fn == "sgemm":
        cases.append((dict(trans_b="yes"), TypeError, "trans_b must be a bool, got str"))
    else:
        cases.append((dict(strassen=1), TypeError, "strassen must be a bool, got int"))
    for kw, error, words in cases:
        with pytest.raises(error, match=re.escape(words)) as e:
            run(**kw)
        assert "\n" not in str(e.value)
    for make in (ops.packed_b, ops.packed_quadrants):
        with pytest.raises(TypeError, match="trans_b must be a bool, got NoneType"):
            make(6, 8, trans_b=None)


def test_results_numpy_cannot_make_name_the_call():
    """maxpool_backward made its result with NumPy's words ("array is too big", naming neither
    call nor shape), and an empty result NumPy refuses (its other dimensions too large) was
    called a MemoryError of 0 GiB."""
    one, arg = np.zeros((1, 1, 1, 1), np.float32), np.zeros((1, 1, 1, 1), np.int32)
    big = np.zeros((2, 3, 1, 1), np.float32), np.zeros((2, 3, 1, 1), np.int32)
    with pytest.raises(MemoryError, match=re.escape(
            "maxpool_backward: cannot allocate the result, shape (2, 3, 2147483647, "
            "2147483647)")):
        ops.maxpool_backward(*big, (2, 3, 2**31 - 1, 2**31 - 1))
    with pytest.raises(ValueError, match=re.escape(   # shapes that do not match: said first
            "dx: expected 1 x 1 planes, got shape (2147483647, 2147483647, 2147483647, 2)")):
        ops.maxpool_backward(one, arg, (2**31 - 1, 2**31 - 1, 2**31 - 1, 2))
    for call, words in [
            (lambda: ops.col2im(np.zeros((0, 0), np.float32), (0, 2**31 - 1, 2**31 - 1,
                                                               2**31 - 1), 3, 3),
             "col2im: the result's shape (0, 2147483647, 2147483647, 2147483647) is empty, "
             "but NumPy refuses it"),
            (lambda: ops.im2col(np.zeros((0, 3, 5, 5), np.float32), 2**30, 2**30, 1, 2**30),
             "im2col: the result's shape (3458764513820540928, 0) is empty, but NumPy")]:
        with pytest.raises(ValueError, match=re.escape(words)):
            call()


def test_a_masked_array_is_refused_not_read_without_its_mask():
    """np.ascontiguousarray drops a mask: a masked 99 won the pool over the 0s."""
    x = np.ma.masked_array(np.zeros((1, 1, 2, 2), np.float32), mask=[[[[0, 1], [0, 0]]]])
    x.data[0, 0, 0, 1] = 99
    with pytest.raises(TypeError, match=r"x: .* got a masked array \(fill its masked values"):
        ops.maxpool(x, 2)
    m = np.ma.masked_array(np.ones((3, 3), np.float32))
    with pytest.raises(TypeError, match="a: .*masked array"):
        ops.sgemm(m, np.ones((3, 3), np.float32))


def test_an_output_of_another_dtype_says_what_came():
    with pytest.raises(TypeError, match="c: expected a numpy float32 array, got dtype float64"):
        ops.sgemm(np.ones((2, 2), np.float32), np.ones((2, 2), np.float32), c=np.zeros((2, 2)))
    with pytest.raises(TypeError, match="got list"):
        ops.sgemm(np.ones((2, 2), np.float32), np.ones((2, 2), np.float32), c=[[0, 0], [0, 0]])
    with pytest.raises(TypeError, match="c: .*got a masked array"):
        ops.sgemm(np.ones((2, 2), np.float32), np.ones((2, 2), np.float32),
                  c=np.ma.masked_array(np.zeros((2, 2), np.float32), mask=[[0, 1], [0, 0]]))


@beyond_asan
def test_threads_the_process_cannot_start_are_refused_not_fatal():
    """libgomp ends the process (exit 1, no exception) where it cannot make a team's thread;
    a team larger than any before is tried first."""
    import subprocess
    import sys
    if not ops.have_openmp():
        pytest.skip("one thread without OpenMP")
    code = ("import numpy as np\nfrom pyhet import ops\n"
            "try:\n"
            "    ops.maxpool(np.ones((4, 4, 8, 8), np.float32), 2, threads=1000)\n"
            "except RuntimeError as e:\n"
            "    print(e)\n"
            "print(ops.maxpool(np.ones((4, 4, 8, 8), np.float32), 2, threads=2)[0].shape)\n")
    p = subprocess.run(["sh", "-c", 'ulimit -v 1500000 && exec "$@"', "sh", sys.executable,
                        "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=tempfile.gettempdir())     # not the source tree
    if "ulimit" in p.stderr:
        pytest.skip(f"the shell cannot set the limit: {p.stderr.strip()}")
    assert p.returncode == 0, (p.returncode, p.stdout, p.stderr)
    first, second = p.stdout.splitlines()
    assert re.fullmatch(r"threads=1000: this process could start only \d+ threads at once .*"
                        r"give fewer threads", first), first
    assert second == "(4, 4, 4, 4)"


@beyond_asan
def test_a_team_is_tried_at_the_stack_size_openmp_gives_its_threads():
    """Under OMP_STACKSIZE=2G in 1.5 GB of address space, a team of 2 passed the probe at the
    default stack size and libgomp ended the process."""
    import subprocess
    import sys
    if not ops.have_openmp():
        pytest.skip("one thread without OpenMP")
    code = ("import numpy as np\nfrom pyhet import ops\n"
            "try:\n"
            "    ops.maxpool(np.ones((4, 4, 8, 8), np.float32), 2, threads=2)\n"
            "except RuntimeError as e:\n"
            "    print(e)\n"
            "print(ops.maxpool(np.ones((4, 4, 8, 8), np.float32), 2, threads=1)[0].shape)\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["OMP_STACKSIZE"] = "2G"
    p = subprocess.run(["sh", "-c", 'ulimit -v 1500000 && exec "$@"', "sh", sys.executable,
                        "-c", code], capture_output=True, text=True, timeout=120, env=env,
                       cwd=tempfile.gettempdir())
    if "ulimit" in p.stderr:
        pytest.skip(f"the shell cannot set the limit: {p.stderr.strip()}")
    assert p.returncode == 0, (p.returncode, p.stdout, p.stderr)
    first, second = p.stdout.splitlines()
    assert first.startswith("threads=2: this process could start only 1 threads at once"), first
    assert "OMP_STACKSIZE's 2,048 MiB" in first, first
    assert second == "(4, 4, 4, 4)"


def test_the_backends_update_refuses_outputs_it_would_not_write():
    """An F-ordered p_out was reshaped to a copy, the update written to it and lost (p_out
    left all zeros); a g of another shape was applied in flat order."""
    rng = np.random.default_rng(0)
    p, g, v = (rng.standard_normal((4, 6)).astype(np.float32) for _ in range(3))
    cfg = SGDConfig(lr=0.1, momentum=0.9)
    be = CpuBackend(1)
    f_ordered = np.zeros((4, 6), np.float32, order="F")
    with pytest.raises(ValueError, match="p_out: expected a writeable C-contiguous array"):
        be.sgd_update_into(p, g, v, cfg, f_ordered, np.zeros_like(p))
    with pytest.raises(ValueError, match=r"v_out: expected the parameter's shape \(4, 6\)"):
        be.sgd_update_into(p, g, v, cfg, np.zeros_like(p), np.zeros(24, np.float32))
    with pytest.raises(ValueError, match=r"g: expected the parameter's shape \(4, 6\), got "
                                         r"\(6, 4\)"):
        be.sgd_update(p, np.ascontiguousarray(g.T), v, cfg)
    with pytest.raises(ValueError, match=r"g: expected the parameter's shape"):   # F-ordered p
        be.sgd_update(np.asfortranarray(p), np.ascontiguousarray(g.T), v, cfg)
    p_out, v_out = be.sgd_update_into(p, g, v, cfg, np.zeros_like(p), np.zeros_like(p))
    want_p, want_v = sgd_update_into(p, g, v, cfg)
    np.testing.assert_allclose(p_out, want_p, rtol=1e-6)
    np.testing.assert_allclose(v_out, want_v, rtol=1e-6)


def test_packed_room_too_large_says_its_size():
    if "asan" in os.environ.get("LD_PRELOAD", ""):
        pytest.skip("AddressSanitizer reports an allocation it cannot make")
    with pytest.raises(MemoryError, match=r"packed_b: cannot allocate op\(b\) of shape "
                                          r"\(2147483647, 1000000\) packed \(at least 8e\+06"):
        ops.packed_b(2**31 - 1, 10**6)


@pytest.mark.parametrize("shape, k, pad", [((1024, 14, 1, 1), 5, 2), ((256, 2, 2, 2), 7, 3),
                                           ((128, 3, 4, 4), 11, 5), ((64, 1, 1, 3), 9, 4)])
def test_a_kernel_wider_than_its_input_packs_its_zeros_in_its_rows(shape, k, pad):
    """A tap that sees only the left padding (pad - j > OW at stride 1) wrote its row's zeros
    past the row's end: into the next thread's buffer in im2col_pack (a zero in another's
    packed column, now and then) or past the last one's (heap corruption: 'double free or
    corruption' as the pack was freed)."""
    x = rand(np.random.default_rng(0), *shape) + 3      # no zero where the padding is not
    col = ref.im2col(x, k, k, 1, pad)
    K, NP = col.shape
    for threads in (1, 2):
        for _ in range(5):
            fwd, t = ops.packed_b(K, NP), ops.packed_b(NP, K, trans_b=True)
            ops.im2col_pack(x, k, k, 1, pad, fwd=fwd, t=t, threads=threads)
            np.testing.assert_array_equal(ops.sgemm_packed(np.eye(K, dtype=np.float32), fwd),
                                          col)
            np.testing.assert_array_equal(ops.sgemm_packed(np.eye(NP, dtype=np.float32), t),
                                          col.T)
        np.testing.assert_array_equal(ops.im2col(x, k, k, 1, pad, threads=threads), col)


def test_a_kernel_wider_than_its_input_does_not_corrupt_the_heap():
    """The overrun past the last thread's buffer, in a process of its own: it ended in
    'double free or corruption (!prev)' (SIGABRT)."""
    import subprocess
    import sys
    code = ("import numpy as np, pyhet.ops as ops\n"
            "x = np.ones((1024, 1, 1, 1), np.float32)\n"
            "for _ in range(3):\n"
            "    fwd = ops.packed_b(101 * 101, 1024)\n"
            "    ops.im2col_pack(x, 101, 101, 1, 50, fwd=fwd, threads=1)\n"
            "    del fwd\n"
            "print('done')\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=tempfile.gettempdir())
    assert (p.returncode, p.stdout) == (0, "done\n"), (p.returncode, p.stderr[-2000:])


# ================================================================================================
# Output sizes and units: checked arguments


@pytest.mark.parametrize("call, error, words", [
    (lambda: ops.conv_out_size(4, 3, 0), ValueError, "conv_out_size: stride must be >= 1, got 0"),
    (lambda: ops.conv_out_size(4, 3, 1, -2), ValueError, "conv_out_size: pad must be >= 0, got -2"),
    (lambda: ops.conv_out_size(-4, 3), ValueError, "conv_out_size: size must be >= 0, got -4"),
    (lambda: ops.conv_out_size(4, -3), ValueError, "conv_out_size: k must be >= 1, got -3"),
    (lambda: ops.conv_out_size(4, 0), ValueError, "conv_out_size: k must be >= 1, got 0"),
    (lambda: ops.conv_out_size(4.5, 3), TypeError, "conv_out_size: size must be an int, got float"),
    (lambda: ops.conv_out_size(4, True), TypeError, "conv_out_size: k must be an int, got bool"),
    (lambda: ops.conv_out_size(4, 3, "1"), TypeError, "conv_out_size: stride must be an int"),
    (lambda: ops.conv_out_size(2, 3), ValueError,
     "conv_out_size: a kernel of 3 does not fit a size 2 input with padding 0"),
    (lambda: ops.conv_out_size(0, 1), ValueError, "a kernel of 1 does not fit a size 0 input"),
    (lambda: ops.pool_out_size(4, 0, 1), ValueError, "pool_out_size: k must be >= 1, got 0"),
    (lambda: ops.pool_out_size(4, -2, 1), ValueError, "pool_out_size: k must be >= 1, got -2"),
    (lambda: ops.pool_out_size(4, 2, 0), ValueError, "pool_out_size: stride must be >= 1, got 0"),
    (lambda: ops.pool_out_size(-1, 1, 1), ValueError, "pool_out_size: size must be >= 0, got -1"),
    (lambda: ops.pool_out_size(4, 2.0, 2), TypeError, "pool_out_size: k must be an int, got float"),
    (lambda: ops.pool_out_size(1, 2, 1), ValueError,
     "pool_out_size: window 2 is larger than the size 1 input"),
    (lambda: ops.quadrant_units(-2), ValueError, "quadrant_units: batch must be >= 0, got -2"),
    (lambda: ops.quadrant_units(3), ValueError, "quadrant_units: expected an even batch, got 3"),
    (lambda: ops.quadrant_units(4.0), TypeError, "quadrant_units: batch must be an int, got float"),
    (lambda: ops.quadrant_units(4, fwd=None), TypeError, "quadrant_units: fwd must be a bool"),
])
def test_output_sizes_and_units_refuse_bad_arguments(call, error, words):
    """They returned nonsense (conv_out_size(4, 3, 1, -2) == -2, pool_out_size(4, 0, 1) == 5,
    quadrant_units(3) == 11) or raised ZeroDivisionError, where the rest of ops refuses."""
    with pytest.raises(error, match=re.escape(words)):
        call()


def test_output_sizes_take_numpy_ints_and_give_the_formula():
    assert ops.conv_out_size(np.int64(28), np.int32(5)) == 24
    assert type(ops.conv_out_size(np.int64(28), 5)) is int
    assert ops.conv_out_size(7, 3, 2, 1) == 4 and ops.conv_out_size(2, 3, 1, 1) == 2
    assert ops.conv_out_size(3, 3) == 1 and ops.conv_out_size(0, 1, 1, 1) == 2
    assert ops.pool_out_size(5, 2, 2) == 2 and ops.pool_out_size(5, 3, 1) == 3
    assert ops.pool_out_size(2, 2, 5) == 1
    assert ops.quadrant_units(0) == 0 and ops.quadrant_units(np.int64(30)) == 165
    assert ops.quadrant_units(30, t=False) == ops.quadrant_units(30, fwd=False) == 105
    assert ops.quadrant_units(30, fwd=False, t=False) == 0


def test_a_network_that_cannot_work_is_still_an_architecture_error():
    """The geometry checks its blocks before it asks the sizes, with its own words."""
    with pytest.raises(ArchitectureError, match="a 5x5 kernel is larger than its 3x3 input"):
        ConvGeometry("conv1", 1, 3, 3, 4, 5, 5)
    with pytest.raises(ArchitectureError, match="a 3x3 pool is larger than the 2x2 conv output"):
        ConvGeometry("conv1", 1, 4, 4, 4, 3, 3, pool=3, pool_stride=3)
    with pytest.raises(ArchitectureError, match="stride must be >= 1, got 0"):
        ConvGeometry("conv1", 1, 4, 4, 4, 3, 3, stride=0)
    g = ConvGeometry("conv1", 1, 7, 7, 4, 3, 3, stride=2, pad=1, pool=2, pool_stride=1)
    assert (g.OH, g.OW, g.PH, g.PW) == (4, 4, 3, 3)


def test_maxpool_backward_refuses_a_pooled_shape_no_pool_of_x_gives():
    """A 2x2 dout cannot be a max-pool of 1x1 planes: it was summed into the one pixel."""
    dout, arg = np.ones((1, 1, 2, 2), np.float32), np.zeros((1, 1, 2, 2), np.int32)
    with pytest.raises(ValueError, match=re.escape(
            "maxpool_backward: dout: expected planes of 1 x 1 (a max-pool of x_shape "
            "(1, 1, 1, 1)'s 1x1 planes), got shape (1, 1, 2, 2)")):
        ops.maxpool_backward(dout, arg, (1, 1, 1, 1))
    with pytest.raises(ValueError, match=r"expected planes of 1\.\.3 x 1\.\.2 .* got shape "
                                         r"\(1, 1, 2, 3\)"):
        ops.maxpool_backward(np.ones((1, 1, 2, 3), np.float32), np.zeros((1, 1, 2, 3), np.int32),
                             (1, 1, 3, 2))
    with pytest.raises(ValueError, match=r"expected planes of 1\.\.2 x 1\.\.2 .* got shape "
                                         r"\(1, 1, 0, 1\)"):
        ops.maxpool_backward(np.ones((1, 1, 0, 1), np.float32), np.zeros((1, 1, 0, 1), np.int32),
                             (1, 1, 2, 2))
    # what a max-pool gives is taken: a whole-plane window, a 1x1 one, an empty batch
    x = np.arange(12, dtype=np.float32).reshape(1, 1, 3, 4)
    for k, s in ((3, 1), (1, 1), (2, 2)):
        out, arg = ops.maxpool(x, k, s)
        dx = ops.maxpool_backward(np.ones_like(out), arg, x.shape)
        assert dx.shape == x.shape and dx.sum() == out.size
    empty = np.zeros((0, 1, 1, 2), np.float32)
    assert ops.maxpool_backward(empty, empty.astype(np.int32), (0, 1, 3, 4)).shape == (0, 1, 3, 4)


# ================================================================================================
# The other byte order


def test_big_endian_float32_is_refused_saying_how_to_convert():
    """float32 of the other byte order was refused as 'expected dtype float32, got >f4', which
    reads as a contradiction: ops convert nothing, so the message says what to do."""
    native = sys.byteorder
    other, code = ("big", ">") if native == "little" else ("little", "<")
    a, b = np.ones((2, 3), np.float32), np.ones((3, 2), np.float32)
    with pytest.raises(TypeError, match=re.escape(
            f"a: expected native ({native}-endian) float32, got {other}-endian {code}f4: "
            f"convert with a.astype(np.float32)")):
        ops.gemm(a.astype(f"{code}f4"), b)
    with pytest.raises(TypeError, match=re.escape(f"b: expected native ({native}-endian) "
                                                  f"float32")):
        ops.sgemm(a, b.astype(f"{code}f4"))
    with pytest.raises(TypeError, match=re.escape(
            f"c: expected a numpy float32 array of native ({native}-endian) byte order, got "
            f"dtype {code}f4")):
        ops.sgemm(a, b, c=np.zeros((2, 2), f"{code}f4"))
    x = np.zeros((1, 1, 4, 4), np.float32)
    with pytest.raises(TypeError, match=re.escape("x: expected native")):
        ops.im2col(x.astype(f"{code}f4"), 3, 3)
    out, arg = ops.maxpool(x, 2)
    with pytest.raises(TypeError, match=re.escape(
            f"arg: expected native ({native}-endian) int32, got {other}-endian {code}i4: "
            f"convert with arg.astype(np.int32)")):
        ops.maxpool_backward(out, arg.astype(f"{code}i4"), x.shape)
    with pytest.raises(TypeError, match="a: expected dtype float32, got float64"):
        ops.gemm(a.astype(np.float64), b)
