"""Networks of any depth from the --arch notation: the reference conv block's new paths (stride,
padding, pool windows and strides of their own, no pool) against finite differences; whole
networks of three and four conv blocks, hidden fc layers, overlapping pools and non-square
inputs against torch.nn, on every mix of device kinds; distributed training against one
reference device; and trained weights in torch.

Tolerances: gradient checks as tests/test_layers.py (float64, central differences, rtol 1e-5);
against torch as tests/test_torch.py (each weight within 1e-4 of its largest entry after every
step, the first logits within 1e-5 of the largest logit). The torch sections are skipped where
torch is not installed; the rest runs without it.

Letters as in pyhet.geometry: x (N, C, H, W) images, y (N,) labels, w (K, C, R, S) kernels,
col (C*R*S, N*OH*OW), out (N, K, PH, PW) a block's output, F the fc inputs, M classes.
"""

import re

import numpy as np
import pytest

from conftest import assert_same_weights, numeric_grad, train_weights
from pyhet import arch
from pyhet.backends import numpy_ref as ref
from pyhet.errors import ArchitectureError
from pyhet.geometry import ConvGeometry
from pyhet.model import init_params, load_weights, network_of_file, save_weights
from pyhet.optim import SGDConfig
from pyhet.partition import even

GRAD_RTOL, GRAD_ATOL = 1e-5, 1e-7
FORWARD_RTOL = 1e-5
LR, MOMENTUM, WEIGHT_DECAY = 0.05, 0.9, 1e-3
CFG = SGDConfig(LR, MOMENTUM, WEIGHT_DECAY)
STEPS = 3


# ================================================================ the reference block's gradients

BLOCKS = {
    # name: (N, C, H, W, K, R, S, stride, pad, pool, pool_stride)
    # 9x8, k3 s2 p1 -> 5x4 -> P2 2x2 (the odd row dropped)
    "stride 2 pad 1 pool 2": (2, 3, 9, 8, 4, 3, 3, 2, 1, 2, 2),
    # 7x9, k3 p2 -> 9x11 -> P3s2 4x5 (windows overlap by one row and column)
    "pad 2 overlapping pool 3s2": (2, 2, 7, 9, 3, 3, 3, 1, 2, 3, 2),
    # 6x7, k2x3 -> 5x5 -> P2s1 4x4 (every pixel but the edges in four windows)
    "pool 2 stride 1": (1, 3, 6, 7, 2, 2, 3, 1, 0, 2, 1),
    # 5x6, k3x2 s2 p1 -> 3x4, no pool
    "no pool, stride 2 pad 1": (2, 2, 5, 6, 3, 3, 2, 2, 1, 1, 1),
    # 8x7, k2 s3 -> 3x2: the stride skips pixels, whose gradient is 0; no pool
    "stride larger than the kernel": (1, 2, 8, 7, 2, 2, 2, 3, 0, 1, 1),
    # 17x13, k5 s3 p2 -> 6x5 -> P2s1 5x4
    "k5 stride 3 pad 2 pool 2s1": (1, 1, 17, 13, 2, 5, 5, 3, 2, 2, 1),
    # 7x7, 1x1 s2 -> 4x4 -> P3s2 1x1 (the last row and column in no window)
    "1x1 stride 2 pool 3s2": (3, 1, 7, 7, 1, 1, 1, 2, 0, 3, 2),
}


