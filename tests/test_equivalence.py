"""Distributed training gives the single-device weights, for any network, devices and split
drawn at random: a small network (1-3 conv blocks of any kernel size, stride, padding and pool
that fit the map, odd and even kernel counts, maybe a hidden fc layer), a mix of devices (the
host group's cpu ones, one emulated at half speed, the numpy reference), a split of every
layer's kernels over them (some devices none), a batch size, and the GEMM's Strassen threshold
(lowered to 2, so that every product that can takes Strassen's scheme and the host group packs
in quadrants) end a few SGD steps within float32 rounding of one numpy device.

Letters (as pyhet.geometry): N images, C input channels, (H, W) input plane, K kernels, R x R
kernel size; a block is KCR[pP][sS][-PW[sT]] in --arch notation (README, "Networks").

PYHET_EQUIVALENCE_EXAMPLES=2000 draws that many examples instead (a hunt for rare cases, about
a minute a thousand).
"""

import os
import threading
from unittest import mock

import numpy as np
import pytest
from hypothesis import assume, event, given, settings
from hypothesis import strategies as st

import conftest
from conftest import assert_trains_like_one_device
from pyhet import _core, arch
from pyhet.backends import numpy_ref
from pyhet.geometry import conv_out_size, pool_out_size
from pyhet.model import init_params

# Three times the profile's examples (120 in the default one): the paths are many, and an
# example is cheap (tens of ms: tiny layers, a few device threads started and stopped), so that
# they take a few seconds on two cores.
EXAMPLES = int(os.environ.get("PYHET_EQUIVALENCE_EXAMPLES", 0)) or \
    settings.default.max_examples * 3

KINDS = ["cpu:1", "cpu:2", "numpy", "cpu:1@0.5"]


def sizes(low, high):
    """An integer in [low, high], an even one more often than not: the host group packs in
    quadrants only for an even batch and an even channel count of the layer's input."""
    return st.one_of(st.integers(low, high),
                     st.sampled_from([v for v in range(low, high + 1) if v % 2 == 0]))


@st.composite
def networks(draw):
    """(input shape, --arch string) of 1-3 conv blocks that fit, then maybe an fc layer. Each
    block is drawn to fit the map it gets (the kernel within the padded map, the pool within
    the conv output), so that none is rejected; a map shrunk to 1x1 takes only 1x1 kernels or
    padding."""
    input_shape = (draw(sizes(1, 3)), draw(st.integers(7, 17)), draw(st.integers(7, 17)))
    _, H, W = input_shape
    blocks = []
    for _ in range(draw(st.integers(1, 3))):
        pad = draw(st.integers(0, 2))
        size = draw(st.integers(1, min(5, H + 2 * pad, W + 2 * pad)))
        stride = draw(st.integers(1, 2))
        K = draw(sizes(1, 9))
        block = f"{K}C{size}" + (f"p{pad}" if pad else "") + (f"s{stride}" if stride > 1 else "")
        H, W = conv_out_size(H, size, stride, pad), conv_out_size(W, size, stride, pad)
        windows = [k for k in (2, 3) if k <= min(H, W)]
        if windows and draw(st.booleans()):
            pool, pool_stride = draw(st.sampled_from(windows)), draw(st.integers(1, 3))
            block += f"-P{pool}" + (f"s{pool_stride}" if pool_stride != pool else "")
            H, W = pool_out_size(H, pool, pool_stride), pool_out_size(W, pool, pool_stride)
        blocks.append(block)
    if draw(st.booleans()):
        blocks.append(f"{draw(st.integers(1, 8))}N")
    return input_shape, "-".join(blocks)


@st.composite
def partitions(draw, shape, devices):
    """{"conv1": kernels per device, ...}: each layer's K cut anywhere into `devices` runs,
    zeros allowed (a device without kernels of a layer is left out of it); they sum to K >= 1,
    so some device has kernels."""
    part = {}
    for g in shape.blocks:
        cuts = sorted(draw(st.lists(st.integers(0, g.K), min_size=devices - 1,
                                    max_size=devices - 1)))
        bounds = [0, *cuts, g.K]
        part[g.name] = [b - a for a, b in zip(bounds, bounds[1:])]
    return part


