"""The GPU backend on a real CUDA GPU through CuPy. Skipped where CuPy or a GPU is missing (the
same code is exercised on a stand-in CuPy in test_devices.py)."""

import numpy as np
import pytest

from conftest import (assert_repartitions_like_one_device, assert_trains_like_one_device,
                      net_shape)
from pyhet.backends import numpy_ref as ref
from pyhet import arch
from pyhet.geometry import ConvGeometry
from pyhet.specs import cuda_device_count

cupy = pytest.importorskip("cupy")
if cuda_device_count() == 0:
    pytest.skip("no CUDA GPU", allow_module_level=True)

from pyhet.backends.cuda import CudaBackend  # noqa: E402


@pytest.mark.parametrize("g", [
    ConvGeometry("t", 5, 13, 12, 7, 3, 3),                          # valid, pool 1: none
    ConvGeometry("t", 5, 13, 12, 7, 3, 3, pool=2, pool_stride=2),
    ConvGeometry("t", 5, 13, 12, 7, 3, 3, 2, 1, 3, 2),              # stride 2, pad 1, P3s2
], ids=["no pool", "pool 2", "stride 2 pad 1 pool 3s2"])
def test_conv_block_on_the_gpu_matches_the_reference(g):
    rng = np.random.default_rng(0)
    x = rng.standard_normal(g.x_shape(3)).astype(np.float32)
    w = rng.standard_normal(g.weight_shape).astype(np.float32)
    b = rng.standard_normal(g.K).astype(np.float32)
    be = CudaBackend(0)
    col = be.im2col(be.asarray(x), g)
    out, saved = be.block_forward(col, x.shape, be.asarray(w), be.asarray(b), g)
    rcol = ref.im2col(x.astype(np.float64), g.R, g.S, g.stride, g.pad)
    rout, rsaved = ref.conv_block_forward(rcol, x.shape, w.astype(np.float64),
                                          b.astype(np.float64), g.stride, g.pad, g.pool,
                                          g.pool_stride)
    assert out.shape == g.out_batch_shape(g.K, 3)
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
    assert_trains_like_one_device(net_shape((2, 13, 12), (7, 9), 3, 5), spec, part)


def test_kernels_moved_onto_and_off_the_gpu_keep_the_result():
    assert_repartitions_like_one_device("gpu:0,cpu:1")


# 2x17x15: conv1 p1 s2 9x8 -> P2 4x4 -> conv2 p1 4x4 (no pool) -> conv3 2x2 -> P2 1x1 -> 6 -> 5
DEEP = "6C3p1s2-P2-5C3p1-7C3-P2-6N"


@pytest.mark.parametrize("spec,part", [
    ("gpu:0", {"conv1": [6], "conv2": [5], "conv3": [7]}),
    ("gpu:0,cpu:1", {"conv1": [4, 2], "conv2": [0, 5], "conv3": [3, 4]}),
    ("cpu:1,gpu:0,numpy", {"conv1": [2, 2, 2], "conv2": [1, 3, 1], "conv3": [3, 0, 4]}),
])
def test_deep_network_on_the_gpu_gives_the_single_device_weights(spec, part):
    assert_trains_like_one_device(arch.build(DEEP, (2, 17, 15), 5), spec, part, seed=2)