@pytest.mark.parametrize("case", list(BLOCKS))
def test_conv_block_gradients(case):
    """conv (stride, padding) -> ReLU -> max-pool (window, stride) from the im2col matrix: dx
    (col2im of dcol), dw and db against central differences of sum(G * out)."""
    N, C, H, W, K, R, S, stride, pad, pool, pool_stride = BLOCKS[case]
    g = ConvGeometry("conv", C, H, W, K, R, S, stride, pad, pool, pool_stride)
    rng = np.random.default_rng(sorted(BLOCKS).index(case))
    x = rng.standard_normal((N, C, H, W))
    w, b = rng.standard_normal((K, C, R, S)), rng.standard_normal(K)

    def forward():
        col = ref.im2col(x, R, S, stride, pad)
        return ref.conv_block_forward(col, x.shape, w, b, stride, pad, pool, pool_stride)

    out, saved = forward()
    assert out.shape == g.out_batch_shape(K, N) and out.dtype == np.float64
    G = rng.standard_normal(out.shape)

    def loss():
        return float((forward()[0] * G).sum())

    col = ref.im2col(x, R, S, stride, pad)
    assert col.shape == g.col_shape(N)
    dcol, dw, db = ref.conv_block_backward(G, saved, col, w)
    dx = ref.col2im(dcol, x.shape, R, S, stride, pad)
    assert dx.shape == x.shape
    np.testing.assert_allclose(dw, numeric_grad(loss, w), rtol=GRAD_RTOL, atol=GRAD_ATOL)
    np.testing.assert_allclose(db, numeric_grad(loss, b), rtol=GRAD_RTOL, atol=GRAD_ATOL)
    np.testing.assert_allclose(dx, numeric_grad(loss, x), rtol=GRAD_RTOL, atol=GRAD_ATOL)

    # without dcol (conv1): the same parameter gradients, no input gradient
    none, dw2, db2 = ref.conv_block_backward(G, forward()[1], col, w, need_dcol=False)
    assert none is None
    np.testing.assert_array_equal(dw2, dw)
    np.testing.assert_array_equal(db2, db)


def test_no_pool_block_is_relu_of_the_conv():
    """pool 1, stride 1: the block's output is the ReLU of the conv itself, every position."""
    rng = np.random.default_rng(20)
    x, w, b = rng.standard_normal((2, 3, 6, 5)), rng.standard_normal((4, 3, 3, 3)), \
        rng.standard_normal(4)
    col = ref.im2col(x, 3, 3, 2, 1)
    out, _ = ref.conv_block_forward(col, x.shape, w, b, 2, 1, pool=1, pool_stride=1)
    y, _ = ref.conv2d_forward(x, w, b, 2, 1)
    np.testing.assert_array_equal(out, np.maximum(y, 0))


# ================================================================ the networks

ARCHS = {
    # name: (--arch, input (C, H, W), classes, batch, block outputs (K, PH, PW))
    # 20x20 -> conv1 18 -> P2 9 -> conv2 7 -> P2 3 -> conv3 2, no pool; F = 5*2*2
    "three blocks": ("4C3-P2-6C3-P2-5C2", (1, 20, 20), 5, 4,
                     [(4, 9, 9), (6, 3, 3), (5, 2, 2)]),
    # 28x28 -> conv1 28 -> P2 14 -> conv2 7 (stride 2) -> conv3 7 -> P2 3 -> conv4 3; F = 63
    "four blocks, padding, stride 2": ("4C3p1-P2-5C3p1s2-6C3p1-P2-7C3p1", (1, 28, 28), 10, 4,
                                       [(4, 14, 14), (5, 7, 7), (6, 3, 3), (7, 3, 3)]),
    # 11x13 -> conv1 9x11, no pool -> conv2 (pad 2, stride 2) 6x7 -> P2 3x3; F = 54
    "first block without pool": ("5C3-6C3p2s2-P2", (3, 11, 13), 4, 5,
                                 [(5, 9, 11), (6, 3, 3)]),
    # 16x16 -> conv1 14 -> P2 7 -> conv2 5 -> P2 2; F = 24 -> fc1 32 -> fc2 16 -> fc 4
    "hidden fc layers": ("4C3-P2-6C3-P2-32N-16N", (1, 16, 16), 4, 6,
                         [(4, 7, 7), (6, 2, 2)]),
    # 24x24 -> conv1 20 -> P3s2 9 -> conv2 7 -> P3s2 3; F = 54
    "overlapping pools": ("4C5-P3s2-6C3-P3s2", (1, 24, 24), 6, 4,
                          [(4, 9, 9), (6, 3, 3)]),
    # 12x12 -> conv1 10 -> P2s1 9 -> conv2 (stride 2) 4 -> P3s1 2; F = 20
    "pools of stride 1": ("3C3-P2s1-5C3s2-P3s1", (2, 12, 12), 3, 4,
                          [(3, 9, 9), (5, 2, 2)]),
    # 17x23 -> conv1 (pad 1) 16x22 -> P3s2 7x10 -> conv2 (stride 2) 3x4 -> P2 1x2; F = 10
    # -> fc1 8 -> fc 3
    "non-square, wide": ("3C4p1-P3s2-5C3s2-P2-8N", (2, 17, 23), 3, 5,
                         [(3, 7, 10), (5, 1, 2)]),
    # 30x9 -> conv1 (pad 1, stride 2) 15x5 -> conv2 14x4 -> P2 7x2; F = 35
    "non-square, tall": ("4C3p1s2-5C2-P2", (1, 30, 9), 4, 4,
                         [(4, 15, 5), (5, 7, 2)]),
}