def same_weights_at_their_scale(shape, rtol=1e-4):
    """conftest.assert_same_weights, for assert_trains_like_one_device to check with: each
    parameter's error measured against its largest entry at the start (init_params(shape, 0),
    where train_weights starts) or at the end, whichever is larger. Against the end alone, a
    bias of one entry (a 1-unit fc layer, a 1-kernel conv) that trains to near 0 fails on float32
    roundings of its first values: fc1.bias of 6C2-P3s2-6C2p1-1N, from 4e-2 to 4e-5, off by
    6e-9 on one cpu:1 (test_a_one_entry_bias_trained_to_near_zero_is_measured_at_its_scale)."""
    start = init_params(shape, 0)

    def compare(got, want):
        for k in want:
            scale = max(np.abs(want[k]).max(), np.abs(start[k]).max())
            err = np.abs(got[k] - want[k]).max() / scale
            assert err < rtol, f"{k}: max error {err:.2e} of its largest entry ({scale:.2e})"
    return compare


# A max-pool window whose two largest values are this close (relative to the larger) may pick
# the other one on another device: float32 roundings apart (the two failures found were 1.2e-7
# and 1.2e-6 apart), and rare (about one max-pool call in a hundred holds such a window)
NEAR_TIE = 1e-5


class TieFlip(AssertionError):
    """The weights differ, and the reference run met a near tie: in a max-pool window, or a
    ReLU's input at zero."""

    def __init__(self, message, gap):
        super().__init__(message)
        self.gap = gap


def smallest_pool_gap(x, arg, k, stride):
    """Over the windows of maxpool_forward(x, k, stride) whose maximum is > 0, the smallest gap
    between it and the runner-up, relative to the maximum (inf: none). Windows of zeros (after
    ReLU) are left out: whichever wins, ReLU passes it no gradient."""
    s = k if stride is None else stride
    N, C, H, W = x.shape
    PH, PW = arg.shape[2], arg.shape[3]
    rows, cols = (np.arange(PH) * s)[:, None], (np.arange(PW) * s)[None, :]
    top = np.full(arg.shape, -np.inf, x.dtype)
    second = np.full(arg.shape, -np.inf, x.dtype)
    for i in range(k):
        for j in range(k):
            v = x[:, :, i:i + s * PH:s, j:j + s * PW:s]
            chosen = (rows + i) * W + cols + j == arg
            top = np.where(chosen, v, top)
            second = np.where(chosen, second, np.maximum(second, v))
    positive = top > 0
    if not positive.any():
        return np.inf
    return float(((top - second)[positive] / top[positive]).min())


def smallest_relu_gap(x):
    """Of relu_forward's input x, the smallest magnitude of an entry that is not 0, relative to
    the largest (inf: none): an input that close to 0 is positive on one device and negative on
    another by a rounding, and passes the gradient on one only. An exact 0 (a window of zeros
    with no bias yet) is 0 on every device."""
    a = np.abs(np.asarray(x, np.float64))
    nonzero = a[a > 0]
    return float(nonzero.min() / nonzero.max()) if nonzero.size else np.inf


def check(shape, spec, partition, seed, images, strassen):
    """assert_trains_like_one_device (as same_weights_at_their_scale checks), the Strassen
    threshold lowered to 2 or not, every device closed after.

    Weights that differ where a max-pool window of the reference run (the numpy device's) held
    two maxima within NEAR_TIE of each other, or a ReLU's input held an entry within NEAR_TIE of
    0 (both relative to the largest; '4C4p1-4C4p1s2-8C2-P3s2' on 2x11x13: 1.9e-9 against 2.2
    after a step, conv1.weight 3.4e-3 apart two steps later), raise TieFlip: a float32 rounding
    apart between devices (another order of the sums; Strassen's scheme, which rounds equal
    columns of a product unequally, so that even the exact ties of a kernel over padding alone
    break) can send the gradient to the other one, as valid a gradient, not a rounding of this one
    (8C4p2-P3s1-4C2s2-P2s1-8C1p1 on 2x10x9: conv1.weight 3.9e-4 apart after three steps on
    one cpu:1, one kernel's weights, its bias exact). Without a near tie, it is a failure."""
    gaps, relu_gaps = [], []
    real_pool, real_relu = numpy_ref.maxpool_forward, numpy_ref.relu_forward

    def pool(x, k=2, stride=None):
        out, arg = real_pool(x, k, stride)
        gaps.append(smallest_pool_gap(x, arg, k, stride))
        return out, arg

    def relu(x):
        relu_gaps.append(smallest_relu_gap(x))
        return real_relu(x)

    # a threshold of 2 takes Strassen's scheme wherever a product's sizes allow it, and the
    # host group's quadrant sums where the layer's input has an even batch and channel count
    # and a member on one thread has 2 kernels or more (cpu:2 needs products big enough to
    # wake its threads for)
    old = _core.set_gemm_strassen_min_dim(2) if strassen else None
    threads = set(threading.enumerate())
    try:
        with mock.patch.object(conftest, "assert_same_weights",
                               same_weights_at_their_scale(shape)), \
                mock.patch.object(numpy_ref, "maxpool_forward", pool), \
                mock.patch.object(numpy_ref, "relu_forward", relu):
            assert_trains_like_one_device(shape, spec, partition, seed=seed, n=images)
    except AssertionError as e:
        gap, at_zero = min(gaps, default=np.inf), min(relu_gaps, default=np.inf)
        if gap < NEAR_TIE:
            raise TieFlip(f"{e} (a max-pool window's two maxima {gap:.1e} apart)", gap) from e
        if at_zero < NEAR_TIE:
            raise TieFlip(f"{e} (a ReLU input {at_zero:.1e} from 0)", at_zero) from e
        raise
    finally:
        if strassen:
            _core.set_gemm_strassen_min_dim(old)
    # every device closed (its worker joined), or hundreds of examples would pile up threads
    assert set(threading.enumerate()) <= threads
    return min(gaps + relu_gaps, default=np.inf)


