"""Every layer's hand-written backward against central finite differences, in float64 on the
reference backend (fixed seeds).

The check: for a random cotangent G, the loss L = sum(G * forward(x)); the analytic gradients
from backward(G) must match (L(x + e) - L(x - e)) / 2e entry by entry.
"""

import numpy as np
import pytest

from conftest import numeric_grad
from pyhet.backends import numpy_ref as ref
from pyhet.layers import Conv2d, Flatten, Linear, MaxPool2d, ReLU, SoftmaxCrossEntropy

EPS = 1e-6   # the finite-difference step of conftest.numeric_grad
RTOL, ATOL = 1e-5, 1e-7


def check_layer(layer, x, seed=0):
    rng = np.random.default_rng(seed)
    y = layer.forward(x)
    G = rng.standard_normal(y.shape)
    dx = layer.backward(G)

    def loss():
        return float((layer.forward(x) * G).sum())

    if dx is not None:
        np.testing.assert_allclose(dx, numeric_grad(loss, x), rtol=RTOL, atol=ATOL)
    for name, p in layer.params.items():
        np.testing.assert_allclose(layer.grads[name], numeric_grad(loss, p), rtol=RTOL,
                                   atol=ATOL, err_msg=name)


@pytest.mark.parametrize("N,C,H,W,K,R,S,stride,pad", [
    (2, 3, 7, 6, 4, 3, 3, 1, 0),
    (1, 2, 5, 5, 3, 5, 5, 1, 0),      # kernel as large as the input
    (3, 1, 8, 7, 2, 2, 3, 2, 1),      # stride and padding, rectangular kernel
    (2, 2, 6, 6, 5, 1, 1, 1, 0),      # 1x1
])
def test_conv2d_gradients(N, C, H, W, K, R, S, stride, pad):
    rng = np.random.default_rng(1)
    layer = Conv2d(rng.standard_normal((K, C, R, S)), rng.standard_normal(K), stride, pad)
    check_layer(layer, rng.standard_normal((N, C, H, W)))


def test_relu_gradient():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, 4, 5, 5))
    x[np.abs(x) < 1e-3] = 0.5  # keep away from the kink, where the derivative is undefined
    check_layer(ReLU(), x)


@pytest.mark.parametrize("shape,k,stride", [((2, 3, 7, 7), 2, None), ((1, 2, 6, 9), 3, 2),
                                            ((2, 1, 5, 4), 2, 1)])
def test_maxpool_gradient(shape, k, stride):
    # distinct values, spaced well above EPS, so no perturbation changes a window's maximum
    rng = np.random.default_rng(3)
    x = rng.permutation(np.prod(shape)).reshape(shape).astype(np.float64) * 1e-2
    check_layer(MaxPool2d(k, stride), x)


def test_flatten_gradient():
    check_layer(Flatten(), np.random.default_rng(4).standard_normal((2, 3, 4, 5)))


def test_linear_gradient():
    rng = np.random.default_rng(5)
    layer = Linear(rng.standard_normal((7, 11)), rng.standard_normal(7))
    check_layer(layer, rng.standard_normal((5, 11)))


def test_softmax_cross_entropy_gradient():
    rng = np.random.default_rng(6)
    logits = rng.standard_normal((6, 5)) * 3
    labels = rng.integers(0, 5, 6)
    layer = SoftmaxCrossEntropy()
    layer.forward(logits, labels)
    d = layer.backward()
    np.testing.assert_allclose(
        d, numeric_grad(lambda: float(layer.forward(logits, labels)), logits),
        rtol=RTOL, atol=ATOL)


def test_softmax_cross_entropy_value_and_stability():
    logits = np.array([[1000.0, 0.0], [0.0, 0.0]])
    loss, d = ref.softmax_cross_entropy(logits, np.array([0, 1]))
    assert np.isfinite(loss) and np.isclose(loss, np.log(2) / 2)
    np.testing.assert_allclose(d.sum(axis=1), 0, atol=1e-12)