def build(name):
    spec, input_shape, classes, _, _ = ARCHS[name]
    return arch.build(spec, input_shape, classes)


def batches(name, seed, steps=STEPS):
    """`steps` batches (x, y) of the network's input, from a fixed seed."""
    _, input_shape, classes, n, _ = ARCHS[name]
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((n, *input_shape)).astype(np.float32),
             rng.integers(0, classes, size=n).astype(np.int64)) for _ in range(steps)]


@pytest.mark.parametrize("name", list(ARCHS))
def test_arch_builds_the_shapes_in_its_comment(name):
    spec, input_shape, classes, _, outs = ARCHS[name]
    shape = build(name)
    assert [g.out_shape for g in shape.blocks] == outs
    assert shape.arch == spec                       # the notation round-trips
    assert shape.input_shape == input_shape and shape.num_classes == classes
    K, PH, PW = outs[-1]
    assert shape.fc_layers()[0][1] == K * PH * PW


def test_a_deep_network_of_the_documentation_builds():
    # 28x28 -> conv1 28 -> P2 14 -> conv2 (stride 2) 7 -> conv3 7 -> P2 3 -> conv4 3
    shape = arch.build("16C3p1-P2-24C3p1s2-32C3p1-P2-40C3p1", (1, 28, 28), 10)
    assert [g.out_shape for g in shape.blocks] == [(16, 14, 14), (24, 7, 7), (32, 3, 3),
                                                   (40, 3, 3)]
    assert [(g.stride, g.pad, g.pool, g.pool_stride) for g in shape.blocks] == [
        (1, 1, 2, 2), (2, 1, 1, 1), (1, 1, 2, 2), (1, 1, 1, 1)]
    assert shape.features == 40 * 3 * 3
    assert list(shape.param_shapes())[-2:] == ["fc.weight", "fc.bias"]


@pytest.mark.parametrize("spec,block", [
    ("\uff13C3", "\uff13C3"),                 # a fullwidth 3
    ("3C3p\u0661", "3C3p\u0661"),               # an Arabic-Indic 1
    ("3C3-P\u0968", "P\u0968"),                 # a Devanagari 2
    ("3C3-\u0661\u0660N", "\u0661\u0660N"),
])
def test_numbers_are_ascii_digits(spec, block):
    """int() reads any script's digits; the notation takes ASCII ones only, as --devices does."""
    with pytest.raises(ArchitectureError) as e:
        arch.parse(spec)
    for w in (repr(block), "not a block", "ASCII digits"):
        assert w in str(e.value), (w, str(e.value))


@pytest.mark.parametrize("spec,block,number", [
    ("8C3s4294967297", 1, "'4294967297'"),          # the core's im2col refused it, in training
    ("8C3-P2s2147483648", 2, "'2147483648'"),
    ("2147483648N", 1, "'2147483648'"),
    ("2C" + "9" * 5000, 1, "(5000 chars)"),         # int() of so many digits is a ValueError
])
def test_numbers_past_the_cores_int_are_refused_naming_the_block(spec, block, number):
    with pytest.raises(ArchitectureError) as e:
        arch.parse(spec if not spec.endswith("N") else "2C3-" + spec)
    message = str(e.value)
    assert f"block {block + spec.endswith('N')} " in message, message
    assert number in message and "2**31 - 1" in message and len(message) < 400, message


def test_the_largest_number_is_taken():
    assert arch.parse("1C1s2147483647")[0][0].stride == 2**31 - 1
    # leading zeros count for nothing, however many (int() refuses 4,300 digits)
    assert arch.parse("2C" + "0" * 5000 + "3")[0][0].size == 3
    with pytest.raises(ArchitectureError, match=r"\(5012 chars\) is past the largest"):
        arch.parse("2C" + "0" * 5000 + "9" * 12)