# cpu:1 and cpu:2 ask for more threads than two cores have: slower, the same weights
@pytest.mark.filterwarnings("ignore:the cpu devices use:RuntimeWarning")
@settings(max_examples=EXAMPLES, deadline=None)
@given(net=networks(), kinds=st.lists(st.sampled_from(KINDS), min_size=1, max_size=3),
       classes=st.integers(2, 5), images=sizes(1, 9), seed=st.integers(0, 3),
       strassen=st.booleans(), data=st.data())
def test_any_network_split_any_way_trains_like_one_device(net, kinds, classes, images, seed,
                                                          strassen, data):
    input_shape, spec = net
    shape = arch.build(spec, input_shape, classes)   # raises if a drawn block did not fit
    partition = data.draw(partitions(shape, len(kinds)), label="partition")
    try:
        check(shape, ",".join(kinds), partition, seed, images, strassen)
    except TieFlip:
        event("weights apart after a near tie: example set aside")
        assume(False)   # rare: two in the 2,000 examples of one hunt


@pytest.mark.parametrize("spec,input_shape,images,seed,strassen", [
    ("8C4p2-P3s1-4C2s2-P2s1-8C1p1", (2, 10, 9), 4, 0, False),   # a near tie
    ("4C1p1-8C1-4C4p1s2-P2s1", (2, 15, 16), 3, 1, True),        # ties over padding alone
])
def test_the_weights_that_differ_came_from_a_max_pool_tie(spec, input_shape, images, seed,
                                                          strassen):
    """The two examples where one cpu:1 ended apart from the numpy device (on a Zen 3 with the
    avx2-fma kernel; whether the tie breaks the other way depends on the roundings of both
    GEMMs, so on the CPU): the reference meets a near tie, and check() either passes or says
    so (TieFlip), never fails as rounding."""
    shape = arch.build(spec, input_shape, 4)
    try:
        gap = check(shape, "cpu:1", {g.name: [g.K] for g in shape.blocks}, seed, images,
                    strassen)
    except TieFlip as e:
        gap = e.gap
    assert gap < NEAR_TIE


def test_weights_apart_after_a_relu_input_at_zero_are_a_tie():
    """The example the hunt (test_any_network_split_any_way_trains_like_one_device) found where
    one cpu:1 ended apart from the numpy device without a max-pool tie: after the first step
    one of conv1's outputs is 1.9e-9 (the largest 2.2), its sign a rounding's, and conv1's
    weights end 3.4e-3 apart (avx2-fma kernel, Zen 4). check() passes or says so (TieFlip),
    never fails as rounding."""
    shape = arch.build("4C4p1-4C4p1s2-8C2-P3s2", (2, 11, 13), 2)
    try:
        gap = check(shape, "cpu:1", {g.name: [g.K] for g in shape.blocks}, 1, 2, False)
    except TieFlip as e:
        gap = e.gap
    assert gap < NEAR_TIE


def test_a_one_entry_bias_trained_to_near_zero_is_measured_at_its_scale():
    """The first failure the test above found (same_weights_at_their_scale): fc1.bias, one
    entry, trains from 4e-2 to 4e-5, a few float32 roundings from one numpy device's."""
    shape = arch.build("6C2-P3s2-6C2p1-1N", (2, 17, 17), 4)
    check(shape, "cpu:1", {"conv1": [6], "conv2": [6]}, seed=2, images=2, strassen=False)
