"""The GPU backend on a real CUDA GPU through CuPy. Skipped where CuPy or a GPU is missing (the
same code is exercised on a stand-in CuPy in test_devices.py)."""

import numpy as np
import pytest

from conftest import assert_same_weights, net_shape, train_weights
from pyhet.backends import numpy_ref as ref
from pyhet.specs import cuda_device_count
from pyhet.optim import SGDConfig

cupy = pytest.importorskip("cupy")
if cuda_device_count() == 0:
    pytest.skip("no CUDA GPU", allow_module_level=True)

from pyhet.backends.cuda import CudaBackend  # noqa: E402


def test_conv_block_on_the_gpu_matches_the_reference():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 5, 13, 12)).astype(np.float32)
    w = rng.standard_normal((7, 5, 3, 3)).astype(np.float32)
    b = rng.standard_normal(7).astype(np.float32)
    be = CudaBackend(0)
    col = be.im2col(be.asarray(x), 3, 3)
    out, saved = be.block_forward(col, x.shape, be.asarray(w), be.asarray(b), 2)
    rcol = ref.im2col(x.astype(np.float64), 3, 3)
    rout, rsaved = ref.conv_block_forward(rcol, x.shape, w.astype(np.float64),
                                          b.astype(np.float64), 2)
    np.testing.assert_allclose(be.to_host(out), rout, rtol=1e-4, atol=1e-4)
    dout = rng.standard_normal(rout.shape).astype(np.float32)
    dcol, dw, db = be.block_backward(be.asarray(dout), saved, col, be.asarray(w), True)
    rdcol, rdw, rdb = ref.conv_block_backward(dout.astype(np.float64), rsaved, rcol,
                                              w.astype(np.float64))
    for got, want in ((dcol, rdcol), (dw, rdw), (db, rdb)):
        np.testing.assert_allclose(be.to_host(got), want, rtol=1e-3,
                                   atol=1e-3 * (np.abs(want).max() + 1))


@pytest.mark.parametrize("spec,part", [
    ("gpu:0", {"conv1": [7], "conv2": [9]}),
    ("gpu:0,cpu:1", {"conv1": [4, 3], "conv2": [2, 7]}),
    ("cpu:1,gpu:0,numpy", {"conv1": [2, 3, 2], "conv2": [3, 3, 3]}),
])
def test_training_on_the_gpu_gives_the_single_device_weights(spec, part):
    shape = net_shape((2, 13, 12), (7, 9), 3, 5)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((6, 2, 13, 12)).astype(np.float32)
    y = rng.integers(0, 5, 6)
    cfg = SGDConfig(0.05, 0.9, 1e-3)
    want, _ = train_weights(shape, "numpy", {"conv1": [7], "conv2": [9]}, [(x, y)] * 3, cfg)
    got, _ = train_weights(shape, spec, part, [(x, y)] * 3, cfg)
    assert_same_weights(got, want)