@pytest.mark.parametrize("spec,words", [
    ("4C3p-1", "'4C3p-1': padding must be a whole number >= 0, got -1"),
    ("4C3p1s-2", "'4C3p1s-2': stride must be a whole number >= 1, got -2"),
    ("4C3s-2p1-P2", "'4C3s-2': stride must be a whole number >= 1, got -2"),
    # a number left out, then the next block: no negative number to name
    ("32C5s-64C3-P2", "block 1 ('32C5s'): not a block"),
    ("32C5p-256N", "block 1 ('32C5p'): not a block"),
])
def test_a_negative_padding_or_stride_names_which(spec, words):
    """One message per number ("padding and stride must be whole numbers >= 0 and >= 1" paired
    the two bounds with the two names)."""
    with pytest.raises(ArchitectureError, match=re.escape(words)):
        arch.parse(spec)


def partition_of(shape, spec, counts=None):
    """{"conv1": counts per device, ...}: the given counts, or an even split of every block."""
    n = len(spec.split(","))
    return counts or {g.name: even(g.K, n) for g in shape.blocks}


# ================================================================ against torch.nn

@pytest.fixture(scope="module")
def torch():
    """torch with one thread, float32 and deterministic kernels (restored afterwards); a test
    that asks for it is skipped where torch is not installed."""
    torch = pytest.importorskip("torch")
    import torch_ref

    with torch_ref.torch_settings():
        yield torch


@pytest.fixture(scope="module")
def twin(torch):
    """tests/torch_ref.py (TorchNet, torch_model, torch_params); it imports torch."""
    import torch_ref

    return torch_ref


# Every network on one device of each kind, then mixes: several devices of a kind, both kinds
# (the host group's shared im2col and channel-split input gradient, beside a device on its own),
# uneven shares, and devices with no kernels in a block.
MIXES = {
    # name: (network, devices, kernels per device in each block, or None for an even split)
    "three blocks / cpu:1,cpu:1 uneven": (
        "three blocks", "cpu:1,cpu:1", {"conv1": [1, 3], "conv2": [4, 2], "conv3": [2, 3]}),
    "three blocks / numpy,numpy one idle per block": (
        "three blocks", "numpy,numpy", {"conv1": [4, 0], "conv2": [0, 6], "conv3": [2, 3]}),
    "four blocks / cpu:1,numpy uneven": (
        "four blocks, padding, stride 2", "cpu:1,numpy",
        {"conv1": [3, 1], "conv2": [1, 4], "conv3": [5, 1], "conv4": [2, 5]}),
    # conv3 all on numpy: no host group in that block; conv2 and conv1 idle devices
    "four blocks / numpy,cpu:1,cpu:1 idle devices": (
        "four blocks, padding, stride 2", "numpy,cpu:1,cpu:1",
        {"conv1": [0, 3, 1], "conv2": [2, 0, 3], "conv3": [6, 0, 0], "conv4": [1, 4, 2]}),
    "four blocks / cpu:1,cpu:1 even": ("four blocks, padding, stride 2", "cpu:1,cpu:1", None),
    "first block without pool / cpu:1,cpu:1 even": (
        "first block without pool", "cpu:1,cpu:1", None),
    "first block without pool / cpu:1,numpy uneven": (
        "first block without pool", "cpu:1,numpy", {"conv1": [1, 4], "conv2": [5, 1]}),
    "hidden fc layers / cpu:1,numpy even": ("hidden fc layers", "cpu:1,numpy", None),
    "hidden fc layers / numpy,numpy,numpy uneven": (
        "hidden fc layers", "numpy,numpy,numpy", {"conv1": [2, 1, 1], "conv2": [1, 0, 5]}),
    "overlapping pools / numpy,cpu:1,cpu:1 uneven": (
        "overlapping pools", "numpy,cpu:1,cpu:1", {"conv1": [1, 1, 2], "conv2": [3, 2, 1]}),
    "pools of stride 1 / cpu:1,cpu:1 one idle per block": (
        "pools of stride 1", "cpu:1,cpu:1", {"conv1": [0, 3], "conv2": [5, 0]}),
    "non-square, wide / cpu:1,numpy uneven": (
        "non-square, wide", "cpu:1,numpy", {"conv1": [2, 1], "conv2": [1, 4]}),
    "non-square, tall / numpy,cpu:1,cpu:1 uneven": (
        "non-square, tall", "numpy,cpu:1,cpu:1", {"conv1": [1, 0, 3], "conv2": [2, 2, 1]}),
}
CASES = {**{f"{name} / {spec}": (name, spec, None) for name in ARCHS
            for spec in ("numpy", "cpu:1")}, **MIXES}