def test_conv_block_gradients():
    """The network's block (conv -> ReLU -> pool, from the im2col matrix) as one function."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((2, 3, 9, 8))
    w, b = rng.standard_normal((4, 3, 3, 3)), rng.standard_normal(4)
    G = rng.standard_normal((2, 4, 3, 3))

    def loss():
        col = ref.im2col(x, 3, 3)
        return float((ref.conv_block_forward(col, x.shape, w, b, pool=2)[0] * G).sum())

    col = ref.im2col(x, 3, 3)
    out, saved = ref.conv_block_forward(col, x.shape, w, b, pool=2)
    dcol, dw, db = ref.conv_block_backward(G, saved, col, w)
    dx = ref.col2im(dcol, x.shape, 3, 3)
    np.testing.assert_allclose(dw, numeric_grad(loss, w), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(db, numeric_grad(loss, b), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(dx, numeric_grad(loss, x), rtol=RTOL, atol=ATOL)


def test_conv_forward_matches_direct_definition():
    """The im2col conv against the textbook sum, so the oracle itself is checked."""
    rng = np.random.default_rng(8)
    x, w, b = rng.standard_normal((2, 3, 6, 7)), rng.standard_normal((4, 3, 3, 2)), \
        rng.standard_normal(4)
    y, _ = ref.conv2d_forward(x, w, b, stride=2, pad=1)
    xp = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    want = np.zeros_like(y)
    for n in range(2):
        for k in range(4):
            for i in range(y.shape[2]):
                for j in range(y.shape[3]):
                    want[n, k, i, j] = (xp[n, :, 2 * i:2 * i + 3, 2 * j:2 * j + 2] * w[k]).sum() \
                        + b[k]
    np.testing.assert_allclose(y, want, rtol=1e-12, atol=1e-12)


def test_maxpool_floor_mode_and_ties():
    x = np.array([[[[1, 3, 3, 0, 9],
                    [2, 3, 1, 1, 9],
                    [7, 7, 7, 7, 9]]]], dtype=np.float64)
    y, arg = ref.maxpool_forward(x, 2)
    assert y.shape == (1, 1, 1, 2)                     # the odd row and column are dropped
    np.testing.assert_array_equal(y[0, 0], [[3, 3]])
    np.testing.assert_array_equal(arg[0, 0], [[1, 2]])  # the first maximum wins


@pytest.mark.parametrize("chunk", [1, 7, 1 << 16])
def test_initial_weights_drawn_in_chunks_are_one_draws(monkeypatch, chunk):
    """init_uniform draws a chunk at a time (a large fc layer costs its float32 array, not a
    float64 one beside it): the numbers, and the generator's state after them, are those of
    one draw of the whole shape."""
    from pyhet import layers
    monkeypatch.setattr(layers, "INIT_CHUNK", chunk)
    for shape in [(5, 3, 2, 2), (3,), (11, 13)]:
        a, b = np.random.default_rng(4), np.random.default_rng(4)
        got = layers.init_uniform(a, shape, 9)
        want = b.uniform(-1 / 3, 1 / 3, size=shape).astype(np.float32)
        assert got.dtype == np.float32 and got.shape == shape
        np.testing.assert_array_equal(got, want)
        assert a.uniform() == b.uniform()


@pytest.mark.parametrize("order", ["C", "F"])
@pytest.mark.parametrize("momentum,weight_decay", [(0.9, 0.0), (0.9, 0.01), (0.0, 0.01),
                                                   (0.0, 0.0)])
@pytest.mark.parametrize("update", ["parts", "cpu"])
def test_the_update_a_part_at_a_time_is_the_whole_update(momentum, weight_decay, order,
                                                         update):
    """sgd_update_parts (the NumPy update of a large layer, with a part's temporaries) and the
    cpu backend's update give the numbers of pyhet.optim.sgd_update, on the first step and
    after it, also on arrays in Fortran order (whose flat form is a copy: their update was
    lost)."""
    from pyhet.backends.cpu import CpuBackend
    from pyhet.backends.numpy_ref import sgd_update_parts
    from pyhet.optim import SGDConfig, sgd_update
    cfg = SGDConfig(lr=0.1, momentum=momentum, weight_decay=weight_decay)
    rng = np.random.default_rng(0)
    p = np.array(rng.standard_normal((13, 7)).astype(np.float32), order=order)
    q, v, u = p.copy(order="K"), None, None
    step = ((lambda q, g, u: sgd_update_parts(q, g, u, cfg, part=5)) if update == "parts"
            else (lambda q, g, u: CpuBackend(1).sgd_update(q, g, u, cfg)))
    for i in range(3):
        g = rng.standard_normal(p.shape).astype(np.float32)
        v = sgd_update(p, g, v, cfg)
        if i == 1 and v is not None and order == "F":
            u = np.asfortranarray(u)
        u = step(q, g, u)
        np.testing.assert_array_equal(q, p)
        assert (u is None) == (v is None)
        if v is not None:
            np.testing.assert_array_equal(u, v)


@pytest.mark.parametrize("order", ["C", "F"])
@pytest.mark.parametrize("start", ["first", "buffer"])
@pytest.mark.parametrize("outs", ["given", "none"])
@pytest.mark.parametrize("momentum,weight_decay", [(0.9, 0.0), (0.9, 0.01), (0.0, 0.01),
                                                   (0.0, 0.0)])
def test_the_staged_update_a_part_at_a_time_is_the_whole_update(momentum, weight_decay, outs,
                                                                start, order):
    """The numpy device's staged update (sgd_update_into_parts, a part's temporaries at a time)
    writes the numbers of pyhet.optim.sgd_update_into into the arrays given (or new ones),
    leaves p, g and v as they were, and keeps a buffer as the whole update does (momentum 0: a
    copy of v apart, or none), on the first step and after it, and from a buffer a step with
    momentum left; arrays in Fortran order too."""
    from pyhet.backends.numpy_ref import NumpyBackend, sgd_update_into_parts
    from pyhet.optim import SGDConfig, sgd_update_into
    cfg = SGDConfig(lr=0.1, momentum=momentum, weight_decay=weight_decay)
    rng = np.random.default_rng(1)
    p = np.array(rng.standard_normal((13, 7)).astype(np.float32), order=order)
    v = None if start == "first" else np.array(rng.standard_normal(p.shape).astype(np.float32),
                                               order=order)
    for i in range(3):
        g = rng.standard_normal(p.shape).astype(np.float32)
        before = [a.copy() for a in (p, g) + (() if v is None else (v,))]
        want_p, want_v = sgd_update_into(p, g, v, cfg)
        given = (np.full_like(p, np.nan), np.full_like(p, np.nan)) if outs == "given" else \
            (None, None)
        got_p, got_v = sgd_update_into_parts(p, g, v, cfg, *given, part=5)
        for a, b in zip((p, g) + (() if v is None else (v,)), before):
            np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(got_p, want_p)
        assert (got_v is None) == (want_v is None)
        if outs == "given":
            assert got_p is given[0] and (got_v is None or got_v is given[1])
        if want_v is not None:
            np.testing.assert_array_equal(got_v, want_v)
            assert v is None or not np.may_share_memory(got_v, v)
        back_p, back_v = NumpyBackend().sgd_update_into(p, g, v, cfg)
        np.testing.assert_array_equal(back_p, want_p)
        p, v = got_p, got_v
