"""Each C++ op against the NumPy reference on random odd shapes, forward and backward.

Tolerances: im2col, col2im, pooling and the fused bias + ReLU + max-pool only move or compare
values (col2im adds at most R*S of them), so they must match to float32 rounding; products go
through the GEMM and are compared relative to the size of their terms.
"""

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from pyhet import _core, ops
from pyhet.backends import numpy_ref as ref
from pyhet.backends.cpu import CpuBackend

SETTINGS = settings(max_examples=40, deadline=None)


@st.composite
def conv_geometry(draw):
    N = draw(st.integers(1, 3))
    C = draw(st.integers(1, 4))
    R = draw(st.integers(1, 5))
    S = draw(st.integers(1, 5))
    stride = draw(st.integers(1, 3))
    pad = draw(st.integers(0, 2))
    H = draw(st.integers(max(1, R - 2 * pad), 13))
    W = draw(st.integers(max(1, S - 2 * pad), 13))
    return N, C, H, W, R, S, stride, pad


def rand(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


# ------------------------------------------------------------------------------------------------
# im2col / col2im


@SETTINGS
@given(conv_geometry(), st.integers(1, 2), st.integers(0, 2**31))
def test_im2col_matches_reference(geom, threads, seed):
    N, C, H, W, R, S, stride, pad = geom
    x = rand(np.random.default_rng(seed), N, C, H, W)
    got = ops.im2col(x, R, S, stride, pad, threads=threads)
    np.testing.assert_array_equal(got, ref.im2col(x, R, S, stride, pad))


@SETTINGS
@given(conv_geometry(), st.integers(1, 2), st.integers(0, 2**31))
def test_col2im_matches_reference(geom, threads, seed):
    N, C, H, W, R, S, stride, pad = geom
    rng = np.random.default_rng(seed)
    OH, OW = ref.out_size(H, R, stride, pad), ref.out_size(W, S, stride, pad)
    col = rand(rng, C * R * S, N * OH * OW)
    got = ops.col2im(col, (N, C, H, W), R, S, stride, pad, threads=threads)
    want = ref.col2im(col.astype(np.float64), (N, C, H, W), R, S, stride, pad)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_col2im_overwrites_its_output():
    x = np.full((1, 1, 4, 4), np.nan, np.float32)
    ops.col2im(np.ones((9, 4), np.float32), (1, 1, 4, 4), 3, 3, out=x)
    assert np.isfinite(x).all() and x[0, 0, 1, 1] == 4 and x[0, 0, 0, 0] == 1


# ------------------------------------------------------------------------------------------------
# Max-pool


@st.composite
def pool_geometry(draw):
    k = draw(st.integers(1, 4))
    s = draw(st.integers(1, 4))
    return (draw(st.integers(1, 3)), draw(st.integers(1, 4)), draw(st.integers(k, 12)),
            draw(st.integers(k, 12)), k, s)


@SETTINGS
@given(pool_geometry(), st.booleans(), st.integers(0, 2**31))
def test_maxpool_matches_reference(geom, ties, seed):
    N, C, H, W, k, s = geom
    rng = np.random.default_rng(seed)
    # small integers make ties common: the first maximum must win in both
    x = (rng.integers(-3, 4, (N, C, H, W)) if ties else rng.standard_normal((N, C, H, W)))
    x = x.astype(np.float32)
    out, arg = ops.maxpool(x, k, s, threads=2)
    rout, rarg = ref.maxpool_forward(x, k, s)
    np.testing.assert_array_equal(out, rout)
    np.testing.assert_array_equal(arg, rarg)
    dout = rand(rng, *out.shape)
    np.testing.assert_allclose(ops.maxpool_backward(dout, arg, x.shape),
                               ref.maxpool_backward(dout, rarg, x.shape), rtol=1e-6, atol=1e-6)


def test_maxpool_propagates_nan_like_torch():
    x = np.array([[[[1, np.nan], [5, 2]]]], np.float32)
    out, arg = ops.maxpool(x, 2)
    rout, rarg = ref.maxpool_forward(x, 2)
    assert np.isnan(out).all() and np.isnan(rout).all()
    assert arg.item() == rarg.item() == 1


@st.composite
def block_geometry(draw):
    p = draw(st.integers(1, 3))
    return (draw(st.integers(1, 7)), draw(st.integers(1, 3)), draw(st.integers(p, 11)),
            draw(st.integers(p, 11)), p)


@SETTINGS
@given(block_geometry(), st.booleans(), st.integers(0, 2**31))
def test_bias_relu_maxpool_matches_reference(geom, ties, seed):
    K, N, H, W, p = geom
    rng = np.random.default_rng(seed)
    y = (rng.integers(-2, 3, (K, N, H, W)) if ties else rng.standard_normal((K, N, H, W)))
    y = y.astype(np.float32)
    b = (rng.integers(-1, 2, K) if ties else rng.standard_normal(K)).astype(np.float32)
    out, arg = ops.bias_relu_maxpool(y, b, p, threads=2)
    # the reference, composed: bias, ReLU, then pool, in NCHW
    r = ref.relu_forward(y + b[:, None, None, None]).transpose(1, 0, 2, 3)
    rout, rarg = ref.maxpool_forward(np.ascontiguousarray(r), p)
    np.testing.assert_array_equal(out, rout)
    # where the output is positive, the same input was chosen
    pos = rout > 0
    np.testing.assert_array_equal(arg[pos], rarg[pos])
    assert (arg[~pos] == -1).all()
    dout = rand(rng, *out.shape)
    dy = ops.bias_relu_maxpool_backward(dout, arg, y.shape, p, threads=2)
    want = ref.relu_backward(ref.maxpool_backward(dout, rarg, r.shape), r)
    np.testing.assert_array_equal(dy, want.transpose(1, 0, 2, 3))


# ------------------------------------------------------------------------------------------------
# The conv block of the C++ backend against the reference, forward and backward


@SETTINGS
@given(st.integers(1, 3), st.integers(1, 5), st.integers(1, 9), st.integers(1, 4),
       st.integers(1, 2), st.integers(0, 2**31))
def test_cpu_conv_block_matches_reference(N, C, K, R, p, seed):
    rng = np.random.default_rng(seed)
    H, W = R - 1 + p * rng.integers(1, 4) + rng.integers(0, p), R - 1 + p + rng.integers(0, 5)
    x, w, b = rand(rng, N, C, H, W), rand(rng, K, C, R, R), rand(rng, K)
    be = CpuBackend(2)
    col = be.im2col(x, R, R, key="t")
    out, saved = be.block_forward(col, x.shape, w, b, p, key="t")
    rcol = ref.im2col(x.astype(np.float64), R, R)
    rout, rsaved = ref.conv_block_forward(rcol, x.shape, w.astype(np.float64),
                                          b.astype(np.float64), p)
    scale = np.abs(w).reshape(K, -1).sum(1).max() * np.abs(x).max() + 1
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


def test_cpu_linear_matches_reference():
    rng = np.random.default_rng(0)
    x, w, b, dy = rand(rng, 5, 37), rand(rng, 3, 37), rand(rng, 3), rand(rng, 5, 3)
    be = CpuBackend(2)
    np.testing.assert_allclose(be.linear_forward(x, w, b), ref.linear_forward(x, w, b),
                               rtol=1e-5, atol=1e-5)
    for got, want in zip(be.linear_backward(dy, x, w), ref.linear_backward(dy, x, w)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------------
# Bad input to the bindings: a clear exception, never a crash or a silent copy


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


def test_core_refuses_overlapping_output():
    a = np.ones((4, 4), np.float32)
    with pytest.raises(ValueError, match="overlaps"):
        _core.sgemm(a, a, a)


def test_ops_accept_non_contiguous_inputs():
    rng = np.random.default_rng(1)
    x = rand(rng, 2, 3, 9, 8)[:, :, ::-1]  # a reversed view
    np.testing.assert_array_equal(ops.im2col(x, 3, 3), ref.im2col(np.ascontiguousarray(x), 3, 3))