@pytest.mark.parametrize("case", list(CASES))
def test_sgd_steps_match_torch(torch, twin, make_net, case):
    name, spec, counts = CASES[case]
    shape = build(name)
    seed = sorted(CASES).index(case)
    params = init_params(shape, seed)
    partition = partition_of(shape, spec, counts)
    net = make_net(shape, params, spec, partition)
    model = twin.torch_model(shape, params)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM,
                          weight_decay=WEIGHT_DECAY)

    for step, (x, y) in enumerate(batches(name, 100 + seed)):
        if step == 0:
            logits = np.asarray(net.forward(x))
        loss = net.train_step(x, y, CFG)
        want_logits, want_loss = twin.torch_step(model, opt, x, y)
        if step == 0:
            assert logits.shape == (len(x), shape.num_classes) and logits.dtype == np.float32
            err = np.abs(logits - want_logits).max()
            assert err <= FORWARD_RTOL * np.abs(want_logits).max(), f"logits off by {err:.3g}"
            assert loss == pytest.approx(want_loss, rel=FORWARD_RTOL)
        assert np.isfinite(loss)
        twin.assert_close_weights(net.params(), twin.torch_params(model), f"{case}, step {step + 1}:")
    assert net.partition() == {layer: {f"d{i}": c for i, c in enumerate(shares)}
                               for layer, shares in partition.items()}


@pytest.mark.parametrize("name,spec", [("four blocks, padding, stride 2", "numpy"),
                                       ("four blocks, padding, stride 2", "cpu:1,numpy"),
                                       ("hidden fc layers", "cpu:1,cpu:1"),
                                       ("overlapping pools", "numpy,numpy"),
                                       ("non-square, wide", "numpy")])
def test_trained_weights_predict_the_same_in_torch(torch, twin, make_net, tmp_path, name, spec):
    """After training, net.params() and the saved weight file load strictly into TorchNet,
    which then predicts what net.forward predicts; the file names its network."""
    shape = build(name)
    net = make_net(shape, init_params(shape, 3), spec, partition_of(shape, spec))
    for x, y in batches(name, 30):
        net.train_step(x, y, CFG)
    params = net.params()
    assert list(params) == list(shape.param_names)

    _, input_shape, classes, _, _ = ARCHS[name]
    rng = np.random.default_rng(31)
    x = rng.standard_normal((16, *input_shape)).astype(np.float32)
    logits = np.asarray(net.forward(x))
    model = twin.torch_model(shape, params)         # strict: same names, same shapes
    with torch.no_grad():
        want = model(torch.from_numpy(x)).numpy()
    assert np.abs(logits - want).max() <= FORWARD_RTOL * np.abs(want).max()
    np.testing.assert_array_equal(logits.argmax(axis=1), want.argmax(axis=1))

    path = tmp_path / "weights.npz"
    save_weights(path, params, shape)
    assert network_of_file(path)[0] == shape
    loaded = load_weights(path, shape)
    reloaded = twin.TorchNet(shape)
    reloaded.load_state_dict({k: torch.from_numpy(v) for k, v in loaded.items()}, strict=True)
    with torch.no_grad():
        np.testing.assert_array_equal(reloaded(torch.from_numpy(x)).numpy(), want)


# ================================================================ distributed = one device

DEEP = "four blocks, padding, stride 2"   # 4C3p1-P2-5C3p1s2-6C3p1-P2-7C3p1 on 1x28x28

SPLITS = {
    # devices: kernels per device in each block (K = 4, 5, 6, 7)
    "cpu:1,cpu:1": {"conv1": [1, 3], "conv2": [3, 2], "conv3": [6, 0], "conv4": [4, 3]},
    "cpu:1,numpy": {"conv1": [3, 1], "conv2": [2, 3], "conv3": [0, 6], "conv4": [5, 2]},
    "numpy,numpy": {"conv1": [2, 2], "conv2": [5, 0], "conv3": [1, 5], "conv4": [3, 4]},
    "numpy,cpu:1,cpu:1": {"conv1": [0, 1, 3], "conv2": [2, 2, 1], "conv3": [1, 0, 5],
                          "conv4": [3, 3, 1]},
}


@pytest.fixture(scope="module")
def one_device():
    """The weights and losses of the deep network trained on one numpy device."""
    shape = build(DEEP)
    return train_weights(shape, "numpy", {g.name: [g.K] for g in shape.blocks},
                         batches(DEEP, 50), CFG, seed=5)


@pytest.mark.parametrize("spec", list(SPLITS))
def test_distributed_training_gives_one_device_weights(one_device, spec):
    params, losses = train_weights(build(DEEP), spec, SPLITS[spec], batches(DEEP, 50), CFG,
                                   seed=5)
    assert list(params) == list(one_device[0])
    assert_same_weights(params, one_device[0])
    np.testing.assert_allclose(losses, one_device[1], rtol=1e-5)


# ================================================================ on the bundled data, CLI and Python

BUNDLED_ARCH = "8C3p1-P2-12C3p1s2-16C3p1-16C3p1-P2-32N"   # 1x28x28: 28 -> 14 -> 7 -> 7 -> 7 -> 3
BUNDLED_BATCH = 16


def bundled_torch_weights(torch, twin, seed):
    """torch.nn's weights after 3 SGD steps on the bundled data's first 3 batches of 16 (file
    order), from pyhet's seeded initialisation."""
    from pyhet.data import load_dataset

    ds = load_dataset("bundled")
    shape = arch.build(BUNDLED_ARCH, ds.input_shape, ds.num_classes)
    model = twin.torch_model(shape, init_params(shape, seed))
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM,
                          weight_decay=WEIGHT_DECAY)
    for s in range(STEPS):
        sl = slice(s * BUNDLED_BATCH, (s + 1) * BUNDLED_BATCH)
        twin.torch_step(model, opt, ds.x_train[sl], ds.y_train[sl])
    return twin.torch_params(model)


@pytest.mark.parametrize("spec", ["cpu:1,cpu:1", "cpu:1,numpy,cpu:1"])
def test_four_blocks_on_bundled_data_from_the_cli_equal_torch(torch, twin, cli, tmp_path, spec):
    out = tmp_path / "w.npz"
    res = cli("train", "--dataset", "bundled", "--arch", BUNDLED_ARCH, "--devices", spec,
              "--balance", "static", "--steps", STEPS, "--batch-size", BUNDLED_BATCH,
              "--no-shuffle", "--lr", LR, "--momentum", MOMENTUM, "--weight-decay",
              WEIGHT_DECAY, "--seed", 5, "--save", out, "--quiet", "--json")
    assert res.code == 0, res.err
    with np.load(out) as f:
        got = {k: f[k] for k in f.files if k != "arch"}
    twin.assert_close_weights(got, bundled_torch_weights(torch, twin, 5), f"cli {spec}:")


@pytest.mark.parametrize("spec", ["cpu:1,cpu:1", "numpy,cpu:1"])
def test_four_blocks_on_bundled_data_from_python_equal_torch(torch, twin, spec):
    import pyhet

    with pyhet.Network(BUNDLED_ARCH, (1, 28, 28), 10, devices=spec, balance="static",
                       seed=6) as net:
        net.fit(dataset="bundled", steps=STEPS, batch_size=BUNDLED_BATCH, shuffle=False,
                lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)
        got = net.params()
    twin.assert_close_weights(got, bundled_torch_weights(torch, twin, 6), f"python {spec}:")


def test_the_summaries_give_mixed_kernel_sizes_alike(cli, npz_dataset):
    """pyhet train's summary gave a list of the blocks' kernel sizes where they differ, pyhet
    devices' only the first block's."""
    import json

    data = npz_dataset(n=16)
    common = ["--dataset", f"npz:{data}", "--arch", "3C5-P2-4C3-P2", "--devices", "cpu:1",
              "--json"]
    train = cli("train", *common, "--steps", "1", "--batch-size", "8", "--quiet")
    devices = cli("devices", *common, "--no-calibrate")
    assert train.code == 0 and devices.code == 0, (train.err, devices.err)
    assert json.loads(train.out.splitlines()[-1])["kernel_size"] == [5, 3]
    assert json.loads(devices.out.splitlines()[-1])["network"]["kernel_size"] == [5, 3]
